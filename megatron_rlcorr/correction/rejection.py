"""Rejection sampling (ratio levels and divergence options) and the veto: docs/math.md states each rule.

Token rules decide locally. Sequence rules decide from whole-sequence statistics after the CP
reduction, so every CP rank holding part of a sequence makes the identical decision.
"""
from __future__ import annotations

import math

import torch

from ..config import RejectionRule, RolloutCorrectionConfig
from .context import Context, finite_or_zero, max_all, min_all
from .ratio_metrics import RatioMetrics


def divergence_tok(estimator: str, clamped: torch.Tensor) -> torch.Tensor:
    """Per-token k1/k2/k3 from c = clamp20(log_ratio)."""
    if estimator == "k1":
        return -clamped
    if estimator == "k2":
        return 0.5 * clamped * clamped
    return torch.expm1(clamped) - clamped


class RuleDecision:
    """Keep/reject decisions of one rule, plus its per-option metrics for divergence rules."""

    def __init__(self, rule: RejectionRule) -> None:
        self.rule = rule
        self.prefix = f"rs/{rule.option}/"
        self.log_upper = math.log(rule.upper)
        self.log_lower = math.log(rule.lower) if rule.lower is not None else None

    def keep_tokens(self, ctx: Context) -> torch.Tensor:
        """float32 1 = kept by this rule (values at masked positions are irrelevant)."""
        rule = self.rule
        if rule.estimator == "ratio":  # compare the ratio itself, as the seed does
            return _within(ctx, ctx.ratio_tok, rule.lower, rule.upper)
        if rule.estimator == "k1":  # log rho within the log bounds
            return _within(ctx, ctx.clamped, self.log_lower, self.log_upper)
        return ctx.indicator(torch.le, divergence_tok(rule.estimator, ctx.clamped), rule.upper, zero_masked=True)

    # A statistic in "log rho" space (ratio and k1 rules) is kept iff log lower <= s <= log upper.
    def _keep_log_rho(self, log_rho: torch.Tensor) -> torch.Tensor:
        return (log_rho >= self.log_lower) & (log_rho <= self.log_upper)

    def statistic_row(self, ctx: Context) -> torch.Tensor:
        """Sequence statistic (float32 [rows]) of a sequence-level divergence rule."""
        rule, rows = self.rule, ctx.rows
        if rule.aggregate == "seq_max":
            return rows.max(self.prefix + "stat_max")
        total = rows.sum(self.prefix + "stat")
        if rule.aggregate == "seq_mean":
            total = total / ctx.n_row.clamp(min=1)
        return total.float()

    def keep_rows(self, ctx: Context) -> torch.Tensor:
        rule = self.rule
        if rule.estimator == "ratio":
            rho = (ctx.log_ratio_sum_row if rule.aggregate == "seq_sum" else ctx.log_ratio_mean_row)
            rho = rho.float().clamp(-20.0, 20.0).exp()
            return (rho >= rule.lower) & (rho <= rule.upper)
        stat = self.statistic_row(ctx)
        if rule.estimator == "k1":
            return self._keep_log_rho(-stat)
        return stat <= rule.upper


