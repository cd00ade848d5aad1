"""Importance-sampling weights: token or sequence level, truncation, batch normalisation (docs/math.md).

Token level: w_t = clamp(rho_t, lower, C), written in the token phase. Sequence level:
w_i = clamp(exp(clamp20(S_i)), lower, C) on every valid token of sequence i, written after the
row phase as the mask times (w_i - 1) + 1. Batch normalisation divides by the mean truncated
weight over valid tokens (token level) or non-empty sequences (sequence level), when that mean is
above 1e-8. The IS metrics describe the weights before truncation (`ratio_metrics.py`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..config import RolloutCorrectionConfig
from .builder import S, Builder
from .linear import to_device
from .metrics import ratio
from .ratio_metrics import declare_sequence, declare_token
from .tokens import LOG_RATIO_BOUND

BATCH_NORM_MIN_MEAN = 1e-8
FACTOR, INVERSE = "rollout_is_batch_norm_factor", "is/inverse_norm"


@dataclass
class ImportanceWeights:
    level: str
    lower: float | None
    upper: float
    batch_normalize: bool
    weight_row: str | None = None  # sequence level: the series w_i - 1
    _upper: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)

    @staticmethod
    def declare(cfg: RolloutCorrectionConfig, b: Builder) -> "ImportanceWeights":
        iw = ImportanceWeights(cfg.rollout_is, cfg.rollout_is_threshold_lower, cfg.rollout_is_threshold,
                               cfg.rollout_is_batch_normalize)
        hi, lo = cfg.rollout_is_threshold, cfg.is_threshold_low_mark
        if iw.level == "token":
            declare_token(b, "rollout_is_", hi, lo)
            if iw.batch_normalize:
                truncated, count = b.per_seq(b.rows.add(b.tok.truncated(iw.lower, iw.upper))), b.tokens
        else:
            declare_sequence(b, "rollout_is_", "seq_sum", hi, lo)
            bound = LOG_RATIO_BOUND
            log_lo = -bound if iw.lower is None else max(math.log(iw.lower), -bound)
            iw.weight_row = b.rows.add(S, lo=log_lo, hi=min(math.log(iw.upper), bound), expm1=True)
            truncated, count = b.per_seq(iw.weight_row) + b.seqs, b.seqs
        if iw.batch_normalize:  # the mean, where it is above 1e-8 (else 1), and its inverse
            above = truncated - BATCH_NORM_MIN_MEAN * count
            b.metric(FACTOR, ratio(truncated, count), cond=above, default=1.0)
            b.metric(INVERSE, ratio(count, truncated), cond=above, default=1.0, public=False)
        return iw

    def prepare(self, device: torch.device) -> None:
        if device not in self._upper:  # a tensor bound: the float64 ratios clamp into float32 weights
            # (shape [1], not 0-d: torch.compile takes a 0-d CPU tensor there for a number and guards its value)
            self._upper[device] = to_device(torch.tensor([self.upper], dtype=torch.float64), device)

    def token_weights(self, rho: torch.Tensor, rho_masked: torch.Tensor | None, mask: torch.Tensor,
                      out: torch.Tensor) -> None:
        """Token level, in the token phase: clamp(rho, lower, C) at valid positions, else 0."""
        if self.lower is None:  # min(rho, C) is 0 where rho * mask is
            torch.clamp(rho_masked, max=self._upper[out.device], out=out)
        else:
            torch.mul(torch.clamp(rho, self.lower, self.upper), mask, out=out)

    def finish(self, weights: torch.Tensor, factor: torch.Tensor | None, inverse: torch.Tensor | None,
               weight_row: torch.Tensor | None, to_tokens: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """In place, after the metrics. Token level: `weights` holds the truncated weights; they
        are divided by the batch-normalisation factor. Sequence level: `weights` holds the mask;
        it is multiplied by w_i / factor = (weight_row + 1) * inverse."""
        if self.level == "token":
            if factor is not None:
                weights.div_(factor)
            return
        scale = torch.addcmul(inverse, weight_row, inverse) if inverse is not None else weight_row + 1.0
        weights.mul_(to_tokens(scale))
