"""Entry point: `torchrun --nproc_per_node=N -m megatron_rlcorr.train --config RECIPE [section.key=value ...]`.

The recipe is loaded and validated (keys, types, correction block, layout for WORLD_SIZE, task)
before any process group exists: a bad recipe stops every rank with one message and exit code 2,
without a hanging rendezvous or a traceback. Then: gloo (CPU) or NCCL (GPU) process group,
Megatron-Core's CPU compatibility layer when there is no GPU, parallel groups, training.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from .training.checkpoint import check_resumable
from .recipe import Recipe, load_recipe

EXIT_BAD_RECIPE = 2
REPORT_GRACE_S = 10.0  # how long ranks other than 0 wait, on a bad recipe, for rank 0 to report it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_rlcorr.train",
                                     description="RL training with rollout correction (launch with torchrun)")
    parser.add_argument("--config", required=True, help="recipe YAML (see recipes/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=10 optim.lr=1e-3")
    return parser.parse_args(argv)


def load_and_check(config: str, overrides: list[str], world_size: int) -> Recipe:
    """The validated recipe; ValueError naming the key and the fix otherwise."""
    recipe = load_recipe(config, overrides)
    recipe.check_layout(world_size)
    if recipe.trainer.resume:
        check_resumable(recipe.run_dir, recipe.parallel.layout(world_size))
    return recipe


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        recipe = load_and_check(args.config, args.overrides, world_size)
    except ValueError as err:
        where = ""
        if rank != 0:
            # Rank 0 reports. torchrun stops all workers as soon as one exits non-zero, so a rank
            # that failed its check first waits: exiting at once could get rank 0 killed before it
            # printed. Still alive after the wait, rank 0 must have passed (e.g. it sees another
            # filesystem): then this rank reports its own error.
            time.sleep(REPORT_GRACE_S)
            where = f" (rank {rank})"
        print(f"error: recipe {args.config}{where}: {err}", file=sys.stderr, flush=True)
        return EXIT_BAD_RECIPE
    return run(recipe)


def run(recipe: Recipe) -> int:
    from .parallel.cpu import enable_cpu_megatron
    from .parallel.groups import build_parallel_groups, destroy_parallel_groups
    from .rl.trainer import train

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    try:
        enable_cpu_megatron()
        p = recipe.parallel
        groups = build_parallel_groups(p.tp, p.pp, p.cp, p.vpp)
        try:
            train(recipe, groups)
        finally:
            destroy_parallel_groups()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
