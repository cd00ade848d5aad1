"""The trainable model: Megatron-Core DDP chunks, Megatron's Adam and its learning-rate schedule.

`build_model_and_optimizer` returns what a training step needs:

- model chunks (one per virtual pipeline stage) wrapped in Megatron-Core's
  `DistributedDataParallel`: gradients accumulate in float32 buffers (`param.main_grad`) and are
  all-reduced over the data x context parallel group once per mini-batch, in
  `finalize_model_grads`, which also sums the tied embedding's gradient between the first and
  the last pipeline stage;
- Megatron-Core's optimizer (`get_megatron_optimizer`): Adam with gradient clipping over the
  model-parallel group, float32 master weights for a bf16 model;
- with `use_distributed_optimizer` (the default) the float32 master weights and Adam moments are
  sharded over the data x context parallel group (ZeRO-1: each rank keeps 1/(dp*cp) of them, which
  at 32B is the difference between 12 and 12/(dp*cp) bytes per parameter of optimizer state); DDP
  then reduce-scatters the gradients instead of all-reducing them, and the updated weights are
  all-gathered back after the step;
- `overlap_grad_reduce` starts each gradient bucket's reduction during the backward of the last
  micro-batch; `overlap_param_gather` (distributed optimizer only) defers the weight all-gather to
  the forward pre-hooks of the next forward. Deferred means stale: `sync_params` gathers them
  before anything reads the weights outside a forward (weight export to the rollout engine,
  checkpoints, Hugging Face export);
- mixture-of-experts models: the routed experts' weights are expert-parallel parameters
  (model/build.py marks them at every expert layout): DDP keeps their gradients in buffers of their
  own, reduced over the expert-data-parallel group, and Megatron's optimizer is a chain of two, the
  dense parameters' over DP x CP and the experts' over the expert groups (both from the
  `pg_collection`, which carries Megatron-Core's expert groups); its grad norm combines the two, so
  clipping sees the whole model's norm;
- `OptimizerParamScheduler`: linear warm-up from 0, then constant / linear / cosine decay to
  min_lr at `total_steps` (Megatron's convention: update k, counted from 0, uses the lr of step k,
  so with warm-up the first update has lr 0).

The pipeline schedule (`get_forward_backward_func`) reads its hooks from the model config:
`finalize_model_grads_func`, `grad_scale_func` (the optimizer's loss scale), `no_sync_func`
(no gradient reduction until the last micro-batch) and, with overlap, `grad_sync_func` /
`param_sync_func`. `install_schedule_hooks` sets them. The grad_sync_func is not optional with
overlap under pipeline parallelism: without it a stage's buckets are launched from the backward
hooks of its last micro-batch before the other virtual chunks finished, and measured on CPU/gloo
(pp2 x dp2, overlapped reduce-scatter) the weights then drifted 6e-3 from the reference after
three steps; with it they match to 1e-7.

Gradient scale: the schedule divides every micro-batch loss by the number of micro-batches
(and multiplies it by the CP size), DDP averages over DP x CP. Our losses are already global
sums (losses.global_loss_normalizers), so step.py multiplies each micro-batch loss by
`loss_scale_for_schedule(...)` to undo both.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from ..model.build import build_model_chunks
from ..model.config import ModelConfig
from ..parallel.cpu import enable_cpu_megatron

if TYPE_CHECKING:
    from ..parallel.groups import ParallelGroups


@dataclass(frozen=True)
class OptimSettings:
    """The recipe's `optim:` section: Adam, clipping and the learning-rate schedule."""

    lr: float = 1e-3                # peak learning rate; > 0
    min_lr: float = 0.0             # the lr at the end of a linear or cosine decay; 0 <= min_lr <= lr
    warmup_steps: int = 0           # RL steps of linear warm-up from lr 0 (so step 1 trains at lr 0); 0: none
    # After the warm-up: constant lr, or a linear / cosine decay that reaches min_lr after trainer.steps; the
    # schedule advances once per RL step, so every optimizer step of an RL step has the same lr.
    decay_style: Literal["constant", "linear", "cosine"] = "constant"
    weight_decay: float = 0.0       # decoupled (AdamW) weight decay; biases and norm weights are exempt
    adam_beta1: float = 0.9         # Adam's first-moment decay
    adam_beta2: float = 0.999       # Adam's second-moment decay
    adam_eps: float = 1e-8          # Adam's epsilon in the update's denominator
    clip_grad: float = 1.0          # clip the global gradient norm (all ranks) to this; 0: no clipping
    use_distributed_optimizer: bool = True  # shard float32 master weights and Adam moments over DP x CP (ZeRO-1)
    overlap_grad_reduce: bool = False       # reduce gradient buckets during the last micro-batch's backward
    # Defer the updated weights' all-gather to the next forward; needs use_distributed_optimizer and
    # overlap_grad_reduce.
    overlap_param_gather: bool = False
    # While the rollout engine generates, keep the optimizer's state (float32 master weights, Adam moments) in
    # host memory (pinned on CUDA), copied back before training (verl's optimizer_offload; training/offload.py)
    offload_optimizer: bool = False

    def __post_init__(self) -> None:
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("optim.overlap_param_gather overlaps the distributed optimizer's weight all-gather: "
                             "set optim.use_distributed_optimizer: true, or overlap_param_gather: false")
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise ValueError("optim.overlap_param_gather needs optim.overlap_grad_reduce: true (Megatron-Core's "
                             "DDP requires both)")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup_steps < 0 or self.clip_grad < 0:
            raise ValueError("warmup_steps and clip_grad must be >= 0")


