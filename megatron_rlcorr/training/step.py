"""One optimizer step of RL post-training with rollout correction on Megatron-Core.

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

import contextlib
import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..config import RolloutCorrectionConfig
from ..correction import compute_rollout_correction
from .logprobs import token_logprobs_and_entropy
from .kl import KLLossSettings
from .losses import LossConfig, aggregate_over_batch, global_loss_normalizers, policy_loss, reduce_metric_partials
from .microbatches import MicroBatchPlan, PackingRules, plan_packed, plan_padded, sequence_lengths, sequence_multiple
from .optimizer import current_lr, loss_scale_for_schedule, step_optimizer, zero_grads
from .routing_replay import forward_context, routing_pass

if TYPE_CHECKING:
    from ..parallel.groups import ParallelGroups


@dataclass
class StepBatch:
    """One DP rank's mini-batch: full (un-split) sequences, padded [B, T], identical on every TP/CP/PP rank of that DP rank."""
    tokens_BT: torch.Tensor            # int64 input tokens (prompt + response, right-padded with pad id 0)
    targets_BT: torch.Tensor           # int64, tokens_BT shifted left by one (target of position t); pad at the end
    response_mask_BT: torch.Tensor     # float32 0/1: 1 where targets_BT[:, t] is a response token to train on
    rollout_log_probs_BT: torch.Tensor # float32 engine log-prob of targets_BT[:, t] (garbage where mask is 0)
    advantages_BT: torch.Tensor        # float32 per-token advantage
    # MoE: the experts the rollout engine routed each position's token to, int16 [B, T, MoE layers, k]
    # (axis 2: DecoderShape.moe_layers), -1 where it recorded none (padding, prompt positions it did
    # not report, each sequence's last token); None for a dense model or an engine that records none.
    # rollout.routing_replay replays it (routing_replay.py); the routing metrics compare against it.
    routed_experts_BTLK: torch.Tensor | None = None


