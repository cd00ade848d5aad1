"""`compute_rollout_correction`: the public entry point of the correction (its contract: docs/api.md)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import RolloutCorrectionConfig
from .context import LOG_RATIO_BOUND, Context, Counts, finite
from .offpolicy import OffPolicyMetrics
from .rejection import Rejection, Veto
from .reduce import Partials
from .segments import Segments
from .validate import check_layout, check_values
from .weights import ImportanceWeights

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
    if not isinstance(config, RolloutCorrectionConfig):
        raise ValueError(f"config must be a RolloutCorrectionConfig, got {type(config).__name__}")
    check_layout(old_log_prob, rollout_log_prob, response_mask, cu_seqlens)
    if check_inputs:
        check_values(old_log_prob, rollout_log_prob, response_mask, cu_seqlens)

    weights = ImportanceWeights(config) if config.rollout_is is not None else None
    rejection = Rejection(config) if config.rejection_rules else None
    veto = Veto(config.rollout_token_veto_threshold)
    families = [Counts(), OffPolicyMetrics(), veto]
    families += [f for f in (weights, rejection) if f is not None]

    is_weights = torch.empty_like(response_mask, dtype=torch.float32) if weights is not None else None
    # Without a rule that can reject, the padded output mask is the input mask: nothing to write.
    # (The packed one still drops the tokens after cu_seqlens[-1].)
    can_reject = rejection is not None or veto.log_threshold is not None or cu_seqlens is not None
    keep = torch.empty_like(response_mask, dtype=torch.float32) if can_reject else None
    row_partials, seg = [], None
    for rows in _row_blocks(response_mask, cu_seqlens):
        # The block's float mask is written straight into the output mask's rows.
        tok = _context(old_log_prob, rollout_log_prob, response_mask, cu_seqlens, rows,
                       mask_out=keep[rows] if keep is not None else None)
        for family in families:
            family.rows_phase(tok)
        row_partials.append(tok.rows)
        if is_weights is not None:
            weights.token_part(tok, out=is_weights[rows])
        if rejection is not None:
            keep[rows] = rejection.token_keep(tok)
        seg = tok.seg

    if len(row_partials) > 1:
        seg = Segments.padded(response_mask.shape[0])
    ctx = Context(seg, None, None, None, rows=Partials.concat_rows(row_partials))
    ctx.rows.all_reduce(cp_group)
    for family in families:
        family.batch_phase(ctx)
    ctx.totals.all_reduce(dp_group)
    metrics: dict[str, torch.Tensor] = {}
    for family in families[1:]:
        metrics.update(family.metrics(ctx))

    if is_weights is not None:
        weights.finish_(is_weights, ctx)
    keep_row = _sequence_decisions(rejection, veto)
    if keep_row is not None:
        keep.mul_(seg.to_tokens(keep_row.float()))
    if keep is None:
        out_mask = response_mask
    else:
        out_mask = keep != 0 if response_mask.dtype == torch.bool else keep.to(response_mask.dtype)
    return CorrectionResult(
        is_weights=is_weights,
        response_mask=out_mask,
        metrics=_float32_metrics(metrics),
    )


def _float32_metrics(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """"rollout_corr/<name>" -> 0-d float32, converted in one op rather than one per metric
    (each op is a kernel launch on a GPU)."""
    if not metrics:
        return {}
    values = torch.stack([value.to(torch.float64) for value in metrics.values()]).float()
    return {METRIC_PREFIX + name: value for name, value in zip(metrics, values.unbind())}


def _sequence_decisions(rejection: Rejection | None, veto: Veto) -> torch.Tensor | None:
    """bool [rows]: sequences kept by the sequence-level rules and the veto (None: no such rule)."""
    decisions = []
    if rejection is not None and rejection.row_rules:
        decisions.append(rejection.keep_row)
    if veto.log_threshold is not None:
        decisions.append(veto.keep_row)
    if not decisions:
        return None
    return decisions[0] if len(decisions) == 1 else decisions[0] & decisions[1]


def _row_blocks(response_mask: torch.Tensor, cu_seqlens: torch.Tensor | None) -> list[slice]:
    """Blocks of rows for the token phases. On a CPU the padded layout is processed a few hundred
    thousand tokens at a time: the temporaries then stay in cache and are reused by the allocator
    instead of being page-faulted in afresh for every op, which roughly halves the time.
    GPUs, and the packed layout, take the batch in one block."""
    if cu_seqlens is not None or response_mask.device.type != "cpu" or response_mask.dim() != 2:
        return [slice(None)]
    num_rows, row_len = response_mask.shape
    rows_per_block = max(1, CPU_BLOCK_TOKENS // max(row_len, 1))
    if rows_per_block >= num_rows:
        return [slice(None)]
    return [slice(r, min(r + rows_per_block, num_rows)) for r in range(0, num_rows, rows_per_block)]


def _context(old_log_prob, rollout_log_prob, response_mask, cu_seqlens, rows: slice,
             mask_out: torch.Tensor | None) -> Context:
    """The block's token tensors. `mask_out`: where to write the float mask (None: anywhere; a
    float32 0/1 input mask is then used as it is, read-only)."""
    old_log_prob, rollout_log_prob, response_mask = old_log_prob[rows], rollout_log_prob[rows], response_mask[rows]
    if mask_out is None and response_mask.dtype == torch.float32:
        mask = response_mask
    else:
        mask_out = torch.empty_like(response_mask, dtype=torch.float32) if mask_out is None else mask_out
        mask = torch.ne(response_mask, 0, out=mask_out)
    if cu_seqlens is None:
        seg = Segments.padded(mask.shape[0])
    else:
        seg = Segments.packed(cu_seqlens, mask.numel(), mask.device)
        # Tokens after cu_seqlens[-1] belong to no sequence: they never count.
        mask = mask.mul_(seg.row_of_token < seg.num_rows)  # mask_out: the packed layout always has one
    log_ratio = finite(old_log_prob.detach().float() - rollout_log_prob.detach().float(), inplace=True).mul_(mask)
    return Context(seg=seg, mask=mask, log_ratio=log_ratio,
                   clamped=log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND),
                   rollout_log_prob=rollout_log_prob.detach())