def build_model_and_optimizer(model_cfg: ModelConfig, optim: OptimSettings, groups: ParallelGroups, *,
                              seed: int, total_steps: int) -> tuple[list[Any], Any, Any]:
    """(model_chunks, optimizer, scheduler) for this rank.

    model_chunks: list of DDP-wrapped GPTModel chunks (one, or vpp with virtual pipelining),
    initialised from `model.build.initial_weights` (model_cfg.hf_checkpoint, or the seeded
    `init_full_weights(model_cfg, seed)`, identical under any layout).
    total_steps: the number of optimizer steps of the run (the end of lr decay).
    """
    _check_schedule(optim, total_steps)
    enable_cpu_megatron()
    chunks = [_wrap_ddp(chunk, optim, groups, first=(i == 0))
              for i, chunk in enumerate(build_model_chunks(model_cfg, groups, seed=seed, main_grads=True))]
    optimizer = build_optimizer(chunks, model_cfg, optim, groups)
    scheduler = build_scheduler(optimizer, optim, total_steps)
    install_schedule_hooks(chunks, optimizer, groups, optim)
    return chunks, optimizer, scheduler


def _check_schedule(optim: OptimSettings, total_steps: int) -> None:
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1 (the number of optimizer steps), got {total_steps}")
    if optim.decay_style != "constant" and total_steps <= optim.warmup_steps:
        raise ValueError(f"optim.decay_style={optim.decay_style!r} decays the lr after optim.warmup_steps="
                         f"{optim.warmup_steps}, but the run has only {total_steps} steps: lower warmup_steps "
                         "or use decay_style: constant")


def _wrap_ddp(chunk, optim: OptimSettings, groups: ParallelGroups, *, first: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=optim.overlap_grad_reduce,
        # Megatron's own default, stated so that the parameter layout below uses the same buckets.
        bucket_size=max(40_000_000, 1_000_000 * groups.dp_size) if optim.overlap_grad_reduce else None,
        use_distributed_optimizer=optim.use_distributed_optimizer,
        overlap_param_gather=optim.overlap_param_gather,
        # Dispatch every chunk's all-gather from the schedule (param_sync_func), in the order the
        # pipeline runs them, as Megatron-LM does under virtual pipelining.
        align_param_gather=optim.overlap_param_gather and (groups.vpp_size or 1) > 1,
        check_for_nan_in_grad=False,
    )
    # Megatron's own get_model: only the first chunk splits its buffer into buckets (and DDP never
    # does on later pipeline stages).
    bucketed = first and groups.pp_rank == 0
    extra = {}
    if optim.use_distributed_optimizer and "full_param_layout" in inspect.signature(DistributedDataParallel).parameters:
        # megatron-core >= 0.19 wants the distributed optimizer's layout from the caller (it warns
        # and computes the same one itself otherwise).
        extra["full_param_layout"] = _full_param_layout(chunk, ddp_config, groups,
                                                        ddp_config.bucket_size if bucketed else None)
    return DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                   disable_bucketing=not first, pg_collection=groups.pg_collection, **extra)


def _full_param_layout(chunk, ddp_config, groups: ParallelGroups, bucket_size: int | None):
    """The distributed optimizer's padded layout of `chunk`'s trainable parameters in DDP's
    buffers: shards over DP x CP, the routed experts' over the expert-data-parallel group (the
    ranks holding the same expert shards). Without that size megatron-core 0.19 lays the experts
    out for DP x CP and DDP refuses the layout (measured at ep2 on two ranks: "Parameter layout was
    built for 2 optimizer shards but the buffer's data-parallel group has 1 ranks")."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    params = [p for p in chunk.parameters() if p.requires_grad]
    edp = groups.dp_cp_size if groups.edp is None else dist.get_world_size(groups.edp)
    return DistributedOptimizer.compute_full_param_layout(params, bucket_size, groups.dp_cp_size, ddp_config,
                                                          expert_data_parallel_world_size=edp)


def optimizer_config(model_cfg: ModelConfig, optim: OptimSettings):
    """Megatron-Core OptimizerConfig: Adam (decoupled weight decay), clipping, precision, sharding."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=model_cfg.bf16,
        params_dtype=model_cfg.torch_params_dtype,
        use_distributed_optimizer=optim.use_distributed_optimizer,
        overlap_param_gather=optim.overlap_param_gather,
    )


def build_optimizer(model_chunks: list[Any], model_cfg: ModelConfig, optim: OptimSettings, groups: ParallelGroups):
    from megatron.core.optimizer import get_megatron_optimizer

    return get_megatron_optimizer(optimizer_config(model_cfg, optim), model_chunks,
                                  use_gloo_process_groups=False, pg_collection=groups.pg_collection)


