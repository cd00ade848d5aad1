"""One optimizer step of RL post-training with rollout correction on Megatron-Core.

This module holds the update (`train_minibatch`) and the decoupled correction computed once per RL
step (`step_correction`); its parts live beside it: step_types.py (StepBatch, StepConfig,
StepResult), local_batch.py (the cut into this rank's micro-batches), schedule.py (Megatron's
pipeline schedule, log-probs from the logits), old_pass.py (the forward-only pi_old pass and
`actor/entropy`), update_metrics.py (the update's metrics). Their public names are importable from
here too.

Data flow of `train_minibatch` for one DP rank's mini-batch `[B, T]`:

1. Cut every per-token tensor (tokens, targets, masks, rollout / old log-probs, advantages) into
   this rank's micro-batches (microbatches.py): padded rows of `micro_batch_size`, or packed
   sequences up to `max_tokens_per_micro_batch` tokens per rank; each sequence padded for the
   zigzag CP split, sequence parallelism and FP8 (the model's TransformerConfig says which).
2. Last pipeline stage only: in decoupled mode the rollout correction's weights and mask come
   precomputed, once for the whole RL step (`step_correction`, as verl computes them once over
   the step batch), and are cut like the other tensors; the mask (rejection sampling, veto)
   becomes the loss mask. (Called without them, the correction runs on this mini-batch.) Then
   the loss normalisers of all micro-batches (global over micro-batches, CP and DP ranks).
   Bypass mode (PPO and policy gradient) instead corrects inside each micro-batch's loss, from
   the current policy's (detached) log-probs against the rollout's.
3. Megatron-Core's pipeline schedule runs forward/backward over the micro-batches (p2p over the
   PP group; packed micro-batches go in as THD with PackedSeqParams); each loss is this
   micro-batch's share of the global loss, times the factor that undoes the schedule's and DDP's
   averaging (optimizer.loss_scale_for_schedule), so the gradient equals the single-process
   full-batch gradient for any layout, micro-batch size or packing. `batch/padding_fraction`:
   tokens computed / tokens the sequences need - 1.
4. DDP reduces the gradients (finalize_model_grads: an all-reduce, or with the distributed
   optimizer a reduce-scatter, possibly overlapped with the backward), Megatron's optimizer clips
   and steps; a gradient that is zero everywhere (every token rejected) skips the step
   (optimizer.step_optimizer).
   The learning-rate scheduler is the caller's: it advances once per RL step, so every update of
   a step uses that step's learning rate (verl's schedule). Metrics, kept as (sum, count)
   tensors, are reduced once over CP x DP and broadcast from the last pipeline stage to the
   others. `actor/pg_loss` is the policy-gradient term alone; the entropy bonus
   (`actor/entropy_loss`) and the KL loss (`actor/kl_loss`, with a reference policy's log-probs)
   are reported beside it. The update computes the entropy only for the loss (entropy_coeff != 0).
   `actor/entropy` is pi_old's, from the forward-only pass (`compute_old_log_probs_and_entropy`,
   `old_pass_entropy`: verl's trainer reports it the same way); bypass mode has no such pass, so
   there it is the update's entropy term / -entropy_coeff, and absent with entropy_coeff 0.

MoE (routing_replay.py): with `StepConfig.routing_replay` (rollout.routing_replay) every forward of
those tokens, the pi_old pass, each update and its recompute, and the reference policy's pass (the
trainer passes it to ReferencePolicy.log_probs), routes the tokens the engine recorded
(StepBatch.routed_experts_BTLK) to the engine's experts. The reference replays too so that the KL
terms compare the two policies' weights under one routing: with the policy's own weights the KL is
exactly 0, whereas a freely routed reference would charge the policy with the engine-vs-trainer
routing differences that replay removed (the replayed top-k gets no gradient, so the policy could
not reduce them). The step's MoE metrics come from the pi_old pass (bypass mode: the updates).

Modes (RolloutCorrectionConfig): decoupled (bypass_mode False): pi_old comes from
`compute_old_log_probs` before the update, IS/RS from pi_old vs pi_rollout, PPO ratio against
pi_old. Bypass (pi_old := pi_rollout, no old-log-prob pass): the correction compares pi_theta
(detached: the log-probs of the forward pass, before this mini-batch's update) with pi_rollout
inside each micro-batch's loss; comparing pi_old := pi_rollout with itself would give a log-ratio
of 0, IS weights 1, and RS and the veto could never fire. The RS/veto mask is the loss mask and,
as it depends on pi_theta (known only during the forward pass), the loss normalisers count
response tokens BEFORE rejection (a rejected token leaves the numerator only).
- Bypass PPO: the PPO ratio pi_theta / pi_rollout already is the importance weight and the PPO
  clip truncates it, so the loss is NOT multiplied by IS weights; `rollout_is` / its threshold
  only select the reported `rollout_is_*` metrics. The in-loss call computes only the mask (CP
  reduced, no DP collective); the `rollout_corr/*` metrics come from one more correction call
  after the schedule on the whole shard's pi_theta (CP x DP reduced), so they equal the
  single-process full-batch values for any micro-batch size.
- Bypass policy gradient: REINFORCE weighted by the IS weights pi_theta / pi_rollout (detached,
  batch-normalised per micro-batch round) on the RS/veto mask; its correction metrics are the
  mean over micro-batches of per-micro-batch (DP-global) values.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..config import RolloutCorrectionConfig
from ..correction.compiled import correction_function
from .local_batch import LocalBatch, cut_batch, group_or_none, plan_micro_batches
from .losses import global_loss_normalizers, policy_loss
from .old_pass import compute_old_log_probs, compute_old_log_probs_and_entropy, old_pass_entropy
from .optimizer import current_lr, loss_scale_for_schedule, step_optimizer, zero_grads
from .routing_replay import routing_pass
from .schedule import run_schedule, token_log_probs
from .step_types import StepBatch, StepConfig, StepResult
from .update_metrics import broadcast_from_last_stage, last_stage_metrics

if TYPE_CHECKING:
    from ..parallel.groups import ParallelGroups

# Re-exported: the step's types and the pi_old pass were defined here, and callers import them from here.
__all__ = ["StepBatch", "StepConfig", "StepCorrection", "StepResult", "broadcast_from_last_stage",
           "compute_old_log_probs", "compute_old_log_probs_and_entropy", "old_pass_entropy", "step_correction",
           "train_minibatch"]


def _check_bypass_pg_batch_norm(cfg: StepConfig, num_microbatches: int) -> None:
    """Bypass policy gradient corrects inside each micro-batch's loss: a batch normalisation there
    would be per micro-batch, and the gradient would depend on the micro-batch size."""
    c = cfg.correction
    if c.bypass_mode and cfg.use_policy_gradient and c.rollout_is_batch_normalize and num_microbatches > 1:
        raise ValueError(f"rollout_is_batch_normalize in bypass policy-gradient mode needs one micro-batch per "
                         f"rank and mini-batch (got {num_microbatches}): raise trainer.micro_batch_size to the "
                         f"sequences per rank per mini-batch (without trainer.max_tokens_per_micro_batch), or "
                         f"set rollout_is_batch_normalize: false")


def _mask_only(correction: RolloutCorrectionConfig) -> RolloutCorrectionConfig:
    """The same rejection rules and veto without IS weights: what bypass PPO's loss needs."""
    return dataclasses.replace(correction, rollout_is=None, rollout_is_batch_normalize=False)


