"""tools/check_parallel_parity.py chooses a tiny model that fits every layout it is asked for
(it used a fixed 4-head, 2-query-group model, and `--layouts tp4` crashed)."""
import importlib.util
from pathlib import Path

import pytest

from megatron_rlcorr.model.config import ModelConfig

_spec = importlib.util.spec_from_file_location(
    "check_parallel_parity", Path(__file__).resolve().parents[2] / "tools" / "check_parallel_parity.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


@pytest.mark.parametrize("names", [["tp4"], ["tp2", "cp2", "pp2", "tp2cp2pp2"], ["tp8", "pp2vpp2"], ["tp4", "pp4"],
                                   ["pp3"], ["tp2", "pp2vpp3"]])
def test_tiny_model_fits_every_layout(names):
    layouts = [tool.parse_layout(name) for name in names] + [tool.parse_layout("tp1")]
    model = tool.tiny_model(layouts)
    ModelConfig(**model)  # a valid model
    for name, layout in zip(names, layouts):
        assert model["num_attention_heads"] % layout["tp"] == 0, name
        assert model["num_query_groups"] % layout["tp"] == 0, name
        assert model["num_layers"] % (layout["pp"] * (layout["vpp"] or 1)) == 0, name
        assert model["hidden_size"] == 8 * model["num_attention_heads"]
    assert model["num_layers"] >= 4


def test_tp4_needs_more_query_groups_than_the_old_fixed_model():
    model = tool.tiny_model([tool.parse_layout("tp4")])
    assert model["num_query_groups"] == 4 and model["num_attention_heads"] == 8


@pytest.mark.parametrize("name, message", [("tp2x", "cannot parse"), ("tp2tp2", "twice"), ("vpp2", "vpp needs pp > 1"),
                                           ("tp0", "must be >= 1")])
def test_bad_layout_names(name, message):
    with pytest.raises(ValueError, match=message):
        tool.parse_layout(name)
