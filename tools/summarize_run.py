"""Summarise a run's metrics.jsonl: reward of the first vs the last steps, the mismatch metrics, and the
validation metrics (val-core/...) at every step the run validated (step 0: before training).

    python tools/summarize_run.py runs/tiny_cpu/metrics.jsonl [--window 10]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROWS = (
    ("reward_mean", "reward (round-0 samples)"),
    ("reward/acc_mean", "right answers (round 0)"),
    ("response_length_mean", "response length"),
    ("loss", "policy loss"),
    ("grad_norm", "grad norm"),
    ("rollout_corr/k3_kl", "k3 KL(rollout || train)"),
    ("rollout_corr/log_ppl_abs_diff", "|log ppl diff|"),
    ("rollout_corr/rollout_is_mean", "IS weight mean"),
    ("rollout_corr/rollout_is_seq_max", "IS weight seq max"),
    ("rollout_corr/rollout_rs_masked_fraction", "RS masked token fraction"),
    ("rollout_corr/rollout_is_veto_fraction", "veto sequence fraction"),
    ("rollout_corr/invalid_rollout_token_fraction", "invalid rollout tokens"),
    ("throughput/tokens_per_s", "tokens/s"),
)


def _mean(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return sum(values) / len(values) if values else math.nan


MAX_VALIDATION_COLUMNS = 6


def summarize(path: Path, window: int) -> str:
    everything = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = [r for r in everything if r.get("step", 0) > 0]  # step 0 holds only the before-training validation
    if not records:
        raise ValueError(f"{path} holds no metrics of a training step")
    first, last = records[:window], records[-window:]
    wall = sum(r.get("timing/step_s", 0.0) for r in records)
    lines = [f"{path}: {len(records)} steps, {wall:.1f} s in training steps",
             f"{'metric':<28}{'first ' + str(len(first)):>14}{'last ' + str(len(last)):>14}"]
    for key, label in ROWS:
        if any(key in r for r in records):
            lines.append(f"{label:<28}{_mean(first, key):>14.5g}{_mean(last, key):>14.5g}")
    return "\n".join(lines + validation_lines(everything))


def validation_lines(records: list[dict]) -> list[str]:
    """The val-core metrics by validation step (the first and last few when there are many)."""
    keys = sorted({k for r in records for k in r if k.startswith("val-core/")})
    validated = [r for r in records if any(k in r for k in keys)]
    if not validated:
        return []
    if len(validated) > MAX_VALIDATION_COLUMNS:
        half = MAX_VALIDATION_COLUMNS // 2
        validated = validated[:half] + validated[-half:]
    width = max(len(k) for k in keys) + 2
    lines = ["", "validation".ljust(width) + "".join(f"{'step ' + str(r['step']):>12}" for r in validated)]
    for key in keys:
        lines.append(key.ljust(width) + "".join(f"{r.get(key, math.nan):>12.4g}" for r in validated))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=Path)
    parser.add_argument("--window", type=int, default=10)
    args = parser.parse_args(argv)
    try:
        print(summarize(args.metrics, args.window))
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
