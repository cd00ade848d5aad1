"""Per-sequence reductions for the padded `[B, T]` and packed `[N] + cu_seqlens` layouts.

A `Segments` object turns per-token tensors into per-sequence ("row") sums and maxima and
broadcasts per-row values back to tokens, without any host synchronisation. Under context
parallelism every CP rank holds the same sequences in the same order (only a part of each), so
row r means the same sequence on every CP rank and row statistics can be all-reduced directly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segments:
    num_rows: int
    # Packed layout only: the row of each token; tokens after cu_seqlens[-1] get row `num_rows`
    # (a spill row that is dropped), so trailing padding never reaches a real sequence.
    row_of_token: torch.Tensor | None = None

    @staticmethod
    def padded(batch_size: int) -> "Segments":
        return Segments(batch_size)

    @staticmethod
    def packed(cu_seqlens: torch.Tensor, num_tokens: int, device: torch.device) -> "Segments":
        positions = torch.arange(num_tokens, device=device, dtype=cu_seqlens.dtype)
        # searchsorted is sync-free (unlike repeat_interleave with tensor repeats).
        row = torch.searchsorted(cu_seqlens[1:].to(device), positions, right=True)
        return Segments(cu_seqlens.numel() - 1, row)

    @property
    def is_packed(self) -> bool:
        return self.row_of_token is not None

    def row_sum(self, x_tok: torch.Tensor) -> torch.Tensor:
        """float64 [rows] sums of a per-token tensor that is already zero at masked positions.

        Padded rows are summed in float32 by torch's cascade/tree reduction (error ~eps*log T,
        and no float64 copy of the tokens on a CPU); packed rows go through a sequential
        index_add, so they accumulate in float64 to stay independent of how a sequence is split.
        """
        if not self.is_packed:
            return x_tok.sum(dim=-1).double()
        out = torch.zeros(self.num_rows + 1, dtype=torch.float64, device=x_tok.device)
        return out.index_add_(0, self.row_of_token, x_tok.double())[: self.num_rows]

    def row_max(self, x_tok: torch.Tensor) -> torch.Tensor:
        """[rows] maxima of a per-token tensor whose masked positions cannot be the maximum."""
        if not self.is_packed:
            return x_tok.amax(dim=-1) if x_tok.shape[-1] else x_tok.new_full(x_tok.shape[:-1], float("-inf"))
        out = torch.full((self.num_rows + 1,), float("-inf"), dtype=x_tok.dtype, device=x_tok.device)
        return out.scatter_reduce_(0, self.row_of_token, x_tok, reduce="amax")[: self.num_rows]

    def row_min(self, x_tok: torch.Tensor) -> torch.Tensor:
        """[rows] minima of a per-token tensor whose masked positions cannot be the minimum."""
        if not self.is_packed:
            return x_tok.amin(dim=-1) if x_tok.shape[-1] else x_tok.new_full(x_tok.shape[:-1], float("inf"))
        out = torch.full((self.num_rows + 1,), float("inf"), dtype=x_tok.dtype, device=x_tok.device)
        return out.scatter_reduce_(0, self.row_of_token, x_tok, reduce="amin")[: self.num_rows]

    def to_tokens(self, x_row: torch.Tensor) -> torch.Tensor:
        """Broadcast a [rows] tensor to the token layout."""
        if not self.is_packed:
            return x_row.unsqueeze(-1)
        spill = torch.cat([x_row, x_row.new_zeros(1)])
        return spill[self.row_of_token]
