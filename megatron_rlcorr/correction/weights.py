"""Importance-sampling weights: token or sequence level, truncation, batch normalisation (docs/math.md)."""
from __future__ import annotations

import torch

from ..config import RolloutCorrectionConfig
from .context import Context, exp_clamped
from .ratio_metrics import RatioMetrics

BATCH_NORM_MIN_MEAN = 1e-8


class ImportanceWeights:
    def __init__(self, cfg: RolloutCorrectionConfig) -> None:
        self.level = cfg.rollout_is
        self.upper = cfg.rollout_is_threshold
        self.lower = cfg.rollout_is_threshold_lower  # None: truncate from above only
        self.batch_normalize = cfg.rollout_is_batch_normalize
        level = "token" if self.level == "token" else "seq_sum"
        # IS metrics describe the weights before truncation (docs/math.md, "The metrics").
        self.family = RatioMetrics("rollout_is_", level, cfg.rollout_is_threshold, cfg.is_threshold_low_mark)

    def _truncate(self, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return torch.clamp(w, min=self.lower, max=self.upper, out=out)

    def rows_phase(self, ctx: Context) -> None:
        self.family.rows_phase(ctx)
        if self.batch_normalize and self.level == "token":
            ctx.rows.add_sum("is/truncated", ctx.row_sum(self._truncate(ctx.ratio_tok)))

    def batch_phase(self, ctx: Context) -> None:
        self.family.batch_phase(ctx)
        if self.level == "sequence":
            self.weight_row = self._truncate(exp_clamped(ctx.log_ratio_sum_row.float()))
        if self.batch_normalize:
            total = (ctx.rows.sum("is/truncated").sum() if self.level == "token"
                     else ctx.sum_rows(self.weight_row))
            ctx.totals.add_sum("is/truncated", total)

    def metrics(self, ctx: Context) -> dict[str, torch.Tensor]:
        out = self.family.metrics(ctx)
        self.norm_factor = None
        if self.batch_normalize:
            # token level: mean over valid tokens; sequence level: mean over non-empty sequences.
            per = ctx.per_token if self.level == "token" else ctx.per_row
            mean = per(ctx.totals.sum("is/truncated"))
            self.norm_factor = torch.where(mean > BATCH_NORM_MIN_MEAN, mean, 1.0)
            out["rollout_is_batch_norm_factor"] = self.norm_factor
        return out

    def token_part(self, ctx: Context, out: torch.Tensor) -> None:
        """Writes the part of a block's weights known in the token phase into `out`: the truncated
        token weights, or the mask for sequence weights (0 at masked positions)."""
        if self.level == "token" and self.lower is None:  # min(rho, C) is 0 where rho * mask is
            torch.clamp(ctx.ratio_tok_masked, max=self.upper, out=out)
        elif self.level == "token":
            self._truncate(ctx.ratio_tok, out=out).mul_(ctx.mask)
        else:
            out.copy_(ctx.mask)

    def finish_(self, w_tok: torch.Tensor, ctx: Context) -> None:
        """In place, after `metrics`: the sequence weights and the batch normalisation."""
        scale_row = self.weight_row if self.level == "sequence" else None
        if self.norm_factor is not None:
            norm = self.norm_factor.float()
            scale_row = scale_row / norm if scale_row is not None else None
            if scale_row is None:
                w_tok.div_(norm)
        if scale_row is not None:
            w_tok.mul_(ctx.seg.to_tokens(scale_row.float()))
