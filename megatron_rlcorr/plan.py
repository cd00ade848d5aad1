"""`megatron-rlcorr plan RECIPE --nodes N --gpus-per-node G`: check a layout before queueing for GPUs.

Runs anywhere (no GPU, no checkpoint, no data: a recipe with `model.architecture` is planned from
the preset). It validates the recipe for a launch of N x G ranks (`Recipe.check_layout(here=
False)`: layout, batch sizes, sequence lengths, rollout settings; each failure names the setting
and values that work), then prints the parameter count (total and, for a mixture-of-experts
model, active per token and the routed experts of the most-loaded GPU), the estimated memory
per GPU (recipe/memory.py) against the GPU's, and, when it fits, the launch command; `--json` prints the same
as one object, whose `command` and `torchrun` (the launch) are null when the layout does not fit;
`--search` lists the layouts that fit, cheapest communication first (recipe/layout_search.py).
With `rollout.placement: separate` the last rollout.num_ranks ranks of the launch only generate:
the layout is checked (and searched) over the other ranks, the trainer ranks, whose memory holds
no engine, and the plan says what a rollout rank holds (the engine).

Exit codes: 0 the layout validates and fits, 1 it validates but does not fit (or --search found
nothing), 2 bad input (the recipe, an override or the layout).
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Sequence

from .recipe import Recipe, load_recipe
from .recipe.memory import (HEADROOM, GiB, estimate_memory, micro_batch_tokens, parameter_counts,
                             rollout_rank_bytes, usable_bytes)
from .runtime import EXIT_BAD_INPUT

DEFAULT_MASTER_PORT = 29500


def plan_report(path: str | Path, overrides: Sequence[str], *, nodes: int, gpus_per_node: int,
                gpu_memory_gib: float = 80.0) -> dict[str, Any]:
    """The plan as one JSON-ready mapping; ValueError for bad input (module docstring)."""
    _check_launch(nodes, gpus_per_node, gpu_memory_gib)
    recipe = load_recipe(path, overrides)
    world = nodes * gpus_per_node
    dp = recipe.check_launch(world, here=False)
    trainers = recipe.rollout.trainer_world(world)
    counts = parameter_counts(recipe.model, recipe.parallel)
    memory = estimate_memory(recipe, trainers, gpu_memory_gib * GiB)
    rollout_ranks = _rollout_ranks(recipe, world, gpu_memory_gib)
    trainer_fits = memory.total <= usable_bytes(gpu_memory_gib)
    fits = trainer_fits and (rollout_ranks is None or rollout_ranks["fits"])
    p, model = recipe.parallel, recipe.model
    return {
        "recipe": str(path), "overrides": list(overrides), "nodes": nodes, "gpus_per_node": gpus_per_node,
        "world_size": world, "gpu_memory_gib": gpu_memory_gib,
        "placement": recipe.rollout.placement, "trainer_ranks": trainers, "rollout_ranks": rollout_ranks,
        "layout": {"tp": p.tp, "pp": p.pp, "cp": p.cp, "vpp": p.vpp, "dp": dp, "ep": p.ep, "etp": p.etp,
                   "sequence_parallel": p.sequence_parallel,
                   "recompute": None if model.recompute is None else model.recompute.granularity,
                   "distributed_optimizer": recipe.optim.use_distributed_optimizer,
                   "micro_batch_tokens": micro_batch_tokens(recipe),
                   "rollout_engine": recipe.rollout.engine,
                   "rollout_tensor_parallel_size": recipe.rollout.tensor_parallel_size},
        "padded_vocab_size": counts.padded_vocab_size,
        "params_total": counts.total,
        "params_active": counts.active,
        "params_per_gpu_max": counts.per_gpu_max,
        "expert_params_per_gpu_max": max(counts.experts_per_stage),
        "moe": None if model.moe is None else {
            "num_experts": model.moe.num_experts, "router_topk": model.moe.router_topk,
            "moe_layers": len(model.decoder_shape.moe_layers),
            "experts_per_ep_rank": model.moe.num_experts // p.ep},
        "memory_gib_per_gpu": memory.gib(),
        "phases_gib_per_gpu": memory.phases_gib(),
        "offload": {"params": model.offload_params, "grads": model.offload_grads,
                    "optimizer": recipe.optim.offload_optimizer},
        "most_loaded_stage": memory.stage,
        "usable_gib": round(usable_bytes(gpu_memory_gib) / GiB, 2),
        "trainer_fits": trainer_fits,
        "fits": fits,
        # No launch command for a layout that does not fit (the text output prints none either).
        "command": launch_command(path, overrides, nodes=nodes, gpus_per_node=gpus_per_node) if fits else None,
        "torchrun": torchrun_command(path, overrides, nodes=nodes, gpus_per_node=gpus_per_node) if fits else None,
    }


def _rollout_ranks(recipe: Recipe, world: int, gpu_memory_gib: float) -> dict[str, Any] | None:
    """The rollout ranks of rollout.placement separate and what each holds (None when colocated):
    the engine only, one weight set whatever rollout.max_staleness (recipe/memory.py)."""
    rollout = recipe.rollout
    if not rollout.separate:
        return None
    engine = rollout_rank_bytes(recipe, gpu_memory_gib * GiB)
    return {"count": rollout.num_ranks, "ranks": [world - rollout.num_ranks, world - 1],
            "engines": rollout.num_ranks // rollout.tensor_parallel_size, "max_staleness": rollout.staleness,
            "engine_gib_per_gpu": round(engine / GiB, 2), "fits": engine <= usable_bytes(gpu_memory_gib)}


def _check_launch(nodes: int, gpus_per_node: int, gpu_memory_gib: float) -> None:
    for name, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not gpu_memory_gib > 0:
        raise ValueError(f"--gpu-memory-gib must be > 0, got {gpu_memory_gib}")


def launch_command(path: str | Path, overrides: Sequence[str], *, nodes: int, gpus_per_node: int) -> str:
    """The command that launches the recipe: one launch.sh per node (tools/launch.sh), or
    `megatron-rlcorr train` on a single node."""
    args = _quoted(path, overrides)
    if nodes == 1:
        return f"megatron-rlcorr train --config {args} --nproc {gpus_per_node}"
    return (f"NNODES={nodes} GPUS_PER_NODE={gpus_per_node} NODE_RANK=<0..{nodes - 1}> MASTER_ADDR=<first node> "
            f"MASTER_PORT={DEFAULT_MASTER_PORT} bash tools/launch.sh {args}")


def torchrun_command(path: str | Path, overrides: Sequence[str], *, nodes: int, gpus_per_node: int) -> str:
    """What each node runs (tools/launch.sh runs exactly this, with the node's rank and node 0's address)."""
    args = _quoted(path, overrides)
    return (f"python -m torch.distributed.run --nnodes={nodes} --node-rank=$NODE_RANK --nproc-per-node={gpus_per_node} "
            f"--master-addr=$MASTER_ADDR --master-port={DEFAULT_MASTER_PORT} -m megatron_rlcorr.train --config {args}")


def _quoted(path: str | Path, overrides: Sequence[str]) -> str:
    return " ".join(shlex.quote(str(a)) for a in (path, *overrides))


def format_report(report: dict[str, Any]) -> str:
    layout, memory = report["layout"], report["memory_gib_per_gpu"]
    recompute = layout["recompute"] or "none"
    separate = report["rollout_ranks"] is not None
    lines = [
        f"plan: {report['recipe']} on {report['nodes']} x {report['gpus_per_node']} GPUs "
        f"({report['gpu_memory_gib']:g} GiB each)",
        *([_ranks_line(report)] if separate else []),
        f"layout: tp={layout['tp']} pp={layout['pp']} cp={layout['cp']} vpp={layout['vpp']} dp={layout['dp']} "
        + (f"ep={layout['ep']} etp={layout['etp']} " if report["moe"] else "") +
        f"sequence_parallel={layout['sequence_parallel']} recompute={recompute} "
        f"distributed_optimizer={layout['distributed_optimizer']}",
        f"  micro-batch: {layout['micro_batch_tokens']} tokens per rank; rollout: {layout['rollout_engine']} "
        f"with tensor_parallel_size {layout['rollout_tensor_parallel_size']}; "
        f"padded vocabulary {report['padded_vocab_size']}",
        _parameters_line(report),
        f"memory per {'trainer ' if separate else ''}GPU (GiB, estimate) on the most-loaded pipeline stage, "
        f"{report['most_loaded_stage']} of 0..{layout['pp'] - 1}:",
    ]
    for name in ("weights", "gradients", "optimizer", "activations", "logits", "rollout"):
        lines.append(f"  {name:<12} {memory[name]:>8.2f}")
    verdict = "fits" if report["trainer_fits"] else "does NOT fit: try `--search`"
    lines.append(f"  {'total':<12} {memory['total']:>8.2f} of {report['usable_gib']:g} usable "
                 f"({report['gpu_memory_gib']:g} less {HEADROOM:.0%} headroom): {verdict}")
    if separate:
        lines.append("  (a trainer rank holds no engine: total = weights + gradients + optimizer + activations + "
                     "logits)")
        lines.append(_rollout_memory_line(report))
    else:
        phases, offload = report["phases_gib_per_gpu"], report["offload"]
        moved = [name for name in ("params", "grads", "optimizer") if offload[name]]
        lines.append(f"  phases: training {phases['training']:.2f}, generation {phases['generation']:.2f} "
                     f"(offloaded while generating: {', '.join(moved) if moved else 'nothing'}, "
                     f"{phases['offloaded']:.2f})")
        lines.append("  (total = the larger of training (weights + gradients + optimizer + activations + logits + "
                     "what the engine keeps while asleep) and generation (the states not offloaded + the engine's "
                     "share))")
    if not report["fits"]:
        lines.append("launch: none printed, as this layout does not fit (`--search` lists the layouts that do)")
        return "\n".join(lines)
    lines.append("launch:")
    if report["nodes"] > 1:
        lines.append("  # on every node (or under SLURM: srun --nodes=N --ntasks-per-node=1 bash tools/launch.sh ...)")
    lines.append(f"  {report['command']}")
    if report["nodes"] > 1:
        lines.append("  # which runs on each node:")
        lines.append(f"  {report['torchrun']}")
    return "\n".join(lines)


def _ranks_line(report: dict[str, Any]) -> str:
    trainers, rollout = report["trainer_ranks"], report["rollout_ranks"]
    first, last = rollout["ranks"]
    return (f"ranks: {report['world_size']} = {trainers} trainer ranks (0..{trainers - 1}) + {rollout['count']} "
            f"rollout ranks ({first}..{last}: {rollout['engines']} engine(s) of tensor_parallel_size "
            f"{report['layout']['rollout_tensor_parallel_size']}); rollout.placement: separate, the trainer trains "
            f"on batches at most {rollout['max_staleness']} step(s) stale")


def _rollout_memory_line(report: dict[str, Any]) -> str:
    rollout, layout = report["rollout_ranks"], report["layout"]
    if layout["rollout_engine"] == "vllm":
        held = "vLLM's gpu_memory_utilization share: its weights and KV cache"
    else:
        held = "the embedded engine's copy of the weights"
    verdict = "fits" if rollout["fits"] else "does NOT fit"
    return (f"memory per rollout GPU (GiB, estimate): {rollout['engine_gib_per_gpu']:.2f}, {held} (one weight set "
            f"whatever rollout.max_staleness), nothing of training: {verdict} in {report['usable_gib']:g} usable")


def _parameters_line(report: dict[str, Any]) -> str:
    total, most = report["params_total"], report["params_per_gpu_max"]
    moe, layout = report["moe"], report["layout"]
    if moe is None:
        return f"parameters: {total:,} in total, {most:,} on the most-loaded GPU"
    return (f"parameters: {total:,} in total, {report['params_active']:,} active per token (top-{moe['router_topk']} "
            f"of {moe['num_experts']} experts in {moe['moe_layers']} MoE layers), {most:,} on the most-loaded GPU "
            f"({report['expert_params_per_gpu_max']:,} of them routed experts: {moe['experts_per_ep_rank']} per MoE "
            f"layer with ep={layout['ep']}, each split over etp={layout['etp']})")


def format_search(candidates: list, *, limit: int = 10, why_none: str = "") -> str:
    """The layouts that fit, or (none) why none does (layout_search.search_with_reason)."""
    if not candidates:
        return "no layout of the search space fits" + (f": {why_none}" if why_none else "")
    lines = ["layouts that fit, cheapest first (estimated communication + bubble + recompute s/step, memory GiB/GPU):"]
    for c in candidates[:limit]:
        experts = "" if c.ep is None else f"ep={c.ep} "
        lines.append(f"  tp={c.tp} pp={c.pp} cp={c.cp} {experts}dp={c.dp} recompute={c.recompute:<9} "
                     f"~{c.seconds:8.2f} s  {c.memory.total / GiB:6.1f} GiB   " + " ".join(map(shlex.quote, c.overrides)))
    if len(candidates) > limit:
        lines.append(f"  ... and {len(candidates) - limit} more")
    return "\n".join(lines)


def plan_command(path: str, overrides: Sequence[str], *, nodes: int, gpus_per_node: int, gpu_memory_gib: float,
                 as_json: bool, search: bool) -> int:
    """The CLI's `plan` (module docstring for the exit codes)."""
    import sys

    try:
        if search:
            from .recipe.layout_search import search_with_reason
            from .recipe.tree import read_tree

            _check_launch(nodes, gpus_per_node, gpu_memory_gib)
            candidates, why_none = search_with_reason(read_tree(Path(path), overrides), nodes=nodes,
                                                      gpus_per_node=gpus_per_node, gpu_memory_gib=gpu_memory_gib)
            if why_none and as_json:
                print(f"plan {path}: no layout of the search space fits: {why_none}", file=sys.stderr)
            if as_json:
                print(json.dumps([{"overrides": c.overrides, "tp": c.tp, "pp": c.pp, "cp": c.cp, "ep": c.ep or 1,
                                   "dp": c.dp, "recompute": c.recompute, "seconds_estimate": round(c.seconds, 3),
                                   "memory_gib_per_gpu": c.memory.gib()} for c in candidates], indent=1))
            else:
                print(format_search(candidates, why_none=why_none))
            return 0 if candidates else 1
        report = plan_report(path, overrides, nodes=nodes, gpus_per_node=gpus_per_node, gpu_memory_gib=gpu_memory_gib)
    except ValueError as err:
        print(f"error: plan {path}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(report, indent=1) if as_json else format_report(report))
    return 0 if report["fits"] else 1
