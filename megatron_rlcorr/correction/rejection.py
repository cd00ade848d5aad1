"""Rejection sampling (ratio levels and divergence options) and the veto (docs/math.md).

Token rules decide per token in the token phase (the `kept` slot: tokens every token rule
keeps). Sequence rules and the veto decide per sequence from whole-sequence statistics after the
CP reduction (decision rows), so every CP rank holding part of a sequence makes the identical
decision. A ratio rule compares in log space: rho_i > U is L_i > log U (never when log U >= 20,
as rho_i = exp(clamp20(L_i)) is at most e^20). The output mask keeps a token iff the token rules
keep it and no sequence rule nor the veto rejects its sequence (`rej`).
"""
from __future__ import annotations

import math

from ..config import RejectionRule, RolloutCorrectionConfig
from .builder import N, N1, S, Builder
from .divergence import declare_sequence_option, declare_token_option, sequence_decisions, token_keep
from .linear import ONE, ZERO, Lin
from .metrics import ratio
from .ratio_metrics import declare_sequence, declare_token
from .tokens import LOG_RATIO_BOUND, at_least

REJECTED = "rej"  # the any-row: a sequence rule or the veto rejects the sequence


def declare_veto(threshold: float | None, b: Builder) -> bool:
    """Reject a whole sequence if any valid token has log_ratio < log(threshold) (unclamped)."""
    if threshold is None:
        b.metric("rollout_is_veto_fraction", ratio(ZERO))
        b.metric("rollout_is_catastrophic_token_fraction", ratio(ZERO))
        return False
    vetoed = b.rows.add(b.tok.veto(math.log(threshold)), above=0.0, tag="veto")
    b.metric("rollout_is_veto_fraction", b.seq_mean(b.per_seq(f"ind:{vetoed}")))
    b.metric("rollout_is_catastrophic_token_fraction", b.token_mean(b.per_seq(vetoed)))
    return True


def declare_rejection(cfg: RolloutCorrectionConfig, b: Builder) -> None:
    """Every rule's decisions, the masked fractions, the ratio family and the divergence metrics."""
    rules, rows = cfg.rejection_rules, b.rows
    token_rules = any(not r.is_sequence_level for r in rules)
    decisions = []
    for rule in rules:
        if rule.estimator == "ratio":
            rule_rows = _ratio_rule(rule, b)
        elif rule.is_sequence_level:
            rule_rows = sequence_decisions(b, rule)[2]
        else:
            token_keep(b, rule)
            rule_rows = []
        if rule_rows:
            decisions.append(rule_rows)
    # tokens lost: to the token rules (n - kept), plus the kept tokens of rejected sequences
    lost_tokens = b.per_seq(rows.n) - b.per_seq(rows.kept) if token_rules else ZERO
    if len(decisions) == 1:  # one sequence rule: its (exclusive) indicators say "rejected"
        rejected_kept = sum((rows.total(f"ind:{r}", rows.kept) for r in decisions[0]), ZERO)
        rejected_seqs = sum((b.per_seq(f"ind:{r}") for r in decisions[0]), ZERO)
    elif decisions:
        rejected_kept = rows.total(rows.any_of("rej_rs", ("rs",)), rows.kept)
        rejected_seqs = b.per_seq("rej_rs")
    else:
        rejected_kept = rejected_seqs = ZERO
    if token_rules:  # a sequence lost a token: to a token rule (n > kept) or a sequence rule
        rows.add(N - Lin.of("kept"), above=0.0, tag="lost")
        rejected_seqs = b.per_seq(rows.any_of("lost", ("lost", "rs") if decisions else ("lost",)))
    b.metric("rollout_rs_masked_fraction", b.token_mean(lost_tokens + rejected_kept))
    b.metric("rollout_rs_seq_masked_fraction", b.seq_mean(rejected_seqs))
    ratio_rule = cfg.ratio_rejection
    if ratio_rule is not None and ratio_rule.aggregate == "token":
        declare_token(b, "rollout_rs_", ratio_rule.upper, ratio_rule.lower)
    elif ratio_rule is not None:
        declare_sequence(b, "rollout_rs_", ratio_rule.aggregate, ratio_rule.upper, ratio_rule.lower)
    for rule in rules:
        if rule.estimator != "ratio":
            (declare_sequence_option if rule.is_sequence_level else declare_token_option)(b, rule)


def _ratio_rule(rule: RejectionRule, b: Builder) -> list[str]:
    """A ratio rule: token level keeps lo <= rho <= U per token; sequence levels decide from
    L = S (sequence) or S / n (geometric)."""
    if rule.aggregate == "token":
        b.tok.keep(b.tok.above("rho", at_least(rule.lower)), b.tok.above("rho", rule.upper))
        return []
    div = N1 if rule.aggregate == "seq_mean" else ONE
    log_hi, log_lo = math.log(rule.upper), math.log(rule.lower)
    high = b.rows.add(S, div, above=log_hi if log_hi < LOG_RATIO_BOUND else math.inf, tag="rs")
    low = b.rows.add(-S, div, above=-log_lo if log_lo > -LOG_RATIO_BOUND else math.inf, tag="rs")
    return [high, low]
