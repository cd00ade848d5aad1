"""Policy losses for RL with rollout correction: PPO-clip and policy gradient, plus the entropy
bonus and the KL penalty to a reference policy (kl.py).

Every per-token loss is aggregated as a SUM divided by a normaliser of the whole mini-batch
(all micro-batches, all DP and CP ranks), computed once per mini-batch by
`global_loss_normalizers`. The micro-batch losses then add up, over micro-batches and ranks, to
exactly the mini-batch loss, so the gradient does not depend on the micro-batch size or the
parallel layout. (Megatron's schedule divides each micro-batch loss by the number of
micro-batches and DDP averages gradients over DP x CP; the caller undoes both factors.)

Aggregation modes (verl's names), with l the per-token loss and the sums over the mini-batch:
token-mean sum_it l / tokens; seq-mean-token-sum sum_it l / sequences; seq-mean-token-mean
sum_i (sum_t l / tokens_i) / sequences; seq-mean-token-sum-norm (Dr. GRPO) sum_it l /
(sequences x F), F = `loss_scale_factor` (the response length limit by default). "sequences"
counts those with at least one valid token. verl's per-micro-batch `sum / F` for the last mode
scales with the micro-batch size; here it does not. Metrics are another matter:
`aggregate_over_batch` (actor/entropy) is verl's agg_loss over the whole step batch, which for
seq-mean-token-sum-norm is sum / F, with no sequence count.

Rejection is the mask: a rejected token leaves the numerator and the denominator. Values at
masked positions may be garbage (NaN, inf) and never reach the loss, its gradient or a metric.
Importance-sampling weights multiply the per-token loss and are detached.

Layouts: padded `[B, T]` (rows are sequences) or packed `[N]` with `cu_seqlens` `[S+1]` giving
each sequence's span on this rank (under CP: the local spans, `cu_seqlens_padded / cp`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence, get_args

import torch
import torch.distributed as dist

from ..settings import check_choice
from .kl import KLLossSettings, kl_penalty

LossType = Literal["ppo_clip", "policy_gradient"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)

LOG_RATIO_BOUND = 20.0  # exp(+-20) stays finite in float32

MetricPartial = tuple[torch.Tensor, torch.Tensor]  # (sum, count), 0-d device tensors


@dataclass(frozen=True)
class LossConfig:
    """The recipe's `algorithm.loss` (verl's actor settings of the same names and defaults)."""

    loss_type: LossType = "ppo_clip"       # ppo_clip: clipped pi_theta / pi_old ratio; policy_gradient: -A log pi_theta
    clip_ratio: float = 0.2                # the symmetric clip; the default of the two below
    clip_ratio_low: float | None = None    # ratio clipped below at 1 - clip_ratio_low
    clip_ratio_high: float | None = None   # and above at 1 + clip_ratio_high (DAPO's clip-higher: 0.28)
    clip_ratio_c: float | None = 3.0       # dual clip: for A < 0 the loss is capped at -A * c
    loss_agg_mode: LossAggMode = "token-mean"  # mini-batch normaliser: tokens or sequences (docs/math.md)
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's F; None: the response limit
    entropy_coeff: float = 0.0             # loss -= entropy_coeff * agg(entropy)

    def __post_init__(self) -> None:
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        if not 0.0 <= self.clip_ratio < 1.0:
            raise ValueError(f"clip_ratio must be in [0, 1), got {self.clip_ratio}")
        for name in ("clip_ratio_low", "clip_ratio_high"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.clip_ratio)
        if self.loss_scale_factor is not None and not (math.isfinite(self.loss_scale_factor)
                                                       and self.loss_scale_factor > 0):
            raise ValueError(f"loss_scale_factor must be a finite number > 0 (or null for the response length "
                             f"limit), got {self.loss_scale_factor}")
        if not 0.0 <= self.clip_ratio_low < 1.0:
            raise ValueError(f"clip_ratio_low must be in [0, 1) so that 1 - clip_ratio_low > 0, "
                             f"got {self.clip_ratio_low}")
        if not 0.0 <= self.clip_ratio_high < math.inf:
            raise ValueError(f"clip_ratio_high must be a finite number >= 0, got {self.clip_ratio_high}")
        if self.clip_ratio_c is not None and not 1.0 < self.clip_ratio_c < math.inf:
            raise ValueError(f"clip_ratio_c must be a finite number > 1 (or None to disable dual "
                             f"clipping), got {self.clip_ratio_c}")
        if not math.isfinite(self.entropy_coeff):
            raise ValueError(f"entropy_coeff must be finite, got {self.entropy_coeff}")


@dataclass(frozen=True)
class LossNormalizer:
    """Mini-batch denominators for one micro-batch's loss (float64 0-d / [S] tensors)."""
    num_tokens: torch.Tensor                      # valid tokens of the mini-batch, DP x CP
    num_seqs: torch.Tensor | None = None          # sequences with >= 1 valid token, DP
    seq_token_counts: torch.Tensor | None = None  # [S] valid tokens of each WHOLE sequence (CP-summed)
    token_scale: float = 1.0                      # seq-mean-token-sum-norm's F


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor                     # 0-d float32: this micro-batch's share of the mini-batch loss
    metrics: dict[str, MetricPartial]      # token-averaged metrics as (sum, count) partials
    # This micro-batch's detached shares of the loss's terms ("pg_loss", "entropy_loss",
    # "kl_loss"): summed over micro-batches and ranks they give each term of the mini-batch loss.
    terms: dict[str, torch.Tensor]


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: LossConfig,
    *,
    normalizer: LossNormalizer,
    is_weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    ref_log_prob: torch.Tensor | None = None,
    kl: KLLossSettings | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """One micro-batch's policy loss contribution, metric partials and the shares of its terms.

    log_prob: float32 log pi_theta(token) (differentiable). old_log_prob: log pi_old (PPO-clip;
    optional for policy gradient, where it only feeds `ppo_kl`). advantages: per token.
    loss_mask: 1 for tokens that count (response tokens kept by rejection sampling).
    entropy: per-token entropy, needed when cfg.entropy_coeff != 0 (reported whenever given).
    ref_log_prob, kl: the reference policy's log-probs and the KL-loss settings (kl.enabled).
    All per-token tensors share log_prob's shape: [B, T], or [N] with cu_seqlens.
    """
    _check_inputs(log_prob, old_log_prob, advantages, loss_mask, cfg, normalizer, is_weights,
                  entropy, cu_seqlens)
    if kl is not None and kl.enabled and (ref_log_prob is None or ref_log_prob.shape != log_prob.shape):
        raise ValueError("the KL loss needs ref_log_prob, shaped like log_prob")
    mask = loss_mask != 0
    zero = log_prob.new_zeros((), dtype=torch.float32)  # one constant for every masking below
    adv = _masked(advantages, mask, zero)
    # where() before any arithmetic: garbage at masked positions gets neither value nor gradient.
    lp = _masked(log_prob, mask, zero)
    metrics: dict[str, MetricPartial] = {}
    num_valid = mask.sum(dtype=torch.float32)
    aggregate = _Aggregation(cfg.loss_agg_mode, normalizer, cu_seqlens)

    clamped = None
    if old_log_prob is not None:
        # The log-ratio clamped as the PPO ratio uses it; verl's ppo_kl is its mean.
        clamped = (lp - _masked(old_log_prob, mask, zero)).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        metrics["ppo_kl"] = (-clamped.detach().sum(), num_valid)

    if cfg.loss_type == "ppo_clip":
        loss_tok, clip_active, dual_clip_active = _ppo_clip(clamped, adv, cfg)
        # Both are false at masked positions, where the advantage is 0 and the ratio 1.
        clipped = torch.stack([clip_active, dual_clip_active]).flatten(1).sum(-1, dtype=torch.float32)
        metrics["pg_clipfrac"] = (clipped[0], num_valid)
        metrics["pg_clipfrac_lower"] = (clipped[1], num_valid)
    else:
        loss_tok = -adv * lp
    if is_weights is not None:
        loss_tok = loss_tok * _masked(is_weights.detach(), mask, zero)

    loss = aggregate(loss_tok)
    terms = {"pg_loss": loss.detach()}
    if entropy is not None:
        entropy_sum, entropy_agg = aggregate.with_sum(_masked(entropy, mask, zero))
        metrics["entropy"] = (entropy_sum.detach(), num_valid)
        if cfg.entropy_coeff != 0.0:
            entropy_loss = -cfg.entropy_coeff * entropy_agg
            loss, terms["entropy_loss"] = loss + entropy_loss, entropy_loss.detach()
    if kl is not None and kl.enabled:
        # Both sides masked first: k2's gradient d * upstream would carry a masked NaN even with 0
        # upstream. Every estimator is exactly 0 where log_prob == ref_log_prob: masked tokens add 0.
        kl_value = aggregate(kl_penalty(lp, _masked(ref_log_prob, mask, zero), kl.type))
        loss, terms["kl_loss"] = loss + kl.coef * kl_value, kl_value.detach()
    return PolicyLossOutput(loss, metrics, terms)