def _within(ctx: Context, x_tok: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    return ctx.indicator(torch.ge, x_tok, lower, zero_masked=True).mul_(
        ctx.indicator(torch.le, x_tok, upper, zero_masked=True))


class Rejection:
    def __init__(self, cfg: RolloutCorrectionConfig) -> None:
        self.decisions = [RuleDecision(rule) for rule in cfg.rejection_rules]
        self.token_rules = [d for d in self.decisions if not d.rule.is_sequence_level]
        self.row_rules = [d for d in self.decisions if d.rule.is_sequence_level]
        ratio = cfg.ratio_rejection
        self.ratio_family = (RatioMetrics("rollout_rs_", ratio.aggregate, ratio.upper, ratio.lower)
                             if ratio is not None else None)
        self.divergence = [DivergenceMetrics(d) for d in self.decisions if d.rule.estimator != "ratio"]

    def rows_phase(self, ctx: Context) -> None:
        ctx.rows.add_sum("rs/kept", ctx.row_sum_zero_masked(self.token_keep(ctx, remember=True)))
        for decision in self.row_rules:
            if decision.rule.estimator != "ratio":
                stat = divergence_tok(decision.rule.estimator, ctx.clamped)
                if decision.rule.aggregate == "seq_max":
                    ctx.rows.add_max(decision.prefix + "stat_max", ctx.row_max(stat))
                else:
                    ctx.rows.add_sum(decision.prefix + "stat", ctx.row_sum(stat))
        if self.ratio_family is not None:
            self.ratio_family.rows_phase(ctx)
        for family in self.divergence:
            family.rows_phase(ctx)

    def batch_phase(self, ctx: Context) -> None:
        keep_row = torch.ones_like(ctx.nonempty_row)
        for decision in self.row_rules:
            decision.keep_row = decision.keep_rows(ctx)
            keep_row = keep_row & decision.keep_row
        self.keep_row = keep_row
        lost = ctx.n_row - torch.where(keep_row, ctx.rows.sum("rs/kept"), 0.0)
        ctx.totals.add_sum("rs/lost_tokens", lost.sum())
        ctx.totals.add_sum("rs/lost_rows", ctx.sum_rows(lost > 0))
        if self.ratio_family is not None:
            self.ratio_family.batch_phase(ctx)
        for family in self.divergence:
            family.batch_phase(ctx)

    def metrics(self, ctx: Context) -> dict[str, torch.Tensor]:
        out = {
            "rollout_rs_masked_fraction": ctx.per_token(ctx.totals.sum("rs/lost_tokens")),
            "rollout_rs_seq_masked_fraction": ctx.per_row(ctx.totals.sum("rs/lost_rows")),
        }
        if self.ratio_family is not None:
            out.update(self.ratio_family.metrics(ctx))
        for family in self.divergence:
            out.update(family.metrics(ctx))
        return out

    def token_keep(self, ctx: Context, remember: bool = False) -> torch.Tensor:
        """float32 token layout of a block: kept by every token rule (0 at masked positions); the
        sequence decisions (`keep_row`) follow after the CP reduction. `remember`: keep each
        rule's decisions for this block's divergence metrics."""
        keep_tok = ctx.mask
        for decision in self.token_rules:
            keep_rule = decision.keep_tokens(ctx)
            if remember:
                decision.keep_tok = keep_rule
            keep_tok = keep_tok * keep_rule
        return keep_tok


class DivergenceMetrics:
    """Per-option metrics `rollout_rs_<option>_*` of a divergence rule (docs/correction.md).

    The statistic is the option's value (k1: -log rho). Token options average over tokens;
    sequence options report token-weighted mean/std, sequence-counted fractions and `seq_*`
    metrics over sequences; `seq_max_deviation` is the largest |statistic| (its on-policy value is 0).
    """

    def __init__(self, decision: RuleDecision) -> None:
        self.d = decision
        self.name = f"rollout_rs_{decision.rule.option}_"
        self.key = f"rsdiv/{decision.rule.option}/"

    def _high_low(self, stat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """bool [rows] statistic above the upper / below the lower bound."""
        rule = self.d.rule
        if rule.estimator == "k1":  # bounds apply to rho = exp(-stat)
            return -stat > self.d.log_upper, -stat < self.d.log_lower
        return stat > rule.upper, torch.zeros_like(stat, dtype=torch.bool)

    def _high_low_tokens(self, ctx: Context, stat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 token indicators of `_high_low`, 0 at masked positions."""
        rule = self.d.rule
        if rule.estimator == "k1":  # -stat is the clamped log-ratio
            return (ctx.indicator(torch.gt, ctx.clamped, self.d.log_upper),
                    ctx.indicator(torch.lt, ctx.clamped, self.d.log_lower))
        return ctx.indicator(torch.gt, stat, rule.upper), torch.zeros_like(stat)

    def rows_phase(self, ctx: Context) -> None:
        if self.d.rule.is_sequence_level:
            return
        stat, rows, k = divergence_tok(self.d.rule.estimator, ctx.clamped), ctx.rows, self.key
        high, low = self._high_low_tokens(ctx, stat)
        stat_max = ctx.row_max(stat)
        stat_sum, stat2_sum = ctx.row_moments(stat, stat_max)
        rows.add_sum(k + "stat", stat_sum)
        rows.add_sum(k + "stat2", stat2_sum)
        rows.add_sum(k + "hi", ctx.row_sum_zero_masked(high))
        rows.add_sum(k + "lo", ctx.row_sum_zero_masked(low))
        rows.add_sum(k + "rejected", ctx.row_sum(1.0 - self.d.keep_tok))
        rows.add_max(k + "max", stat_max)
        rows.add_min(k + "min", ctx.row_min(stat))

    def batch_phase(self, ctx: Context) -> None:
        rows, totals, k, n = ctx.rows, ctx.totals, self.key, ctx.n_row
        if not self.d.rule.is_sequence_level:
            for name in ("stat", "stat2", "hi", "lo", "rejected"):
                totals.add_sum(k + name, rows.sum(k + name).sum())
            totals.add_sum(k + "rejected_rows", ctx.sum_rows(rows.sum(k + "rejected") > 0))
            totals.add_max(k + "max", max_all(rows.max(k + "max")))
            totals.add_min(k + "min", min_all(rows.min(k + "min")))
            return
        stat = self.d.statistic_row(ctx)
        high, low = self._high_low(stat)
        rejected = ~self.d.keep_row
        ctx.add_centred_moments(k + "stat", stat, n)
        totals.add_sum(k + "hi", ctx.sum_rows(high))
        totals.add_sum(k + "lo", ctx.sum_rows(low))
        totals.add_sum(k + "rejected", torch.where(rejected, n, 0.0).sum())
        totals.add_sum(k + "rejected_rows", ctx.sum_rows(rejected))
        totals.add_max(k + "max", ctx.max_rows(stat))
        totals.add_min(k + "min", ctx.min_rows(stat))
        ctx.add_centred_moments(k + "seq_stat", stat, torch.ones_like(n))
        totals.add_max(k + "seq_max_deviation", ctx.max_rows(stat.abs()))

    def metrics(self, ctx: Context) -> dict[str, torch.Tensor]:
        t, k, tokens, seqs = ctx.totals, self.key, ctx.num_tokens, ctx.num_rows
        sequence_level = self.d.rule.is_sequence_level
        per_frac = ctx.per_row if sequence_level else ctx.per_token
        if sequence_level:
            mean = ctx.per_token(t.sum(k + "stat/s"))
            variance = ctx.per_token(ctx.centred_sum_of_squares(k + "stat", tokens))
        else:
            mean = ctx.per_token(t.sum(k + "stat"))
            variance = (ctx.per_token(t.sum(k + "stat2")) - mean * mean).clamp(min=0.0)
        out = {
            "mean": mean,
            "max": finite_or_zero(t.max(k + "max")),
            "min": finite_or_zero(t.min(k + "min")),
            "std": torch.where(tokens > 1, variance.sqrt(), 0.0),
            "fraction_high": per_frac(t.sum(k + "hi")),
            "fraction_low": per_frac(t.sum(k + "lo")),
            "masked_fraction": ctx.per_token(t.sum(k + "rejected")),
            "seq_masked_fraction": ctx.per_row(t.sum(k + "rejected_rows")),
        }
        if sequence_level:
            seq_var = ctx.centred_sum_of_squares(k + "seq_stat", seqs) / (seqs - 1).clamp(min=1)
            out.update({
                "seq_mean": ctx.per_row(t.sum(k + "seq_stat/s")),
                "seq_std": torch.where(seqs > 1, seq_var.sqrt(), 0.0),
                "seq_max": out["max"],
                "seq_min": out["min"],
                "seq_max_deviation": finite_or_zero(t.max(k + "seq_max_deviation")),
                "seq_fraction_high": out["fraction_high"],
                "seq_fraction_low": out["fraction_low"],
            })
        return {self.name + name: value for name, value in out.items()}


class Veto:
    """Reject a whole sequence if any valid token has log_ratio < log(threshold) (unclamped)."""

    def __init__(self, threshold: float | None) -> None:
        self.log_threshold = math.log(threshold) if threshold is not None else None

    def rows_phase(self, ctx: Context) -> None:
        if self.log_threshold is not None:
            # The masked log-ratio is 0: only a threshold above 1 needs the mask.
            vetoed = ctx.row_count(torch.lt, ctx.log_ratio, self.log_threshold, zero_masked=self.log_threshold <= 0)
            ctx.rows.add_sum("veto/tokens", vetoed)

    def batch_phase(self, ctx: Context) -> None:
        if self.log_threshold is None:
            return
        vetoed_tokens = ctx.rows.sum("veto/tokens")
        self.keep_row = vetoed_tokens == 0
        ctx.totals.add_sum("veto/tokens", vetoed_tokens.sum())
        ctx.totals.add_sum("veto/rows", ctx.sum_rows(~self.keep_row))

    def metrics(self, ctx: Context) -> dict[str, torch.Tensor]:
        if self.log_threshold is None:
            zero = ctx.num_tokens.new_zeros(())
            return {"rollout_is_veto_fraction": zero, "rollout_is_catastrophic_token_fraction": zero}
        return {
            "rollout_is_veto_fraction": ctx.per_row(ctx.totals.sum("veto/rows")),
            "rollout_is_catastrophic_token_fraction": ctx.per_token(ctx.totals.sum("veto/tokens")),
        }
