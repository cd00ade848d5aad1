"""`plan --search`: the Megatron layouts of a recipe that fit the GPUs, cheapest communication first.

Candidates: TP over the divisors of the heads and K/V groups up to one node's GPUs (TP's
per-layer collectives stay on NVLink), sequence parallelism whenever TP > 1, PP over the
divisors of the layers, CP of 1, 2, 4 or 8, with a MoE model (model.moe) EP over the divisors of
the experts that divide a stage's ranks (expert TP 1: each expert whole on its rank), and no,
selective (MLP + norms) or full (one layer per chunk) recomputation; the recipe's other settings
stay. A candidate is kept when the whole recipe validates for the launch
(`Recipe.check_layout(here=False)`) and its estimated memory (memory.py) fits the GPU with the
headroom `plan` keeps (plan.HEADROOM). With rollout.placement separate the candidates are layouts
of the trainer ranks (the launch less rollout.num_ranks), whose memory holds no engine; when a
rollout rank's engine does not fit its GPU (memory.rollout_rank_bytes) no candidate does. When none
fits, `search_with_reason` says why: that engine, the settings every layout fails to validate on
(batch sizes the data-parallel sizes do not divide, ...), or the memory of the smallest layout that
validates.

Ranking: an estimate of the seconds per RL step spent waiting on other GPUs, from bytes moved and
link bandwidth, plus the pipeline bubble and recomputation as time. The constants below are
round numbers for H100 nodes (NVLink within a node, one 400 Gb/s NIC per GPU across nodes); the
estimate orders layouts, it does not predict step times. Per GPU, per optimizer step:
- TP with SP: 4 all-gathers/reduce-scatters of the hidden state in the forward and 4 in the
  backward, each moving 2h bytes per token times (t-1)/t: 16h (t-1)/t bytes per token per layer.
- CP: each rank sends its K and V (and receives dK, dV): 8 kv (cp-1) / t bytes per token per layer.
- PP: 4h / t bytes per token per stage boundary (activation forward, gradient backward).
- EP: each MoE layer sends every token's k routed copies to their experts' ranks and back (the
  all-to-all dispatch and combine), forward and backward: 8 k h (e-1)/e bytes per token of the
  rank (its 1/t share with SP), e = EP.
- DP: reduce-scatter of fp32 gradients and all-gather of bf16 weights, 6 (d-1)/d bytes per
  parameter of the rank, d = DP x CP; for routed-expert parameters d is the expert-data-parallel
  size tp x cp x dp / (ep x etp).
- a group's link is NVLink when its ranks fit in one node (Megatron orders ranks TP, CP, DP, PP;
  the expert groups ETP, EP, expert-DP within a stage).
- compute: 6 x active parameters (a MoE model's top-k experts, not all) x tokens FLOPs at
  SUSTAINED_FLOPS per GPU; recomputation adds the forward of what it recomputes (a third of the
  whole, or of the dense MLPs' share with selective `mlp`), and the pipeline bubble
  (pp - 1) / (micro-batches x vpp) of the compute.
"""
from __future__ import annotations

import copy
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from .memory import (GiB, MemoryEstimate, estimate_memory, expert_optimizer_group_size, micro_batch_tokens,
                     parameter_counts, rollout_rank_bytes, sequence_tokens, usable_bytes)
from .recipe import Recipe, divisors, parse_recipe
from .tree import apply_overrides, read_tree

NVLINK_BYTES_PER_S = 450e9
NETWORK_BYTES_PER_S = 50e9
SUSTAINED_FLOPS = 400e12       # bf16, per H100, a typical sustained rate for large GEMMs
def _flow(value: Any) -> str:
    return "[" + ", ".join(map(str, value)) + "]" if isinstance(value, list) else str(value)


# The recomputation of each candidate, as the recipe's model.recompute (None: none)
RECOMPUTE_SETTINGS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "selective": {"granularity": "selective", "modules": ["mlp", "layernorm"]},
    "full": {"granularity": "full", "method": "uniform", "num_layers": 1},
}
RECOMPUTE_CHOICES: dict[str, tuple[str, ...]] = {
    name: ("model.recompute=" + ("null" if value is None else
                                 "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"),)
    for name, value in RECOMPUTE_SETTINGS.items()}


@dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    cp: int
    recompute: str
    dp: int
    memory: MemoryEstimate
    seconds: float          # the ranking estimate (module docstring)
    ep: int | None = None   # expert parallelism of a MoE model; None: a dense model (no ep/etp overrides)

    @property
    def overrides(self) -> list[str]:
        return layout_overrides(self.tp, self.pp, self.cp, self.recompute, self.ep)


