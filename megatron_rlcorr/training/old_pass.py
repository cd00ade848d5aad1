"""The forward-only pi_old pass: log pi_old of every target token (compute_old_log_probs), with the
entropy of pi_old's tempered distribution (compute_old_log_probs_and_entropy), and the step's
`actor/entropy` from it (old_pass_entropy).

Decoupled mode runs it once per RL step before any update (the trainer, rl/trainer.py); the
reference policy (reference.py), score and export run it too. Collective over the model-parallel
group of a DP rank; results, full width [B, T] and merged over CP, exist on the last pipeline
stage only (None elsewhere). Memory: the per-micro-batch results are float32 [b, T / cp] until
merged; no autograd graph is kept.

`actor/entropy` is verl's trainer's: agg_loss(entropys, response_mask, loss_agg_mode,
loss_scale_factor) over the whole step batch (losses.aggregate_over_batch), whatever the loss's own
seq-mean-token-sum-norm normaliser (losses.py).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from .local_batch import cut_batch, group_or_none, plan_micro_batches
from .losses import aggregate_over_batch
from .routing_replay import routing_pass
from .schedule import run_schedule, token_log_probs
from .step_types import StepBatch, StepConfig

if TYPE_CHECKING:
    from ..parallel.groups import ParallelGroups


def compute_old_log_probs(model_chunks: list[Any], batch: StepBatch, *, groups: ParallelGroups,
                          micro_batch_size: int, temperature: float, max_tokens_per_micro_batch: int = 0,
                          routing_replay: bool = False, routing_metrics: bool = False) -> torch.Tensor | None:
    """log pi_old(targets) [B, T] float32 (full, merged over CP) on last-stage ranks, None elsewhere.

    A forward-only pass of the current weights through the pipeline schedule, in padded
    micro-batches of `micro_batch_size` rows or, with `max_tokens_per_micro_batch`, packed ones.
    Collective over the model-parallel group of this DP rank (all of TP x CP x PP must call it).
    MoE: `routing_replay` routes the tokens the engine recorded (batch.routed_experts_BTLK) to its
    experts; `routing_metrics` adds this pass's routing to the step's MoE metrics
    (routing_replay.routing_metrics). Without either, the routers route freely, untouched.
    """
    return compute_old_log_probs_and_entropy(model_chunks, batch, groups=groups, micro_batch_size=micro_batch_size,
                                             temperature=temperature, entropy=False,
                                             max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                                             routing_replay=routing_replay, routing_metrics=routing_metrics)[0]


def compute_old_log_probs_and_entropy(model_chunks: list[Any], batch: StepBatch, *, groups: ParallelGroups,
                                      micro_batch_size: int, temperature: float, entropy: bool = True,
                                      max_tokens_per_micro_batch: int = 0, routing_replay: bool = False,
                                      routing_metrics: bool = False
                                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """compute_old_log_probs, and with `entropy` the entropy of pi_old's tempered distribution at
    every position [B, T] float32 (where the trainer's `actor/entropy` comes from: old_pass_entropy)."""
    plan = plan_micro_batches(batch, model_chunks, groups, micro_batch_size=micro_batch_size,
                              max_tokens=max_tokens_per_micro_batch, same_count_over_dp=False)
    local = cut_batch(batch, plan)
    log_probs: list[torch.Tensor | None] = [None] * plan.num_microbatches
    entropies: list[torch.Tensor | None] = [None] * plan.num_microbatches

    def loss_fn(mb, logits):
        log_probs[mb], entropies[mb] = token_log_probs(logits, local.targets[mb], groups, temperature, entropy=entropy)
        return logits.new_zeros(()), {}

    routing = (routing_pass(model_chunks, plan, batch, groups, replay=routing_replay, collect=routing_metrics,
                            training=False) if routing_replay or routing_metrics else contextlib.nullcontext())
    with torch.no_grad(), routing as replay_pass:
        run_schedule(model_chunks, local, loss_fn, groups=groups, forward_only=True, routing=replay_pass)
    if not groups.is_pipeline_last_stage():
        return None, None
    width = batch.tokens_BT.shape[1]
    return plan.merge(log_probs, width), plan.merge(entropies, width) if entropy else None


def old_pass_entropy(entropy_BT: torch.Tensor, batch: StepBatch, cfg: StepConfig,
                     groups: ParallelGroups) -> torch.Tensor:
    """`actor/entropy` (0-d): pi_old's entropy over the response tokens of the step batch (all DP
    ranks), as verl's trainer reports it after its compute_log_prob: agg_loss(entropys,
    response_mask, loss_agg_mode, loss_scale_factor) over the whole batch (seq-mean-token-sum-norm:
    sum / F, F = cfg.loss_scale_factor, the recipe's or the response limit, verl's padded response
    width). Last stage only."""
    return aggregate_over_batch(entropy_BT, batch.response_mask_BT.to(entropy_BT.device), cfg.loss.loss_agg_mode,
                                dp_group=group_or_none(groups.dp, groups.dp_size),
                                loss_scale_factor=cfg.loss_scale_factor)
