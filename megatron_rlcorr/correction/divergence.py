"""Divergence rejection options and their metrics `rollout_rs_<option>_*` (docs/math.md).

Per token, from c = clamp20(lr): k1 = -c, k2 = c^2 / 2, k3 = expm1(c) - c (float64). A token option keeps a
token iff its statistic is within bounds (k1: log lo <= c <= log U; k2, k3: statistic <= U). A
sequence option aggregates the statistic over the sequence (sum, mean or max) and rejects the
whole sequence (a decision row). The statistic is the option's value (k1: -log rho). Token
options average over tokens; sequence options report the token-weighted mean/std, the
sequence-counted fraction_high/low and `seq_*` metrics over sequences; seq_max_deviation is the
largest |statistic| (its on-policy value is 0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import RejectionRule
from .builder import C, N, N1, Builder
from .linear import ONE, ZERO, Lin
from .metrics import ratio, variance
from .tokens import LOG_RATIO_BOUND, at_least


@dataclass
class Statistic:
    """Per-sequence forms of one estimator's token statistic s."""
    total: Lin    # sum of s over valid tokens
    square: Lin   # sum of s^2
    maximum: Lin                # max of s (0 for an empty sequence)
    minimum: tuple[Lin, Lin]    # min of s, as num / div


def statistic(b: Builder, estimator: str, token_level: bool) -> Statistic:
    tok = b.tok
    if estimator == "k1":
        sq = tok.slot("c2") if token_level else ZERO
        return Statistic(-C, sq, tok.max_of("c", LOG_RATIO_BOUND, -1.0),
                         (-tok.max_of("c", LOG_RATIO_BOUND, 1.0), ONE) if token_level else (ZERO, ONE))
    if estimator == "k2":
        sq = 0.25 * tok.slot("c4") if token_level else ZERO
        num, div = tok.min_of("c2") if token_level else (ZERO, ONE)
        return Statistic(0.5 * tok.slot("c2"), sq, 0.5 * tok.max_of("c2", 0.0, 1.0), (0.5 * num, div))
    sq = tok.slot("k3sq") if token_level else ZERO
    return Statistic(tok.slot("k3"), sq, tok.max_of("k3", 0.0, 1.0), tok.min_of("k3") if token_level else (ZERO, ONE))


def token_keep(b: Builder, rule: RejectionRule) -> tuple[Lin, Lin]:
    """A token option's keep rule (token phase); (tokens above the upper bound, below the lower)."""
    tok = b.tok
    if rule.estimator == "k1":  # log lo <= c <= log U
        high = tok.above("c", math.log(rule.upper))
        kept_low = tok.above("c", at_least(math.log(rule.lower)))
        tok.keep(kept_low, high)
        return high, N - kept_low
    high = tok.above("c2", 2.0 * rule.upper) if rule.estimator == "k2" else tok.above("k3", rule.upper)
    tok.keep(None, high)
    return high, ZERO


def sequence_decisions(b: Builder, rule: RejectionRule) -> tuple[Lin, Lin, list[str]]:
    """A sequence option's statistic (num / div) and its decision rows ("rs"; at most one of them
    is 1 for a sequence)."""
    rows = b.rows
    stat = statistic(b, rule.estimator, token_level=False)
    num, div = (stat.maximum, ONE) if rule.aggregate == "seq_max" else (
        stat.total, N1 if rule.aggregate == "seq_mean" else ONE)
    if rule.estimator == "k1":  # log rho = -statistic within [log lo, log U]
        return num, div, [rows.add(-num, div, above=math.log(rule.upper), tag="rs"),
                          rows.add(num, div, above=-math.log(rule.lower), tag="rs")]
    return num, div, [rows.add(num, div, above=rule.upper, tag="rs")]


def declare_token_option(b: Builder, rule: RejectionRule) -> None:
    """A token option's metrics (its keep rule: `token_keep`)."""
    rows = b.rows
    high, low = token_keep(b, rule)
    stat = statistic(b, rule.estimator, token_level=True)
    total, square = rows.add(stat.total), rows.add(stat.square)
    rejected = rows.add(high + low, above=0.0)
    prefix = f"rollout_rs_{rule.option}_"
    metrics = {
        "mean": b.token_mean(b.per_seq(total)),
        "max": b.extreme(rows.maximum(rows.add(stat.maximum))),
        "min": b.extreme(-rows.maximum(rows.add(-stat.minimum[0], stat.minimum[1]))),
        "std": variance(b.per_seq(square), b.per_seq(total), b.tokens),
        "fraction_high": b.token_mean(b.per_seq(rows.add(high))),
        "fraction_low": b.token_mean(b.per_seq(rows.add(low))) if rule.estimator == "k1" else ratio(ZERO),
        "masked_fraction": b.token_mean(b.per_seq(rejected)),
        "seq_masked_fraction": b.seq_mean(b.per_seq(f"ind:{rejected}")),
    }
    for name, value in metrics.items():
        b.metric(prefix + name, value)


def declare_sequence_option(b: Builder, rule: RejectionRule) -> None:
    """A sequence option's metrics (its decisions: `sequence_decisions`)."""
    rows = b.rows
    num, div, decisions = sequence_decisions(b, rule)
    value, negated = rows.add(num, div), rows.add(-num, div)
    seqs, d = b.seqs, f"dev:{value}"
    fraction_high = b.seq_mean(b.per_seq(f"ind:{decisions[0]}"))
    fraction_low = b.seq_mean(b.per_seq(f"ind:{decisions[1]}")) if len(decisions) > 1 else ratio(ZERO)
    extremes = (b.extreme(rows.maximum(value)), b.extreme(-rows.maximum(negated)))
    metrics = {
        "mean": b.token_mean(b.per_token(value)),
        "max": extremes[0],
        "min": extremes[1],
        "std": variance(rows.total(f"ndev:{value}", d), rows.total(f"ndev:{value}", rows.ne), b.tokens),
        "fraction_high": fraction_high,
        "fraction_low": fraction_low,
        "masked_fraction": b.token_mean(sum((b.per_token(f"ind:{r}") for r in decisions), ZERO)),
        "seq_masked_fraction": b.seq_mean(sum((b.per_seq(f"ind:{r}") for r in decisions), ZERO)),
        "seq_mean": b.seq_mean(b.per_seq(value)),
        "seq_std": variance(rows.total(d, d), b.per_seq(d), seqs, seqs - 1.0),
        "seq_max": extremes[0],
        "seq_min": extremes[1],
    }
    prefix = f"rollout_rs_{rule.option}_"
    for name, formula in metrics.items():
        b.metric(prefix + name, formula)
    b.metric(prefix + "seq_max_deviation", b.extreme(rows.maximum(value)), other=b.extreme(rows.maximum(negated)))
    b.metric(prefix + "seq_fraction_high", fraction_high)
    b.metric(prefix + "seq_fraction_low", fraction_low)
