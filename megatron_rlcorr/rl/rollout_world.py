"""Layout-free, all-rank generation: which rank samples which prompts, and how the samples reach the
data-parallel replica that trains on them.

Every rank generates. The world is cut into K = world / R rollout groups of R =
`rollout.tensor_parallel_size` consecutive ranks (vLLM's grouping of torchrun ranks into
tensor-parallel engines; R = 1 for the embedded engine). A generation round's P prompts, the same
list on every rank, are split into K contiguous chunks and group k samples chunk k, prompt i with
the seed derived from (run seed, step, round, i). What a prompt's samples are therefore depends
on neither the training layout nor the number of engines: one process, dp2, tp2, pp2 and cp2
sample identical rollouts.

Two exchanges per step, sized so that nothing of O(tokens) goes to every rank:
1. After each round, a table of 5 float64 per sample (length, EOS, score, acc, reward) is
   all-gathered among `groups.rollout_peers` (the ranks holding the same position in their
   rollout group). Every rank then knows every group's statistics, so DAPO dynamic sampling
   (sampling.dynamic_sample) runs on the step's whole batch, identically everywhere; the tokens
   stay where they were generated.
2. Once the step's batch is chosen, each rank receives the tokens and log-probs of its replica's
   share from the rank that generated them (`share_of_replica`: point-to-point, sizes known from
   the table, 8 bytes per token: ids as float32, exact below 2**24, and float32 log-probs). A
   rank of rollout group k serves the receivers whose position in their own rollout group
   matches its own, which spreads the sending over the group's ranks.
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..data import Prompt, Task
from ..rollout import RolloutConfig, RolloutEngine
from .advantages import OverlongPenalty
from .sampling import RolloutGroups, generate_groups

if TYPE_CHECKING:  # Megatron-Core is imported inside the process groups only (runtime.py)
    from ..parallel.groups import ParallelGroups

_COLUMNS = 5  # length, eos, score, acc, reward
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
    n = rollout.n
    table = torch.zeros(max(e - s for s, e in bounds) * n, _COLUMNS, dtype=torch.float64)
    if local is not None:
        table[: len(local) * n] = _stats_table(local)
    gathered = [torch.empty_like(table, device=device) for _ in range(num_engines)]
    dist.all_gather(gathered, table.to(device), group=groups.rollout_peers)
    rows = torch.cat([t[: (e - s) * n].cpu() for t, (s, e) in zip(gathered, bounds)])
    return _round_groups(prompts, rows, local, start, n, bounds)


def _stats_table(rollouts: RolloutGroups) -> torch.Tensor:
    eos = torch.tensor([r == "eos" for r in rollouts.finish_reasons], dtype=torch.float64)
    return torch.stack([rollouts.lengths_B.double(), eos, rollouts.scores_GN.reshape(-1).double(),
                        rollouts.acc_GN.reshape(-1).double(), rollouts.rewards_GN.reshape(-1).double()], dim=1)


def _round_groups(prompts: list[Prompt], rows: torch.Tensor, local: RolloutGroups | None, start: int, n: int,
                  bounds: list[tuple[int, int]]) -> RolloutGroups:
    """The whole round from its gathered table, with this rank's own samples filled in."""
    num_rows = len(prompts) * n
    response_ids: list[list[int] | None] = [None] * num_rows
    logprobs: list[torch.Tensor | None] = [None] * num_rows
    if local is not None:
        response_ids[start * n: start * n + len(local.response_ids)] = local.response_ids
        logprobs[start * n: start * n + len(local.logprobs)] = local.logprobs
    lengths, eos, scores, acc, rewards = rows.unbind(1)
    source_G = torch.cat([torch.full((e - s,), k, dtype=torch.int64) for k, (s, e) in enumerate(bounds)])
    return RolloutGroups(prompts=list(prompts), response_ids=response_ids, logprobs=logprobs,
                         finish_reasons=["eos" if e else "length" for e in eos.tolist()],
                         scores_GN=scores.float().reshape(-1, n), rewards_GN=rewards.float().reshape(-1, n),
                         acc_GN=acc.float().reshape(-1, n), lengths_B=lengths.long(), source_G=source_G)


def share_of_replica(batch: RolloutGroups, groups: ParallelGroups, *,
                     device: torch.device | str = "cpu") -> RolloutGroups:
    """This rank's data-parallel replica's contiguous share of the step's `batch` (the same on
    every rank), with every sample's tokens and log-probs (collective over the world)."""
    per_replica = len(batch) // groups.dp_size
    assert per_replica * groups.dp_size == len(batch), (len(batch), groups.dp_size)
    share = batch.select(list(range(groups.dp_rank * per_replica, (groups.dp_rank + 1) * per_replica)))
    sends, receives = _transfer_plan(batch, groups, per_replica)
    n, ops, inbox = batch.n, [], {}
    for dst, group_idx in sends.items():
        ops.append(dist.P2POp(dist.isend, _pack(batch, group_idx).to(device), dst))
    for src, group_idx in receives.items():
        rows = [g * n + j for g in group_idx for j in range(n)]
        inbox[src] = (group_idx, torch.empty(2 * int(batch.lengths_B[rows].sum()), device=device))
        ops.append(dist.P2POp(dist.irecv, inbox[src][1], src))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    first = groups.dp_rank * per_replica
    for group_idx, buffer in inbox.values():
        _unpack(share, [g - first for g in group_idx], buffer.cpu())
    missing = [i for i, r in enumerate(share.response_ids) if r is None]
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
    """Token ids then log-probs of the groups' samples, float32, in row order."""
    rows = [g * batch.n + j for g in group_idx for j in range(batch.n)]
    ids = [t for r in rows for t in batch.response_ids[r]]
    if ids and max(ids) >= _EXACT_IDS:
        raise ValueError(f"token id {max(ids)} is too large to travel as float32 (vocabularies up to {_EXACT_IDS})")
    logprobs = [batch.logprobs[r].float() for r in rows]
    return torch.cat([torch.tensor(ids, dtype=torch.float32), *logprobs])


def _unpack(share: RolloutGroups, group_idx: list[int], buffer: torch.Tensor) -> None:
    """Fill the share's samples of `group_idx` (share indices) from a `_pack`ed buffer."""
    rows = [g * share.n + j for g in group_idx for j in range(share.n)]
    lengths = share.lengths_B[rows].tolist()
    ids, logprobs = buffer.split(sum(lengths))
    for row, row_ids, row_logprobs in zip(rows, ids.split(lengths), logprobs.split(lengths)):
        share.response_ids[row] = [int(t) for t in row_ids.tolist()]
        share.logprobs[row] = row_logprobs.clone()
