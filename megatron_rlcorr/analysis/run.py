"""One analysis end to end: read the input, evaluate the presets and the block, run the checks,
write summary.json, report.md and the plots.

Why here: the entry module (`megatron_rlcorr/analyze.py`) only parses arguments and maps errors
to exit codes; tests and notebooks call `analyze` and `write_outputs` directly.

summary.json (docs/api.md gives the contract, `presets` and `findings`; the other keys are additions,
never renames):
- `input` {path, kind, files, steps}, `num_sequences` (all records), `num_tokens` (valid tokens);
- `statistics`: statistics.mismatch_statistics;
- `presets`: every preset of config.PRESETS by name -> presets.Evaluation.numbers();
- `correction`: the evaluated block: `source`, the same numbers, and all its `metrics`;
- `checks`: every check -> {value, threshold, flagged} (value null when it does not apply);
- `findings`: [{check, value, threshold, recommendation}]; `recommended`: per finding, the block
  `settings`, the same as `overrides`, and what the correction gives with them (`expected`);
- `trend`: trend.Trend.to_dict() or null; `plots`: the PNG files written; `plots_error`: why
  there are none (matplotlib missing), else null.
Non-finite numbers are written as null (strict JSON).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .findings import Context, Finding, overrides, run_checks
from .inputs import AnalysisInput, load_input
from .plots import PlotsUnavailable, write_plots
from .presets import Block, Evaluation, evaluate, evaluate_presets, load_block
from .report import format_report
from .statistics import Sequences, mismatch_statistics, sequences
from .trend import Trend, k3_trend


@dataclass
class Analysis:
    input: AnalysisInput
    block: Block
    sequences: Sequences
    statistics: dict[str, Any]
    presets: dict[str, Evaluation]
    correction: Evaluation
    trend: Trend | None
    checks: dict[str, dict[str, Any]]
    findings: list[Finding]

    def summary(self) -> dict[str, Any]:
        inp = self.input
        return {
            "input": {"path": str(inp.path), "kind": inp.kind, "files": [f.name for f in inp.files],
                      "steps": inp.steps or None},
            "num_sequences": inp.batch.num_sequences,
            "num_tokens": inp.batch.num_tokens,
            "statistics": self.statistics,
            "presets": {name: ev.numbers() for name, ev in self.presets.items()},
            "correction": {"source": self.block.source, **self.correction.numbers(),
                           "metrics": self.correction.metrics},
            "checks": self.checks,
            "findings": [f.to_dict() for f in self.findings],
            "recommended": {f.check: {"settings": f.settings, "overrides": overrides(f.settings),
                                      "expected": f.expected} for f in self.findings},
            "trend": self.trend.to_dict() if self.trend is not None else None,
        }


@dataclass
class Outputs:
    summary: Path
    report: Path
    plots: list[Path]
    plots_error: str | None


def analyze(path: str | Path, config: str | Path | None = None, overrides: Sequence[str] = ()) -> Analysis:
    """The analysis of INPUT `path` under the block of `config` (presets.load_block); ValueError
    for bad input, naming the file, line or key and the fix."""
    inp = load_input(path)
    block = load_block(config, overrides, run_recipe=inp.recipe)
    presets = evaluate_presets(inp.batch)
    correction = evaluate(inp.batch, block.config)
    seqs = sequences(inp.batch)
    trend = k3_trend(inp)
    checks, findings = run_checks(Context(inp.batch, seqs, correction, trend))
    stats = mismatch_statistics(inp.batch, seqs, presets["disabled"].metrics)
    return Analysis(inp, block, seqs, stats, presets, correction, trend, checks, findings)


def write_outputs(analysis: Analysis, out: str | Path, plots: bool = True) -> Outputs:
    """DIR/summary.json, DIR/report.md and (with matplotlib) the PNG plots."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory (it is created if missing)")
    out.mkdir(parents=True, exist_ok=True)
    files, error = [], None
    if plots:
        try:
            files = write_plots(out, analysis.input, analysis.sequences, analysis.correction)
        except PlotsUnavailable as err:
            error = str(err)
    summary = {**analysis.summary(), "plots": [f.name for f in files], "plots_error": error}
    summary = _json_ready(summary)
    summary_path, report_path = out / "summary.json", out / "report.md"
    summary_path.write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    report_path.write_text(format_report(summary))
    return Outputs(summary_path, report_path, files, error)


def _json_ready(value: Any) -> Any:
    """Non-finite floats -> None, tuples -> lists, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value
