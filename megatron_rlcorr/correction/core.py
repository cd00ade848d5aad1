"""`compute_rollout_correction`: the public entry point of the correction (its contract: docs/api.md).

A call runs the configuration's compiled plan (`plan.py`) in three phases:
  1. token -> sequence: the token phase fills one float64 buffer of per-token quantities and
     reduces it per sequence in one product (`tokens.py`); under CP the per-sequence statistics
     are all-reduced over `cp_group` (one SUM, one MAX), so every CP rank sees whole sequences;
  2. sequence -> batch: every per-sequence series and decision in one chain (`rows.py`); the
     batch maxima are all-reduced over `dp_group` (MAX) and then the batch sums (SUM);
  3. the metrics from the batch totals in one chain (`metrics.py`), then the outputs.
On a GPU one call launches a few dozen kernels whatever the configuration's metric count
(`tools/bench_correction.py --count-ops`) and never synchronises with the host.
`run_plan` is those phases on checked inputs; `compiled.py` runs the same function under
`torch.compile` (an option of the trainer, `algorithm.correction_compile`); this eager call is
the reference and the default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..config import RolloutCorrectionConfig
from .plan import Plan, plan_for
from .rejection import REJECTED
from .segments import Segments
from .validate import check_layout, check_values

METRIC_PREFIX = "rollout_corr/"
CPU_BLOCK_TOKENS = 1 << 18


@dataclass
class CorrectionResult:
    is_weights: torch.Tensor | None    # float32, like old_log_prob; None when rollout_is is None
    response_mask: torch.Tensor        # the input mask with rejected tokens removed; same dtype (the
                                       # input tensor itself when no rule can reject, padded layout)
    metrics: dict[str, torch.Tensor]   # "rollout_corr/<name>" -> 0-d float32 tensor, equal on all ranks


def compute_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    cu_seqlens: torch.Tensor | None = None,
    cp_group: dist.ProcessGroup | None = None,
    dp_group: dist.ProcessGroup | None = None,
    check_inputs: bool = True,
) -> CorrectionResult:
    """IS weights, rejection mask and metrics for this rank's shard of the batch.

    Layouts: padded `[B, T]` (rows are sequences) or packed `[N]` with `cu_seqlens` `[S+1]`.
    Under context parallelism each CP rank passes its part of every sequence (same sequences, same
    order); per-sequence statistics are all-reduced over `cp_group` before any decision. Batch
    statistics (metrics, batch normalisation) are reduced over `dp_group`. With
    `check_inputs=False` the call never synchronises with the host.
    """
    plan = checked_plan(old_log_prob, rollout_log_prob, response_mask, config, cu_seqlens, check_inputs)
    weights, keep, metrics = run_plan(plan, old_log_prob, rollout_log_prob, response_mask, cu_seqlens,
                                      cp_group, dp_group)
    return as_result(response_mask, weights, keep, metrics)


def checked_plan(old_log_prob, rollout_log_prob, response_mask, config: RolloutCorrectionConfig,
                 cu_seqlens: torch.Tensor | None, check_inputs: bool) -> Plan:
    """The call's checks, then the configuration's plan with its constants on the inputs' device."""
    if not isinstance(config, RolloutCorrectionConfig):
        raise ValueError(f"config must be a RolloutCorrectionConfig, got {type(config).__name__}")
    check_layout(old_log_prob, rollout_log_prob, response_mask, cu_seqlens)
    if check_inputs:
        check_values(old_log_prob, rollout_log_prob, response_mask, cu_seqlens)
    plan = plan_for(config)
    plan.prepare(old_log_prob.device, response_mask.dtype)
    return plan


