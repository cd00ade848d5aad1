"""A newcomer's console: the known, harmless third-party warnings and log records are hidden at the
entry points (runtime.quiet_known_warnings, entered by process_groups), exactly those (by message,
category and module; by logger, level and message), never the project's own, and all of them are
shown again with RLCORR_VERBOSE=1 (`megatron-rlcorr ... --verbose`)."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron_rlcorr import cli
from megatron_rlcorr.runtime import KNOWN_RECORDS, KNOWN_WARNINGS, VERBOSE_ENV, quiet_known_warnings

ROOT = Path(__file__).resolve().parents[2]

# Each as the run meets it (message, category, the module it is attributed to), Megatron-Core 0.16
# and 0.19 and torch 2.x: KNOWN_WARNINGS must cover every one and nothing else here.
SEEN = [
    ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning,
     "megatron.core.optimizer"),
    ("Transformer Engine and Apex are not installed. Falling back to local implementations of multi_tensor_applier "
     "and multi_tensor_scale", UserWarning, "megatron.core.optimizer.optimizer"),
    ("Transformer Engine and Apex are not installed. Falling back to local implementations of multi_tensor_applier, "
     "multi_tensor_l2norm, and multi_tensor_scale", UserWarning, "megatron.core.optimizer.clip_grads"),
    ("Transformer Engine and Apex are not installed. Falling back to local implementations of multi_tensor_applier "
     "and multi_tensor_scale", UserWarning, "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision"),
    ("Apex is not installed. Falling back to Torch Norm", UserWarning, "megatron.core.models.backends"),
    ("Apex is not installed. Falling back to Torch Norm", UserWarning, "megatron.core.models.gpt.gpt_layer_specs"),
    ("full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.", UserWarning,
     "megatron.core.transformer.transformer_config"),
    ("full scope is deprecated. Use empty cuda_graph_modules to capture the whole layer.", UserWarning,
     "megatron.core.transformer.transformer_config"),
    ("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its .grad attribute won't be "
     "populated during autograd.backward().", UserWarning, "megatron_rlcorr.parallel.cpu"),
    ("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use `torch.distributed.reduce_scatter_single` "
     "instead.", FutureWarning, "torch.distributed.c10d_logger"),
    ("`torch.distributed.all_gather_into_tensor` is deprecated. Please use `torch.distributed.all_gather_single` "
     "instead.", FutureWarning, "torch.distributed.c10d_logger"),
    ("`load_state_dict` is deprecated and will be removed in future versions. Please use `load` instead.",
     FutureWarning, "megatron.core.dist_checkpointing.strategies.torch"),
    ("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning,
     "megatron_rlcorr.parallel.cpu"),
    ("When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS "
     "to 1 for maximum speedup", UserWarning, "megatron.core.tensor_parallel.layers"),
    ("absl.logging is not installed. Using logging.getLogger(__name__) instead. Please install absl.logging with "
     "`pip install absl-py` to use absl.", UserWarning, "megatron.core.hyper_comm_grid"),
    ("MimoModelConfig is experimental and still under active development. The API may change without notice in "
     "future releases.", UserWarning, "megatron.core.models.mimo.config.base_configs"),
]
SEEN_RECORDS = [
    ("megatron.core.dist_checkpointing.strategies.torch", logging.WARNING,
     "MCore's async save is deprecated and will be removed in the future releases. Please, use NVRx async solution "
     "by setting `async_strategy` to `nvrx`."),
    ("torch.utils.cpp_extension", logging.WARNING, "No CUDA runtime is found, using CUDA_HOME='/usr/local'"),
]
STILL_SHOWN = [
    ("rollout.top_p=0.9 is ignored", UserWarning, "megatron_rlcorr.rl.trainer"),                 # the project's own
    ("Apex is not installed. Falling back to Torch Norm", UserWarning, "megatron_rlcorr.model.build"),  # other module
    ("Apex is not installed. Falling back to Torch Norm", DeprecationWarning, "megatron.core.models.backends"),
    ("Something new in Megatron-Core", UserWarning, "megatron.core.optimizer"),                    # unknown
    ("`torch.distributed.broadcast` is deprecated", FutureWarning, "torch.distributed.c10d_logger"),
]


def _shown(cases, **env) -> list[str]:
    """The messages of `cases` that get through quiet_known_warnings, under `env`."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(VERBOSE_ENV, raising=False)
        for key, value in env.items():
            mp.setenv(key, value)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with quiet_known_warnings():
                for message, category, module in cases:
                    warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", 1, module=module,
                                           registry={})
    return [str(w.message) for w in caught]


def test_every_known_warning_is_hidden_and_each_filter_is_exercised():
    assert _shown(SEEN) == []
    for known in KNOWN_WARNINGS:  # a filter that matches nothing seen is a filter nobody checked
        assert any(re.match(known.message, m, re.I) and category is known.category
                   and re.fullmatch(known.module, module) for m, category, module in SEEN), known


def test_the_projects_own_and_unknown_warnings_are_still_shown():
    assert _shown(STILL_SHOWN) == [message for message, _, _ in STILL_SHOWN]


