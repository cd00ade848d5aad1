"""The metrics of one update (train_minibatch), reduced once over CP x DP on the last pipeline stage
(last_stage_metrics), and any stage's metrics sent to the others (broadcast_from_last_stage).

Conventions: the loss's terms come as each micro-batch's share (summed over micro-batches and ranks
they give the mini-batch's term); token-averaged metrics as (sum, count) partials
(losses.reduce_metric_partials); the correction's metrics as one dict per correction call (their
mean). `batch/padding_fraction` is tokens computed / tokens the sequences need - 1. All 0-d tensors.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .losses import reduce_metric_partials
from .microbatches import MicroBatchPlan

if TYPE_CHECKING:
    from ..parallel.groups import ParallelGroups


def last_stage_metrics(terms, partials, corr_metrics, plan: MicroBatchPlan, groups: ParallelGroups, cp_group,
                       dp_group) -> dict[str, torch.Tensor]:
    """The update's actor/* terms and metrics, batch/padding_fraction and the correction's metrics."""
    # Each micro-batch's term is this rank's share of the mini-batch's: their sum over ranks is it.
    names = sorted({name for micro in terms for name in micro})
    totals = [torch.stack([micro[n] for micro in terms if n in micro]).sum().double() for n in names]
    # The padding statistics: every CP rank holds the whole count, hence the / cp before the sum.
    device = totals[0].device
    tokens = torch.stack([torch.tensor(float(plan.computed_tokens), device=device),
                          plan.real_tokens.to(device, torch.float64)]) / groups.cp_size
    totals = torch.cat([torch.stack(totals), tokens.double()])
    if groups.dp_cp_size > 1:
        dist.all_reduce(totals, group=groups.dp_cp)
    metrics = {f"actor/{name}": totals[i].float() for i, name in enumerate(names)}
    metrics["batch/padding_fraction"] = (totals[-2] / totals[-1] - 1).float()
    metrics.update({f"actor/{name}": value
                    for name, value in reduce_metric_partials(partials, cp_group=cp_group, dp_group=dp_group).items()})
    names = sorted({name for m in corr_metrics for name in m})
    for name in names:
        metrics[name] = torch.stack([m[name].float() for m in corr_metrics]).mean()
    return metrics


def broadcast_from_last_stage(metrics: dict[str, torch.Tensor], groups: ParallelGroups,
                              device: torch.device) -> dict[str, torch.Tensor]:
    """The last stage's metrics on every pipeline stage (names as objects, values in one tensor)."""
    if groups.pp_size == 1:
        return metrics
    src = dist.get_global_rank(groups.pp, groups.pp_size - 1)
    names = [sorted(metrics)]
    dist.broadcast_object_list(names, src=src, group=groups.pp, device=device)
    if groups.is_pipeline_last_stage():
        values = torch.stack([metrics[n].float().to(device) for n in names[0]]) if names[0] else None
    else:
        values = torch.empty(len(names[0]), dtype=torch.float32, device=device)
    if values is None:
        return {}
    dist.broadcast(values, src=src, group=groups.pp)
    return {name: values[i] for i, name in enumerate(names[0])}
