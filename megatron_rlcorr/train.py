"""Entry point: `torchrun --nproc_per_node=N -m megatron_rlcorr.train --config RECIPE [section.key=value ...]`.

The recipe is loaded and validated (keys, types, correction block, layout for WORLD_SIZE, task)
before any process group exists: a bad recipe stops every rank with one message and exit code 2
(runtime.report_bad_input). Then: the process groups of the recipe's layout, training. With
rollout.placement: separate the last rollout.num_ranks ranks generate instead (rl/async_rollout.py).
"""
from __future__ import annotations

import argparse
import sys

from .recipe import Recipe, load_recipe
from .runtime import EXIT_BAD_INPUT, launch_rank, process_groups, report_bad_input
from .training.checkpoint import check_resumable

EXIT_BAD_RECIPE = EXIT_BAD_INPUT


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_rlcorr.train",
                                     description="RL training with rollout correction (launch with torchrun)")
    parser.add_argument("--config", required=True, help="recipe YAML (see recipes/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=10 optim.lr=1e-3")
    return parser.parse_args(argv)


def load_and_check(config: str, overrides: list[str], world_size: int) -> Recipe:
    """The validated recipe for a launch of `world_size` ranks (the trainer's layout counts the
    ranks that train: rollout.placement separate keeps the last rollout.num_ranks apart);
    ValueError naming the key and the fix otherwise."""
    recipe = load_recipe(config, overrides)
    recipe.check_launch(world_size)
    world_size = recipe.rollout.trainer_world(world_size)
    if recipe.trainer.resume:
        check_resumable(recipe.run_dir, recipe.parallel.layout(world_size),
                        distributed_optimizer=recipe.optim.use_distributed_optimizer)
    return recipe


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        recipe = load_and_check(args.config, args.overrides, launch_rank()[1])
    except ValueError as err:
        return report_bad_input(f"recipe {args.config}", err)
    return run(recipe)


def run(recipe: Recipe) -> int:
    rollout = recipe.rollout
    with process_groups(recipe.parallel, timeout_minutes=recipe.trainer.timeout_minutes,
                        rollout_tp=rollout.tensor_parallel_size,
                        rollout_ranks=rollout.num_ranks if rollout.separate else 0) as groups:
        from .rl.async_rollout import run_rollout_worker  # inside: Megatron-Core's import-time warnings are
        from .rl.trainer import train                     # filtered (runtime.py)

        if groups.launch is not None and groups.launch.role == "rollout":
            run_rollout_worker(recipe, groups)  # rollout.placement separate: this rank only generates
        else:
            train(recipe, groups)
    return 0


if __name__ == "__main__":
    sys.exit(main())
