"""The model folder's modules import one way: settings, then config.json <-> architecture, then the
neutral names and loading (model/hf.py's docstring): no module pulls in one that comes after it."""
from __future__ import annotations

import json
import subprocess
import sys

# The order they read in: each may import only those before it.
ORDER = ("architecture", "hf_config", "presets", "config", "weights", "hf", "weight_stream")

_SCRIPT = """
import importlib, json, sys
order = {order!r}
loaded = []
for name in order:
    importlib.import_module("megatron_rlcorr.model." + name)
    loaded.append(sorted(m.rsplit(".", 1)[1] for m in sys.modules
                         if m.rsplit(".", 1)[0] == "megatron_rlcorr.model" and m.rsplit(".", 1)[1] in order))
print(json.dumps(loaded))
"""


def test_model_modules_import_one_way():
    out = subprocess.run([sys.executable, "-c", _SCRIPT.format(order=ORDER)], capture_output=True, text=True,
                         check=True).stdout
    loaded = json.loads(out.splitlines()[-1])
    for i, (name, modules) in enumerate(zip(ORDER, loaded)):
        later = sorted(set(modules) - set(ORDER[: i + 1]))
        assert not later, f"importing model.{name} (after {ORDER[:i]}) also imported model.{later}"
    # and the config.json module stands on the architecture alone
    assert loaded[1] == ["architecture", "hf_config"]