def _ppo_clip(clamped_log_ratio: torch.Tensor, adv: torch.Tensor,
              cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss, and where the clip and the dual clip are active."""
    ratio = clamped_log_ratio.exp()
    neg_adv = -adv
    unclipped = neg_adv * ratio
    clipped = neg_adv * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    loss_tok = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if cfg.clip_ratio_c is None:
        return loss_tok, clip_active, torch.zeros_like(clip_active)
    # Dual clip: a negative advantage with a huge ratio would otherwise give an unbounded loss.
    cap = neg_adv * cfg.clip_ratio_c
    negative = adv < 0
    dual_clip_active = negative & (loss_tok > cap)
    loss_tok = torch.where(negative, torch.minimum(loss_tok, cap), loss_tok)
    return loss_tok, clip_active, dual_clip_active


class _Aggregation:
    """`aggregate_loss` of several per-token quantities of one micro-batch, the normaliser's
    denominators computed once."""

    def __init__(self, agg_mode: LossAggMode, normalizer: LossNormalizer,
                 cu_seqlens: torch.Tensor | None = None) -> None:
        self.agg_mode, self.cu_seqlens = agg_mode, cu_seqlens
        count = normalizer.num_tokens if agg_mode == "token-mean" else normalizer.num_seqs
        self.denominator = _denominator(count)
        if agg_mode == "seq-mean-token-sum-norm":
            self.denominator = self.denominator * normalizer.token_scale
        if agg_mode == "seq-mean-token-mean":
            self.token_counts = _denominator(normalizer.seq_token_counts)

    def __call__(self, loss_tok: torch.Tensor) -> torch.Tensor:
        """Sum of a per-token quantity (already 0 at masked positions) over the micro-batch,
        divided by the mini-batch normaliser (float32, like loss_tok)."""
        if self.agg_mode != "seq-mean-token-mean":
            # sum_i sum_t l_it is the plain sum: no per-sequence pass needed.
            return loss_tok.sum() / self.denominator
        per_seq = sequence_sums(loss_tok, self.cu_seqlens) / self.token_counts
        return per_seq.sum() / self.denominator

    def with_sum(self, loss_tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the plain sum over the micro-batch, the aggregate), one sum where the mode allows."""
        if self.agg_mode != "seq-mean-token-mean":
            total = loss_tok.sum()
            return total, total / self.denominator
        return loss_tok.sum(), self(loss_tok)


def aggregate_loss(loss_tok: torch.Tensor, agg_mode: LossAggMode, normalizer: LossNormalizer, *,
                   cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of a per-token quantity (already 0 at masked positions) over the micro-batch, divided
    by the mini-batch normaliser of `agg_mode`."""
    return _Aggregation(agg_mode, normalizer, cu_seqlens)(loss_tok)


def aggregate_over_batch(values_BT: torch.Tensor, mask_BT: torch.Tensor, agg_mode: LossAggMode, *,
                         dp_group: dist.ProcessGroup | None = None,
                         loss_scale_factor: float | None = None) -> torch.Tensor:
    """A per-token quantity of a whole batch (rows split over the DP ranks) aggregated over its valid
    tokens as verl's agg_loss(values, mask, agg_mode, loss_scale_factor=...) aggregates a whole batch:
    0-d float32, identical on the ranks of dp_group. Values at masked positions may be garbage.

    The seq-mean modes and token-mean are the loss's aggregation; seq-mean-token-sum-norm is not:
    verl's agg_loss divides the sum by F alone (no sequence count), F = `loss_scale_factor`, or with
    None verl's default, the mask's width (the widest over dp_group: the padded batch's). The loss's
    sum / (sequences x F) is this module's own choice (module docstring), not a metric verl reports.
    """
    mask = mask_BT != 0
    values = torch.where(mask, values_BT.float(), 0.0)
    if agg_mode == "seq-mean-token-sum-norm":
        total = values.sum(dtype=torch.float64)
        _all_reduce_sum(total, dp_group)
        return (total / _scale_factor(loss_scale_factor, mask, dp_group)).float()
    (normalizer,) = global_loss_normalizers([mask], agg_mode, dp_group=dp_group)
    value = aggregate_loss(values, agg_mode, normalizer)
    _all_reduce_sum(value, dp_group)
    return value


def _scale_factor(loss_scale_factor: float | None, mask_BT: torch.Tensor,
                  dp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """verl's F: the given factor, else the batch's padded width (each DP rank may pad to less)."""
    if loss_scale_factor is not None:
        return torch.tensor(float(loss_scale_factor), dtype=torch.float64, device=mask_BT.device)
    width = torch.tensor(float(mask_BT.shape[-1]), dtype=torch.float64, device=mask_BT.device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=dp_group)
    return width


def global_loss_normalizers(
    loss_masks_per_microbatch: Sequence[torch.Tensor],
    agg_mode: LossAggMode,
    *,
    cu_seqlens: Sequence[torch.Tensor] | None = None,
    cp_group: dist.ProcessGroup | None = None,
    dp_group: dist.ProcessGroup | None = None,
    loss_scale_factor: float = 1.0,
) -> list[LossNormalizer]:
    """The normaliser of each micro-batch of a mini-batch (this rank's micro-batches).

    Call once per mini-batch, with the final loss masks (after rejection). Communication: one
    all-reduce over cp_group (per-sequence counts, O(sequences)), then one of two numbers over
    dp_group; for token-mean only a single number travels. `loss_scale_factor` is
    seq-mean-token-sum-norm's F.
    """
    check_choice("agg_mode", agg_mode, LOSS_AGG_MODES)
    if cu_seqlens is not None and len(cu_seqlens) != len(loss_masks_per_microbatch):
        raise ValueError(f"cu_seqlens has {len(cu_seqlens)} entries for {len(loss_masks_per_microbatch)} "
                         "micro-batches; pass one per micro-batch (or None for the padded layout)")
    masks = [(m != 0).to(torch.float64) for m in loss_masks_per_microbatch]
    if agg_mode == "token-mean":
        num_tokens = torch.stack([m.sum() for m in masks]).sum()
        _all_reduce_sum(num_tokens, cp_group)
        _all_reduce_sum(num_tokens, dp_group)
        return [LossNormalizer(num_tokens) for _ in masks]

    cus = cu_seqlens if cu_seqlens is not None else [None] * len(masks)
    seq_counts = [sequence_sums(m, cu) for m, cu in zip(masks, cus)]
    all_counts = torch.cat(seq_counts)
    _all_reduce_sum(all_counts, cp_group)
    totals = torch.stack([all_counts.sum(), (all_counts > 0).sum(dtype=torch.float64)])
    _all_reduce_sum(totals, dp_group)
    per_microbatch = all_counts.split([c.numel() for c in seq_counts])
    scale = float(loss_scale_factor) if agg_mode == "seq-mean-token-sum-norm" else 1.0
    return [LossNormalizer(totals[0], totals[1], counts, scale) for counts in per_microbatch]


def sequence_sums(x_tok: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """[S] per-sequence sums (differentiable): rows of [B, T], or the cu_seqlens spans of [N]."""
    if cu_seqlens is None:
        return x_tok.sum(dim=-1)
    num_seqs = cu_seqlens.numel() - 1
    position = torch.arange(x_tok.shape[0], device=x_tok.device)
    # Tokens past cu_seqlens[-1] land in a spill row that is dropped.
    row = torch.searchsorted(cu_seqlens[1:].to(x_tok.device, torch.int64), position, right=True)
    return x_tok.new_zeros(num_seqs + 1).index_add(0, row, x_tok)[:num_seqs]


def reduce_metric_partials(
    partials_per_microbatch: Sequence[dict[str, MetricPartial]],
    *,
    cp_group: dist.ProcessGroup | None = None,
    dp_group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Mini-batch means (0-d tensors) of the metric partials of all micro-batches and ranks.

    Every rank must pass the same metric names. One all-reduce per group; 0 where a count is 0.
    """
    names = sorted({name for partials in partials_per_microbatch for name in partials})
    if not names:
        return {}
    buffer = torch.stack([
        torch.stack([torch.stack([p[name][0], p[name][1]]).double()
                     for p in partials_per_microbatch if name in p]).sum(dim=0)
        for name in names
    ])
    _all_reduce_sum(buffer, cp_group)
    _all_reduce_sum(buffer, dp_group)
    means = buffer[:, 0] / buffer[:, 1].clamp(min=1)
    return {name: means[i].float() for i, name in enumerate(names)}


# ---- helpers ----

def _masked(x: torch.Tensor, mask: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x.float(), zero)


def _denominator(count: torch.Tensor | None) -> torch.Tensor:
    """A float32 count, at least 1 (the per-token quantities are float32)."""
    assert count is not None, "normalizer lacks the count this loss_agg_mode needs"
    # A zero count only comes with a zero numerator (nothing valid): the loss is then exactly 0.
    return count.to(torch.float32).clamp(min=1.0)


def _all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def _check_inputs(log_prob, old_log_prob, advantages, loss_mask, cfg, normalizer, is_weights,
                  entropy, cu_seqlens) -> None:
    shape = log_prob.shape
    named = {"old_log_prob": old_log_prob, "advantages": advantages, "loss_mask": loss_mask,
             "is_weights": is_weights, "entropy": entropy}
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected log_prob's {tuple(shape)}")
    if cu_seqlens is None and log_prob.dim() != 2:
        raise ValueError(f"log_prob must be [B, T] (padded) or [N] with cu_seqlens (packed), "
                         f"got shape {tuple(shape)} without cu_seqlens")
    if cu_seqlens is not None and log_prob.dim() != 1:
        raise ValueError(f"with cu_seqlens the layout is packed: log_prob must be 1-D [N], "
                         f"got {tuple(shape)}")
    if cfg.loss_type == "ppo_clip" and old_log_prob is None:
        raise ValueError("loss_type='ppo_clip' needs old_log_prob (the ratio's denominator)")
    if cfg.entropy_coeff != 0.0 and entropy is None:
        raise ValueError("entropy_coeff != 0 needs the per-token entropy (entropy=...)")
    agg = cfg.loss_agg_mode
    if agg != "token-mean" and normalizer.num_seqs is None:
        raise ValueError(f"loss_agg_mode={agg!r} needs normalizer.num_seqs: build the normalizers "
                         f"with global_loss_normalizers(..., {agg!r})")
    if agg == "seq-mean-token-mean" and normalizer.seq_token_counts is None:
        raise ValueError("loss_agg_mode='seq-mean-token-mean' needs normalizer.seq_token_counts: build the "
                         "normalizers with global_loss_normalizers(..., 'seq-mean-token-mean')")