def layout_overrides(tp: int, pp: int, cp: int, recompute: str, ep: int | None = None) -> list[str]:
    """The recipe overrides of one candidate layout (sequence parallelism whenever TP > 1; with `ep`,
    expert parallelism with expert TP 1)."""
    experts = [] if ep is None else [f"parallel.ep={ep}", "parallel.etp=1"]
    return [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.cp={cp}", "parallel.vpp=null",
            f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}", *experts, *RECOMPUTE_CHOICES[recompute]]


def search_layouts(path: str | Path, overrides: Sequence[str], *, nodes: int, gpus_per_node: int,
                   gpu_memory_gib: float) -> list[Candidate]:
    """Every candidate that validates and fits, cheapest first (module docstring)."""
    return search_with_reason(read_tree(Path(path), overrides), nodes=nodes, gpus_per_node=gpus_per_node,
                              gpu_memory_gib=gpu_memory_gib)[0]


def search_with_reason(tree: Mapping[str, Any], *, nodes: int, gpus_per_node: int,
                       gpu_memory_gib: float) -> tuple[list[Candidate], str]:
    """search_layouts of a recipe tree (read once; each candidate applies its layout to a copy), and,
    when no candidate fits, why not ("" otherwise: module docstring), from one pass over the layouts
    (each candidate is parsed, validated and estimated once). ValueError when the recipe itself does
    not load (its message)."""
    found = _search(tree, nodes, gpus_per_node, gpu_memory_gib)
    return found.candidates, "" if found.candidates else found.why()


@dataclass
class _Search:
    """What one pass over the search space found: the candidates that fit, and what `why` needs (the validation errors by setting, the smallest memory of a layout that validates)."""

    world: int
    gpu_memory_gib: float
    engine_bytes: float | None = None     # a rollout rank's engine, when it does not fit its GPU
    candidates: list[Candidate] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)   # by the setting each message starts with (its first word)
    examples: dict[str, str] = field(default_factory=dict)
    smallest: float | None = None

    def why(self) -> str:
        usable = usable_bytes(self.gpu_memory_gib) / GiB
        if self.engine_bytes is not None:
            return (f"a rollout rank's engine needs {self.engine_bytes / GiB:.1f} GiB, more than the {usable:.1f} GiB "
                    "usable: lower rollout.gpu_memory_utilization or raise rollout.tensor_parallel_size")
        if self.smallest is not None:
            return (f"every layout that validates needs at least {self.smallest / GiB:.1f} GiB per GPU, more than the "
                    f"{usable:.1f} GiB usable: more GPUs, a shorter token budget "
                    "(trainer.max_tokens_per_micro_batch), more offload, or a smaller engine share "
                    "(rollout.gpu_memory_utilization)")
        if not self.errors:
            return f"no tp x pp x cp of the search divides the {self.world} trainer ranks"
        top = self.errors.most_common(2)
        others = sum(self.errors.values()) - sum(count for _, count in top)
        reasons = "; ".join(f"{count} of them on {setting}, e.g. {self.examples[setting]}" for setting, count in top)
        return (f"no layout validates for {self.world} trainer ranks: {reasons}"
                + (f" ({others} more on other settings)" if others else ""))


def _search(tree: Mapping[str, Any], nodes: int, gpus_per_node: int, gpu_memory_gib: float) -> _Search:
    """One pass over the layouts: each is validated, and its memory estimated when it validates."""
    base = parse_recipe(tree)
    world = base.rollout.trainer_world(nodes * gpus_per_node)  # the ranks that train
    found = _Search(world, gpu_memory_gib)
    if base.rollout.separate and rollout_rank_bytes(base, gpu_memory_gib * GiB) > usable_bytes(gpu_memory_gib):
        found.engine_bytes = rollout_rank_bytes(base, gpu_memory_gib * GiB)
        return found
    for (tp, pp, cp, ep, recompute), outcome in _attempts(tree, base, world, gpus_per_node):
        if isinstance(outcome, ValueError):
            setting = str(outcome).split(" ", 1)[0]
            found.errors[setting] += 1
            found.examples.setdefault(setting, str(outcome))
            continue
        recipe, dp = outcome
        memory = estimate_memory(recipe, world, gpu_memory_gib * GiB)
        found.smallest = memory.total if found.smallest is None else min(found.smallest, memory.total)
        if memory.total <= usable_bytes(gpu_memory_gib):
            seconds = step_seconds(recipe, world, gpus_per_node)
            found.candidates.append(Candidate(tp, pp, cp, recompute, dp, memory, seconds, ep))
    found.candidates.sort(key=lambda c: (c.seconds, c.tp * c.pp * c.cp, c.ep or 1))
    return found


