"""Rollout routing replay (R3) and the routing metrics of a mixture-of-experts policy.

What: the rollout engine records the experts it routed every token to (StepBatch.routed_experts_BTLK,
[B, T, MoE layers, k], -1 where it recorded none). With `rollout.routing_replay` every trainer forward
of those tokens (pi_old, the reference policy, each update, the recompute of an update) routes each
recorded token to the engine's experts; unrecorded tokens (prompt positions the engine did not report,
padding) are routed freely. Either way the trainer's free routing is compared with the engine's for
the metrics. A model whose config has no experts gets no driver: nothing runs for a dense model.

How: model/build.py gives every router a Megatron-Core RouterReplay (`router.router_replay`), whose
`get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)` Megatron calls in place of
its top-k (moe_utils.topk_routing_with_score_function, 0.16.1 and 0.19.2 alike). `RoutingReplay.of`
swaps each for a subclass (`_replay_router_class`) that computes the default (free) top-k, takes the
target's rows where one is recorded, and gathers the probabilities of the chosen experts from the
live scores (as Megatron's own replay does), so the router still gets gradients. The class's global instance list
is not used: a run holds several models (the reference policy), and the list would drive them all;
each model has its own driver, found through a walk of its chunks, each router mapped to its global
MoE layer index (router.layer_number; a PP/VPP stage holds some of the layers).

Layout: the targets of a micro-batch are cut exactly like its tokens (microbatches.py: padded
`[b, s_local]` or packed THD `[n_local]`, this CP rank's zigzag share), then put in the order the
router sees them: hidden states are `[S, B, H]` and the router flattens them S-major (row s * B + b),
and under sequence parallelism each TP rank holds the contiguous S/tp slice of rank tp_rank.

Recompute: a checkpointed forward (full recompute, or a recomputed MLP) runs under no_grad inside
Megatron's CheckpointFunction and again in backward, outside our forward step, for the micro-batch
whose backward it is. Each router queues the routing it used in a checkpointed forward of a training
pass and the recompute pops it (first in, first out: a chunk's backwards run in the order of its
forwards), so the recompute routes exactly as the forward did, replay or not. Everything is cleared at
the end of each pass; a non-empty queue then is an error.

Metrics (`routing_metrics`, one all-reduce over the world, once per step): `moe/routing_mismatch_fraction`
(response tokens whose top-k set differs between the engine and the trainer's free routing, per MoE
layer, then the mean over layers; with replay on, a layer's free top-k is taken on the hidden states
the replayed layers before it produced, so each layer's own disagreement is measured) and
`moe/expert_load_max_over_mean` (tokens per expert of the routing the trainer used, over the positions
the sequences need, max / mean, mean over layers), both from the passes that collect them (pi_old's;
bypass mode's updates); `moe/aux_loss` (Megatron's load-balancing loss without its coefficient, per
MoE layer and update micro-batch, read from its MoE logging tracker and reduced as Megatron reduces
it) when model.moe.aux_loss_coeff > 0. Without sequence parallelism every TP rank routes the same
tokens: only TP rank 0 counts them.

Memory: the targets of a pass, int64 [tokens, MoE layers, k] per micro-batch on this rank, and one
[tokens, k] queue entry per checkpointed MoE layer between a forward and its recompute.
"""
from __future__ import annotations

import collections
import contextlib
import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..model.build import forget_router_replays

if TYPE_CHECKING:
    from ..parallel.groups import ParallelGroups
    from .microbatches import MicroBatchPlan


def moe_layer_indices(config: Any) -> list[int]:
    """Global indices of the MoE layers of a TransformerConfig (moe_layer_freq: a 0/1 list or every
    n-th layer), the axis 2 of routed_experts_BTLK (DecoderShape.moe_layers)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i for i in range(config.num_layers) if i % freq == 0]
    return [i for i, is_moe in enumerate(freq) if is_moe]


def router_rows(x: torch.Tensor, *, packed: bool, sp_size: int, sp_rank: int) -> torch.Tensor:
    """A micro-batch's per-token values (`[b, s_local, ...]`, or packed `[n_local, ...]`) in the order
    the router sees its tokens: `[S, B]` flattened S-major, this TP rank's slice under sequence
    parallelism."""
    x_SB = x[:, None] if packed else x.transpose(0, 1)
    if sp_size > 1:
        x_SB = x_SB.chunk(sp_size, dim=0)[sp_rank]
    return x_SB.flatten(0, 1)


def sequence_valid_mask(response_mask_BT: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: the input positions a sequence needs (through its last response position)."""
    from .microbatches import sequence_lengths

    lengths = sequence_lengths(response_mask_BT)
    return torch.arange(response_mask_BT.shape[1], device=lengths.device)[None] < lengths[:, None]


