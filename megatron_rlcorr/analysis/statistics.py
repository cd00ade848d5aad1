"""The mismatch statistics of a batch: divergences, and the distribution of the IS ratios per level.

Why: before choosing thresholds one wants to see how far the engine is from the trainer, and in
what shape: a small shift of every token (a precision mismatch), a few catastrophic tokens (a
sampling bug), or a drift that grows with the response length. The divergences (KL k1 and k3,
log-perplexity difference, chi-square) are the correction's own off-policy metrics (docs/math.md,
from the `disabled` preset, so exactly what the trainer logs as `rollout_corr/...`); the
quantiles are computed here.

Conventions: log_ratio = old - rollout (trainer minus engine), float64, masked tokens excluded.
The three ratios are those of the IS/RS levels (docs/math.md): token exp(lr_t), sequence
exp(S_i) with S_i the sum of a sequence's log-ratios, geometric exp(S_i / n_i); like the
correction, the exponent is clamped to [-20, 20] first. Sequence statistics count non-empty
sequences only. Quantiles use linear interpolation between order statistics (torch.quantile's
default), computed by sorting so that any number of tokens works.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .inputs import Batch

LOG_RATIO_BOUND = 20.0     # the correction's clamp of a log-ratio before exp (docs/math.md)
QUANTILES: tuple[tuple[str, float], ...] = (
    ("min", 0.0), ("p1", 0.01), ("p5", 0.05), ("p25", 0.25), ("p50", 0.5),
    ("p75", 0.75), ("p95", 0.95), ("p99", 0.99), ("max", 1.0),
)
# The correction's off-policy metrics reported under `statistics` (names as in docs/math.md, unprefixed).
DIVERGENCES = ("kl", "k3_kl", "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min",
               "ppl_ratio", "chi2_token", "chi2_seq", "training_ppl", "rollout_ppl")


@dataclass
class Sequences:
    """Per-sequence views of the log-ratio, float64 [S], over the non-empty sequences only."""

    log_ratio_sum: torch.Tensor    # S_i
    num_tokens: torch.Tensor       # n_i (valid tokens), > 0
    min_log_ratio: torch.Tensor    # the most negative token log-ratio of the sequence (what the veto tests)
    max_log_ratio: torch.Tensor

    @property
    def log_ratio_mean(self) -> torch.Tensor:
        """S_i / n_i: the log of the geometric mean ratio."""
        return self.log_ratio_sum / self.num_tokens

    def __len__(self) -> int:
        return self.log_ratio_sum.numel()


def token_log_ratio(batch: Batch) -> torch.Tensor:
    """float64 [N]: old - rollout at valid tokens, 0 at masked ones."""
    return (batch.old_log_prob - batch.rollout_log_prob) * batch.mask.double()


def sequences(batch: Batch) -> Sequences:
    """Per-sequence sums, counts and extremes of the log-ratio (non-empty sequences only)."""
    lr, valid, seq = token_log_ratio(batch), batch.mask.double(), batch.sequence_of_token
    n_seq = batch.num_sequences
    sums = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, seq, lr)
    counts = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, seq, valid)
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    low = torch.full((n_seq,), float("inf"), dtype=torch.float64).scatter_reduce(
        0, seq, torch.where(valid > 0, lr, inf), "amin")
    high = torch.full((n_seq,), -float("inf"), dtype=torch.float64).scatter_reduce(
        0, seq, torch.where(valid > 0, lr, -inf), "amax")
    keep = counts > 0
    return Sequences(sums[keep], counts[keep], low[keep], high[keep])


def ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp of the clamped log-ratio, as the correction forms every ratio."""
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()


def quantile(values: torch.Tensor, q: float) -> float:
    """The q-quantile of a non-empty 1-D tensor (linear interpolation, float64)."""
    return _at(values.double().sort().values, q)


def quantiles(values: torch.Tensor) -> dict[str, float]:
    """QUANTILES of `values` by name ({} when empty)."""
    if values.numel() == 0:
        return {}
    ordered = values.double().sort().values
    return {name: _at(ordered, q) for name, q in QUANTILES}


def _at(ordered: torch.Tensor, q: float) -> float:
    pos = q * (ordered.numel() - 1)
    below = int(pos)
    above = min(below + 1, ordered.numel() - 1)
    return float(ordered[below] + (ordered[above] - ordered[below]) * (pos - below))


def mismatch_statistics(batch: Batch, seqs: Sequences, off_policy: Mapping[str, float]) -> dict[str, Any]:
    """`summary.json`'s `statistics`: the divergences (from `off_policy`, the correction's metrics
    without prefix) and the quantiles of the ratios, the log-ratio and the response lengths."""
    lr = token_log_ratio(batch)[batch.mask.bool()]
    stats: dict[str, Any] = {name: off_policy[name] for name in DIVERGENCES if name in off_policy}
    stats.update({
        "log_ratio_mean": float(lr.mean()),
        "log_ratio_std": float(lr.std(unbiased=False)),
        "log_ratio_abs_max": float(lr.abs().max()),
        "token_ratio": quantiles(ratio(lr)),
        "sequence_ratio": quantiles(ratio(seqs.log_ratio_sum)),
        "geometric_ratio": quantiles(ratio(seqs.log_ratio_mean)),
        "response_length": quantiles(seqs.num_tokens),
        "empty_sequences": batch.num_sequences - len(seqs),
        "invalid_tokens": batch.invalid_tokens,
    })
    return stats