def run_plan(plan: Plan, old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
             cu_seqlens: torch.Tensor | None, cp_group: dist.ProcessGroup | None, dp_group: dist.ProcessGroup | None,
             all_reduce: Callable[..., None] | None = None, one_block: bool = False
             ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]:
    """The three phases on checked inputs: (weights or None, the output mask or None for the input
    one, {metric name: 0-d float32}). `all_reduce(tensor, op, group)` runs the collectives
    (`_all_reduce` by default); `one_block` takes the token phase in one block on a CPU too."""
    reduce = _all_reduce if all_reduce is None else all_reduce
    device = old_log_prob.device
    old, rollout = old_log_prob.detach().float(), rollout_log_prob.detach().float()
    seg = (Segments.padded(old.shape[0]) if cu_seqlens is None
           else Segments.packed(cu_seqlens, old.numel(), device))
    weights = torch.empty_like(old) if plan.weights is not None else None
    # Without a rule that can reject, the padded output mask is the input mask: nothing to write.
    # (The packed one still drops the tokens after cu_seqlens[-1].)
    keep = torch.empty_like(response_mask) if plan.rejects or cu_seqlens is not None else None
    stats = torch.empty(len(plan.tokens.stat_names), seg.num_rows, dtype=torch.float64, device=device)
    blocks = [(slice(None), old.shape[0])] if one_block else _row_blocks(response_mask, cu_seqlens)
    _token_phase(plan, old, rollout, response_mask, seg, stats, weights, keep, blocks)
    reduce(stats[:plan.tokens.num_sums], dist.ReduceOp.SUM, cp_group)
    reduce(stats[plan.tokens.num_sums:], dist.ReduceOp.MAX, cp_group)
    zbuf, series = plan.rows.run(stats, lambda t: reduce(t, dist.ReduceOp.MAX, dp_group),
                                 lambda t: reduce(t, dist.ReduceOp.SUM, dp_group))
    values, metrics = plan.metrics.run(zbuf)
    if weights is not None:
        _finish_weights(plan, weights, values, series, seg)
    if plan.sequence_rejects:
        torch.gt(keep, seg.to_tokens(plan.rows.any_row(series, REJECTED)), out=keep)
    return weights, keep, metrics


def as_result(response_mask: torch.Tensor, weights: torch.Tensor | None, keep: torch.Tensor | None,
              metrics: dict[str, torch.Tensor]) -> CorrectionResult:
    return CorrectionResult(
        is_weights=weights,
        response_mask=response_mask if keep is None else keep,
        metrics={METRIC_PREFIX + name: value for name, value in metrics.items()},
    )


def _token_phase(plan: Plan, old, rollout, response_mask, seg: Segments, stats, weights, keep,
                 blocks: list[tuple[slice, int]]) -> None:
    """Phase 1 over blocks of rows (each a slice and its size); also writes what the outputs need
    of each block: the token IS weights, or the mask (the tokens the token rules keep) for the
    later sequence factors."""
    tp, num_sums = plan.tokens, plan.tokens.num_sums
    sizes = [size for _, size in blocks]
    if not seg.is_packed and not max(sizes):
        return
    shape = old.shape if seg.is_packed else (max(sizes), old.shape[1])
    buffers = tp.new_buffers(old, tuple(shape))
    m = tp.at("m")
    kept = tp.at("kept") if plan.token_rules else m
    for rows, size in blocks:
        basis, max_values = (x if x is None or seg.is_packed else x[:, :size] for x in buffers)
        tp.fill(old[rows], rollout[rows], response_mask[rows], basis, seg)
        seg.row_sums(basis, basis[m], stats[:num_sums, rows])
        maxima = tp.maxima(basis, max_values)
        seg.row_maxes(maxima, stats[num_sums:, rows])
        if keep is not None:
            keep[rows].copy_(basis[kept])
        if weights is None:
            continue
        if plan.weights.level == "token":
            plan.weights.token_weights(basis[tp.at("rho")], maxima[2] if tp.pairs else None, basis[m], weights[rows])
        else:
            weights[rows].copy_(basis[m])


def _finish_weights(plan: Plan, weights, values, series, seg: Segments) -> None:
    factor, inverse, iw = plan.factor_index(), plan.inverse_index(), plan.weights
    row = None if iw.weight_row is None else plan.rows.z_row(series, iw.weight_row)
    iw.finish(weights, None if factor is None else values[factor], None if inverse is None else values[inverse],
              row, seg.to_tokens)


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    """In place over `group` (nothing for None or a group of one, or an empty tensor)."""
    if group is None or dist.get_world_size(group) == 1 or tensor.numel() == 0:
        return
    if tensor.is_contiguous():
        dist.all_reduce(tensor, op=op, group=group)
    else:
        buffer = tensor.contiguous()
        dist.all_reduce(buffer, op=op, group=group)
        tensor.copy_(buffer)


def _row_blocks(response_mask: torch.Tensor, cu_seqlens: torch.Tensor | None) -> list[tuple[slice, int]]:
    """Blocks of rows for the token phase, with their sizes. On a CPU the padded layout is
    processed a few hundred thousand tokens at a time: the buffers then stay in cache and are
    reused for every block instead of being page-faulted in afresh. GPUs, and the packed layout,
    take the batch in one block."""
    whole = [(slice(None), response_mask.shape[0])]
    if cu_seqlens is not None or response_mask.device.type != "cpu" or response_mask.dim() != 2:
        return whole
    num_rows, row_len = response_mask.shape
    rows_per_block = max(1, CPU_BLOCK_TOKENS // max(row_len, 1))
    if rows_per_block >= num_rows:
        return whole
    return [(slice(r, min(r + rows_per_block, num_rows)), min(rows_per_block, num_rows - r))
            for r in range(0, num_rows, rows_per_block)]
