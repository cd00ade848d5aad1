"""Layout-free, all-rank generation: which rank samples which prompts, and how the samples reach the
data-parallel replica that trains on them.

Every rank generates (with rollout.placement: separate, every rank of the rollout ranks' own world,
rl/async_rollout.py). The world is cut into K = world / R rollout groups of R =
`rollout.tensor_parallel_size` consecutive ranks (vLLM's grouping of torchrun ranks into
tensor-parallel engines; R = 1 for the embedded engine). A generation round's P prompts, the same
list on every rank, are split into K contiguous chunks and group k samples chunk k, prompt i with
the seed derived from (run seed, step, round, i). What a prompt's samples are therefore depends
on neither the training layout nor the number of engines: one process, dp2, tp2, pp2 and cp2
sample identical rollouts.

Two exchanges per step, sized so that nothing of O(tokens) goes to every rank:
1. After each round, a table of 10 float64 per sample (length, EOS, score, acc, reward, the
   layout of its recorded MoE routing: MoE layers, top-k, bytes per expert index (0: none), prompt
   rows recorded; and whether it carries a multi-turn response mask) is all-gathered among
   `groups.rollout_peers` (the ranks holding the same position in their rollout group). Every
   rank then knows every group's statistics, so DAPO dynamic sampling (sampling.dynamic_sample)
   runs on the step's whole batch, identically everywhere; the tokens stay where they were
   generated.
2. Once the step's batch is chosen, each rank receives the tokens and log-probs of its replica's
   share from the rank that generated them (`share_of_replica`: point-to-point, sizes known from
   the table, 8 bytes per token: ids as float32, exact below 2**24, and float32 log-probs; 12 with
   multi-turn samples in the round, whose response masks follow as a third float32 segment). A
   rank of rollout group k serves the receivers whose position in their own rollout group
   matches its own, which spreads the sending over the group's ranks. MoE models: the routed
   experts (response rows, and prompt rows where recorded) follow in a second message of raw bytes
   (MoE layers x top-k bytes per token for uint8 indices), sizes known from the prompts, the
   lengths and the routing layout.
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..data import Prompt, Task
from ..rollout import RolloutConfig, RolloutEngine
from .advantages import OverlongPenalty
from .sampling import RolloutGroups, RoutingLayout, generate_groups

if TYPE_CHECKING:  # Megatron-Core is imported inside the process groups only (runtime.py)
    from ..parallel.groups import ParallelGroups

_COLUMNS = 10  # length, eos, score, acc, reward, routed layers, top-k, index bytes (0: no routing), prompt rows, masked
_INDEX_DTYPES = {1: torch.uint8, 2: torch.int16}  # rollout.base.routed_experts_dtype's choices, by size
_EXACT_IDS = 1 << 24  # float32 holds every integer below this exactly


def chunk_bounds(num_prompts: int, num_chunks: int) -> list[tuple[int, int]]:
    """[start, end) of `num_chunks` contiguous near-equal chunks of `num_prompts` (the first ones
    take one more when it does not divide; some are empty when there are fewer prompts)."""
    base, extra = divmod(num_prompts, num_chunks)
    bounds, start = [], 0
    for k in range(num_chunks):
        end = start + base + (k < extra)
        bounds.append((start, end))
        start = end
    return bounds


def sample_round(engine: RolloutEngine, task: Task, prompts: list[Prompt], seeds: list[int], *,
                 rollout: RolloutConfig, overlong: OverlongPenalty, groups: ParallelGroups,
                 device: torch.device | str = "cpu") -> RolloutGroups:
    """The round's RolloutGroups over all `prompts` on every rank (collective over the world):
    statistics of every sample, tokens and log-probs of the samples this rank's engine made."""
    size = groups.rollout_group_size
    num_engines, mine = dist.get_world_size() // size, dist.get_rank() // size
    bounds = chunk_bounds(len(prompts), num_engines)
    start, end = bounds[mine]
    local = generate_groups(engine, task, prompts[start:end], rollout=rollout, overlong=overlong,
                            seeds=seeds[start:end]) if end > start else None
    if num_engines == 1:
        return local
    return gather_round(local, prompts, rollout.n, groups, device=device)