def build_scheduler(optimizer, optim: OptimSettings, total_steps: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=total_steps,
        lr_decay_style=optim.decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=total_steps,
        wd_incr_style="constant",
    )


def install_schedule_hooks(model_chunks: list[Any], optimizer, groups: ParallelGroups,
                           optim: OptimSettings) -> None:
    """Set the hooks Megatron's pipeline schedules read from every chunk's config."""
    from megatron.core.distributed import finalize_model_grads

    no_sync = _one_or_list([chunk.no_sync for chunk in model_chunks])
    grad_sync = _one_or_list([chunk.start_grad_sync for chunk in model_chunks]) if optim.overlap_grad_reduce else None
    param_sync = (_one_or_list([chunk.start_param_sync for chunk in model_chunks])
                  if optim.overlap_param_gather and (groups.vpp_size or 1) > 1 else None)
    # gloo matches batched isend/irecv between the same two ranks by posting order; with two
    # stages and interleaving, a stage's forward and backward partner is the same rank and the
    # activations of different micro-batches get swapped. Unbatched p2p keeps them in order.
    unbatched_p2p = groups.pp_size > 1 and dist.get_backend(groups.pp) == "gloo"
    for chunk in model_chunks:
        config = chunk.config
        if unbatched_p2p:
            config.batch_p2p_comm = False
        config.finalize_model_grads_func = partial(_finalize_grads, finalize_model_grads)
        config.grad_scale_func = optimizer.scale_loss
        config.no_sync_func = no_sync
        config.grad_sync_func = grad_sync
        config.param_sync_func = param_sync


def _one_or_list(funcs: list[Any]) -> Any:
    # The schedules take one function for one chunk and a list (one per chunk) under vpp.
    return funcs[0] if len(funcs) == 1 else funcs


def sync_params(model_chunks: list[Any]) -> None:
    """Make every weight current after an optimizer step (collective over DP x CP).

    Needed before reading weights outside a forward when `overlap_param_gather` defers the
    distributed optimizer's all-gather to the next forward's pre-hooks; a no-op otherwise. The
    synchronous gather marks the buckets as gathered, so the next forward does not repeat it.
    """
    for chunk in model_chunks:
        if chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def _finalize_grads(finalize, model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    # The schedule passes the pg_collection it was given (ours); keep that explicit.
    return finalize(model, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def loss_scale_for_schedule(num_microbatches: int, groups: ParallelGroups) -> float:
    """Factor on a micro-batch's share of the global loss so that the accumulated, DDP-reduced
    gradient is the gradient of the global loss: the schedule multiplies by cp / num_microbatches,
    DDP by 1 / (dp * cp)."""
    return float(num_microbatches * groups.dp_size)


def zero_grads(model_chunks: list[Any], optimizer) -> None:
    """Clear DDP's gradient buffers and the optimizer's (master) gradients before a mini-batch."""
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


def inner_optimizers(optimizer) -> list[Any]:
    """The optimizers inside Megatron's ChainedOptimizer (one per parameter group kind), or the
    optimizer itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def step_optimizer(optimizer) -> tuple[bool, float]:
    """Megatron's optimizer step, except that a step whose gradient is zero everywhere changes
    nothing: (updated, global grad norm; NaN when Megatron found inf/nan and skipped).

    Why: Adam with a zero gradient still moves every weight, by its decaying first moment
    (about lr x 0.67, 0.52, 0.36, ... on the steps after a single real gradient). An RL step
    produces a zero gradient when the correction rejected every token or every group's advantage
    is 0, and such a step must not change the policy: measured on tiny_hf_cpu at policy lag 2,
    DAPO's rejection sampling rejected every token from step 2 on, and two steps of drift on
    momentum alone took the policy from 10% right answers (after its one real update) to 2%,
    then 0% (docs/ablation). The pieces are Megatron's own (`prepare_grads`, `get_grad_norm`,
    clipping by the total norm, `step_with_ready_grads`), in the order `optimizer.step()` runs
    them; the norm is reduced over every rank, so all ranks skip together.
    """
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if optimizer.prepare_grads():  # inf/nan under fp16 loss scaling: Megatron's own skip
        return False, math.nan
    grad_norm = float(optimizer.get_grad_norm())
    if grad_norm == 0.0:
        return False, 0.0
    for part in inner_optimizers(optimizer):
        params = part.get_parameters()
        if params and part.config.clip_grad > 0.0 and not getattr(part, "is_stub_optimizer", False):
            clip_grad_by_total_norm_fp32(params, part.config.clip_grad, grad_norm,
                                         part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return bool(optimizer.step_with_ready_grads()), grad_norm


def current_lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def grad_buffers_norm(model_chunks: list[Any]) -> torch.Tensor:
    """Local L2 norm of the accumulated main_grad buffers (tests; no communication)."""
    total = torch.zeros((), dtype=torch.float64)
    for chunk in model_chunks:
        for param in chunk.parameters():
            grad = getattr(param, "main_grad", None)
            if grad is not None:
                total = total + grad.double().pow(2).sum().cpu()
    return total.sqrt()
