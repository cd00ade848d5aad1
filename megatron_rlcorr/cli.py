"""`megatron-rlcorr` (or `python -m megatron_rlcorr.cli`): train | score | eval | export | plan | presets | import-verl | analyze.

    megatron-rlcorr train --config recipes/tiny_cpu.yaml [--nproc 2] [section.key=value ...]
    megatron-rlcorr score --model SRC --rollouts IN.jsonl --out OUT.jsonl [--nproc N] [--config R] [k=v ...]
    megatron-rlcorr eval --model SRC --data FILE [FILE ...] --out DIR [--n N] [--temperature T] [--top-p P]
        [--top-k K] [--max-new-tokens M] [--nproc N] [--config R] [--overwrite] [k=v ...]
    megatron-rlcorr export --model SRC --out DIR [--nproc N] [--dtype bfloat16|float32] [--config R] [k=v ...]
    megatron-rlcorr plan RECIPE --nodes N --gpus-per-node G [--gpu-memory-gib 80] [--json] [--search] [k=v ...]
    megatron-rlcorr presets
    megatron-rlcorr import-verl SCRIPT_OR_YAML --out RECIPE.yaml [model.architecture=NAME ...]
    megatron-rlcorr analyze INPUT --out DIR [--config RECIPE] [algorithm.rollout_correction.k=v ...]

Each launching command validates its arguments for the requested number of processes first (so
a typo fails in a second, not after a rendezvous), then runs `python -m torch.distributed.run
--standalone --nproc_per_node N -m megatron_rlcorr.<command> ...` and returns its exit code.
`--nproc` defaults to the recipe's tp*pp*cp (for `train` plus rollout.num_ranks with
rollout.placement: separate, whose rollout ranks come on top of the trainer's; a smaller --nproc is
refused with the one to pass), or for a run checkpoint to the world size that wrote it.
`--verbose` (train, score, eval, export) keeps the known harmless third-party warnings that the
launched processes otherwise hide (RLCORR_VERBOSE=1; runtime.quiet_known_warnings). An unknown
command or option exits 2, with a "did you mean" only when a known name is close (config.did_you_mean).
"""
from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
from typing import TYPE_CHECKING

from .config import PRESETS, RolloutCorrectionConfig, did_you_mean
from .runtime import EXIT_BAD_INPUT, VERBOSE_ENV

