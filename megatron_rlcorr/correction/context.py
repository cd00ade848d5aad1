"""The state one call of the correction works on, and the reductions every family shares.

A call runs in three phases, each family of statistics contributing to each:
  1. token -> row:   per-token quantities are summed (or max-ed) per sequence into `rows`;
  2. rows over CP:   `rows` is all-reduced over the CP group, so every CP rank sees whole
                     sequences; sequence decisions and weights are derived from it, and batch
                     partials are summed over this rank's sequences into `totals`;
  3. totals over DP: `totals` is all-reduced over the DP group and the metrics are finalised.
Token-level batch sums go through rows as well (the sum of row sums), which is what makes a
sequence split over CP ranks count exactly once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from .reduce import Partials
from .segments import Segments

LOG_RATIO_BOUND = 20.0  # clamp20 of SPEC section 4: exp stays finite in float32


@dataclass
class Context:
    seg: Segments
    mask: torch.Tensor          # bool, token layout
    log_ratio: torch.Tensor     # float32 old - rollout, exactly 0 at masked positions
    clamped: torch.Tensor       # clamp20(log_ratio)
    rows: Partials = field(default_factory=Partials)
    totals: Partials = field(default_factory=Partials)

    @cached_property
    def ratio_tok(self) -> torch.Tensor:
        """rho_t = exp(clamp20(log_ratio)): the token IS weight before truncation and the token RS ratio."""
        return self.clamped.exp()

    @cached_property
    def ratio_minus_one_tok(self) -> torch.Tensor:
        """rho_t - 1 (0 at masked positions). Spreads are summed from it rather than from rho_t,
        so E[x^2] - E[x]^2 does not cancel catastrophically for ratios near 1. (exp - 1 rather
        than expm1: its absolute error, ~eps32, is far below what the spreads need, and expm1 is
        ~10x slower on CPUs.)"""
        return self.ratio_tok - 1.0

    @cached_property
    def clamped_row_max(self) -> torch.Tensor:
        """float32 [rows] max of the clamped log-ratio over valid tokens (-inf for none)."""
        return self.row_max(self.clamped)

    @cached_property
    def clamped_row_min(self) -> torch.Tensor:
        return self.seg.row_min(self.where_tokens(self.clamped, float("inf")))

    # ---- phase 2 views (valid after rows are reduced over CP) ----
    @property
    def n_row(self) -> torch.Tensor:
        """float64 [rows]: valid tokens of each whole sequence."""
        return self.rows.sum("n")

    @property
    def nonempty_row(self) -> torch.Tensor:
        return self.n_row > 0

    @property
    def log_ratio_sum_row(self) -> torch.Tensor:
        """float64 [rows]: S_i, the unclamped log-ratio summed over the whole sequence."""
        return self.rows.sum("log_ratio")

    @property
    def log_ratio_mean_row(self) -> torch.Tensor:
        return self.log_ratio_sum_row / self.n_row.clamp(min=1)

    # ---- phase 3 views (valid after totals are reduced over DP) ----
    @property
    def num_tokens(self) -> torch.Tensor:
        return self.totals.sum("tokens")

    @property
    def num_rows(self) -> torch.Tensor:
        return self.totals.sum("rows")

    def where_tokens(self, x_tok: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        return torch.where(self.mask, x_tok, fill)

    def row_sum(self, x_tok: torch.Tensor) -> torch.Tensor:
        """float64 [rows] sum over valid tokens (masked positions never read)."""
        if x_tok.dtype == torch.bool:
            return self.seg.row_sum(x_tok & self.mask)
        return self.seg.row_sum(self.where_tokens(x_tok))

    @cached_property
    def local_n_row(self) -> torch.Tensor:
        """float64 [rows]: valid tokens of each sequence on this rank (before the CP reduction)."""
        return self.seg.row_sum(self.mask)

    def row_moments(self, x_tok: torch.Tensor, shift_row: torch.Tensor, *,
                    second: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float64 [rows] sums of x and x^2 over valid tokens, accumulated in float32 around a
        per-row shift (a value within the row's range) and shifted back in float64, so that the
        variance of nearly equal values does not cancel catastrophically."""
        shift_row = torch.where(torch.isfinite(shift_row), shift_row, 0.0)
        d_tok = self.where_tokens(x_tok - self.seg.to_tokens(shift_row))
        d_sum = self.seg.row_sum(d_tok)
        n, k = self.local_n_row, shift_row.double()
        x_sum = d_sum + n * k
        if not second:
            return x_sum, None
        return x_sum, self.seg.row_sum(d_tok * d_tok) + k * (2.0 * d_sum + n * k)

    def row_sum_zero_masked(self, x_tok: torch.Tensor) -> torch.Tensor:
        """row_sum for a quantity that is 0 at masked positions by construction (a function f of
        the clamped log-ratio with f(0) = 0), saving the masking pass."""
        return self.seg.row_sum(x_tok)

    def row_max(self, x_tok: torch.Tensor) -> torch.Tensor:
        return self.seg.row_max(self.where_tokens(x_tok, float("-inf")))

    def sum_rows(self, x_row: torch.Tensor) -> torch.Tensor:
        """0-d float64 sum over this rank's non-empty sequences."""
        return torch.where(self.nonempty_row, x_row.to(torch.float64), 0.0).sum()

    def max_rows(self, x_row: torch.Tensor) -> torch.Tensor:
        return max_all(torch.where(self.nonempty_row, x_row, float("-inf")))

    def min_rows(self, x_row: torch.Tensor) -> torch.Tensor:
        return -max_all(torch.where(self.nonempty_row, -x_row, float("-inf")))


def max_all(x: torch.Tensor) -> torch.Tensor:
    """0-d max that is -inf (not an error) for an empty tensor, e.g. a rank with no sequence."""
    if x.numel() == 0:  # a shape, not a value: no host sync
        return x.new_full((), float("-inf"))
    return x.max()


def per_count(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """total / count for a count of tokens or sequences; 0 for an empty batch (total is 0 then)."""
    return total / count.clamp(min=1)


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """Extremes over an empty set are +-inf; report 0 instead."""
    return torch.where(torch.isfinite(x), x, 0.0)


def exp_clamped(log_value: torch.Tensor) -> torch.Tensor:
    return log_value.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()


class Counts:
    """Valid tokens and non-empty sequences of the whole batch: every family's denominators."""

    def rows_phase(self, ctx: Context) -> None:
        ctx.rows.add_sum("n", ctx.local_n_row)
        ctx.rows.add_sum("log_ratio", ctx.row_sum_zero_masked(ctx.log_ratio))

    def batch_phase(self, ctx: Context) -> None:
        ctx.totals.add_sum("tokens", ctx.n_row.sum())
        ctx.totals.add_sum("rows", ctx.nonempty_row.sum(dtype=torch.float64))