@functools.cache
def _replay_router_class():
    """The RouterReplay subclass (made on first use: megatron.core is imported lazily)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    class ReplayRouter(RouterReplay):
        """One router's replay: targets of the current micro-batch, a queue for recompute."""

        def __init__(self, driver: "RoutingReplay", moe_index: int) -> None:
            super().__init__()
            forget_router_replays([self])  # not in the global list (module docstring)
            self.driver, self.moe_index = driver, moe_index
            self.forward_target: torch.Tensor | None = None   # int64 [N, k], -1: free
            self.forward_stats: tuple | None = None            # (engine [N, k], compare [N], valid [N])
            self.recompute_queue: collections.deque[torch.Tensor] = collections.deque()

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            pass_ = self.driver.active
            if pass_ is None:  # outside a trainer pass (export, evaluation): Megatron's routing
                return default_compute_topk(scores, topk, num_groups, group_topk)
            if not self.driver.in_forward:  # a recompute in backward: the forward's routing again
                if not self.recompute_queue:
                    raise RuntimeError(f"MoE layer {self.moe_index}: a recomputed forward found no queued routing "
                                       "(the recompute ran outside a checkpointed training forward)")
                chosen = self.recompute_queue.popleft().to(scores.device)
                return scores.gather(1, chosen), chosen
            free_values, free = default_compute_topk(scores, topk, num_groups, group_topk)
            values, chosen = free_values, free
            target = self.forward_target
            if target is not None:
                target = target.to(scores.device)
                chosen = torch.where(target[:, :1] >= 0, target, free)
                values = scores.gather(1, chosen)
            if pass_.expects_backward and not torch.is_grad_enabled():
                self.recompute_queue.append(chosen.detach())  # a checkpointed forward: recomputed later
            if self.forward_stats is not None:
                self.driver.accumulate(self.moe_index, free.detach(), chosen.detach(), *self.forward_stats,
                                       num_experts=scores.shape[-1])
            return values, chosen

        def clear(self) -> None:
            self.forward_target = self.forward_stats = None
            self.recompute_queue.clear()
            self.clear_indices()

    return ReplayRouter


