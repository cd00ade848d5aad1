"""Per-step metrics: `runs/<name>/metrics.jsonl` always, the console line and the trackers of trainer.logger.

Metrics arrive as 0-d device tensors; they become Python floats here, once per step, and every
destination gets that same record (TensorBoard, wandb and MLflow through rl/trackers.py).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import torch

from .trackers import open_trackers

CONSOLE_KEYS = (
    ("reward", "reward_mean"), ("acc", "reward/acc_mean"), ("len", "response_length_mean"),
    ("len_max", "response_length_max"), ("trunc", "response/clip_fraction"), ("gen_s", "timing/gen_s"),
    ("gen_tok/s", "throughput/gen_tokens_per_s"), ("loss", "loss"),
    ("gnorm", "grad_norm"), ("k3", "rollout_corr/k3_kl"), ("lppl_diff", "rollout_corr/log_ppl_abs_diff"),
    ("ppl_ratio", "rollout_corr/ppl_ratio"),
    ("is_mean", "rollout_corr/rollout_is_mean"), ("rs_masked", "rollout_corr/rollout_rs_masked_fraction"),
    ("veto", "rollout_corr/rollout_is_veto_fraction"), ("tok/s", "throughput/tokens_per_s"),
)


VAL_CORE = "val-core/"


class MetricsLogger:
    """Writes on one rank only (the caller passes enabled=False elsewhere)."""

    def __init__(self, run_dir: Path, total_steps: int, enabled: bool, *,
                 trackers: Sequence[str] = ("console", "tensorboard"), project: str = "megatron-rlcorr",
                 experiment: str = "run", config: Mapping | None = None, resume_step: int = 0) -> None:
        self.enabled, self.total_steps = enabled, total_steps
        self.console = "console" in trackers
        self.path = run_dir / "metrics.jsonl"
        self.trackers = []
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step == 0 and self.path.exists():
            self.path.unlink()
        elif resume_step:
            _truncate_after(self.path, resume_step)
        self.trackers = open_trackers(trackers, run_dir, project=project, experiment=experiment,
                                      config=config or {}, resume_step=resume_step)

    def log(self, step: int, metrics: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
        values = {k: float(v) for k, v in metrics.items()}  # the one host transfer per step
        if not self.enabled:
            return values
        record = {"step": step, "time": time.time(), **values}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for tracker in self.trackers:
            tracker.log(step, values)
        if self.console:
            print(self.console_line(step, values), flush=True, file=sys.stdout)
        return values

    def console_line(self, step: int, values: Mapping[str, float]) -> str:
        width = 20
        done = int(width * step / max(self.total_steps, 1))
        bar = "#" * done + "." * (width - done)
        fields = [f"{label}={values[key]:.4g}" for label, key in CONSOLE_KEYS if key in values]
        # A validation's headline: per data source, the mean and pass@n of its core variable.
        fields += [f"{key[len(VAL_CORE):]}={value:.4g}" for key, value in values.items()
                   if key.startswith(VAL_CORE) and ("/mean@" in key or "/pass@" in key)]
        return f"[{bar}] step {step}/{self.total_steps} {' '.join(fields)}"

    def close(self) -> None:
        """Close the trackers; called from the loop's `finally`, so an exception in flight marks them failed."""
        failed = sys.exc_info()[0] is not None
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close(failed)


def _truncate_after(path: Path, step: int) -> None:
    """Drop records of steps after `step` (a resumed run rewrites them)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))