def _attempts(tree: Mapping[str, Any], base: Recipe, world: int, gpus_per_node: int):
    """Each layout of the search space with the recipe it makes and its data-parallel size, or the
    ValueError of the recipe's validation."""
    heads_and_groups = math.gcd(base.model.num_attention_heads, base.model.num_query_groups)
    moe = base.model.moe
    for tp in (t for t in divisors(heads_and_groups) if t <= gpus_per_node):
        for pp in divisors(base.model.num_layers):
            for cp in (1, 2, 4, 8):
                if world % (tp * pp * cp):
                    continue
                eps = [None] if moe is None else [e for e in divisors(moe.num_experts) if (world // pp) % e == 0]
                for ep, recompute in itertools.product(eps, RECOMPUTE_CHOICES):
                    try:
                        layout = layout_overrides(tp, pp, cp, recompute, ep)
                        recipe = parse_recipe(apply_overrides(copy.deepcopy(dict(tree)), layout))
                        outcome: Any = (recipe, recipe.check_layout(world, here=False))
                    except ValueError as err:
                        outcome = err
                    yield (tp, pp, cp, ep, recompute), outcome


def step_seconds(recipe: Recipe, world: int, gpus_per_node: int) -> float:
    """The ranking estimate of communication, bubble and recomputation time per RL step."""
    model, parallel, shape = recipe.model, recipe.parallel, recipe.model.decoder_shape
    tp, pp, cp, ep = parallel.tp, parallel.pp, parallel.cp, parallel.ep
    dp = world // (tp * pp * cp)
    h, kv = shape.hidden_size, shape.num_query_groups * shape.head_dim
    step_tokens = recipe.data.prompts_per_step * recipe.rollout.n * sequence_tokens(recipe)
    tokens = step_tokens / (dp * cp)          # what one rank's model-parallel group processes, per rank
    layers = shape.num_layers / pp
    mini_batches = recipe.data.prompts_per_step // (recipe.trainer.mini_batch_prompts or recipe.data.prompts_per_step)

    def link(span: int) -> float:
        return NVLINK_BYTES_PER_S if span <= gpus_per_node else NETWORK_BYTES_PER_S

    seconds = tokens * layers * 16 * h * (tp - 1) / tp / link(tp)
    seconds += tokens * layers * 8 * kv * (cp - 1) / tp / link(tp * cp)
    seconds += tokens * (4 * h / tp) * (pp - 1) / pp / link(world) if pp > 1 else 0.0
    if shape.moe is not None:
        routed_tokens = tokens / (tp if parallel.sequence_parallel else 1)
        moe_layers = len(shape.moe_layers) / pp
        seconds += (routed_tokens * moe_layers * 8 * shape.moe.router_topk * h * (ep - 1) / ep
                    / link(ep * parallel.etp))
    counts = parameter_counts(model, parallel)
    stage = max(range(pp), key=lambda i: counts.per_stage[i])
    experts = counts.experts_per_stage[stage]
    d, expert_d = dp * cp, expert_optimizer_group_size(parallel, world)
    seconds += mini_batches * (counts.per_stage[stage] - experts) * 6 * (d - 1) / d / link(tp * cp * dp)
    seconds += mini_batches * experts * 6 * (expert_d - 1) / expert_d / link(tp * cp * dp)
    compute = 6 * shape.active_parameter_count * step_tokens / (world * SUSTAINED_FLOPS)
    extra = compute * _recomputed_share(recipe)          # forward passes run again in the backward
    micro_batches = max(1, math.ceil(tokens / mini_batches / micro_batch_tokens(recipe)))
    bubble = (compute + extra) * (pp - 1) / (micro_batches * (parallel.vpp or 1))
    return seconds + bubble + extra


def _recomputed_share(recipe: Recipe) -> float:
    """The extra compute of recomputation, as a share of the step's: the forward (a third of
    forward + backward) of what is recomputed (the whole layer, or the dense MLPs' share of the
    layers' active parameters: selective `mlp` leaves a MoE layer's experts alone)."""
    recompute, shape = recipe.model.recompute, recipe.model.decoder_shape
    if recompute is None:
        return 0.0
    if recompute.granularity == "full":
        return 1 / 3
    dense = [i for i in range(shape.num_layers) if not shape.is_moe_layer(i)]
    active = sum(shape.layer_parameter_count(i, active=True) for i in range(shape.num_layers))
    mlp = 3 * shape.hidden_size * shape.ffn_hidden_size * len(dense) / active
    return mlp / 3 if "mlp" in recompute.modules else 0.0
