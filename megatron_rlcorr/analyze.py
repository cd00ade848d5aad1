"""`megatron-rlcorr analyze INPUT --out DIR [--config RECIPE] [key=value ...]`: the rollout mismatch.

INPUT is a scored rollout file (`megatron-rlcorr score`'s output), a dumps directory
(`step_<N>.jsonl`, written with `trainer.dump_every`) or a run directory (`dumps/` and
`metrics.jsonl`). DIR receives summary.json (its contract: docs/api.md), report.md and PNG plots
(megatron_rlcorr/analysis/ says what each holds). The findings are evaluated under the
`algorithm.rollout_correction` block of RECIPE (overrides: `algorithm.rollout_correction.<field>=v`),
else of a run directory's own recipe.yaml, else the DAPO block.

One process, no torchrun: the correction runs on the whole input at once. Without matplotlib the
plots are skipped with a message saying how to get them; the rest is written.

Exit codes: 0 written (with or without findings), 2 bad input (INPUT, the recipe, an override, DIR).
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .analysis import analyze, write_outputs
from .runtime import EXIT_BAD_INPUT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", metavar="INPUT",
                        help="scored rollout file (JSONL), dumps directory (step_<N>.jsonl) or run directory")
    parser.add_argument("--out", required=True, help="directory for summary.json, report.md and the plots")
    parser.add_argument("--config", default=None,
                        help="recipe whose algorithm.rollout_correction block the findings are evaluated under "
                             "(default: a run directory's recipe.yaml, else the DAPO block)")
    parser.add_argument("overrides", nargs="*", help="overrides of that block, e.g. "
                                                     "algorithm.rollout_correction.rollout_rs_threshold=1.02")


def analyze_command(input_path: str, out: str, config: str | None = None, overrides: Sequence[str] = ()) -> int:
    """The CLI's `analyze` (module docstring for the exit codes)."""
    try:
        analysis = analyze(input_path, config, overrides)
        outputs = write_outputs(analysis, out)
    except (ValueError, OSError) as err:
        print(f"error: analyze {input_path}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    summary = analysis.summary()
    print(f"analyze: {summary['num_sequences']} sequences, {summary['num_tokens']} tokens from {input_path}; "
          f"evaluated under {analysis.block.source}")
    print(f"findings: {len(analysis.findings)}" + "".join(
        f"\n  {f.check}: {f.value:.4g} (threshold {f.threshold:g})" for f in analysis.findings))
    print(f"wrote {outputs.summary}, {outputs.report}" + "".join(f", {p.name}" for p in outputs.plots))
    if outputs.plots_error:
        print(f"plots: {outputs.plots_error}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-rlcorr analyze",
                                     description="the rollout engine's mismatch with the trainer, on data")
    add_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    stray = [item for item in extra if item.startswith("-") or "=" not in item]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    return analyze_command(args.input, args.out, args.config, [*args.overrides, *extra])


if __name__ == "__main__":
    sys.exit(main())
