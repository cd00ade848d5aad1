"""The mismatch over training steps: the data of the `kl_rising` check and of the metric curves.

Why: a mismatch that grows as training goes on means the engine and the trainer drift apart
(weights that do not reach the engine, a precision error that grows with the weights' scale, a
policy moving where low precision is worse); one batch cannot show it, a run's steps can.

Series: `rollout_corr/k3_kl` of every logged step of a run's metrics.jsonl when the run logged it
(the trainer's correction on each step's whole batch); else the k3 of each dump's batch, from the
correction's `disabled` preset (the same metric). A scored file has no steps and no trend; fewer
than MIN_POINTS steps give a series without a trend.

Trend: the mean of the first third of the points (ceil(n/3) of them), the mean of the last third,
and the least-squares slope of k3 per step over all points. Non-finite values are left out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..config import RolloutCorrectionConfig
from ..correction import compute_rollout_correction
from .inputs import AnalysisInput

METRIC = "rollout_corr/k3_kl"
MIN_POINTS = 4


@dataclass
class Trend:
    source: str            # "metrics.jsonl" or "dumps"
    steps: list[int]
    values: list[float]

    @property
    def has_trend(self) -> bool:
        return len(self.steps) >= MIN_POINTS

    @property
    def third(self) -> int:
        return -(-len(self.steps) // 3)

    @property
    def first_mean(self) -> float:
        return sum(self.values[:self.third]) / self.third

    @property
    def last_mean(self) -> float:
        return sum(self.values[-self.third:]) / self.third

    @property
    def first_steps(self) -> tuple[int, int]:
        return self.steps[0], self.steps[self.third - 1]

    @property
    def last_steps(self) -> tuple[int, int]:
        return self.steps[-self.third], self.steps[-1]

    @property
    def slope(self) -> float:
        """Least-squares slope of k3 per step."""
        x = torch.tensor(self.steps, dtype=torch.float64)
        y = torch.tensor(self.values, dtype=torch.float64)
        dx = x - x.mean()
        denominator = float((dx * dx).sum())
        return float((dx * (y - y.mean())).sum()) / denominator if denominator > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "metric": METRIC, "steps": self.steps, "k3_kl": self.values}
        if self.has_trend:
            out.update(first_mean=self.first_mean, last_mean=self.last_mean, first_steps=list(self.first_steps),
                       last_steps=list(self.last_steps), slope_per_step=self.slope)
        return out


def k3_trend(inp: AnalysisInput) -> Trend | None:
    """The k3 series of a run or dumps directory (module docstring); None for a scored file."""
    if inp.metrics:
        points = [(r["step"], r[METRIC]) for r in inp.metrics if isinstance(r.get(METRIC), (int, float))]
        points = [(s, float(v)) for s, v in points if math.isfinite(v)]
        if points:
            steps, values = zip(*sorted(dict(points).items()))
            return Trend("metrics.jsonl", list(steps), list(values))
    if inp.step_of_sequence is None:
        return None
    values = [_dump_k3(inp, step) for step in inp.steps]
    return Trend("dumps", inp.steps, values)


def _dump_k3(inp: AnalysisInput, step: int) -> float:
    batch = inp.batch.select(inp.step_of_sequence == step)
    out = compute_rollout_correction(batch.old_log_prob.float(), batch.rollout_log_prob.float(), batch.mask,
                                     RolloutCorrectionConfig(), cu_seqlens=batch.cu_seqlens)
    return float(out.metrics[METRIC])
