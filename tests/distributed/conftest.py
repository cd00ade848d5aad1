"""Whole runs shared by several test files (session scope: trained once, read by every test that asks).

A run is shared where the tests assert different things about the same run: each test reads the
files and metrics it checks, none writes into the run's directory (a test that trains on from a shared
checkpoint copies it first).
"""
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.dist import run_distributed
from tests.runs import read_metrics, train_runs_in_env
from tests.session_once import once

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_cpu.yaml"
TRACKERS = ("tensorboard", "wandb", "mlflow")


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory):
    """One process, recipes/tiny_cpu.yaml with 4 prompts x 4 samples a step (16 sequences), dynamic
    sampling off, 3 steps, the step's rollouts dumped every step (`trainer.dump_every`), logging to
    every tracker (when tensorboard, wandb and mlflow are installed; else to the console only), stopped
    by exit_interval after step 2 and resumed by a second launch of the same recipe. Once per test run
    (tests/session_once.py).

    Read by test_dumps.py (the dumps of steps 1 and 2 are the one-process reference of every layout;
    `analyze` reads the dumps and metrics.jsonl) and test_trackers_run.py (the trackers' files)."""
    loggers = ["console", *TRACKERS] if all(importlib.util.find_spec(m) for m in TRACKERS) else ["console"]
    run = SimpleNamespace(steps=3, exit_interval=2, loggers=loggers, project="rlcorr-test", experiment="trk-exp")
    out, (run.first, run.resumed) = once(tmp_path_factory, "one_process_run", lambda out: _one_process_run(out, run))
    run.run_dir = out / "one"
    assert read_metrics(run.run_dir) == run.resumed
    return run


def _one_process_run(out: Path, run: SimpleNamespace) -> tuple[list[dict], list[dict]]:
    """The first and the resumed launch's metrics rows."""
    loggers = run.loggers
    launch = (TINY, ["name=one", f"trainer.output_dir={out}", f"trainer.steps={run.steps}",
                     f"trainer.exit_interval={run.exit_interval}", f"trainer.logger=[{','.join(loggers)}]",
                     f"trainer.project_name={run.project}", f"trainer.experiment_name={run.experiment}",
                     "data.prompts_per_step=4", "rollout.n=4", "trainer.micro_batch_size=4", "trainer.save_every=0",
                     "algorithm.dynamic_sampling.enabled=false", "trainer.dump_every=1"])
    # wandb offline (no network, no account); MLflow's file store in the run directory
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": None}
    return run_distributed(train_runs_in_env, 1, [launch, launch], env)[0]