# ---- the decoupled correction, once per RL step ---------------------------------------------

@dataclass
class StepCorrection:
    """The rollout correction's result for a DP rank's whole step batch, full width [B, T]."""
    is_weights_BT: torch.Tensor | None
    mask_BT: torch.Tensor

    def rows(self, start: int, end: int) -> "StepCorrection":
        weights = None if self.is_weights_BT is None else self.is_weights_BT[start:end]
        return StepCorrection(weights, self.mask_BT[start:end])


def step_correction(old_log_probs_BT: torch.Tensor, batch: StepBatch, correction: RolloutCorrectionConfig,
                    groups: ParallelGroups, *, correction_compile: str = "eager"
                    ) -> tuple[StepCorrection, dict[str, torch.Tensor]]:
    """Decoupled mode: IS weights, rejection and metrics over the whole RL step (this DP rank's
    batch, batch statistics over DP), on the last pipeline stage. Every CP rank computes it on the
    whole sequences (compute_old_log_probs merged them), so no CP collective is needed. No host
    sync (check_inputs=False). `correction_compile`: StepConfig's (eager or torch.compile)."""
    device = old_log_probs_BT.device
    out = correction_function(correction_compile)(
        old_log_probs_BT.float(), batch.rollout_log_probs_BT.to(device).float(),
        batch.response_mask_BT.to(device).float(), correction, dp_group=group_or_none(groups.dp, groups.dp_size),
        check_inputs=False)
    return StepCorrection(out.is_weights, out.response_mask), out.metrics


# ---- the training step ---------------------------------------------------------------------

@dataclass
class _LossInputs:
    """What the last stage's loss needs, per micro-batch (split like the tokens)."""
    old: list[torch.Tensor]
    ref: list[torch.Tensor] | None
    loss_mask: list[torch.Tensor]
    is_weights: list[torch.Tensor] | None
    normalizers: list
    correction_metrics: dict[str, torch.Tensor]


