"""How a data-parallel rank's mini-batch `[B, T]` becomes this rank's micro-batches.

Two layouts, one interface (`MicroBatchPlan`):

- padded: micro-batches of `micro_batch_size` rows, the width T padded to `sequence_multiple`
  and cut into this CP rank's zigzag share (`[b, T_pad / cp]` per micro-batch);
- packed (THD, verl's dynamic batch size): sequences, each trimmed to its length (through its last
  response token) and padded to `sequence_multiple`, are packed into micro-batches of at most
  `max_tokens` tokens per rank, and each sequence is split zigzag on its own, as Transformer
  Engine's THD attention expects (`[n_local]` per micro-batch, with `PackedSeqParams`).

A plan is a gather index per micro-batch into the flattened mini-batch (plus one padding cell),
so every per-token tensor is cut with one `index_select` (`split`) and merged back with one
all-gather over CP and a scatter (`merge`). The loss normalisers stay global token / sequence
counts (losses.py), so the gradient of a packed mini-batch equals that of the padded one.

Packing (`pack_bins`): longest-first into the least-loaded micro-batch that keeps it within
the budget. Every DP rank then packs into the same number of micro-batches (the largest any DP
rank needs, an all-reduce over DP): the pipeline schedule and the gradient all-reduce run in
lockstep over DP. Under pipeline parallelism every micro-batch of a mini-batch is padded to the
same token count (the last sequence's padding grows), because the schedule sends activations of
one fixed shape between stages; with virtual pipelining their number is a multiple of pp
(Megatron-Core's interleaved schedule). Under expert parallelism across DP replicas every forward
is a collective of the expert group, so the number of micro-batches is agreed over DP in every
pass, and with the allgather dispatcher (equal-sized token blocks) their token count too (packed)
or the mini-batch width (padded: training/local_batch.py).

Alignment (`sequence_multiple`): 2*cp for the zigzag split; with sequence parallelism each
sequence's share per CP rank is split again over TP; FP8 needs each rank's token count to be a
multiple of 16 (MXFP8: 32; blockwise with sequence parallelism: 128; model.config.fp8_token_alignment).
Padding tokens are pad id 0, masked out of every loss and metric.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..model.config import fp8_token_alignment
from ..parallel.context import cp_pad_multiple, packed_cp_indices, zigzag_token_positions


def sequence_multiple(config: Any) -> int:
    """The padding multiple of every sequence for a model's TransformerConfig (module docstring)."""
    recipe = None
    if getattr(config, "fp8", None):
        recipe = getattr(config, "fp8_recipe", None) or "delayed"  # a Megatron-Core without fp8_recipe: delayed
        recipe = str(getattr(recipe, "value", recipe))             # Megatron's Fp8Recipe enum
    sequence_parallel = bool(config.sequence_parallel)
    alignment = fp8_token_alignment(recipe, sequence_parallel=sequence_parallel)
    return cp_pad_multiple(config.context_parallel_size, tp_size=config.tensor_model_parallel_size,
                           sequence_parallel=sequence_parallel, token_alignment=alignment)