def test_verbose_shows_everything():
    assert _shown(SEEN + STILL_SHOWN, **{VERBOSE_ENV: "1"}) == [m for m, _, _ in SEEN + STILL_SHOWN]
    assert _shown(SEEN, **{VERBOSE_ENV: "0"}) == []  # 0 is not verbose


def test_the_filters_last_only_while_the_block_runs():
    message, category, module = SEEN[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_known_warnings():
            pass
        warnings.warn_explicit(message, category, "x.py", 1, module=module, registry={})
    assert [str(w.message) for w in caught] == [message]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_known_log_records_are_hidden_and_others_kept(monkeypatch):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    other = [("megatron.core.dist_checkpointing.strategies.torch", logging.WARNING, "Something else went wrong"),
             ("megatron.core.dist_checkpointing.strategies.torch", logging.ERROR, SEEN_RECORDS[0][2]),
             ("megatron.core.optimizer", logging.WARNING, SEEN_RECORDS[0][2]),  # not that logger
             ("megatron_rlcorr.rl.trainer", logging.WARNING, "the project's own")]
    collect = _Collect()  # on each logger itself: torch's loggers do not propagate to the root

    def emit(records):
        collect.messages.clear()
        for name, level, message in records:
            logging.getLogger(name).log(level, message)
        return list(collect.messages)

    for name in {name for name, _, _ in SEEN_RECORDS + other}:
        monkeypatch.setattr(logging.getLogger(name), "handlers", [*logging.getLogger(name).handlers, collect])
        monkeypatch.setattr(logging.getLogger(name), "level", logging.WARNING)
    with quiet_known_warnings():
        assert emit(SEEN_RECORDS) == []
        assert emit(other) == [m for _, _, m in other]
    assert emit(SEEN_RECORDS) == [m for _, _, m in SEEN_RECORDS]  # the loggers' filters are removed
    monkeypatch.setenv(VERBOSE_ENV, "1")
    with quiet_known_warnings():
        assert emit(SEEN_RECORDS) == [m for _, _, m in SEEN_RECORDS]
    for known in KNOWN_RECORDS:
        assert any(name == known.logger and level == known.level and re.match(known.message, m)
                   for name, level, m in SEEN_RECORDS), known


def test_cli_verbose_sets_the_variable_for_the_launched_processes(monkeypatch):
    monkeypatch.setenv(VERBOSE_ENV, "0")
    monkeypatch.delenv(VERBOSE_ENV)  # absent now, and again after the test (cli.main sets it)
    seen = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd: seen.append((cmd, os.environ.get(VERBOSE_ENV))) or 0)
    recipe = str(ROOT / "recipes" / "tiny_cpu.yaml")
    assert cli.main(["train", "--config", recipe, "--nproc", "1"]) == 0
    assert cli.main(["train", "--config", recipe, "--nproc", "1", "--verbose", "trainer.steps=2"]) == 0
    assert [env for _, env in seen] == [None, "1"]
    assert "--verbose" not in seen[1][0] and seen[1][0][-1] == "trainer.steps=2"
    namespace = cli.argparse.Namespace(command="export", nproc=1, verbose=True, model="m", out="o", overrides=[])
    assert cli._entry_argv(namespace) == ["--model", "m", "--out", "o"]  # the entry point takes no --verbose


def test_entry_points_import_megatron_core_only_inside_the_process_groups(tiny_hf):
    """Its import-time warnings are filtered only inside runtime.process_groups: the entry points and
    the recipe check (validation files included) before it must not import it."""
    files = [f"model.hf_checkpoint={tiny_hf / 'model'}", f"data.train_files=[{tiny_hf / 'data' / 'train.parquet'}]",
             f"data.val_files=[{tiny_hf / 'data' / 'val.parquet'}]", "trainer.test_freq=1", "trainer.resume=false"]
    script = (
        "import sys\n"
        "import megatron_rlcorr.cli, megatron_rlcorr.train, megatron_rlcorr.score, megatron_rlcorr.export\n"
        "import megatron_rlcorr.eval\n"
        f"megatron_rlcorr.train.load_and_check({str(ROOT / 'recipes' / 'tiny_hf_cpu.yaml')!r}, {files!r}, 2)\n"
        "print(sorted(m for m in sys.modules if m.startswith('megatron.core')))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_a_real_run_prints_none_of_the_known_warnings(tiny_cpu_launch):
    """The session's real launch (tests/launched.py: tools/launch.sh, 2 processes, 3 steps with a
    checkpoint; Megatron-Core's import, model, distributed optimizer, step and save): its console,
    the ranks' stdout and stderr and the launcher's own, holds none of them."""
    proc = tiny_cpu_launch.proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"step {tiny_cpu_launch.steps}/{tiny_cpu_launch.steps} " in proc.stdout
    console = proc.stdout + proc.stderr
    for known in KNOWN_WARNINGS:
        assert not re.search(known.message, console, re.I), (known.message, console[-3000:])
    for record in KNOWN_RECORDS:
        assert not re.search(record.message, console), (record.message, console[-3000:])