def _split_full(full_BT: torch.Tensor, local: LocalBatch, name: str) -> list[torch.Tensor]:
    """This rank's micro-batch parts of a full-width [B, T] tensor of the mini-batch."""
    if full_BT.shape[0] != local.plan.num_rows:
        raise ValueError(f"{name} has shape {tuple(full_BT.shape)} but the mini-batch has {local.plan.num_rows} "
                         "sequences")
    return local.plan.split(full_BT.float())


def _prepare_loss_inputs(local: LocalBatch, cfg: StepConfig, groups: ParallelGroups, *,
                         old_log_probs: torch.Tensor | None, ref_log_probs: torch.Tensor | None,
                         correction: StepCorrection | None) -> _LossInputs:
    cp_group = group_or_none(groups.cp, groups.cp_size)
    dp_group = group_or_none(groups.dp, groups.dp_size)
    if cfg.kl_loss.enabled and ref_log_probs is None:
        raise ValueError("the KL loss (kl_loss.enabled) needs the reference policy's log-probs (ref_log_probs)")
    ref = None if ref_log_probs is None else _split_full(ref_log_probs, local, "ref_log_probs")
    if cfg.correction.bypass_mode:
        return _LossInputs(local.rollout, ref, local.mask, None,
                           _normalizers(local.mask, local, cfg, cp_group, dp_group), {})
    if old_log_probs is None:
        raise ValueError("decoupled mode (correction.bypass_mode=False) needs old_log_probs from "
                         "compute_old_log_probs on the last pipeline stage; or set bypass_mode: true")
    old = _split_full(old_log_probs, local, "old_log_probs")
    if correction is not None:
        loss_mask = _split_full(correction.mask_BT, local, "the correction's mask")
        is_weights = (None if correction.is_weights_BT is None
                      else _split_full(correction.is_weights_BT, local, "the correction's weights"))
        metrics = {}
    else:  # the correction on this mini-batch, all micro-batches at once
        old_all, cu = local.plan.concat(old)
        corr = correction_function(cfg.correction_compile)(
            old_all, local.plan.concat(local.rollout)[0], local.plan.concat(local.mask)[0], cfg.correction,
            cu_seqlens=cu, cp_group=cp_group, dp_group=dp_group, check_inputs=False)
        loss_mask = _unconcat(corr.response_mask, local.mask)
        is_weights = None if corr.is_weights is None else _unconcat(corr.is_weights, local.mask)
        metrics = corr.metrics
    normalizers = _normalizers(loss_mask, local, cfg, cp_group, dp_group)
    return _LossInputs(old, ref, loss_mask, is_weights, normalizers, metrics)