class RoutingReplay:
    """The routing replay of one model (its chunks): the routers, the running pass, the metric sums."""

    def __init__(self, model_chunks: list[Any]) -> None:
        config = model_chunks[0].config
        if getattr(config, "moe_router_fusion", False):
            raise ValueError("moe_router_fusion computes the top-k in Transformer Engine's fused kernel, which "
                             "bypasses RouterReplay: routing replay and the routing metrics need it off")
        self.moe_layers = moe_layer_indices(config)
        self.num_experts = config.num_moe_experts
        self.sequence_parallel = bool(config.sequence_parallel)
        cls = _replay_router_class()
        # model chunk (by id) -> its routers' replays in layer order
        self.routers: dict[int, list[Any]] = {}
        for chunk in model_chunks:
            mine = []
            for module in chunk.modules():
                replay = getattr(module, "router_replay", None)
                if replay is None or not hasattr(module, "layer_number"):
                    continue
                if not isinstance(replay, cls):  # (model/build.py took Megatron's own out of its global list)
                    replay = module.router_replay = cls(self, self.moe_layers.index(module.layer_number - 1))
                mine.append(replay)
            self.routers[id(chunk)] = sorted(mine, key=lambda r: r.moe_index)
        self.active: ReplayPass | None = None
        self.in_forward = False
        self._reset_sums()

    @classmethod
    def of(cls, model_chunks: list[Any]) -> "RoutingReplay | None":
        """The model's driver (made on first use, kept on its first chunk); None for a dense model."""
        first = model_chunks[0]
        if not getattr(first.config, "num_moe_experts", None):
            return None
        driver = first.__dict__.get("_routing_replay")
        if driver is None:
            driver = cls(model_chunks)
            first.__dict__["_routing_replay"] = driver
        return driver

    # ---- metric sums (device tensors, reduced once per step by routing_metrics) ----

    def _reset_sums(self, device: torch.device | None = None) -> None:
        layers = len(self.moe_layers)
        self.mismatch_L = torch.zeros(layers, dtype=torch.float64, device=device)
        self.compared_L = torch.zeros(layers, dtype=torch.float64, device=device)
        self.load_LE = torch.zeros(layers, self.num_experts, dtype=torch.float64, device=device)
        self.engine_routing = False      # a collecting pass had the engine's routing
        self.train_microbatches = 0      # forward micro-batches of training passes (for moe/aux_loss)

    def accumulate(self, layer: int, free_NK: torch.Tensor, chosen_NK: torch.Tensor, engine_NK: torch.Tensor | None,
                   compare_N: torch.Tensor | None, valid_N: torch.Tensor, *, num_experts: int) -> None:
        device = chosen_NK.device
        if self.load_LE.device != device:
            self.mismatch_L, self.compared_L, self.load_LE = (
                t.to(device) for t in (self.mismatch_L, self.compared_L, self.load_LE))
        used = chosen_NK[valid_N.to(device)].reshape(-1)
        self.load_LE[layer] += torch.bincount(used, minlength=num_experts).to(torch.float64)
        if engine_NK is None:
            return
        engine_NK = engine_NK.to(device)
        compare_N = compare_N.to(device) & (engine_NK[:, 0] >= 0)
        differs_N = (free_NK.sort(dim=-1).values != engine_NK.sort(dim=-1).values).any(dim=-1)
        self.mismatch_L[layer] += (differs_N & compare_N).sum()
        self.compared_L[layer] += compare_N.sum()

    # ---- passes -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def run(self, plan: MicroBatchPlan, batch: Any, groups: ParallelGroups, *, replay: bool, collect: bool,
            training: bool):
        """One schedule pass over `plan`'s micro-batches of `batch` (a StepBatch): `replay` routes the
        engine's recorded tokens to its experts, `collect` adds to the metric sums, `training` (a
        forward/backward pass) queues the routing of checkpointed forwards for their recompute."""
        assert self.active is None, "one routing-replay pass at a time"
        self.active = ReplayPass(self, plan, batch, groups, replay=replay, collect=collect, training=training)
        try:
            yield self.active
            self.check_empty()
        finally:
            self.active, self.in_forward = None, False
            for router in self.all_routers():
                router.clear()

    def all_routers(self) -> list[Any]:
        return [r for routers in self.routers.values() for r in routers]

    def check_empty(self) -> None:
        """Every queued routing was replayed by its recompute, and no target is left set."""
        for router in self.all_routers():
            assert not router.recompute_queue, (f"MoE layer {router.moe_index}: {len(router.recompute_queue)} queued "
                                                "routings were never recomputed")
            assert router.forward_target is None and router.target_topk_idx is None


class ReplayPass:
    """The targets and masks of one pass, cut like its micro-batches' tokens."""

    def __init__(self, driver: RoutingReplay, plan: MicroBatchPlan, batch: Any, groups: ParallelGroups, *,
                 replay: bool, collect: bool, training: bool) -> None:
        self.driver, self.plan, self.expects_backward = driver, plan, training
        engine = batch.routed_experts_BTLK
        if engine is not None and engine.shape[2] != len(driver.moe_layers):
            raise ValueError(f"StepBatch.routed_experts_BTLK has {engine.shape[2]} MoE layers, the model has "
                             f"{len(driver.moe_layers)} (layers {driver.moe_layers})")
        if replay and engine is None:
            raise ValueError("rollout.routing_replay needs the experts the rollout engine routed each token to "
                             "(StepBatch.routed_experts_BTLK), and this batch has none: use an engine that records "
                             "them, or set rollout.routing_replay: false")
        self.replay = replay
        self.collect = collect
        sp = driver.sequence_parallel and groups.tp_size > 1
        self._rows = dict(packed=plan.is_packed, sp_size=groups.tp_size if sp else 1,
                          sp_rank=groups.tp_rank if sp else 0)
        # Without sequence parallelism every TP rank routes the same tokens: TP rank 0 counts them.
        self.counts = collect and (sp or groups.tp_rank == 0)
        needs_engine = self.replay or self.counts
        self.engine = plan.split(engine.long(), fill=-1) if needs_engine and engine is not None else None
        if self.counts:
            mask = batch.response_mask_BT
            self.compare = plan.split(mask != 0)
            self.valid = plan.split(sequence_valid_mask(mask.to(plan.micro_batches[0].index.device)))
        if collect:
            driver.engine_routing |= engine is not None
        if training:
            driver.train_microbatches += plan.num_microbatches

    @contextlib.contextmanager
    def forward(self, chunk: Any, mb: int):
        """Around the forward of micro-batch `mb` through model chunk `chunk`."""
        driver = self.driver
        routers = driver.routers.get(id(chunk), [])
        engine = None if self.engine is None else router_rows(self.engine[mb], **self._rows)
        stats = None
        if self.counts:
            stats = (router_rows(self.compare[mb], **self._rows), router_rows(self.valid[mb], **self._rows))
        for router in routers:
            engine_NK = None if engine is None else engine[:, router.moe_index]
            router.forward_target = engine_NK if self.replay else None
            if stats is not None:
                router.forward_stats = (engine_NK, stats[0], stats[1])
        driver.in_forward = True
        try:
            yield
        finally:
            driver.in_forward = False
            for router in routers:
                router.forward_target = router.forward_stats = None