def sequence_lengths(mask_BT: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the tokens each row needs as input, through its last masked-in position (at
    least 1): logits at position t depend on tokens 0..t only."""
    columns = torch.arange(1, mask_BT.shape[1] + 1, device=mask_BT.device)
    return torch.where(mask_BT != 0, columns, 1).amax(dim=1)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ---- packing -----------------------------------------------------------------------------------

def pack_bins(lengths: Sequence[int], capacity: int, num_bins: int) -> list[list[int]] | None:
    """Indices of `lengths` in `num_bins` bins of at most `capacity` each (every bin non-empty,
    indices ascending), or None when this greedy packing does not fit. Longest first, each into the
    least-loaded bin; ties by index, so the result is deterministic."""
    if not 1 <= num_bins <= len(lengths):
        return None
    loads, bins = [0] * num_bins, [[] for _ in range(num_bins)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(num_bins), key=lambda b: (loads[b], b))
        if loads[target] + lengths[i] > capacity:
            return None
        loads[target] += lengths[i]
        bins[target].append(i)
    return [sorted(b) for b in bins]


def fewest_bins(lengths: Sequence[int], capacity: int) -> int:
    """The fewest bins pack_bins fits `lengths` into (each length must fit the capacity)."""
    assert max(lengths) <= capacity, "checked by the caller"
    num_bins = max(1, math.ceil(sum(lengths) / capacity))
    while pack_bins(lengths, capacity, num_bins) is None:
        num_bins += 1  # terminates: one sequence per bin always fits
    return num_bins


def pack_exactly(lengths: Sequence[int], capacity: int, num_bins: int) -> list[list[int]]:
    """`num_bins` bins within the capacity (num_bins >= fewest_bins and <= len(lengths)). The
    greedy packing almost always fits; otherwise the fewest bins are split until there are enough,
    largest bin first (a part of a bin fits wherever the bin did)."""
    bins = pack_bins(lengths, capacity, num_bins)
    if bins is not None:
        return bins
    bins = pack_bins(lengths, capacity, fewest_bins(lengths, capacity))
    while len(bins) < num_bins:
        splittable = [b for b in bins if len(b) > 1]
        largest = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        bins.remove(largest)
        bins += [largest[0::2], largest[1::2]]
    return sorted(bins)


# ---- the plan ----------------------------------------------------------------------------------

@dataclass
class MicroBatch:
    """One micro-batch on this rank."""
    index: torch.Tensor               # int64 [b, s_local] or [n_local]: cells of the flattened mini-batch
    positions: torch.Tensor           # int64, like index: position of each token in its sequence
    packed_seq_params: Any = None     # PackedSeqParams (packed layout) or None
    cu_seqlens_local: torch.Tensor | None = None  # packed: [S+1] this rank's spans of its sequences


class MicroBatchPlan:
    """This rank's micro-batches of a `[B, T]` mini-batch: `split` cuts a per-token tensor into
    them, `merge` puts their values back into `[B, T]`. `seq_length` and `micro_batch_size` are the
    pipeline schedule's activation shape (tokens before the CP split, and rows)."""

    def __init__(self, *, num_rows: int, width: int, micro_batches: list[MicroBatch],
                 all_cp_indices: list[list[torch.Tensor]], seq_length: int, micro_batch_size: int,
                 computed_tokens: int, real_tokens: torch.Tensor, cp_group: dist.ProcessGroup | None) -> None:
        self.num_rows, self.width = num_rows, width
        self.micro_batches = micro_batches
        self._all_cp_indices = all_cp_indices  # [micro-batch][cp rank]
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        # Tokens the model processes (all CP ranks together), and those the sequences need (0-d).
        self.computed_tokens, self.real_tokens = computed_tokens, real_tokens
        self.cp_group = cp_group

    @property
    def num_microbatches(self) -> int:
        return len(self.micro_batches)

    @property
    def is_packed(self) -> bool:
        return self.micro_batches[0].packed_seq_params is not None

    def split(self, x_BT: torch.Tensor, fill: float = 0) -> list[torch.Tensor]:
        """This rank's part of every micro-batch of a per-token `[B, T, ...]` tensor (padding:
        `fill`); trailing dimensions stay: `[b, T_pad / cp, ...]` or `[n_local, ...]`."""
        if x_BT.shape[0] != self.num_rows or x_BT.shape[1] > self.width:
            raise ValueError(f"a per-token tensor of shape {tuple(x_BT.shape)} does not fit the mini-batch "
                             f"[{self.num_rows}, <= {self.width}]")
        cells = self._cells(x_BT, fill)
        return [cells[mb.index] for mb in self.micro_batches]

    def _cells(self, x_BT: torch.Tensor, fill: float) -> torch.Tensor:
        """The mini-batch flattened, with one `fill` cell at the end (where padding points)."""
        device = self.micro_batches[0].index.device
        x_BT = x_BT.to(device, non_blocking=True)
        rows, columns, rest = x_BT.shape[0], x_BT.shape[1], x_BT.shape[2:]
        cells = x_BT.new_full((rows * self.width + 1, *rest), fill)
        cells[:-1].view(rows, self.width, *rest)[:, :columns] = x_BT
        return cells

    def merge(self, parts: Sequence[torch.Tensor], width: int) -> torch.Tensor:
        """`[B, width]` from this rank's micro-batch values (`split`'s shapes); every CP rank gets
        the whole. Collective over CP (one all-gather)."""
        local = torch.cat([p.reshape(-1) for p in parts])
        cp_size = len(self._all_cp_indices[0])
        shards = [local]
        if cp_size > 1:
            shards = [torch.empty_like(local) for _ in range(cp_size)]
            dist.all_gather(shards, local.contiguous(), group=self.cp_group)
        cells = local.new_zeros(self.num_rows * self.width + 1)
        for rank, shard in enumerate(shards):
            index = torch.cat([indices[rank].reshape(-1) for indices in self._all_cp_indices])
            cells.index_copy_(0, index, shard)
        return cells[:-1].view(self.num_rows, self.width)[:, :width]

    def concat(self, parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All micro-batches' values as one batch for a whole-mini-batch computation: rows
        stacked (padded), or sequences concatenated with their spans (packed)."""
        if not self.is_packed:
            return torch.cat(parts), None
        offsets, spans = 0, [parts[0].new_zeros(1, dtype=torch.int64)]
        for part, mb in zip(parts, self.micro_batches):
            spans.append(mb.cu_seqlens_local[1:].to(torch.int64) + offsets)
            offsets += part.shape[0]
        return torch.cat(parts), torch.cat(spans).to(torch.int32)


def plan_padded(lengths: torch.Tensor, length: int, *, micro_batch_size: int, multiple: int, cp_size: int,
                cp_rank: int, cp_group: dist.ProcessGroup | None, device: torch.device) -> MicroBatchPlan:
    """Rows in micro-batches of `micro_batch_size`, the width `length` padded to `multiple` and cut
    zigzag. `lengths` (int64 [B], sequence_lengths) only feed the padding statistics."""
    num_rows = lengths.shape[0]
    if num_rows % micro_batch_size:
        raise ValueError(f"the mini-batch has {num_rows} sequences on this DP rank, not a multiple of "
                         f"micro_batch_size={micro_batch_size}; pick a micro_batch_size that divides it")
    width = round_up(max(length, 1), multiple)
    micro_batches, all_cp = [], []
    for start in range(0, num_rows, micro_batch_size):
        rows = torch.arange(start, start + micro_batch_size, device=device)[:, None]
        per_rank = [rows * width + zigzag_token_positions(width, cp_size, r, device)[None] for r in range(cp_size)]
        mine = per_rank[cp_rank]
        micro_batches.append(MicroBatch(mine, mine % width))
        all_cp.append(per_rank)
    return MicroBatchPlan(num_rows=num_rows, width=width, micro_batches=micro_batches, all_cp_indices=all_cp,
                          seq_length=width, micro_batch_size=micro_batch_size, computed_tokens=num_rows * width,
                          real_tokens=lengths.sum(), cp_group=cp_group)


@dataclass(frozen=True)
class PackingRules:
    """What the packed layout must respect besides the budget."""
    max_tokens: int             # per rank per micro-batch (tokens after the CP split)
    multiple: int               # sequence_multiple
    equal_sizes: bool = False   # pipeline parallelism: every micro-batch the same token count
    bins_multiple: int = 1      # virtual pipelining: the number of micro-batches a multiple of pp
    # expert parallelism with the allgather dispatcher: that count the same on every DP rank too
    equal_sizes_over_dp: bool = False


def plan_packed(lengths_B: torch.Tensor, length: int, rules: PackingRules, *, cp_size: int, cp_rank: int,
                cp_group: dist.ProcessGroup | None, dp_group: dist.ProcessGroup | None,
                device: torch.device) -> MicroBatchPlan:
    """Sequences (`lengths_B`: sequence_lengths, each <= `length`) packed under `rules` (module
    docstring). One host sync (the lengths decide the shapes); collective over DP (the number of
    micro-batches)."""
    lengths = lengths_B.tolist()
    padded = [round_up(n, rules.multiple) for n in lengths]
    capacity = rules.max_tokens * cp_size
    longest = max(padded)
    if longest > capacity:
        raise ValueError(f"trainer.max_tokens_per_micro_batch={rules.max_tokens} is too small for a sequence of "
                         f"{max(lengths)} tokens ({longest} once padded to a multiple of {rules.multiple}, "
                         f"{longest // cp_size} per context-parallel rank): raise it to at least "
                         f"{longest // cp_size}")
    num_bins = _agreed_bins(fewest_bins(padded, capacity), rules.bins_multiple, dp_group, device)
    if num_bins > len(padded):
        raise ValueError(f"{num_bins} packed micro-batches are needed (a multiple of pp={rules.bins_multiple} with "
                         f"virtual pipelining, the same on every data-parallel rank) but this rank has only "
                         f"{len(padded)} sequences: raise trainer.max_tokens_per_micro_batch or the mini-batch size")
    bins = pack_exactly(padded, capacity, num_bins)
    bin_tokens = max(sum(padded[i] for i in b) for b in bins) if rules.equal_sizes else None
    if rules.equal_sizes_over_dp:
        bin_tokens = _agreed_max(bin_tokens, dp_group, device)
    width = round_up(max(length, 1), rules.multiple)
    micro_batches, all_cp, computed = [], [], 0
    for rows in bins:
        spans = [padded[i] for i in rows]
        if bin_tokens is not None:
            spans[-1] += bin_tokens - sum(spans)  # one shape for the pipeline's p2p
        computed += sum(spans)
        mine, per_rank = _packed_micro_batch(rows, spans, [lengths[i] for i in rows], len(lengths), width,
                                             cp_size, cp_rank, device)
        micro_batches.append(mine)
        all_cp.append(per_rank)
    seq_length = bin_tokens if bin_tokens is not None else max(sum(padded[i] for i in b) for b in bins)
    return MicroBatchPlan(num_rows=len(lengths), width=width, micro_batches=micro_batches, all_cp_indices=all_cp,
                          seq_length=seq_length, micro_batch_size=1, computed_tokens=computed,
                          real_tokens=lengths_B.sum(), cp_group=cp_group)


def _agreed_bins(needed: int, multiple: int, dp_group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The number of micro-batches every DP rank uses: the largest any needs, rounded up."""
    return round_up(_agreed_max(needed, dp_group, device), multiple)


def _agreed_max(value: int, dp_group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The largest `value` of the DP ranks (one all-reduce; `value` itself without a group)."""
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        count = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
        value = int(count.item())
    return value


def _packed_micro_batch(rows: list[int], spans: list[int], lengths: list[int], num_rows: int, width: int,
                        cp_size: int, cp_rank: int, device: torch.device) -> tuple[MicroBatch, list[torch.Tensor]]:
    """This rank's micro-batch of sequences `rows` (padded lengths `spans`), and every CP rank's
    gather index."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_padded = torch.tensor([0, *spans], dtype=torch.int64, device=device).cumsum(0)
    cu_real = torch.tensor([0, *lengths], dtype=torch.int64, device=device).cumsum(0)
    total = int(sum(spans))
    # Packed position p of sequence j sits at column c = p - cu_padded[j] of row rows[j]; columns
    # past the mini-batch width (the grown padding of the last sequence) read the padding cell.
    seq = torch.repeat_interleave(torch.arange(len(rows), device=device),
                                  torch.tensor(spans, device=device))
    column = torch.arange(total, device=device) - cu_padded[seq]
    row = torch.tensor(rows, device=device)[seq]
    cell = torch.where(column < width, row * width + column, num_rows * width)
    shards = [packed_cp_indices(cu_padded, total, cp_size, r) for r in range(cp_size)]
    per_rank = [cell[shard] for shard in shards]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_real.to(torch.int32),
                             cu_seqlens_kv=cu_real.to(torch.int32), cu_seqlens_q_padded=cu_padded.to(torch.int32),
                             cu_seqlens_kv_padded=cu_padded.to(torch.int32), max_seqlen_q=max(spans),
                             max_seqlen_kv=max(spans))
    mine = MicroBatch(per_rank[cp_rank], column[shards[cp_rank]], params, (cu_padded // cp_size).to(torch.int32))
    return mine, per_rank