def _unconcat(values: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of plan.concat: one tensor per micro-batch, shaped like `like`'s."""
    return [part.view(ref.shape) for part, ref in zip(values.split([ref.shape[0] for ref in like]), like)]


def _normalizers(loss_masks: list[torch.Tensor], local: LocalBatch, cfg: StepConfig, cp_group, dp_group) -> list:
    cu = [local.cu_seqlens(mb) for mb in range(len(loss_masks))] if local.plan.is_packed else None
    return global_loss_normalizers(loss_masks, cfg.loss.loss_agg_mode, cu_seqlens=cu, cp_group=cp_group,
                                   dp_group=dp_group, loss_scale_factor=cfg.loss_scale_factor)


def train_minibatch(model_chunks: list[Any], optimizer, batch: StepBatch, *, groups: ParallelGroups,
                    cfg: StepConfig, old_log_probs: torch.Tensor | None = None,
                    ref_log_probs: torch.Tensor | None = None, correction: StepCorrection | None = None
                    ) -> StepResult:
    """Forward/backward over the micro-batches of `batch`, then one optimizer step.

    Collective over all ranks. Read on the last pipeline stage only: `old_log_probs`
    (compute_old_log_probs' result; decoupled mode), `ref_log_probs` (the reference policy's, for
    the KL loss), `correction` (the step's decoupled correction sliced to this mini-batch; when
    None in decoupled mode, the correction runs on this mini-batch). The learning-rate scheduler
    is not stepped here (module docstring).
    """
    plan = plan_micro_batches(batch, model_chunks, groups, micro_batch_size=cfg.micro_batch_size,
                              max_tokens=cfg.max_tokens_per_micro_batch, same_count_over_dp=True)
    local = cut_batch(batch, plan)
    is_last = groups.is_pipeline_last_stage()
    correct_in_loss = cfg.correction.bypass_mode  # bypass PPO and bypass policy gradient
    _check_bypass_pg_batch_norm(cfg, plan.num_microbatches)
    bypass_ppo = correct_in_loss and not cfg.use_policy_gradient
    # Bypass PPO's loss needs only the RS/veto mask (no IS weights: the PPO ratio is the weight).
    mask_only = _mask_only(cfg.correction) if bypass_ppo else None
    loss_cfg = dataclasses.replace(cfg.loss, loss_type="policy_gradient") if cfg.use_policy_gradient else cfg.loss
    inputs = (_prepare_loss_inputs(local, cfg, groups, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs,
                                   correction=correction) if is_last else None)
    cp_group = group_or_none(groups.cp, groups.cp_size)
    dp_group = group_or_none(groups.dp, groups.dp_size)
    scale = loss_scale_for_schedule(plan.num_microbatches, groups)
    terms, partials, corr_metrics = [], [], []
    theta_log_probs: list[torch.Tensor | None] = [None] * plan.num_microbatches  # bypass PPO: detached pi_theta
    with_entropy = cfg.loss.entropy_coeff != 0.0
    correct = correction_function(cfg.correction_compile)  # compute_rollout_correction, or torch.compile'd

    def loss_fn(mb, logits):
        cu = local.cu_seqlens(mb)
        # Entropy only for the loss: actor/entropy comes from the pi_old pass (old_pass_entropy).
        log_prob, entropy = token_log_probs(logits, local.targets[mb], groups, cfg.temperature, entropy=with_entropy)
        loss_mask, is_weights = inputs.loss_mask[mb], None if inputs.is_weights is None else inputs.is_weights[mb]
        if bypass_ppo:
            # RS + veto from pi_theta vs pi_rollout; per-sequence decisions need only the CP group.
            theta_log_probs[mb] = log_prob.detach()
            loss_mask = correct(theta_log_probs[mb], local.rollout[mb], loss_mask, mask_only, cu_seqlens=cu,
                                cp_group=cp_group, check_inputs=False).response_mask
        elif correct_in_loss:
            corr = correct(log_prob.detach(), local.rollout[mb], loss_mask, cfg.correction, cu_seqlens=cu,
                           cp_group=cp_group, dp_group=dp_group, check_inputs=False)
            loss_mask, is_weights = corr.response_mask, corr.is_weights
            corr_metrics.append(corr.metrics)
        ref = None if inputs.ref is None else inputs.ref[mb]
        out = policy_loss(log_prob, inputs.old[mb], local.advantages[mb], loss_mask, loss_cfg,
                          normalizer=inputs.normalizers[mb], is_weights=is_weights, entropy=entropy,
                          ref_log_prob=ref, kl=cfg.kl_loss, cu_seqlens=cu)
        terms.append(out.terms)
        partials.append({name: value for name, value in out.metrics.items() if name != "entropy"})
        return out.loss * scale, {}

    zero_grads(model_chunks, optimizer)
    # Bypass mode has no pi_old pass: its updates' routing feeds the step's MoE metrics.
    with routing_pass(model_chunks, plan, batch, groups, replay=cfg.routing_replay, collect=correct_in_loss,
                      training=True) as replay_pass:
        run_schedule(model_chunks, local, loss_fn, groups=groups, forward_only=False, routing=replay_pass)
    lr = current_lr(optimizer)
    update_successful, grad_norm = step_optimizer(optimizer)

    metrics = {}
    if is_last and bypass_ppo:
        # The whole mini-batch's pi_theta at once: metrics (and the mask, equal to the loss's) as
        # one process on the full batch would compute them, whatever the micro-batches.
        theta, cu = plan.concat(theta_log_probs)
        corr_metrics = [correct(theta, plan.concat(local.rollout)[0], plan.concat(local.mask)[0], cfg.correction,
                                cu_seqlens=cu, cp_group=cp_group, dp_group=dp_group, check_inputs=False).metrics]
    if is_last:
        metrics = last_stage_metrics(terms, partials, corr_metrics or [inputs.correction_metrics], plan, groups,
                                      cp_group, dp_group)
        if cfg.kl_loss.enabled:
            metrics["actor/kl_coef"] = torch.tensor(cfg.kl_loss.coef)
        if correct_in_loss and with_entropy:
            # Bypass mode has no pi_old pass: the update's entropy, aggregated as the loss aggregates it.
            metrics["actor/entropy"] = metrics["actor/entropy_loss"] / -cfg.loss.entropy_coeff
    metrics = broadcast_from_last_stage(metrics, groups, local.tokens[0].device)
    grad_norm_t = torch.as_tensor(float(grad_norm), dtype=torch.float32)
    metrics["actor/grad_norm"] = grad_norm_t
    metrics["actor/lr"] = torch.as_tensor(lr, dtype=torch.float32)
    return StepResult(metrics=metrics, grad_norm=grad_norm_t, update_successful=bool(update_successful))
