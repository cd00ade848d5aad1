"""Off-policy diagnostics, reported whenever rollout log-probs are present (docs/math.md, "The metrics").

kl, k3_kl, chi2_token are token means over the batch; the perplexities, log_ppl_diff family,
ppl_ratio and chi2_seq are means over non-empty sequences.
"""
from __future__ import annotations

import torch

from .context import LOG_RATIO_BOUND, Context, finite, finite_or_zero


class OffPolicyMetrics:
    def rows_phase(self, ctx: Context) -> None:
        c = ctx.clamped
        # The old log-prob sum is the rollout sum plus the log-ratio sum: one masked pass saved.
        rollout = finite(ctx.rollout_log_prob.float(), out=ctx.scratch).mul_(ctx.mask)
        ctx.rows.add_sum("offpolicy/rollout", ctx.row_sum_zero_masked(rollout))
        # k3 = rho - 1 - c. rho - 1 is exact given rho, so a token's error is exp's rounding
        # (~1e-7 absolute), far below any KL worth logging; expm1 would cost 4-5 passes more.
        rho = ctx.ratio_tok
        k3 = torch.sub(rho, 1.0, out=ctx.scratch).sub_(c)
        ctx.rows.add_sum("offpolicy/k3", ctx.row_sum_zero_masked(k3))
        # rho^2 - 1 in one pass, zero at masked positions (rho carries exp's rounding either way).
        rho2_minus_one = torch.addcmul(rho.new_full((), -1.0), rho, rho, out=ctx.scratch)
        ctx.rows.add_sum("offpolicy/rho2_minus_one", ctx.row_sum_zero_masked(rho2_minus_one))

    def batch_phase(self, ctx: Context) -> None:
        rows, totals, n = ctx.rows, ctx.totals, ctx.n_row.clamp(min=1)
        rollout_sum = rows.sum("offpolicy/rollout")
        neg_mean_old = -(rollout_sum + ctx.log_ratio_sum_row) / n  # training log-ppl of each sequence
        neg_mean_rollout = -rollout_sum / n                        # rollout log-ppl of each sequence
        diff = neg_mean_old - neg_mean_rollout
        totals.add_sum("offpolicy/log_ratio", ctx.log_ratio_sum_row.sum())
        totals.add_sum("offpolicy/k3", rows.sum("offpolicy/k3").sum())
        totals.add_sum("offpolicy/rho2_minus_one", rows.sum("offpolicy/rho2_minus_one").sum())
        totals.add_sum("offpolicy/training_ppl", ctx.sum_rows(neg_mean_old.exp()))
        totals.add_sum("offpolicy/training_log_ppl", ctx.sum_rows(neg_mean_old))
        totals.add_sum("offpolicy/rollout_ppl", ctx.sum_rows(neg_mean_rollout.exp()))
        totals.add_sum("offpolicy/rollout_log_ppl", ctx.sum_rows(neg_mean_rollout))
        totals.add_sum("offpolicy/diff", ctx.sum_rows(diff))
        totals.add_sum("offpolicy/abs_diff", ctx.sum_rows(diff.abs()))
        totals.add_sum("offpolicy/ppl_ratio", ctx.sum_rows(diff.exp()))
        totals.add_sum("offpolicy/rho2_seq", ctx.sum_rows(torch.exp(2 * ctx.log_ratio_sum_row.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))))
        totals.add_max("offpolicy/diff_max", ctx.max_rows(diff))
        totals.add_min("offpolicy/diff_min", ctx.min_rows(diff))

    def metrics(self, ctx: Context) -> dict[str, torch.Tensor]:
        t, seqs = ctx.totals, ctx.num_rows
        per_seq = {name: ctx.per_row(t.sum(f"offpolicy/{name}"))
                   for name in ("training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "ppl_ratio")}
        return {
            "kl": -ctx.per_token(t.sum("offpolicy/log_ratio")),
            "k3_kl": ctx.per_token(t.sum("offpolicy/k3")),
            **per_seq,
            "log_ppl_diff": ctx.per_row(t.sum("offpolicy/diff")),
            "log_ppl_abs_diff": ctx.per_row(t.sum("offpolicy/abs_diff")),
            "log_ppl_diff_max": finite_or_zero(t.max("offpolicy/diff_max")),
            "log_ppl_diff_min": finite_or_zero(t.min("offpolicy/diff_min")),
            "chi2_token": ctx.per_token(t.sum("offpolicy/rho2_minus_one")),
            "chi2_seq": ctx.per_row(t.sum("offpolicy/rho2_seq")) - (seqs > 0).double(),
        }
