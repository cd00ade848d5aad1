"""Megatron-Core's zigzag context-parallel data layout, for padded and packed (THD) batches.

With causal attention the late tokens of a sequence cost more than the early ones, so
Megatron-Core cuts every sequence into 2*cp equal chunks and gives CP rank r chunks r and
2*cp-1-r (`get_batch_on_this_cp_rank` for `[b, s]` batches; Transformer Engine's
`thd_get_partitioned_indices` applies the same rule to each sequence of a packed batch). Every
per-token tensor of a micro-batch (tokens, labels, masks, rollout log-probs, advantages) is split
the same way; the merges invert the splits (for tests and logging).

Packed batches: sequences are concatenated, each padded to a multiple of `pad_multiple`
(see `cp_pad_multiple`); `cu_seqlens_padded` holds the padded offsets, `cu_seqlens` the real
lengths' cumulative sums (TE's `cu_seqlens_q` / `cu_seqlens_q_padded`). After the split, rank r
holds `cu_seqlens_padded[i] / cp` .. `cu_seqlens_padded[i+1] / cp` of sequence i.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F


# ---- padded [b, s, ...] batches ----

def pad_to_multiple(tensor: torch.Tensor, multiple: int, *, seq_dim: int = 1,
                    value: float = 0) -> torch.Tensor:
    """Right-pad `seq_dim` with `value` to the next multiple of `multiple` (no copy if aligned)."""
    _check_positive("multiple", multiple)
    seq_dim = seq_dim % tensor.dim()
    pad = -tensor.shape[seq_dim] % multiple
    if pad == 0:
        return tensor
    # F.pad lists (left, right) pairs from the last dimension backwards.
    widths = [0, 0] * (tensor.dim() - 1 - seq_dim) + [0, pad]
    return F.pad(tensor, widths, value=value)


def split_for_cp(tensor: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This CP rank's zigzag share (chunks cp_rank and 2*cp_size-1-cp_rank) of a padded batch."""
    _check_rank(cp_size, cp_rank)
    if cp_size == 1:
        return tensor
    seq_len = tensor.shape[seq_dim]
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(f"sequence dim {seq_dim} has length {seq_len}, not a multiple of 2*cp_size="
                         f"{2 * cp_size}; pad it first (pad_to_multiple)")
    chunk = seq_len // (2 * cp_size)
    first = tensor.narrow(seq_dim, cp_rank * chunk, chunk)
    second = tensor.narrow(seq_dim, (2 * cp_size - 1 - cp_rank) * chunk, chunk)
    return torch.cat([first, second], dim=seq_dim)


