"""The training batch of one data-parallel rank: built from rollouts, sliced into mini-batches, and
shared with the other ranks of its model-parallel group.

Layout (right padding with PAD = 0): row i holds prompt_i + response_i; position t predicts
tokens[t + 1] (`targets_BT`), so the response occupies positions [len(prompt) - 1, len(seq) - 2].
Rollout log-probs that are non-finite or positive (a rollout engine's bug or overflow) are taken
out of the response mask before anything else sees them (SPEC section 6); their count is
returned so the trainer can report `rollout_corr/invalid_rollout_token_fraction`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..parallel.groups import ParallelGroups
from .sampling import RolloutGroups
from ..training.step import StepBatch

_FIELDS = tuple(f.name for f in dataclasses.fields(StepBatch))
_DTYPES = {"tokens_BT": torch.int64, "targets_BT": torch.int64}  # the rest float32


def build_step_batch(groups: RolloutGroups, advantages_B: torch.Tensor, *,
                     pad_multiple: int = 1) -> tuple[StepBatch, torch.Tensor]:
    """(StepBatch, number of response tokens masked as invalid) for the rollout groups.

    advantages_B: one advantage per sequence (flat g * n + j order), spread over its response
    tokens. The width T is the longest sequence rounded up to `pad_multiple`. Filler groups
    (dynamic sampling's) get an empty response mask: no advantage, and no place in any
    normaliser, mean or metric downstream; their invalid tokens are not counted either.
    """
    tokens_BT, targets_BT, response_BT, rollout_lp_BT = padded_sequences(
        groups.prompt_ids(), groups.response_ids, groups.logprobs, pad_multiple=pad_multiple)
    filler_B = groups.filler_G.repeat_interleave(groups.n)
    response_BT &= ~filler_B[:, None]
    invalid_BT = response_BT & (~torch.isfinite(rollout_lp_BT) | (rollout_lp_BT > 0))
    mask_BT = response_BT & ~invalid_BT
    batch = StepBatch(
        tokens_BT=tokens_BT,
        targets_BT=targets_BT,
        response_mask_BT=mask_BT.float(),
        rollout_log_probs_BT=torch.where(mask_BT, rollout_lp_BT, torch.zeros_like(rollout_lp_BT)),
        advantages_BT=advantages_B.float()[:, None] * mask_BT.float(),
    )
    return batch, invalid_BT.sum()


def padded_sequences(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                     logprobs: Sequence[torch.Tensor | Sequence[float]] | None = None, *, pad_multiple: int = 1
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens_BT, targets_BT, response_BT bool, log-probs_BT float32) of prompt + response rows,
    right-padded with PAD = 0 to the longest row rounded up to `pad_multiple` (module docstring);
    `logprobs` gives one value per response token (zeros when None)."""
    num_seqs = len(prompt_ids)
    longest = max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids))
    width = -(-longest // pad_multiple) * pad_multiple
    tokens_BT = torch.zeros(num_seqs, width, dtype=torch.int64)
    logprobs_BT = torch.zeros(num_seqs, width, dtype=torch.float32)
    response_BT = torch.zeros(num_seqs, width, dtype=torch.bool)
    for i, (prompt, response) in enumerate(zip(prompt_ids, response_ids)):
        if not prompt:
            raise ValueError(f"sequence {i} has an empty prompt; prompts need at least one token (BOS)")
        start, length = len(prompt) - 1, len(response)
        tokens_BT[i, : len(prompt) + length] = torch.tensor(list(prompt) + list(response), dtype=torch.int64)
        if logprobs is not None:
            logprobs_BT[i, start:start + length] = torch.as_tensor(logprobs[i], dtype=torch.float32)
        response_BT[i, start:start + length] = True
    targets_BT = torch.zeros_like(tokens_BT)
    targets_BT[:, :-1] = tokens_BT[:, 1:]
    return tokens_BT, targets_BT, response_BT, logprobs_BT


def slice_batch(batch: StepBatch, start: int, end: int) -> StepBatch:
    """Rows [start, end) of every field."""
    return StepBatch(**{name: getattr(batch, name)[start:end] for name in _FIELDS})


def is_rollout_source(groups: ParallelGroups) -> bool:
    """The rank that generates for its data-parallel replica: TP, CP and PP rank 0."""
    return groups.tp_rank == 0 and groups.cp_rank == 0 and groups.pp_rank == 0


def share_in_model_parallel(batch: StepBatch | None, per_sequence: torch.Tensor | None, extras: torch.Tensor | None,
                            groups: ParallelGroups, *, num_columns: int, num_extras: int,
                            device: torch.device | str = "cpu") -> tuple[StepBatch, torch.Tensor, torch.Tensor]:
    """Send the source rank's batch, a float64 [B, num_columns] table of per-sequence values and a
    float64 vector of `num_extras` values to every rank of its model-parallel group (all TP, CP
    and PP ranks of the same data-parallel rank).

    Broadcasts along PP, then CP, then TP, each from the group's rank 0; a rank joins a stage only
    when that stage's source already holds the data, so no group ever broadcasts garbage.
    """
    source = is_rollout_source(groups)
    if source:
        header = torch.tensor(batch.tokens_BT.shape, dtype=torch.int64, device=device)
        tensors = [getattr(batch, name).to(device) for name in _FIELDS]
        tensors += [per_sequence.to(device, torch.float64), extras.to(device, torch.float64)]
    for group, joins in ((groups.pp, groups.tp_rank == 0 and groups.cp_rank == 0),
                         (groups.cp, groups.tp_rank == 0), (groups.tp, True)):
        if dist.get_world_size(group) == 1 or not joins:
            continue
        if not source:
            header = torch.empty(2, dtype=torch.int64, device=device)
        root = dist.get_global_rank(group, 0)
        dist.broadcast(header, root, group=group)
        if not source:
            shape = tuple(header.tolist())
            tensors = [torch.empty(shape, dtype=_DTYPES.get(name, torch.float32), device=device) for name in _FIELDS]
            tensors.append(torch.empty(shape[0], num_columns, dtype=torch.float64, device=device))
            tensors.append(torch.empty(num_extras, dtype=torch.float64, device=device))
        for tensor in tensors:
            dist.broadcast(tensor, root, group=group)
        source = True  # holders are always their later groups' rank 0
    return StepBatch(**dict(zip(_FIELDS, tensors[:-2]))), tensors[-2], tensors[-1]
