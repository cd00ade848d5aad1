"""Per-sequence reductions of stacked per-token slots, for the padded `[B, T]` and packed `[N] +
cu_seqlens` layouts.

A `Segments` object sums (and maxes) every slot of a `[K, *tokens]` stack per sequence in one
op, writing `[K, rows]`, and broadcasts per-row values back to tokens, without any host
synchronisation. Under context parallelism every CP rank holds the same sequences in the same
order (only a part of each), so row r means the same sequence on every CP rank and row
statistics can be all-reduced directly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segments:
    num_rows: int
    # Packed layout only: the row of each token, clamped into [0, num_rows - 1] (tokens after
    # cu_seqlens[-1] are masked out by `in_sequence`, so the row they land in never sees them).
    row_of_token: torch.Tensor | None = None
    # Packed layout only: cu_seqlens made safe to index with (non-decreasing, within [0, N]).
    offsets: torch.Tensor | None = None
    # Packed layout only: 1.0 for the tokens of a sequence, 0.0 after cu_seqlens[-1].
    in_sequence: torch.Tensor | None = None

    @staticmethod
    def padded(batch_size: int) -> "Segments":
        return Segments(batch_size)

    @staticmethod
    def packed(cu_seqlens: torch.Tensor, num_tokens: int, device: torch.device) -> "Segments":
        # Even unchecked offsets (check_inputs=False) can never index out of bounds.
        offsets = torch.cummax(cu_seqlens.to(device, torch.int64).clamp(0, num_tokens), dim=0).values
        # Row of token p = number of sequence ends <= p: a scatter of the ends and a running sum
        # (sync-free, unlike repeat_interleave with tensor repeats; ~10x faster than searchsorted).
        ends = torch.zeros(num_tokens + 1, dtype=torch.int64, device=device)
        ends.scatter_add_(0, offsets[1:], torch.ones_like(offsets[1:]))
        row = ends[:num_tokens].cumsum(0)
        num_rows = cu_seqlens.numel() - 1
        in_sequence = (row < num_rows).to(torch.float64)
        return Segments(num_rows, row.clamp_(max=max(num_rows - 1, 0)), offsets, in_sequence)

    @property
    def is_packed(self) -> bool:
        return self.row_of_token is not None

    def row_sums(self, slots: torch.Tensor, mask: torch.Tensor, out: torch.Tensor) -> None:
        """out [K, rows] = per-sequence sums of slots [K, *tokens] over the tokens where mask
        (float64 0/1) is 1. Masked positions must hold finite values. Padded: one batched matrix
        product (the mask multiplies and sums in the same op); packed: a segment reduction."""
        if not self.is_packed:
            if torch.compiler.is_compiling():  # Dynamo traces no out= into a non-contiguous view
                out.copy_(torch.bmm(slots.transpose(0, 1), mask.unsqueeze(-1)).squeeze(-1).t())
            else:
                torch.bmm(slots.transpose(0, 1), mask.unsqueeze(-1), out=out.t().unsqueeze(-1))
            return
        if self.num_rows == 0:
            return
        masked = slots * mask
        if masked.device.type == "cpu":  # a segment reduction is ~2x faster than index_add on a CPU
            out.copy_(torch.segment_reduce(masked, "sum", offsets=self._offsets(masked), axis=1, unsafe=True))
        else:
            out.zero_().index_add_(1, self.row_of_token, masked)

    def row_maxes(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """out [K, rows] = per-sequence maxima of nonnegative values [K, *tokens] that are 0 at
        masked positions (0 for a sequence without tokens)."""
        if values.shape[-1] == 0:
            out.zero_()
        elif not self.is_packed:
            torch.amax(values, -1, out=out)
        elif self.num_rows == 0:
            return
        elif values.device.type == "cpu":
            out.copy_(torch.segment_reduce(values, "max", offsets=self._offsets(values), axis=1, unsafe=True,
                                           initial=0.0))
        else:
            index = self.row_of_token.expand(values.shape[0], -1)
            out.zero_().scatter_reduce_(1, index, values, reduce="amax")

    def _offsets(self, values: torch.Tensor) -> torch.Tensor:
        return self.offsets.expand(values.shape[0], -1)

    def to_tokens(self, x_row: torch.Tensor) -> torch.Tensor:
        """Broadcast a [rows] tensor to the token layout."""
        if not self.is_packed:
            return x_row.unsqueeze(-1)
        if self.num_rows == 0:
            return x_row.new_zeros(self.row_of_token.shape)
        return x_row.index_select(0, self.row_of_token)