def gather_round(local: RolloutGroups | None, prompts: list[Prompt], n: int, groups: ParallelGroups, *,
                 device: torch.device | str = "cpu") -> RolloutGroups:
    """The whole round from each rollout group's `local` samples of its chunk of `prompts` (None:
    an empty chunk): the statistics table all-gathered among the rollout peers (collective)."""
    size = groups.rollout_group_size
    num_engines = dist.get_world_size() // size
    bounds = chunk_bounds(len(prompts), num_engines)
    start = bounds[dist.get_rank() // size][0]
    table = torch.zeros(max(e - s for s, e in bounds) * n, _COLUMNS, dtype=torch.float64)
    if local is not None:
        table[: len(local) * n] = _stats_table(local)
    gathered = [torch.empty_like(table, device=device) for _ in range(num_engines)]
    dist.all_gather(gathered, table.to(device), group=groups.rollout_peers)
    rows = torch.cat([t[: (e - s) * n].cpu() for t, (s, e) in zip(gathered, bounds)])
    return _round_groups(prompts, rows, local, start, n, bounds)


def _stats_table(rollouts: RolloutGroups) -> torch.Tensor:
    eos = torch.tensor([r == "eos" for r in rollouts.finish_reasons], dtype=torch.float64)
    layout = rollouts.routing
    routing = [0, 0, 0, 0] if layout is None else [layout.layers, layout.topk, layout.dtype.itemsize, layout.prompt]
    routing_B4 = torch.tensor(routing, dtype=torch.float64).expand(len(rollouts.finish_reasons), 4)
    masks = rollouts.response_masks or [None] * len(rollouts.finish_reasons)
    masked_B1 = torch.tensor([[m is not None] for m in masks], dtype=torch.float64)
    return torch.cat([torch.stack([rollouts.lengths_B.double(), eos, rollouts.scores_GN.reshape(-1).double(),
                                   rollouts.acc_GN.reshape(-1).double(), rollouts.rewards_GN.reshape(-1).double()],
                                  dim=1), routing_B4, masked_B1], dim=1)


def _routing_layout(rows: torch.Tensor) -> RoutingLayout | None:
    """The round's routing layout from its table (every engine records alike; None: no routing)."""
    recorded = rows[rows[:, 7] > 0, 5:9]
    if len(recorded) == 0:
        return None
    layers, topk, size, prompt = (int(v) for v in recorded[0].tolist())
    assert (recorded == recorded[0]).all(), "rollout engines recorded MoE routing of different layouts"
    return RoutingLayout(layers=layers, topk=topk, dtype=_INDEX_DTYPES[size], prompt=bool(prompt))


def _round_groups(prompts: list[Prompt], rows: torch.Tensor, local: RolloutGroups | None, start: int, n: int,
                  bounds: list[tuple[int, int]]) -> RolloutGroups:
    """The whole round from its gathered table, with this rank's own samples filled in."""
    num_rows = len(prompts) * n
    layout = _routing_layout(rows)

    def spread(field: str) -> list:
        """The field over the whole round: this rank's samples, None for the others'."""
        out: list = [None] * num_rows
        mine = None if local is None else getattr(local, field)
        if mine is not None:
            out[start * n: start * n + len(mine)] = mine
        return out

    routed = None if layout is None else spread("routed_experts")
    prompt_routed = spread("prompt_routed_experts") if layout is not None and layout.prompt else None
    masks = spread("response_masks") if bool((rows[:, 9] > 0).any()) else None
    lengths, eos, scores, acc, rewards = rows[:, :5].unbind(1)
    source_G = torch.cat([torch.full((e - s,), k, dtype=torch.int64) for k, (s, e) in enumerate(bounds)])
    return RolloutGroups(prompts=list(prompts), response_ids=spread("response_ids"),
                         logprobs=spread("logprobs"),
                         finish_reasons=["eos" if e else "length" for e in eos.tolist()],
                         scores_GN=scores.float().reshape(-1, n), rewards_GN=rewards.float().reshape(-1, n),
                         acc_GN=acc.float().reshape(-1, n), lengths_B=lengths.long(), source_G=source_G,
                         routed_experts=routed, prompt_routed_experts=prompt_routed, routing=layout,
                         response_masks=masks)


def share_of_replica(batch: RolloutGroups, groups: ParallelGroups, *,
                     device: torch.device | str = "cpu") -> RolloutGroups:
    """This rank's data-parallel replica's contiguous share of the step's `batch` (the same on
    every rank), with every sample's tokens and log-probs, and routed experts where recorded
    (collective over the world)."""
    per_replica = len(batch) // groups.dp_size
    assert per_replica * groups.dp_size == len(batch), (len(batch), groups.dp_size)
    share = batch.select(list(range(groups.dp_rank * per_replica, (groups.dp_rank + 1) * per_replica)))
    sends, receives = _transfer_plan(batch, groups, per_replica)
    n, ops, inbox = batch.n, [], {}
    routed, segments = batch.routing is not None, 2 if batch.response_masks is None else 3
    for dst, group_idx in sends.items():
        ops.append(dist.P2POp(dist.isend, _pack(batch, group_idx).to(device), dst))
        if routed:
            ops.append(dist.P2POp(dist.isend, _pack_routing(batch, group_idx).to(device), dst))
    for src, group_idx in receives.items():
        rows = [g * n + j for g in group_idx for j in range(n)]
        buffers = [torch.empty(segments * int(batch.lengths_B[rows].sum()), device=device)]
        if routed:
            buffers.append(torch.empty(_routing_bytes(batch, group_idx), dtype=torch.uint8, device=device))
        inbox[src] = (group_idx, buffers)
        ops.extend(dist.P2POp(dist.irecv, buffer, src) for buffer in buffers)
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    first = groups.dp_rank * per_replica
    for group_idx, buffers in inbox.values():
        _unpack(share, [g - first for g in group_idx], buffers[0].cpu())
        if routed:
            _unpack_routing(share, [g - first for g in group_idx], buffers[1].cpu())
    missing = [i for i, r in enumerate(share.response_ids) if r is None]
    if routed:
        missing += [i for i, r in enumerate(share.routed_experts) if r is None]
    assert not missing, f"samples {missing[:5]} of this replica's share never arrived"
    return share


def _transfer_plan(batch: RolloutGroups, groups: ParallelGroups, per_replica: int
                   ) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """(destination rank -> batch groups this rank sends it, source rank -> groups it receives),
    every list in batch order; every rank derives the same plan from the same batch."""
    size, me = groups.rollout_group_size, dist.get_rank()
    sends: dict[int, list[int]] = defaultdict(list)
    receives: dict[int, list[int]] = defaultdict(list)
    source_G = batch.source_G.tolist()
    for rank, dp_rank in enumerate(groups.dp_ranks):
        for g in range(dp_rank * per_replica, (dp_rank + 1) * per_replica):
            if source_G[g] == rank // size:
                continue  # generated by the receiver's own rollout group: already there
            sender = source_G[g] * size + rank % size
            if sender == me:
                sends[rank].append(g)
            if rank == me:
                receives[sender].append(g)
    return sends, receives


def _pack(batch: RolloutGroups, group_idx: list[int]) -> torch.Tensor:
    """Token ids then log-probs of the groups' samples, float32, in row order; then their response
    masks when the batch has multi-turn samples (1 for every token of a sample without one)."""
    rows = [g * batch.n + j for g in group_idx for j in range(batch.n)]
    ids = [t for r in rows for t in batch.response_ids[r]]
    if ids and max(ids) >= _EXACT_IDS:
        raise ValueError(f"token id {max(ids)} is too large to travel as float32 (vocabularies up to {_EXACT_IDS})")
    logprobs = [batch.logprobs[r].float() for r in rows]
    segments = [torch.tensor(ids, dtype=torch.float32), *logprobs]
    if batch.response_masks is not None:
        masks = [batch.response_masks[r] or [1] * len(batch.response_ids[r]) for r in rows]
        segments.append(torch.tensor([m for mask in masks for m in mask], dtype=torch.float32))
    return torch.cat(segments)


def _unpack(share: RolloutGroups, group_idx: list[int], buffer: torch.Tensor) -> None:
    """Fill the share's samples of `group_idx` (share indices) from a `_pack`ed buffer."""
    rows = [g * share.n + j for g in group_idx for j in range(share.n)]
    lengths = share.lengths_B[rows].tolist()
    ids, logprobs, *masks = buffer.split(sum(lengths))
    for row, row_ids, row_logprobs in zip(rows, ids.split(lengths), logprobs.split(lengths)):
        share.response_ids[row] = [int(t) for t in row_ids.tolist()]
        share.logprobs[row] = row_logprobs.clone()
    if masks:
        for row, row_mask in zip(rows, masks[0].split(lengths)):
            share.response_masks[row] = [int(m) for m in row_mask.tolist()]


def _routing_rows(batch: RolloutGroups, group_idx: list[int]) -> list[tuple[int, int, int]]:
    """(row, response tokens, prompt rows recorded) of the groups' samples, in row order."""
    prompt = batch.routing.prompt
    return [(g * batch.n + j, int(batch.lengths_B[g * batch.n + j]), len(batch.prompts[g].ids) - 1 if prompt else 0)
            for g in group_idx for j in range(batch.n)]


def _routing_bytes(batch: RolloutGroups, group_idx: list[int]) -> int:
    layout = batch.routing
    tokens = sum(length + prompt_rows for _, length, prompt_rows in _routing_rows(batch, group_idx))
    return tokens * layout.layers * layout.topk * layout.dtype.itemsize


def _pack_routing(batch: RolloutGroups, group_idx: list[int]) -> torch.Tensor:
    """The groups' recorded routing as raw bytes: per sample its response rows, then its prompt rows."""
    parts = []
    for row, _, _ in _routing_rows(batch, group_idx):
        parts.append(batch.routed_experts[row])
        if batch.routing.prompt:
            parts.append(batch.prompt_routed_experts[row])
    flat = [p.contiguous().reshape(-1).view(torch.uint8) for p in parts]
    return torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)


def _unpack_routing(share: RolloutGroups, group_idx: list[int], buffer: torch.Tensor) -> None:
    """Fill the share's routed experts of `group_idx` (share indices) from a `_pack_routing` buffer."""
    layout = share.routing
    per_token = layout.layers * layout.topk * layout.dtype.itemsize
    offset = 0
    for row, length, prompt_rows in _routing_rows(share, group_idx):
        for field, tokens in (("routed_experts", length), ("prompt_routed_experts", prompt_rows)):
            if field == "prompt_routed_experts" and not layout.prompt:
                continue
            chunk = buffer[offset: offset + tokens * per_token].clone()
            getattr(share, field)[row] = chunk.view(layout.dtype).reshape(tokens, layout.layers, layout.topk)
            offset += tokens * per_token
    assert offset == buffer.numel(), (offset, buffer.numel())