if TYPE_CHECKING:
    from .recipe import Recipe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-rlcorr", description="RL post-training with rollout correction")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="launch a recipe with torchrun on this machine")
    train.add_argument("--config", required=True, help="recipe YAML")
    train.add_argument("--nproc", type=int, default=None,
                       help="processes on this machine (default: tp*pp*cp of the recipe, plus rollout.num_ranks "
                            "with rollout.placement: separate)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=10")
    _add_verbose(train)
    for name, help_text in (("score", "the trainer's log-probs of an engine's rollouts"),
                            ("eval", "validation metrics and generations of a model on prompt files"),
                            ("export", "write a model as a Hugging Face checkpoint")):
        sub = commands.add_parser(name, help=help_text)
        _entry(name).add_arguments(sub)
        sub.add_argument("--nproc", type=int, default=None,
                         help="processes (default: tp*pp*cp, or the layout that wrote a run checkpoint)")
        _add_verbose(sub)
    commands.add_parser("presets", help="list the rollout correction presets and what they set")
    planner = commands.add_parser("plan", help="validate a recipe's layout for a cluster and estimate its memory per "
                                               "GPU, without GPUs (recipe/memory.py)")
    planner.add_argument("config", metavar="RECIPE", help="recipe YAML")
    planner.add_argument("--nodes", type=int, required=True, help="nodes of the launch")
    planner.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (ranks) per node")
    planner.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU (default 80)")
    planner.add_argument("--json", action="store_true", help="print one JSON object")
    planner.add_argument("--search", action="store_true", help="list the layouts that fit, cheapest first")
    planner.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.pp=4")
    importer = commands.add_parser("import-verl", help="write a recipe from a verl run script or config, and report "
                                                       "what was mapped, what differs and what was not mapped")
    importer.add_argument("source", metavar="SCRIPT_OR_YAML",
                          help="a verl run script (bash), a verl YAML config or a file of key=value overrides")
    importer.add_argument("--out", required=True, help="the recipe YAML to write")
    importer.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                          help="recipe keys set on top of the import, e.g. model.architecture=qwen2.5-32b (the layout "
                               "for the script's cluster is then chosen before the checkpoint is on this machine)")
    analyzer = commands.add_parser("analyze", help="the rollout mismatch of a scored file, dumps or a run: statistics, "
                                                   "every preset on the data, findings and plots (analysis/)")
    _entry("analyze").add_arguments(analyzer)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and not argv[0].startswith("-") and argv[0] not in commands.choices:
        parser.error(f"unknown command {argv[0]!r}{did_you_mean(argv[0], list(commands.choices))}; commands: "
                     f"{', '.join(commands.choices)}")
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow options (`score ... parallel.tp=2 --nproc 2 model.bf16=true`): argparse
    # leaves those after an option unparsed.
    stray = [item for item in extra if item.startswith("-") or "=" not in item]
    if stray or (extra and not hasattr(args, "overrides")):
        options = [o for o in commands.choices[args.command]._option_string_actions if o.startswith("--")]
        named = [item + (did_you_mean(item.split("=")[0], options) if item.startswith("--") else "")
                 for item in stray or extra]
        parser.error(f"unrecognized arguments: {' '.join(named)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.command == "presets":
        print(format_presets())
        return 0
    if args.command == "import-verl":
        return import_verl_command(args.source, args.out, args.overrides)
    if args.command == "analyze":
        from .analyze import analyze_command

        return analyze_command(args.input, args.out, args.config, args.overrides)
    if args.command == "plan":
        from .plan import plan_command

        return plan_command(args.config, args.overrides, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                            gpu_memory_gib=args.gpu_memory_gib, as_json=args.json, search=args.search)
    if getattr(args, "verbose", False):
        os.environ[VERBOSE_ENV] = "1"  # the launched processes inherit it
    if args.command == "train":
        return launch(args.config, args.overrides, args.nproc)
    return launch_entry(args.command, args, _entry_argv(args))


def import_verl_command(source: str, out: str, overrides: list[str] | None = None) -> int:
    """Write the recipe imported from a verl script/config to `out` and print the import report."""
    from .recipe.verl import format_report, import_verl, write_recipe

    try:
        result = import_verl(source, overrides=overrides or ())
        write_recipe(result, out)
    except (ValueError, OSError) as err:
        print(f"error: import-verl: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_report(result))
    print(f"wrote {out}")
    return 0


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true",
                        help=f"show every warning, also the known harmless third-party ones ({VERBOSE_ENV}=1)")


def _entry(module: str):
    from importlib import import_module

    return import_module(f"megatron_rlcorr.{module}")


def launch(config: str, overrides: list[str], nproc: int | None) -> int:
    from .recipe import load_recipe
    from .train import load_and_check

    try:
        nproc = _train_nproc(load_recipe(config, overrides), nproc)
        load_and_check(config, overrides, nproc)
    except ValueError as err:
        print(f"error: recipe {config}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return _torchrun("train", nproc, ["--config", config, *overrides])


def launch_entry(command: str, args: argparse.Namespace, argv: list[str]) -> int:
    """Validate `score` / `eval` / `export` arguments in this process, then launch the entry point."""
    from .recipe.source import checkpoint_layout, resolve_source, source_recipe

    entry = _entry(command)
    if hasattr(entry, "normalize_args"):  # eval: overrides after --data's files
        entry.normalize_args(args)
    try:
        nproc = args.nproc
        if nproc is None:
            layout = checkpoint_layout(resolve_source(args.model))
            nproc = layout["world_size"] if layout else source_recipe(
                resolve_source(args.model), args.config, args.overrides).parallel.model_parallel_size
        _check_nproc(nproc)
        entry.prepare(args, nproc)
    except ValueError as err:
        print(f"error: {command} --model {args.model}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return _torchrun(command, nproc, argv)


def _train_nproc(recipe: Recipe, nproc: int | None) -> int:
    """`train`'s launch size: --nproc, else the recipe's default (Recipe.default_launch_world); a
    --nproc below that default, which no layout can run, is refused naming the --nproc to pass."""
    smallest = recipe.default_launch_world
    if nproc is None:
        return smallest
    _check_nproc(nproc)
    if nproc >= smallest:
        return nproc
    mp = recipe.parallel.model_parallel_size
    if recipe.rollout.separate:
        raise ValueError(f"--nproc {nproc} is too few: the trainer needs parallel tp*pp*cp = {mp} rank(s) and "
                         f"rollout.placement: separate puts rollout.num_ranks={recipe.rollout.num_ranks} more after "
                         f"them: pass --nproc {smallest} (or more: a multiple of {mp} for the trainer, plus "
                         f"{recipe.rollout.num_ranks})")
    raise ValueError(f"--nproc {nproc} is too few: one model replica takes parallel tp*pp*cp = {mp} ranks: pass "
                     f"--nproc {mp} (or a multiple of it)")


def _check_nproc(nproc: int) -> None:
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")


def _entry_argv(args: argparse.Namespace) -> list[str]:
    """The entry point's command line from the parsed arguments: its options (each named
    --<dest>, "_" written "-"; a list's values follow it; a flag is given when true), then the
    overrides; --nproc is for torchrun and --verbose for the environment, not the entry point."""
    options: list[str] = []
    for dest, value in vars(args).items():
        if dest in ("command", "nproc", "verbose", "overrides") or value is None or value is False:
            continue
        option = f"--{dest.replace('_', '-')}"
        options += [option] if value is True else [option, *map(str, value if isinstance(value, list) else [value])]
    return [*options, *args.overrides]


def _torchrun(module: str, nproc: int, args: list[str]) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", f"megatron_rlcorr.{module}", *args]
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