def merge_from_cp(shards: Sequence[torch.Tensor], cp_size: int, seq_dim: int = 1) -> torch.Tensor:
    """Inverse of split_for_cp: `shards[r]` is rank r's share; returns the whole batch."""
    if len(shards) != cp_size:
        raise ValueError(f"expected {cp_size} shards (one per CP rank), got {len(shards)}")
    if cp_size == 1:
        return shards[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, shard in enumerate(shards):
        chunks[rank], chunks[2 * cp_size - 1 - rank] = shard.chunk(2, dim=seq_dim)
    return torch.cat(chunks, dim=seq_dim)


def zigzag_token_positions(seq_len: int, cp_size: int, cp_rank: int,
                           device: torch.device | str | None = None) -> torch.Tensor:
    """int64 [seq_len / cp_size]: global positions of this rank's tokens, in local order."""
    return split_for_cp(torch.arange(seq_len, device=device), cp_size, cp_rank, seq_dim=0)


# ---- packed (THD) batches ----

class PackedSequences(NamedTuple):
    values: torch.Tensor             # [N, ...]: sequences back to back, each padded
    cu_seqlens_padded: torch.Tensor  # int32 [S+1]: padded offsets
    cu_seqlens: torch.Tensor         # int32 [S+1]: cumulative real lengths


def cp_pad_multiple(cp_size: int, *, tp_size: int = 1, sequence_parallel: bool = False,
                    token_alignment: int = 1) -> int:
    """The multiple every sequence is padded to (each packed sequence, or a padded batch's width).

    The zigzag split needs 2*cp equal chunks. A sequence's tokens are spread over cp ranks, and
    with sequence parallelism over cp*tp ranks; `token_alignment` (model.config.fp8_token_alignment:
    16 for FP8, 32 for MXFP8, 128 for blockwise FP8 with sequence parallelism, 1 without FP8) is
    what each rank's token count must be a multiple of, which holds when each sequence's share per
    rank is.
    """
    _check_positive("cp_size", cp_size)
    _check_positive("tp_size", tp_size)
    _check_positive("token_alignment", token_alignment)
    ranks_per_sequence = cp_size * (tp_size if sequence_parallel else 1)
    multiple = 2 * cp_size if cp_size > 1 else 1
    return math.lcm(multiple, ranks_per_sequence * token_alignment)


def pack_sequences(sequences: Sequence[torch.Tensor], pad_multiple: int, *,
                   pad_value: float = 0) -> PackedSequences:
    """Concatenate `[L_i, ...]` tensors, padding each with `pad_value` to a multiple of `pad_multiple`.

    Call once per field (tokens with the pad id, masks with 0, ...): the offsets depend only on
    the lengths, so every field of a batch gets the same cu_seqlens.
    """
    _check_positive("pad_multiple", pad_multiple)
    if not sequences:
        raise ValueError("pack_sequences needs at least one sequence")
    lengths = [s.shape[0] for s in sequences]
    padded = [pad_to_multiple(s, pad_multiple, seq_dim=0, value=pad_value) for s in sequences]
    padded_lengths = [p.shape[0] for p in padded]
    return PackedSequences(torch.cat(padded), _cumsum(padded_lengths), _cumsum(lengths))


def packed_cp_indices(cu_seqlens_padded: torch.Tensor, num_tokens: int, cp_size: int,
                      cp_rank: int) -> torch.Tensor:
    """int64 [num_tokens / cp_size]: positions in the packed batch of this rank's tokens.

    The zigzag rule per sequence, as TE's thd_get_partitioned_indices: local token j of sequence
    i (local span cu[i]/cp .. cu[i+1]/cp) is global position cu[i] + j + half_i * r for
    j < half_i, and cu[i] + j + half_i * (2cp-2-r) after, with half_i = (cu[i+1]-cu[i]) / (2cp).
    Computed on the device without host synchronisation.
    """
    _check_rank(cp_size, cp_rank)
    cu = cu_seqlens_padded.to(torch.int64)
    local_cu = cu // cp_size
    local_pos = torch.arange(num_tokens // cp_size, device=cu.device)
    seq = torch.searchsorted(local_cu[1:], local_pos, right=True)
    offset_in_seq = local_pos - local_cu[seq]
    half = (local_cu[seq + 1] - local_cu[seq]) // 2
    chunk = torch.where(offset_in_seq < half, cp_rank, 2 * cp_size - 2 - cp_rank)
    return cu[seq] + offset_in_seq + half * chunk


def split_packed_for_cp(tensor: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int,
                        cp_rank: int, *, seq_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This CP rank's share of a packed batch and its local cu_seqlens (cu_seqlens_padded / cp)."""
    _check_rank(cp_size, cp_rank)
    _check_packed(cu_seqlens_padded, tensor.shape[seq_dim], cp_size)
    if cp_size == 1:
        return tensor, cu_seqlens_padded
    index = packed_cp_indices(cu_seqlens_padded, tensor.shape[seq_dim], cp_size, cp_rank)
    return tensor.index_select(seq_dim, index.to(tensor.device)), cu_seqlens_padded // cp_size


def merge_packed_from_cp(shards: Sequence[torch.Tensor], cu_seqlens_padded: torch.Tensor,
                         cp_size: int, *, seq_dim: int = 0) -> torch.Tensor:
    """Inverse of split_packed_for_cp: `shards[r]` is rank r's share; returns the packed batch."""
    if len(shards) != cp_size:
        raise ValueError(f"expected {cp_size} shards (one per CP rank), got {len(shards)}")
    if cp_size == 1:
        return shards[0]
    first = shards[0]
    shape = list(first.shape)
    shape[seq_dim] *= cp_size
    _check_packed(cu_seqlens_padded, shape[seq_dim], cp_size)
    merged = first.new_empty(shape)
    for rank, shard in enumerate(shards):
        index = packed_cp_indices(cu_seqlens_padded, shape[seq_dim], cp_size, rank)
        merged.index_copy_(seq_dim, index.to(merged.device), shard)
    return merged


def packed_valid_mask(cu_seqlens_padded: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """bool [N]: True at real tokens, False at the padding that pack_sequences added."""
    cu_padded = cu_seqlens_padded.to(torch.int64)
    position = torch.arange(int(cu_padded[-1]), device=cu_padded.device)
    seq = torch.searchsorted(cu_padded[1:], position, right=True)
    real_length = (cu_seqlens[1:] - cu_seqlens[:-1]).to(cu_padded.device, torch.int64)
    return position - cu_padded[seq] < real_length[seq]


# ---- helpers ----

def _cumsum(lengths: Sequence[int]) -> torch.Tensor:
    # int32: what TE's attention kernels and thd_get_partitioned_indices take.
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_rank(cp_size: int, cp_rank: int) -> None:
    _check_positive("cp_size", cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")


def _check_packed(cu_seqlens_padded: torch.Tensor, num_tokens: int, cp_size: int) -> None:
    """One host sync per call: this is data preparation, not a per-token hot path."""
    if cu_seqlens_padded.dim() != 1 or cu_seqlens_padded.numel() < 2:
        raise ValueError(f"cu_seqlens_padded must be 1-D [S+1] with S >= 1, got shape "
                         f"{tuple(cu_seqlens_padded.shape)}")
    cu = cu_seqlens_padded.to(torch.int64).cpu()
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != num_tokens:
        raise ValueError(f"cu_seqlens_padded must run from 0 to the packed length {num_tokens}, "
                         f"got {int(cu[0])}..{int(cu[-1])}")
    misaligned = lengths % (2 * cp_size) != 0
    if bool((lengths < 0).any()):
        raise ValueError("cu_seqlens_padded must be non-decreasing")
    if cp_size > 1 and bool(misaligned.any()):
        raise ValueError(f"{int(misaligned.sum())} packed sequence(s) have a padded length that is not a "
                         f"multiple of 2*cp_size={2 * cp_size}; pack with pad_multiple=cp_pad_multiple(...)")
