"""A mini-batch cut into this rank's micro-batches: the plan (microbatches.py: padded rows of
micro_batch_size, or sequences packed up to a token budget per rank, each padded for the zigzag CP
split, sequence parallelism and FP8) and every per-token tensor split by it (LocalBatch).

Why a separate step: the training step (step.py) and the forward-only passes (old_pass.py) cut the
same way, except that training needs as many micro-batches on every DP rank (DDP's all-reduce and
bypass mode's per-micro-batch collectives run in lockstep), and under expert parallelism across
replicas every forward does (experts_span_replicas). Memory: the split tensors are views or copies
of the mini-batch's, O(tokens of this rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .microbatches import MicroBatchPlan, PackingRules, plan_packed, plan_padded, sequence_lengths, sequence_multiple
from .step_types import StepBatch, check_batch

if TYPE_CHECKING:
    from ..parallel.groups import ParallelGroups


@dataclass
class LocalBatch:
    """A mini-batch cut into this rank's micro-batches (microbatches.py): one tensor per
    micro-batch per field, `[b, T_pad / cp]` (padded) or `[n_local]` (packed)."""
    plan: MicroBatchPlan
    tokens: list[torch.Tensor]
    targets: list[torch.Tensor]
    mask: list[torch.Tensor]
    rollout: list[torch.Tensor]
    advantages: list[torch.Tensor]

    def cu_seqlens(self, mb: int) -> torch.Tensor | None:
        return self.plan.micro_batches[mb].cu_seqlens_local


def plan_micro_batches(batch: StepBatch, model_chunks: list[Any], groups: ParallelGroups, *, micro_batch_size: int,
                       max_tokens: int, same_count_over_dp: bool) -> MicroBatchPlan:
    """Padded micro-batches of `micro_batch_size` rows, or packed ones of `max_tokens` tokens per
    rank, as many on every DP rank with `same_count_over_dp` (training: DDP's gradient all-reduce
    and the per-micro-batch collectives of bypass mode run in lockstep; a forward-only pass needs
    no agreement, except under expert parallelism: experts_span_replicas)."""
    config, device = model_chunks[0].config, model_device(model_chunks)
    lengths = sequence_lengths(batch.response_mask_BT.to(device, non_blocking=True))
    multiple = sequence_multiple(config)
    cp_group = group_or_none(groups.cp, groups.cp_size)
    dp_group = group_or_none(groups.dp, groups.dp_size)
    width = batch.tokens_BT.shape[1]
    lockstep = experts_span_replicas(config, groups)
    same_shapes = lockstep and config.moe_token_dispatcher_type == "allgather"
    if not max_tokens:
        if lockstep:
            width = agreed_width(width, batch.tokens_BT.shape[0], dp_group, device)
        return plan_padded(lengths, width, micro_batch_size=micro_batch_size, multiple=multiple,
                           cp_size=groups.cp_size, cp_rank=groups.cp_rank, cp_group=cp_group, device=device)
    rules = PackingRules(max_tokens, multiple, equal_sizes=groups.pp_size > 1 or same_shapes,
                         bins_multiple=groups.pp_size if groups.vpp_size else 1, equal_sizes_over_dp=same_shapes)
    return plan_packed(lengths, width, rules, cp_size=groups.cp_size, cp_rank=groups.cp_rank, cp_group=cp_group,
                       dp_group=dp_group if same_count_over_dp or lockstep else None, device=device)


def experts_span_replicas(config: Any, groups: ParallelGroups) -> bool:
    """Whether the MoE layers' token dispatcher exchanges tokens between data-parallel replicas
    (parallel.ep * parallel.etp > 1 with dp > 1: an expert group spans replicas). Every forward is
    then a collective over them: each replica runs as many micro-batches, and under the allgather
    dispatcher (which gathers equal-sized token blocks) of one shape."""
    return bool(getattr(config, "num_moe_experts", None)) and groups.ep_size * groups.etp_size > 1 \
        and groups.dp_size > 1


def agreed_width(width: int, rows: int, dp_group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The widest mini-batch of the DP replicas (padded micro-batches of one shape everywhere);
    every replica must hold as many rows (the same number of micro-batches)."""
    if dp_group is None:
        return width
    sizes = torch.tensor([width, rows, -rows], dtype=torch.int64, device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=dp_group)
    assert int(sizes[1]) == -int(sizes[2]), "data-parallel replicas hold mini-batches of different sizes"
    return int(sizes[0])


def cut_batch(batch: StepBatch, plan: MicroBatchPlan) -> LocalBatch:
    """`batch` (checked first) split by `plan`: this rank's part of every micro-batch."""
    check_batch(batch)
    return LocalBatch(plan=plan, tokens=plan.split(batch.tokens_BT), targets=plan.split(batch.targets_BT),
                      mask=plan.split(batch.response_mask_BT.float()),
                      rollout=plan.split(batch.rollout_log_probs_BT.float()),
                      advantages=plan.split(batch.advantages_BT.float()))


def model_device(model_chunks: list[Any]) -> torch.device:
    return next(model_chunks[0].parameters()).device


def group_or_none(group: dist.ProcessGroup, size: int) -> dist.ProcessGroup | None:
    """`group`, or None when it has one rank (the collectives then have nothing to do)."""
    return group if size > 1 else None
