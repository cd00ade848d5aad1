"""Off-policy diagnostics, reported whenever rollout log-probs are present (docs/math.md, "The metrics").

kl, k3_kl, chi2_token are token means over the batch; the perplexities, log_ppl_diff family,
ppl_ratio and chi2_seq are means over non-empty sequences. Per sequence: mo = -(R + S) / n (the
training log-perplexity), mr = -R / n (the rollout one), d = mo - mr = -S / n; exponentials are
taken as expm1 and 1 added back in the mean, |d| = 2 max(d, 0) - d.
"""
from __future__ import annotations

from .builder import C, N, N1, R, RHO, RHO2, S, Builder
from .tokens import LOG_RATIO_BOUND


def declare(b: Builder) -> None:
    rows = b.rows
    lr_sum = rows.add(S)
    k3 = rows.add(RHO - N - C)          # sum of rho - 1 - c (rho - 1 - c: k3 of the clamped log-ratio)
    chi_tok = rows.add(RHO2 - N)        # sum of rho^2 - 1
    mo, mr, d = rows.add(-(R + S), N1), rows.add(-R, N1), rows.add(-S, N1)
    minus_d = rows.add(S, N1)
    d_pos = rows.add(-S, N1, lo=0.0)
    e_mo = rows.add(-(R + S), N1, expm1=True)
    e_mr = rows.add(-R, N1, expm1=True)
    e_d = rows.add(-S, N1, expm1=True)
    chi_seq = rows.add(2.0 * S, lo=-2 * LOG_RATIO_BOUND, hi=2 * LOG_RATIO_BOUND, expm1=True)
    seqs = b.seqs
    b.metric("kl", b.token_mean(-b.per_seq(lr_sum)))
    b.metric("k3_kl", b.token_mean(b.per_seq(k3)))
    b.metric("training_ppl", b.seq_mean(b.per_seq(e_mo) + seqs))
    b.metric("training_log_ppl", b.seq_mean(b.per_seq(mo)))
    b.metric("rollout_ppl", b.seq_mean(b.per_seq(e_mr) + seqs))
    b.metric("rollout_log_ppl", b.seq_mean(b.per_seq(mr)))
    b.metric("ppl_ratio", b.seq_mean(b.per_seq(e_d) + seqs))
    b.metric("log_ppl_diff", b.seq_mean(b.per_seq(d)))
    b.metric("log_ppl_abs_diff", b.seq_mean(2.0 * b.per_seq(d_pos) - b.per_seq(d)))
    b.metric("log_ppl_diff_max", b.extreme(rows.maximum(d)))
    b.metric("log_ppl_diff_min", b.extreme(-rows.maximum(minus_d)))
    b.metric("chi2_token", b.token_mean(b.per_seq(chi_tok)))
    b.metric("chi2_seq", b.seq_mean(b.per_seq(chi_seq)))
