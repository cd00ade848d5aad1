"""The ratio metric family (docs/math.md, "The metrics"), shared by IS weights and ratio rejection sampling.

For a ratio v (the IS weight before truncation, or the RS statistic r) with marks hi/lo:
token level uses v_t = exp(clamp20(lr_t)); sequence levels use v_i = exp(clamp20(L_i)) with L_i
the sequence's log-ratio sum (seq_sum) or mean (seq_mean). w = clamp(v, lo, hi) feeds std and
eff_sample_size; the `seq_*` metrics describe the per-sequence value s_i (the row mean of v_t at
token level, v_i at sequence levels).

Sequence values are carried as s - 1 (and 1/s - 1), exp(.) as expm1, so that values near 1 keep
their digits; the minimum of a positive value is 1 / the maximum of its inverse.
"""
from __future__ import annotations

import math

from .builder import N, N1, RHO, S, Builder
from .linear import ONE, ZERO, Lin
from .metrics import Formula, ratio, variance
from .tokens import LOG_RATIO_BOUND, at_least

EPS_ESS = 1e-8


def declare_token(b: Builder, prefix: str, hi: float, lo: float) -> None:
    """v_t = rho_t: token sums and extremes from the token phase."""
    rows, tok = b.rows, b.tok
    w_sum, w2_sum = tok.w(lo, hi)
    v_sum, w, w2 = rows.add(RHO), rows.add(w_sum), rows.add(w2_sum)
    above_hi = rows.add(tok.above("rho", hi))
    below_lo = rows.add(N - tok.above("rho", at_least(lo)))
    v_max, inv_v_max = rows.add(Lin.of("max:rho")), rows.add(Lin.of("max:inv_rho"))
    s_minus_1 = rows.add(RHO - N, N1, above=hi - 1.0)    # s = row mean of rho
    one_minus_s = rows.add(N - RHO, N1, above=1.0 - lo)
    tokens, seqs = b.tokens, b.seqs
    metrics = {
        "mean": b.token_mean(b.per_seq(v_sum)),
        "max": b.extreme(rows.maximum(v_max)),
        "min": ratio(ONE, rows.maximum(inv_v_max)),
        "std": variance(b.per_seq(w2), b.per_seq(w), tokens),
        "eff_sample_size": _ess(b.per_seq(w) + EPS_ESS * tokens, b.per_seq(w2), tokens),
        "ratio_fraction_high": b.token_mean(b.per_seq(above_hi)),
        "ratio_fraction_low": b.token_mean(b.per_seq(below_lo)),
    }
    low_max = rows.maximum(one_minus_s)
    _declare(b, prefix, metrics, s_minus_1, one_minus_s, seq_min=b.extreme(1.0 - low_max),
             deviation_low=b.extreme(low_max))


def declare_sequence(b: Builder, prefix: str, level: str, hi: float, lo: float) -> None:
    """v_i = exp(clamp20(L_i)), L_i = S_i (seq_sum) or S_i / n_i (seq_mean)."""
    rows = b.rows
    div = N1 if level == "seq_mean" else ONE
    bound = LOG_RATIO_BOUND
    log_w_lo, log_w_hi = max(math.log(lo), -bound), min(math.log(hi), bound)
    above_hi = rows.add(S, div, above=math.log(hi))
    below_lo = rows.add(-S, div, above=-math.log(lo))
    v_max = rows.add(S, div, hi=bound, expm1=True)           # exp(min(L, 20)) - 1
    inv_v_max = rows.add(-S, div, expm1=True)                # exp(-L) - 1
    s_minus_1 = rows.add(S, div, lo=-bound, hi=bound, expm1=True, above=hi - 1.0)
    inv_s_minus_1 = rows.add(-S, div, lo=-bound, hi=bound, expm1=True, above=1.0 / lo - 1.0)
    w = rows.add(S, div, lo=log_w_lo, hi=log_w_hi, expm1=True)                 # w - 1
    w2 = rows.add(2.0 * S, div, lo=2 * log_w_lo, hi=2 * log_w_hi, expm1=True)  # w^2 - 1
    tokens = b.tokens
    w_sum = b.per_token(w) + tokens                                 # sum over tokens of w
    w2_sum = b.per_token(w2) + tokens
    metrics = {
        "mean": b.token_mean(b.per_token(s_minus_1) + tokens),
        "max": b.extreme(rows.maximum(v_max) + 1.0),
        "min": ratio(ONE, rows.maximum(inv_v_max) + 1.0),
        # sum of (w - 1)^2 = sum of (w^2 - 1) - 2 (w - 1), around 1 where the values sit
        "std": variance(b.per_token(w2) - 2.0 * b.per_token(w), b.per_token(w), tokens),
        "eff_sample_size": _ess(w_sum + EPS_ESS * tokens, w2_sum, tokens),
        "ratio_fraction_high": b.seq_mean(b.per_seq(f"ind:{above_hi}")),
        "ratio_fraction_low": b.seq_mean(b.per_seq(f"ind:{below_lo}")),
    }
    inv_max = rows.maximum(inv_s_minus_1)   # min s = 1 / max(1/s); 1 - min s = x / (1 + x)
    _declare(b, prefix, metrics, s_minus_1, inv_s_minus_1, seq_min=ratio(ONE, inv_max + 1.0),
             deviation_low=Formula(inv_max, inv_max + 1.0))


def _ess(shifted_total: Lin, square_total: Lin, tokens: Lin) -> Formula:
    """(mean w + 1e-8)^2 / mean w^2 = a^2 / (tokens * sum w^2), a = sum w + 1e-8 tokens: the
    product term of a Formula with a negated denominator."""
    return Formula(ZERO, ONE, shifted_total, tokens, shifted_total, -square_total)


def _declare(b: Builder, prefix: str, metrics: dict[str, Formula], s_minus_1: str, low_row: str,
             seq_min: Formula, deviation_low: Formula) -> None:
    """The family's metrics: `metrics`, then the `seq_*` ones of s - 1 (low_row: the row whose
    indicator is s < lo; seq_min and 1 - seq_min given)."""
    rows, seqs = b.rows, b.seqs
    for name, value in metrics.items():
        if name == "eff_sample_size":  # 1 for a batch without tokens
            b.metric(prefix + name, value, default=1.0, cond=b.tokens)
        else:
            b.metric(prefix + name, value)
    d = f"dev:{s_minus_1}"
    high_max = rows.maximum(s_minus_1)
    b.metric(prefix + "seq_mean", b.seq_mean(b.per_seq(s_minus_1) + seqs))
    b.metric(prefix + "seq_std", variance(rows.total(d, d), b.per_seq(d), seqs, seqs - 1.0))
    b.metric(prefix + "seq_max", b.extreme(high_max + 1.0))
    b.metric(prefix + "seq_min", seq_min)
    b.metric(prefix + "seq_max_deviation", b.extreme(high_max), other=deviation_low)
    b.metric(prefix + "seq_fraction_high", b.seq_mean(b.per_seq(f"ind:{s_minus_1}")))
    b.metric(prefix + "seq_fraction_low", b.seq_mean(b.per_seq(f"ind:{low_row}")))
