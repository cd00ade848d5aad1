"""`megatron-rlcorr` (or `python -m megatron_rlcorr.cli`): train | presets.

    megatron-rlcorr train --config recipes/tiny_cpu.yaml [--nproc 2] [section.key=value ...]
    megatron-rlcorr presets

`train` validates the recipe for the requested number of processes first (so a typo fails in a
second, not after a rendezvous), then runs `python -m torch.distributed.run --nproc_per_node N
-m megatron_rlcorr.train ...` and returns its exit code.
"""
from __future__ import annotations

import argparse
import inspect
import subprocess
import sys

from .config import PRESETS, RolloutCorrectionConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-rlcorr", description="RL post-training with rollout correction")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="launch a recipe with torchrun on this machine")
    train.add_argument("--config", required=True, help="recipe YAML")
    train.add_argument("--nproc", type=int, default=None,
                       help="processes on this machine (default: tp*pp*cp of the recipe, at least 1)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=10")
    commands.add_parser("presets", help="list the rollout correction presets and what they set")
    args = parser.parse_args(argv)
    if args.command == "presets":
        print(format_presets())
        return 0
    return launch(args.config, args.overrides, args.nproc)


def launch(config: str, overrides: list[str], nproc: int | None) -> int:
    from .train import EXIT_BAD_RECIPE, load_and_check
    from .recipe import load_recipe

    try:
        if nproc is None:
            nproc = load_recipe(config, overrides).parallel.model_parallel_size
        if nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {nproc}")
        load_and_check(config, overrides, nproc)
    except ValueError as err:
        print(f"error: recipe {config}: {err}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "megatron_rlcorr.train", "--config", config, *overrides]
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def format_presets() -> str:
    """One block per preset: its call signature and the settings it differs from the defaults by."""
    defaults = RolloutCorrectionConfig().to_dict()
    lines = []
    for name in PRESETS:
        factory = getattr(RolloutCorrectionConfig, name)
        settings = factory().to_dict()
        changed = {k: v for k, v in settings.items() if v != defaults[k]
                   or (k == "rollout_is_threshold" and settings["rollout_is"] is not None)}
        mode = "bypass (2-policy)" if settings["bypass_mode"] else "decoupled (3-policy)"
        loss = "policy gradient" if settings["use_policy_gradient"] else "PPO-clip"
        params = ", ".join(f"{p.name}={p.default!r}" for p in inspect.signature(factory).parameters.values())
        lines.append(f"{name}({params})  [{mode}, {loss}]")
        if not changed:
            lines.append("    (all defaults: no IS weights, no rejection; metrics only)")
        lines += [f"    {key}: {value}" for key, value in changed.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
