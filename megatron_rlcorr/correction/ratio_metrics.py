"""The ratio metric family of SPEC Appendix A, shared by IS weights and ratio rejection sampling.

For a ratio v (the IS weight before truncation, or the RS statistic r) with marks hi/lo:
token level uses v_t = exp(clamp20(lr_t)); sequence levels use v_i = exp(clamp20(L_i)) with L_i
the sequence's log-ratio sum (sequence) or mean (geometric). Spreads are accumulated as
deviations from 1 (expm1) so that ratios near 1 keep their precision.
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from .context import LOG_RATIO_BOUND, Context, finite_or_zero, per_count

RatioLevel = Literal["token", "seq_sum", "seq_mean"]


class RatioMetrics:
    def __init__(self, prefix: str, level: RatioLevel, hi: float, lo: float) -> None:
        self.prefix, self.level, self.hi, self.lo = prefix, level, hi, lo

    def _key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def log_ratio_row(self, ctx: Context) -> torch.Tensor:
        """float64 L_i of a sequence level."""
        return ctx.log_ratio_sum_row if self.level == "seq_sum" else ctx.log_ratio_mean_row

    def rows_phase(self, ctx: Context) -> None:
        if self.level != "token":
            return  # sequence levels need only S_i and n_i, which every call reduces
        rows, key, v_minus_one = ctx.rows, self._key, ctx.ratio_minus_one_tok
        # Masked positions have c = 0, so v = 1 there: with lo <= 1 <= hi they are neither high,
        # low nor clamped, and every quantity below is already 0 there (no masking pass needed).
        row_sum = ctx.row_sum_zero_masked if self.lo <= 1.0 <= self.hi else ctx.row_sum
        dev = v_minus_one.clamp(self.lo - 1.0, self.hi - 1.0)
        rows.add_sum(key("v_minus_one"), ctx.row_sum_zero_masked(v_minus_one))
        rows.add_sum(key("dev"), row_sum(dev))
        rows.add_sum(key("dev2"), row_sum(dev * dev))
        rows.add_sum(key("hi"), row_sum(ctx.ratio_tok > self.hi))
        rows.add_sum(key("lo"), row_sum(ctx.ratio_tok < self.lo))
        # exp is monotone: the extremes of v are exp of the extremes of c.
        rows.add_max(key("max_log"), ctx.clamped_row_max)
        rows.add_min(key("min_log"), ctx.clamped_row_min)

    def batch_phase(self, ctx: Context) -> None:
        rows, totals, key, n = ctx.rows, ctx.totals, self._key, ctx.n_row
        if self.level == "token":
            for name in ("dev", "dev2", "hi", "lo"):
                totals.add_sum(key(name), rows.sum(key(name)).sum())
            totals.add_sum(key("v"), rows.sum(key("v_minus_one")).sum() + n.sum())
            totals.add_max(key("max"), rows.max(key("max_log")).max())
            totals.add_min(key("min"), rows.min(key("min_log")).min())
            seq_dev = rows.sum(key("v_minus_one")) / n.clamp(min=1)
        else:
            log_v = self.log_ratio_row(ctx)
            clamped = log_v.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).float()
            v = clamped.exp()
            dev = torch.expm1(clamped).clamp(self.lo - 1.0, self.hi - 1.0).double()
            totals.add_sum(key("v"), (n * v).sum())
            totals.add_sum(key("dev"), (n * dev).sum())
            totals.add_sum(key("dev2"), (n * dev * dev).sum())
            totals.add_sum(key("hi"), ctx.sum_rows(log_v > math.log(self.hi)))
            totals.add_sum(key("lo"), ctx.sum_rows(log_v < math.log(self.lo)))
            totals.add_max(key("max"), ctx.max_rows(log_v))
            totals.add_min(key("min"), ctx.min_rows(log_v))
            seq_dev = torch.expm1(clamped).double()
        seq_value = 1.0 + seq_dev  # per-sequence mean ratio s_i
        totals.add_sum(key("seq_dev"), ctx.sum_rows(seq_dev))
        totals.add_sum(key("seq_dev2"), ctx.sum_rows(seq_dev * seq_dev))
        totals.add_sum(key("seq_hi"), ctx.sum_rows(seq_value > self.hi))
        totals.add_sum(key("seq_lo"), ctx.sum_rows(seq_value < self.lo))
        totals.add_max(key("seq_max"), ctx.max_rows(seq_value))
        totals.add_min(key("seq_min"), ctx.min_rows(seq_value))
        totals.add_max(key("seq_max_deviation"), ctx.max_rows(seq_dev.abs()))

    def metrics(self, ctx: Context) -> dict[str, torch.Tensor]:
        t, key, tokens, seqs = ctx.totals, self._key, ctx.num_tokens, ctx.num_rows
        frac_den = tokens if self.level == "token" else seqs
        if self.level == "token":  # extremes of the clamped token log-ratio
            v_max, v_min = t.max(key("max")).exp(), t.min(key("min")).exp()
        else:  # extremes of the unclamped sequence log-ratio (the seed's definition)
            v_max = t.max(key("max")).clamp(max=LOG_RATIO_BOUND).exp()
            v_min = t.min(key("min")).exp()
        mean_dev = per_count(t.sum(key("dev")), tokens)
        mean_dev2 = per_count(t.sum(key("dev2")), tokens)
        variance = (mean_dev2 - mean_dev * mean_dev).clamp(min=0.0)
        seq_dev, seq_dev2 = t.sum(key("seq_dev")), t.sum(key("seq_dev2"))
        seq_var = (seq_dev2 - seq_dev * seq_dev / seqs.clamp(min=1)).clamp(min=0.0) / (seqs - 1).clamp(min=1)
        out = {
            "mean": per_count(t.sum(key("v")), tokens),
            "max": finite_or_zero(v_max),
            "min": finite_or_zero(v_min),
            "std": torch.where(tokens > 1, variance.sqrt(), 0.0),
            "eff_sample_size": (1.0 + mean_dev + 1e-8) ** 2 / (1.0 + 2.0 * mean_dev + mean_dev2),
            "ratio_fraction_high": per_count(t.sum(key("hi")), frac_den),
            "ratio_fraction_low": per_count(t.sum(key("lo")), frac_den),
            "seq_mean": torch.where(seqs > 0, 1.0 + per_count(seq_dev, seqs), 0.0),
            "seq_std": torch.where(seqs > 1, seq_var.sqrt(), 0.0),
            "seq_max": finite_or_zero(t.max(key("seq_max"))),
            "seq_min": finite_or_zero(t.min(key("seq_min"))),
            "seq_max_deviation": finite_or_zero(t.max(key("seq_max_deviation"))),
            "seq_fraction_high": per_count(t.sum(key("seq_hi")), seqs),
            "seq_fraction_low": per_count(t.sum(key("seq_lo")), seqs),
        }
        return {key(name): value for name, value in out.items()}
