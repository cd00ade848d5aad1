"""The ratio metric family (docs/math.md, "The metrics"), shared by IS weights and ratio rejection sampling.

For a ratio v (the IS weight before truncation, or the RS statistic r) with marks hi/lo:
token level uses v_t = exp(clamp20(lr_t)); sequence levels use v_i = exp(clamp20(L_i)) with L_i
the sequence's log-ratio sum (sequence) or mean (geometric). Token sums are accumulated around a
per-row shift and sequence values in float64, so that spreads and tiny ratios keep their digits.
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from .context import LOG_RATIO_BOUND, Context, finite_or_zero, max_all, min_all

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
        rows, key, v = ctx.rows, self._key, ctx.ratio_tok
        v_min, v_max = ctx.ratio_row_extremes
        v_sum = ctx.row_sum_zero_masked(ctx.ratio_tok_masked)  # float32 sums keep tiny ratios' relative precision
        # The spread of the clamped ratio is summed around the row's largest ratio so that nearly
        # equal values (all close to 1, or all clamped to one bound) do not cancel in float32.
        w_tok = torch.clamp(v, self.lo, self.hi, out=ctx.scratch)
        w_sum, w2_sum = ctx.row_moments(w_tok, v_max.clamp(self.lo, self.hi), scratch=True)
        rows.add_sum(key("v"), v_sum)
        rows.add_sum(key("w"), w_sum)
        rows.add_sum(key("w2"), w2_sum)
        # v = 1 at masked positions: only a bound on the wrong side of 1 needs the mask.
        rows.add_sum(key("hi"), ctx.row_count(torch.gt, v, self.hi, zero_masked=self.hi >= 1.0))
        rows.add_sum(key("lo"), ctx.row_count(torch.lt, v, self.lo, zero_masked=self.lo <= 1.0))
        rows.add_max(key("max"), v_max)
        rows.add_min(key("min"), v_min)

    def batch_phase(self, ctx: Context) -> None:
        rows, totals, key, n = ctx.rows, ctx.totals, self._key, ctx.n_row
        if self.level == "token":
            for name in ("v", "w", "w2", "hi", "lo"):
                totals.add_sum(key(name), rows.sum(key(name)).sum())
            totals.add_max(key("max"), max_all(rows.max(key("max"))))
            totals.add_min(key("min"), min_all(rows.min(key("min"))))
            seq_value = rows.sum(key("v")) / n.clamp(min=1)  # s_i, the row mean ratio
        else:
            log_v = self.log_ratio_row(ctx)
            seq_value = log_v.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()  # float64: tiny ratios keep their digits
            w = seq_value.clamp(self.lo, self.hi)
            totals.add_sum(key("v"), (n * seq_value).sum())
            totals.add_sum(key("w"), (n * w).sum())
            totals.add_sum(key("w2"), (n * w * w).sum())
            totals.add_sum(key("hi"), ctx.sum_rows(log_v > math.log(self.hi)))
            totals.add_sum(key("lo"), ctx.sum_rows(log_v < math.log(self.lo)))
            totals.add_max(key("max"), ctx.max_rows(log_v))
            totals.add_min(key("min"), ctx.min_rows(log_v))
        seq_dev = seq_value - 1.0
        ctx.add_centred_moments(key("seq_dev"), seq_dev, torch.ones_like(n))
        totals.add_sum(key("seq_hi"), ctx.sum_rows(seq_value > self.hi))
        totals.add_sum(key("seq_lo"), ctx.sum_rows(seq_value < self.lo))
        totals.add_max(key("seq_max"), ctx.max_rows(seq_value))
        totals.add_min(key("seq_min"), ctx.min_rows(seq_value))
        totals.add_max(key("seq_max_deviation"), ctx.max_rows(seq_dev.abs()))

    def metrics(self, ctx: Context) -> dict[str, torch.Tensor]:
        t, key, tokens, seqs = ctx.totals, self._key, ctx.num_tokens, ctx.num_rows
        per_frac = ctx.per_token if self.level == "token" else ctx.per_row
        if self.level == "token":  # extremes of the token ratio exp(clamp20(lr))
            v_max, v_min = t.max(key("max")), t.min(key("min"))
        else:  # extremes of the unclamped sequence log-ratio (the seed's definition)
            v_max = t.max(key("max")).clamp(max=LOG_RATIO_BOUND).exp()
            v_min = t.min(key("min")).exp()
        mean_w = ctx.per_token(t.sum(key("w")))  # float64: the spread below cancels safely
        mean_w2 = ctx.per_token(t.sum(key("w2")))
        variance = (mean_w2 - mean_w * mean_w).clamp(min=0.0)
        seq_dev = t.sum(key("seq_dev/s"))
        seq_var = ctx.centred_sum_of_squares(key("seq_dev"), seqs) / (seqs - 1).clamp(min=1)
        out = {
            "mean": ctx.per_token(t.sum(key("v"))),
            "max": finite_or_zero(v_max),
            "min": finite_or_zero(v_min),
            "std": torch.where(tokens > 1, variance.sqrt(), 0.0),
            "eff_sample_size": torch.where(tokens > 0, (mean_w + 1e-8) ** 2 / mean_w2.clamp(min=1e-300), 1.0),
            "ratio_fraction_high": per_frac(t.sum(key("hi"))),
            "ratio_fraction_low": per_frac(t.sum(key("lo"))),
            "seq_mean": torch.where(seqs > 0, 1.0 + ctx.per_row(seq_dev), 0.0),
            "seq_std": torch.where(seqs > 1, seq_var.sqrt(), 0.0),
            "seq_max": finite_or_zero(t.max(key("seq_max"))),
            "seq_min": finite_or_zero(t.min(key("seq_min"))),
            "seq_max_deviation": finite_or_zero(t.max(key("seq_max_deviation"))),
            "seq_fraction_high": ctx.per_row(t.sum(key("seq_hi"))),
            "seq_fraction_low": ctx.per_row(t.sum(key("seq_lo"))),
        }
        return {key(name): value for name, value in out.items()}