@dataclass(frozen=True)
class StepConfig:
    loss: LossConfig
    correction: RolloutCorrectionConfig
    micro_batch_size: int
    temperature: float = 1.0      # rollout temperature, applied to logits before log-probs
    # > 0: packed micro-batches of at most this many tokens per rank (micro_batch_size unused)
    max_tokens_per_micro_batch: int = 0
    kl_loss: KLLossSettings = KLLossSettings()
    # seq-mean-token-sum-norm's F when loss.loss_scale_factor is unset (the response length limit)
    response_limit: int = 1
    # rollout.routing_replay: MoE tokens the engine recorded go to its experts in every forward (routing_replay.py)
    routing_replay: bool = False

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError(f"max_tokens_per_micro_batch must be >= 0 (0: padded micro-batches), got "
                             f"{self.max_tokens_per_micro_batch}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    @property
    def loss_scale_factor(self) -> float:
        return self.loss.loss_scale_factor or float(self.response_limit)

    @property
    def use_policy_gradient(self) -> bool:
        return self.correction.use_policy_gradient or self.loss.loss_type == "policy_gradient"


@dataclass
class StepResult:
    metrics: dict[str, torch.Tensor]  # 0-d tensors, identical on ALL ranks
    grad_norm: torch.Tensor
    update_successful: bool


# ---- this rank's micro-batches of a mini-batch ------------------------------------------------

@dataclass
class _Local:
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


def _plan(batch: StepBatch, model_chunks: list[Any], groups: ParallelGroups, *, micro_batch_size: int,
          max_tokens: int, same_count_over_dp: bool) -> MicroBatchPlan:
    """Padded micro-batches of `micro_batch_size` rows, or packed ones of `max_tokens` tokens per
    rank, as many on every DP rank with `same_count_over_dp` (training: DDP's gradient all-reduce
    and the per-micro-batch collectives of bypass mode run in lockstep; a forward-only pass needs
    no agreement, except under expert parallelism: _experts_span_replicas)."""
    config, device = model_chunks[0].config, _model_device(model_chunks)
    lengths = sequence_lengths(batch.response_mask_BT.to(device, non_blocking=True))
    multiple = sequence_multiple(config)
    cp_group = _group_or_none(groups.cp, groups.cp_size)
    dp_group = _group_or_none(groups.dp, groups.dp_size)
    width = batch.tokens_BT.shape[1]
    lockstep = _experts_span_replicas(config, groups)
    same_shapes = lockstep and config.moe_token_dispatcher_type == "allgather"
    if not max_tokens:
        if lockstep:
            width = _agreed_width(width, batch.tokens_BT.shape[0], dp_group, device)
        return plan_padded(lengths, width, micro_batch_size=micro_batch_size, multiple=multiple,
                           cp_size=groups.cp_size, cp_rank=groups.cp_rank, cp_group=cp_group, device=device)
    rules = PackingRules(max_tokens, multiple, equal_sizes=groups.pp_size > 1 or same_shapes,
                         bins_multiple=groups.pp_size if groups.vpp_size else 1, equal_sizes_over_dp=same_shapes)
    return plan_packed(lengths, width, rules, cp_size=groups.cp_size, cp_rank=groups.cp_rank, cp_group=cp_group,
                       dp_group=dp_group if same_count_over_dp or lockstep else None, device=device)


def _experts_span_replicas(config: Any, groups: ParallelGroups) -> bool:
    """Whether the MoE layers' token dispatcher exchanges tokens between data-parallel replicas
    (parallel.ep * parallel.etp > 1 with dp > 1: an expert group spans replicas). Every forward is
    then a collective over them: each replica runs as many micro-batches, and under the allgather
    dispatcher (which gathers equal-sized token blocks) of one shape."""
    return bool(getattr(config, "num_moe_experts", None)) and groups.ep_size * groups.etp_size > 1 \
        and groups.dp_size > 1


def _agreed_width(width: int, rows: int, dp_group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The widest mini-batch of the DP replicas (padded micro-batches of one shape everywhere);
    every replica must hold as many rows (the same number of micro-batches)."""
    if dp_group is None:
        return width
    sizes = torch.tensor([width, rows, -rows], dtype=torch.int64, device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=dp_group)
    assert int(sizes[1]) == -int(sizes[2]), "data-parallel replicas hold mini-batches of different sizes"
    return int(sizes[0])


def _cut(batch: StepBatch, plan: MicroBatchPlan) -> _Local:
    _check_batch(batch)
    return _Local(plan=plan, tokens=plan.split(batch.tokens_BT), targets=plan.split(batch.targets_BT),
                  mask=plan.split(batch.response_mask_BT.float()),
                  rollout=plan.split(batch.rollout_log_probs_BT.float()),
                  advantages=plan.split(batch.advantages_BT.float()))


def _model_device(model_chunks: list[Any]) -> torch.device:
    return next(model_chunks[0].parameters()).device


def _check_batch(batch: StepBatch) -> None:
    shape = batch.tokens_BT.shape
    if batch.tokens_BT.dim() != 2:
        raise ValueError(f"StepBatch.tokens_BT must be [B, T], got shape {tuple(shape)}")
    for field in dataclasses.fields(batch):
        tensor = getattr(batch, field.name)
        if tensor is None:
            continue
        per_token = field.name == "routed_experts_BTLK"  # [B, T, MoE layers, top-k]
        if tensor.shape[:2] != shape or (tensor.dim() != 2 and not per_token):
            raise ValueError(f"StepBatch.{field.name} has shape {tuple(tensor.shape)}, expected tokens_BT's "
                             f"{tuple(shape)}" + (" + [MoE layers, top-k]" if per_token else ""))
    routed = batch.routed_experts_BTLK
    if routed is not None and (routed.dim() != 4 or routed.is_floating_point()):
        raise ValueError(f"StepBatch.routed_experts_BTLK must be an integer [B, T, MoE layers, top-k] tensor, got "
                         f"{routed.dtype} of shape {tuple(routed.shape)}")
    for name in ("tokens_BT", "targets_BT"):
        if getattr(batch, name).is_floating_point():
            raise ValueError(f"StepBatch.{name} must be an integer tensor, got {getattr(batch, name).dtype}")


def _check_bypass_pg_batch_norm(cfg: StepConfig, num_microbatches: int) -> None:
    """Bypass policy gradient corrects inside each micro-batch's loss: a batch normalisation there
    would be per micro-batch, and the gradient would depend on the micro-batch size."""
    c = cfg.correction
    if c.bypass_mode and cfg.use_policy_gradient and c.rollout_is_batch_normalize and num_microbatches > 1:
        raise ValueError(f"rollout_is_batch_normalize in bypass policy-gradient mode needs one micro-batch per "
                         f"rank and mini-batch (got {num_microbatches}): raise trainer.micro_batch_size to the "
                         f"sequences per rank per mini-batch (without trainer.max_tokens_per_micro_batch), or "
                         f"set rollout_is_batch_normalize: false")


def _group_or_none(group: dist.ProcessGroup, size: int) -> dist.ProcessGroup | None:
    return group if size > 1 else None


def _mask_only(correction: RolloutCorrectionConfig) -> RolloutCorrectionConfig:
    """The same rejection rules and veto without IS weights: what bypass PPO's loss needs."""
    return dataclasses.replace(correction, rollout_is=None, rollout_is_batch_normalize=False)


# ---- running the pipeline schedule ---------------------------------------------------------

def _run_schedule(model_chunks: list[Any], local: _Local, loss_fn, *, groups: ParallelGroups,
                  forward_only: bool, routing=None) -> None:
    """Megatron-Core's forward(/backward) schedule; `loss_fn(mb, logits)` -> (loss, {}); `routing`: the
    pass's routing replay (routing_replay.ReplayPass; None for a dense model or nothing to do)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    plan = local.plan

    def forward_step(micro_batch_ids, model):
        mb = next(micro_batch_ids)
        micro = plan.micro_batches[mb]
        tokens, positions = local.tokens[mb], micro.positions
        if plan.is_packed:  # Megatron's THD micro-batch is one row of packed tokens
            tokens, positions = tokens[None], positions[None]
        with forward_context(routing, model, mb):
            output = model(tokens, positions, None, packed_seq_params=micro.packed_seq_params)
        return output, partial(loss_fn, mb)

    num_microbatches = plan.num_microbatches
    if groups.vpp_size and num_microbatches < groups.pp_size:
        raise ValueError(f"virtual pipelining (vpp={groups.vpp_size}) needs at least pp={groups.pp_size} micro-batches "
                         f"per DP rank, got {num_microbatches}: lower micro_batch_size={plan.micro_batch_size}")
    config = model_chunks[0].config
    iterators = [iter(range(num_microbatches)) for _ in model_chunks]
    forward_backward = get_forward_backward_func(pp_size=groups.pp_size, vp_size=groups.vpp_size)
    forward_backward(
        forward_step_func=forward_step,
        data_iterator=iterators,
        model=model_chunks,
        num_microbatches=num_microbatches,
        seq_length=plan.seq_length,
        micro_batch_size=plan.micro_batch_size,
        forward_only=forward_only,
        p2p_communicator=P2PCommunicator(pp_group=groups.pp, config=config),
        pg_collection=groups.pg_collection,
    )


def _log_probs(logits: torch.Tensor, targets: torch.Tensor, groups: ParallelGroups, temperature: float, *,
               entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of a micro-batch's targets, shaped like the targets."""
    log_prob, ent = token_logprobs_and_entropy(logits, targets.view(logits.shape[:-1]), tp_group=groups.tp,
                                               temperature=temperature, compute_entropy=entropy)
    return log_prob.view(targets.shape), None if ent is None else ent.view(targets.shape)


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
    plan = _plan(batch, model_chunks, groups, micro_batch_size=micro_batch_size,
                 max_tokens=max_tokens_per_micro_batch, same_count_over_dp=False)
    local = _cut(batch, plan)
    log_probs: list[torch.Tensor | None] = [None] * plan.num_microbatches
    entropies: list[torch.Tensor | None] = [None] * plan.num_microbatches

    def loss_fn(mb, logits):
        log_probs[mb], entropies[mb] = _log_probs(logits, local.targets[mb], groups, temperature, entropy=entropy)
        return logits.new_zeros(()), {}

    routing = (routing_pass(model_chunks, plan, batch, groups, replay=routing_replay, collect=routing_metrics,
                            training=False) if routing_replay or routing_metrics else contextlib.nullcontext())
    with torch.no_grad(), routing as replay_pass:
        _run_schedule(model_chunks, local, loss_fn, groups=groups, forward_only=True, routing=replay_pass)
    if not groups.is_pipeline_last_stage():
        return None, None
    width = batch.tokens_BT.shape[1]
    return plan.merge(log_probs, width), plan.merge(entropies, width) if entropy else None


def old_pass_entropy(entropy_BT: torch.Tensor, batch: StepBatch, cfg: StepConfig,
                     groups: ParallelGroups) -> torch.Tensor:
    """`actor/entropy` (0-d): pi_old's entropy over the response tokens of the step batch (all DP
    ranks), aggregated with the recipe's loss_agg_mode, as verl's trainer reports it
    (agg_loss(entropys, response_mask, loss_agg_mode) after its compute_log_prob). Last stage only."""
    return aggregate_over_batch(entropy_BT, batch.response_mask_BT.to(entropy_BT.device), cfg.loss.loss_agg_mode,
                                dp_group=_group_or_none(groups.dp, groups.dp_size),
                                loss_scale_factor=cfg.loss_scale_factor)


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
                    groups: ParallelGroups) -> tuple[StepCorrection, dict[str, torch.Tensor]]:
    """Decoupled mode: IS weights, rejection and metrics over the whole RL step (this DP rank's
    batch, batch statistics over DP), on the last pipeline stage. Every CP rank computes it on the
    whole sequences (compute_old_log_probs merged them), so no CP collective is needed. No host
    sync (check_inputs=False)."""
    device = old_log_probs_BT.device
    out = compute_rollout_correction(old_log_probs_BT.float(), batch.rollout_log_probs_BT.to(device).float(),
                                     batch.response_mask_BT.to(device).float(), correction,
                                     dp_group=_group_or_none(groups.dp, groups.dp_size), check_inputs=False)
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


def _split_full(full_BT: torch.Tensor, local: _Local, name: str) -> list[torch.Tensor]:
    """This rank's micro-batch parts of a full-width [B, T] tensor of the mini-batch."""
    if full_BT.shape[0] != local.plan.num_rows:
        raise ValueError(f"{name} has shape {tuple(full_BT.shape)} but the mini-batch has {local.plan.num_rows} "
                         "sequences")
    return local.plan.split(full_BT.float())


def _prepare_loss_inputs(local: _Local, cfg: StepConfig, groups: ParallelGroups, *,
                         old_log_probs: torch.Tensor | None, ref_log_probs: torch.Tensor | None,
                         correction: StepCorrection | None) -> _LossInputs:
    cp_group = _group_or_none(groups.cp, groups.cp_size)
    dp_group = _group_or_none(groups.dp, groups.dp_size)
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
        corr = compute_rollout_correction(old_all, local.plan.concat(local.rollout)[0],
                                          local.plan.concat(local.mask)[0], cfg.correction, cu_seqlens=cu,
                                          cp_group=cp_group, dp_group=dp_group, check_inputs=False)
        loss_mask = _unconcat(corr.response_mask, local.mask)
        is_weights = None if corr.is_weights is None else _unconcat(corr.is_weights, local.mask)
        metrics = corr.metrics
    normalizers = _normalizers(loss_mask, local, cfg, cp_group, dp_group)
    return _LossInputs(old, ref, loss_mask, is_weights, normalizers, metrics)


def _unconcat(values: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of plan.concat: one tensor per micro-batch, shaped like `like`'s."""
    return [part.view(ref.shape) for part, ref in zip(values.split([ref.shape[0] for ref in like]), like)]


def _normalizers(loss_masks: list[torch.Tensor], local: _Local, cfg: StepConfig, cp_group, dp_group) -> list:
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
    plan = _plan(batch, model_chunks, groups, micro_batch_size=cfg.micro_batch_size,
                 max_tokens=cfg.max_tokens_per_micro_batch, same_count_over_dp=True)
    local = _cut(batch, plan)
    is_last = groups.is_pipeline_last_stage()
    correct_in_loss = cfg.correction.bypass_mode  # bypass PPO and bypass policy gradient
    _check_bypass_pg_batch_norm(cfg, plan.num_microbatches)
    bypass_ppo = correct_in_loss and not cfg.use_policy_gradient
    # Bypass PPO's loss needs only the RS/veto mask (no IS weights: the PPO ratio is the weight).
    mask_only = _mask_only(cfg.correction) if bypass_ppo else None
    loss_cfg = dataclasses.replace(cfg.loss, loss_type="policy_gradient") if cfg.use_policy_gradient else cfg.loss
    inputs = (_prepare_loss_inputs(local, cfg, groups, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs,
                                   correction=correction) if is_last else None)
    cp_group = _group_or_none(groups.cp, groups.cp_size)
    dp_group = _group_or_none(groups.dp, groups.dp_size)
    scale = loss_scale_for_schedule(plan.num_microbatches, groups)
    terms, partials, corr_metrics = [], [], []
    theta_log_probs: list[torch.Tensor | None] = [None] * plan.num_microbatches  # bypass PPO: detached pi_theta
    with_entropy = cfg.loss.entropy_coeff != 0.0

    def loss_fn(mb, logits):
        cu = local.cu_seqlens(mb)
        # Entropy only for the loss: actor/entropy comes from the pi_old pass (old_pass_entropy).
        log_prob, entropy = _log_probs(logits, local.targets[mb], groups, cfg.temperature, entropy=with_entropy)
        loss_mask, is_weights = inputs.loss_mask[mb], None if inputs.is_weights is None else inputs.is_weights[mb]
        if bypass_ppo:
            # RS + veto from pi_theta vs pi_rollout; per-sequence decisions need only the CP group.
            theta_log_probs[mb] = log_prob.detach()
            loss_mask = compute_rollout_correction(theta_log_probs[mb], local.rollout[mb], loss_mask, mask_only,
                                                   cu_seqlens=cu, cp_group=cp_group, check_inputs=False).response_mask
        elif correct_in_loss:
            corr = compute_rollout_correction(log_prob.detach(), local.rollout[mb], loss_mask, cfg.correction,
                                              cu_seqlens=cu, cp_group=cp_group, dp_group=dp_group,
                                              check_inputs=False)
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
        _run_schedule(model_chunks, local, loss_fn, groups=groups, forward_only=False, routing=replay_pass)
    lr = current_lr(optimizer)
    update_successful, grad_norm = step_optimizer(optimizer)

    metrics = {}
    if is_last and bypass_ppo:
        # The whole mini-batch's pi_theta at once: metrics (and the mask, equal to the loss's) as
        # one process on the full batch would compute them, whatever the micro-batches.
        theta, cu = plan.concat(theta_log_probs)
        corr_metrics = [compute_rollout_correction(theta, plan.concat(local.rollout)[0], plan.concat(local.mask)[0],
                                                   cfg.correction, cu_seqlens=cu, cp_group=cp_group,
                                                   dp_group=dp_group, check_inputs=False).metrics]
    if is_last:
        metrics = _last_stage_metrics(terms, partials, corr_metrics or [inputs.correction_metrics], plan, groups,
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


# ---- metrics -------------------------------------------------------------------------------

def _last_stage_metrics(terms, partials, corr_metrics, plan: MicroBatchPlan, groups: ParallelGroups, cp_group,
                        dp_group) -> dict[str, torch.Tensor]:
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
