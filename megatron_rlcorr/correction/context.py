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
from typing import Callable

import torch

from .reduce import Partials
from .segments import Segments

LOG_RATIO_BOUND = 20.0  # clamp20 of docs/math.md: exp stays finite in float32


# Adding -MASK_OFFSET at masked positions pushes them out of any row maximum of a finite
# per-token quantity (all of ours are bounded functions of the clamped log-ratio).
MASK_OFFSET = 1e30
INF_STANDIN = 1e30
Compare = Callable[..., torch.Tensor]  # torch.gt / ge / lt / le


@dataclass
class Context:
    """Token tensors are float32 and exactly 0 at masked positions; masks are float 0/1.

    Float masks rather than bool ones: on CPUs `torch.where` and bool-producing ops are 5-10x
    slower than a multiply, and every op here is one pass over the tokens.
    """

    seg: Segments
    # Token tensors of one block of rows (None in the batch-level context of phases 2 and 3).
    mask: torch.Tensor | None          # float32 0/1, token layout
    log_ratio: torch.Tensor | None     # float32 old - rollout, exactly 0 at masked positions
    clamped: torch.Tensor | None       # clamp20(log_ratio)
    rollout_log_prob: torch.Tensor | None = None  # the input, garbage at masked positions
    rows: Partials = field(default_factory=Partials)
    totals: Partials = field(default_factory=Partials)

    @cached_property
    def ratio_tok(self) -> torch.Tensor:
        """rho_t = exp(clamp20(log_ratio)): the token IS weight before truncation and the token RS
        ratio. 1 at masked positions."""
        return self.clamped.exp()

    @cached_property
    def ratio_tok_masked(self) -> torch.Tensor:
        """rho_t at valid positions, 0 at masked ones."""
        return self.ratio_tok * self.mask

    @cached_property
    def ratio_row_extremes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 [rows] (min, max) of rho over valid tokens (+inf, -inf for a row with none).
        rho > 0 everywhere and is 1 at masked positions, so the masked product (0 there) has the
        row's maximum and the quotient by the mask (+inf there) its minimum: no extra masking pass."""
        high = self.seg.row_max(self.ratio_tok_masked)
        low = self.seg.row_min(torch.div(self.ratio_tok, self.mask, out=self.scratch))
        return low, torch.where(self.local_n_row > 0, high, float("-inf"))

    @cached_property
    def _inv_mask(self) -> torch.Tensor:
        return torch.rsub(self.mask, 1.0)  # 1 - mask, one pass

    @cached_property
    def local_log_ratio_row(self) -> torch.Tensor:
        """float64 [rows]: this rank's log-ratio sum of each sequence (before the CP reduction)."""
        return self.seg.row_sum(self.log_ratio)

    @cached_property
    def local_n_row(self) -> torch.Tensor:
        """float64 [rows]: valid tokens of each sequence on this rank (before the CP reduction)."""
        return self.seg.row_sum(self.mask)

    @cached_property
    def scratch(self) -> torch.Tensor:
        """A token-sized buffer for values that are reduced at once: fresh multi-MB allocations
        cost page faults on CPUs, a large share of this memory-bound phase."""
        return torch.empty_like(self.mask)

    def indicator(self, compare: Compare, x_tok: torch.Tensor, threshold: float, *,
                  zero_masked: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [x compare threshold] over valid tokens, 0 at masked positions.
        `zero_masked`: the comparison is already false where x_tok holds its masked value."""
        out = compare(x_tok, threshold, out=torch.empty_like(self.mask) if out is None else out)
        return out if zero_masked else out.mul_(self.mask)

    def row_count(self, compare: Compare, x_tok: torch.Tensor, threshold: float, *,
                  zero_masked: bool = False) -> torch.Tensor:
        """float64 [rows] number of valid tokens with x compare threshold."""
        return self.seg.row_sum(self.indicator(compare, x_tok, threshold, zero_masked=zero_masked,
                                               out=self.scratch))

    def row_sum(self, x_tok: torch.Tensor) -> torch.Tensor:
        """float64 [rows] sum over valid tokens of a tensor that is finite everywhere."""
        return self.seg.row_sum(torch.mul(x_tok, self.mask, out=self.scratch))

    def row_sum_zero_masked(self, x_tok: torch.Tensor) -> torch.Tensor:
        """row_sum for a quantity that is 0 at masked positions by construction (a function f of
        the clamped log-ratio with f(0) = 0, or an indicator), saving the masking pass."""
        return self.seg.row_sum(x_tok)

    def row_moments(self, x_tok: torch.Tensor, shift_row: torch.Tensor, *,
                    scratch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 [rows] sums of x and x^2 over valid tokens, accumulated in float32 around a
        per-row shift (a value within the row's range) and shifted back in float64, so that the
        variance of nearly equal values does not cancel catastrophically.
        `scratch`: x_tok is a temporary of the caller's and may be overwritten."""
        shift_row = torch.where(torch.isfinite(shift_row), shift_row, 0.0)
        shift_tok = self.seg.to_tokens(shift_row)
        d_tok = x_tok.sub_(shift_tok) if scratch else torch.sub(x_tok, shift_tok, out=self.scratch)
        d_tok.mul_(self.mask)
        d_sum = self.seg.row_sum(d_tok)
        n, k = self.local_n_row, shift_row.double()
        return d_sum + n * k, self.seg.row_sum(d_tok.mul_(d_tok)) + k * (2.0 * d_sum + n * k)

    def row_max(self, x_tok: torch.Tensor) -> torch.Tensor:
        """[rows] max over valid tokens of a finite per-token tensor; -inf for a row with none."""
        shifted = torch.add(x_tok, self._inv_mask, alpha=-MASK_OFFSET, out=self.scratch)
        return torch.where(self.local_n_row > 0, self.seg.row_max(shifted), float("-inf"))

    def row_min(self, x_tok: torch.Tensor) -> torch.Tensor:
        shifted = torch.add(x_tok, self._inv_mask, alpha=MASK_OFFSET, out=self.scratch)
        return torch.where(self.local_n_row > 0, self.seg.row_min(shifted), float("inf"))

    # ---- phase 2 views (valid after rows are reduced over CP; the derived ones are computed once,
    # as every family reads them) ----
    @property
    def n_row(self) -> torch.Tensor:
        """float64 [rows]: valid tokens of each whole sequence."""
        return self.rows.sum("n")

    @cached_property
    def nonempty_row(self) -> torch.Tensor:
        return self.n_row > 0

    @property
    def log_ratio_sum_row(self) -> torch.Tensor:
        """float64 [rows]: S_i, the unclamped log-ratio summed over the whole sequence."""
        return self.rows.sum("log_ratio")

    @cached_property
    def log_ratio_mean_row(self) -> torch.Tensor:
        return self.log_ratio_sum_row / self.n_row.clamp(min=1)

    # ---- phase 3 views (valid after totals are reduced over DP) ----
    @property
    def num_tokens(self) -> torch.Tensor:
        return self.totals.sum("tokens")

    @property
    def num_rows(self) -> torch.Tensor:
        return self.totals.sum("rows")

    @cached_property
    def _token_divisor(self) -> torch.Tensor:
        return self.num_tokens.clamp(min=1)

    @cached_property
    def _row_divisor(self) -> torch.Tensor:
        return self.num_rows.clamp(min=1)

    def per_token(self, total: torch.Tensor) -> torch.Tensor:
        """total / valid tokens of the batch; 0 for a batch without any (total is 0 then)."""
        return total / self._token_divisor

    def per_row(self, total: torch.Tensor) -> torch.Tensor:
        """total / non-empty sequences of the batch; 0 for a batch without any."""
        return total / self._row_divisor

    def sum_rows(self, x_row: torch.Tensor) -> torch.Tensor:
        """0-d float64 sum over this rank's non-empty sequences."""
        return torch.where(self.nonempty_row, x_row.to(torch.float64), 0.0).sum()

    def add_centred_moments(self, key: str, x_row: torch.Tensor, weight_row: torch.Tensor) -> None:
        """Batch partials of a per-sequence value x_i with weight w_i (n_i tokens, or 1 a sequence):
        `key/s` = sum w x, `key/m2` = sum w (x - m)^2 around this rank's own weighted mean m, and
        `key/q` = s^2 / W. Centring on the rank's mean keeps equal values (one sequence, duplicate
        responses) at exactly 0 spread, where sum w x^2 - s^2 / W would leave the rounding of two
        large, equal terms."""
        w = torch.where(self.nonempty_row, weight_row.double(), 0.0)
        x = torch.where(self.nonempty_row, x_row.double(), 0.0)
        total_w = w.sum().clamp(min=1)
        s = (w * x).sum()
        self.totals.add_sum(key + "/s", s)
        self.totals.add_sum(key + "/m2", (w * (x - s / total_w).square()).sum())
        self.totals.add_sum(key + "/q", s * s / total_w)

    def centred_sum_of_squares(self, key: str, total_weight: torch.Tensor) -> torch.Tensor:
        """sum w (x - mean)^2 over the whole batch from `add_centred_moments`' partials: the ranks'
        m2 plus the spread of the ranks' means, sum_r s_r^2 / W_r - s^2 / W (exactly 0 on one rank).
        `total_weight`: the batch's W (num_tokens or num_rows)."""
        t, s = self.totals, self.totals.sum(key + "/s")
        return (t.sum(key + "/m2") + t.sum(key + "/q") - s * s / total_weight.clamp(min=1)).clamp(min=0.0)

    def max_rows(self, x_row: torch.Tensor) -> torch.Tensor:
        return max_all(torch.where(self.nonempty_row, x_row, float("-inf")))

    def min_rows(self, x_row: torch.Tensor) -> torch.Tensor:
        return min_all(torch.where(self.nonempty_row, x_row, float("inf")))


def max_all(x: torch.Tensor) -> torch.Tensor:
    """0-d max that is -inf (not an error) for an empty tensor, e.g. a rank with no sequence."""
    if x.numel() == 0:  # a shape, not a value: no host sync
        return x.new_full((), float("-inf"))
    return x.max()


def min_all(x: torch.Tensor) -> torch.Tensor:
    """0-d min that is +inf for an empty tensor."""
    return -max_all(-x)


def finite(x: torch.Tensor, *, inplace: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """NaN -> 0 and +-inf -> +-1e30, so that a multiply by the 0/1 mask clears masked garbage
    (inf * 0 would be NaN). Valid positions are finite whenever the inputs pass validation."""
    return torch.nan_to_num(x, nan=0.0, posinf=INF_STANDIN, neginf=-INF_STANDIN, out=x if inplace else out)


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """Extremes over an empty set are +-inf; report 0 instead."""
    return torch.where(torch.isfinite(x), x, 0.0)


def exp_clamped(log_value: torch.Tensor) -> torch.Tensor:
    return log_value.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()


class Counts:
    """Valid tokens and non-empty sequences of the whole batch: every family's denominators."""

    def rows_phase(self, ctx: Context) -> None:
        ctx.rows.add_sum("n", ctx.local_n_row)
        ctx.rows.add_sum("log_ratio", ctx.local_log_ratio_row)

    def batch_phase(self, ctx: Context) -> None:
        ctx.totals.add_sum("tokens", ctx.n_row.sum())
        ctx.totals.add_sum("rows", ctx.nonempty_row.sum(dtype=torch.float64))