def routing_pass(model_chunks: list[Any], plan: MicroBatchPlan, batch: Any, groups: ParallelGroups, *,
                 replay: bool, collect: bool, training: bool):
    """The context of a schedule pass: a ReplayPass for a MoE model, None (nothing to do) for a dense one."""
    driver = RoutingReplay.of(model_chunks)
    if driver is None:
        return contextlib.nullcontext(None)
    return driver.run(plan, batch, groups, replay=replay, collect=collect, training=training)


def forward_context(pass_: ReplayPass | None, chunk: Any, mb: int):
    return contextlib.nullcontext() if pass_ is None else pass_.forward(chunk, mb)


# ---- metrics ------------------------------------------------------------------------------------

def routing_metrics(model_chunks: list[Any], groups: ParallelGroups, device: torch.device
                    ) -> dict[str, torch.Tensor]:
    """The step's MoE metrics (module docstring), identical on every rank, and the sums reset.
    Collective over the world (every rank calls it; nothing for a dense model)."""
    driver = RoutingReplay.of(model_chunks)
    if driver is None:
        return {}
    layers = len(driver.moe_layers)
    aux_L = _tracked_aux_loss(driver.moe_layers, device)
    sums = torch.cat([driver.mismatch_L.to(device), driver.compared_L.to(device), driver.load_LE.to(device).flatten(),
                      aux_L.double()])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    mismatch_L, compared_L = sums[:layers], sums[layers:2 * layers]
    load_LE = sums[2 * layers:2 * layers + layers * driver.num_experts].view(layers, driver.num_experts)
    aux_sum_L = sums[2 * layers + layers * driver.num_experts:]
    metrics = {}
    if driver.engine_routing:
        measured = compared_L > 0
        fraction_L = mismatch_L / compared_L.clamp(min=1)
        metrics["moe/routing_mismatch_fraction"] = ((fraction_L * measured).sum()
                                                    / measured.sum().clamp(min=1)).float()
    mean_L = load_LE.mean(dim=1)
    loaded = mean_L > 0
    ratio_L = load_LE.amax(dim=1) / mean_L.clamp(min=1e-30)
    metrics["moe/expert_load_max_over_mean"] = ((ratio_L * loaded).sum() / loaded.sum().clamp(min=1)).float()
    config = model_chunks[0].config
    if getattr(config, "moe_aux_loss_coeff", 0) and driver.train_microbatches:
        # Megatron's reduction of its tracker: each TP x CP rank holds its share of a micro-batch's
        # loss (summed), the DP ranks' are averaged; then the mean over micro-batches and MoE layers.
        per_layer = aux_sum_L.sum() / (groups.dp_size * driver.train_microbatches)
        metrics["moe/aux_loss"] = (per_layer / layers).float()
    _clear_aux_tracker()
    driver._reset_sums(device)
    return metrics


def _tracked_aux_loss(moe_layers: list[int], device: torch.device) -> torch.Tensor:
    """This rank's load-balancing loss per MoE layer, summed over its update micro-batches (Megatron's
    MoE logging tracker, `load_balancing_loss`; zeros where this stage holds no such layer)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    if entry is None:
        return torch.zeros(len(moe_layers), device=device)
    return entry["values"].to(device)[torch.tensor(moe_layers, device=device)]


def _clear_aux_tracker() -> None:
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()
