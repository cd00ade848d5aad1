"""Helpers for tests that train whole runs: metrics records, training several recipes in turn
inside one gloo world (`run_distributed(train_runs, world_size, runs)`, or `train_runs_in_env` where the
runs need environment variables of their own), and an entry point (train, score, eval) run on a
pool's processes as torchrun would run it (`entry_point`), without a launch's start-up."""
from __future__ import annotations

import json
from pathlib import Path

# Wall-clock dependent: everything else must repeat exactly.
NONDETERMINISTIC = ("time", "timing/", "throughput/")


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(NONDETERMINISTIC)}


# An example recipe must train on most of its tokens: its rejection sampling (absent without
# rollout_rs) and veto may drop at most the rest.
MOST_TOKENS = 0.5


def kept_token_fraction(record: dict) -> float:
    """The share of a step's response tokens that rejection sampling and the veto kept: 1 less RS's
    share of the tokens and the veto's share of the sequences (a sequence share standing in for
    the tokens it holds; 1 when neither acts)."""
    masked = record.get("rollout_corr/rollout_rs_masked_fraction", 0.0)
    return 1.0 - masked - record["rollout_corr/rollout_is_veto_fraction"]


def train_runs(rank, world_size, runs):
    """Each (recipe path, overrides) in turn, each on its recipe's layout; rank 0's metrics of each."""
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups, destroy_parallel_groups
    from megatron_rlcorr.recipe import load_recipe
    from megatron_rlcorr.rl.trainer import train

    enable_cpu_megatron()
    out = []
    for path, overrides in runs:
        recipe = load_recipe(path, overrides)
        p = recipe.parallel
        groups = build_parallel_groups(p.tp, p.pp, p.cp, p.vpp, rollout_tp=recipe.rollout.tensor_parallel_size,
                                       ep=p.ep, etp=p.etp)
        try:
            run_dir = train(recipe, groups)
        finally:
            destroy_parallel_groups()
        out.append(read_metrics(run_dir) if rank == 0 else None)
    return out


def train_runs_in_env(rank, world_size, runs, env):
    """train_runs with the environment variables `env` set (a value None: unset) while the runs train;
    afterwards the process as a launch's end leaves it: wandb's service stopped (`wandb.teardown()`,
    which a process exit does), and the environment as it was.

    For runs that log to trackers: a session-scoped run has no monkeypatch (WANDB_MODE=offline), and
    what the trackers leave in the process (wandb's service threads and WANDB_SERVICE, MLflow's
    file-store opt-in MLFLOW_ALLOW_FILE_STORE=true of rl/trackers.py) must not outlive the case: a pool
    worker (tests/dist_pool.py) is reused by later cases, and the pool fails a case that leaves
    them behind."""
    import os
    import sys

    from tests.dist_pool import _apply_env

    saved = dict(os.environ)
    try:
        _apply_env(env)
        return train_runs(rank, world_size, runs)
    finally:
        if "wandb" in sys.modules:
            sys.modules["wandb"].teardown()
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        os.environ.update(saved)


def entry_point(rank, world_size, module, argv):
    """`python -m megatron_rlcorr.MODULE ARGV` (train, score, eval: an entry point that makes the launch's
    default group itself) on this rank of a pool (tests/dist_pool.py), as under torchrun: the pool's
    group is put aside first and made again after the case (with rollout.placement separate, train
    cuts the world into trainer and rollout ranks). (exit code, what it printed to stdout)."""
    code, stdout, _ = entry_point_printing(rank, world_size, module, argv)
    return code, stdout


def entry_point_printing(rank, world_size, module, argv):
    """entry_point, with what it printed to stderr too (its warnings and errors, which it prints to
    sys.stderr): (exit code, stdout, stderr)."""
    import contextlib
    import importlib
    import io

    import torch.distributed as dist

    main = importlib.import_module(f"megatron_rlcorr.{module}").main
    dist.destroy_process_group()
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(argv)
    return code, stdout.getvalue(), stderr.getvalue()
