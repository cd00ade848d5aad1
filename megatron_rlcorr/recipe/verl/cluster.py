"""The layout for the source's cluster: trainer.nnodes x trainer.n_gpus_per_node -> `parallel` and
`model.recompute`, chosen as `megatron-rlcorr plan RECIPE --nodes N --gpus-per-node G --search`
chooses (recipe/layout_search.py). verl's one-step-off placement (actor_rollout_ref.hybrid_engine
false, the rollout on rollout.nnodes x rollout.n_gpus_per_node GPUs of its own) becomes
rollout.placement: separate with rollout.num_ranks those GPUs, launched after the trainer's as one
launch of N x G ranks; hybrid_engine true is placement colocated.

When: the recipe loads, which needs the model's architecture: model.hf_checkpoint's config.json
readable here, or model.architecture given (`import-verl SCRIPT --out R.yaml
model.architecture=qwen2.5-32b`). Otherwise the report says which command chooses it.
Which: among the layouts that fit GPUs of GPU_MEMORY_GIB (plan's default), the cheapest that keeps
the tp/pp/cp/ep the source sets, else the cheapest of all (none fits: the note says why, as
layout_search.search_with_reason finds it); the source's other settings (offload, the
engine's share, the token budget, ...) stay as mapped. The trackers are left out of the search:
they change no memory, and planning needs none of their extras installed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..layout_search import RECOMPUTE_SETTINGS, Candidate, search_with_reason
from ..tree import apply_overrides
from .core import Mapper
from .tables import R, build_tree
from .values import pos_int, show, to_bool

GPU_MEMORY_GIB = 80.0
_NODES, _GPUS = "trainer.nnodes", "trainer.n_gpus_per_node"
_HYBRID = "actor_rollout_ref.hybrid_engine"
# verl's one-step-off placement: the rollout's own nodes x GPUs (top-level rollout.*, or under actor_rollout_ref)
_ROLLOUT = {"rollout.nnodes": "nodes", "rollout.n_gpus_per_node": "gpus", R + "nnodes": "nodes",
            R + "n_gpus_per_node": "gpus"}
KEYS = (_NODES, _GPUS, _HYBRID, *_ROLLOUT)


def choose_layout(m: Mapper) -> None:
    """Map trainer.nnodes / n_gpus_per_node (verl's defaults 1 and 8) to the layout (module docstring),
    with verl's separate rollout GPUs (hybrid_engine false) added to the launch."""
    rollout = _placement(m)
    keys = [k for k in (_NODES, _GPUS) if m.has(k)]
    if not keys:
        return
    nodes = m.convert(_NODES, pos_int) if m.pending(_NODES) else 1
    gpus = m.convert(_GPUS, pos_int) if m.pending(_GPUS) else 8
    keys = sorted((k for k in keys if k not in m.done), key=lambda k: m.order[k])
    split = ""
    if rollout is not None:
        split = (f", the trainer's {nodes} x {gpus} and the rollout's {rollout[0]} x {rollout[1]} (the last "
                 "rollout.num_ranks ranks), as one launch")
        total, nodes = nodes * gpus + rollout[0] * rollout[1], max(nodes, rollout[0])
        if total % nodes:
            _skip(m, keys, f"the trainer's and the rollout's GPUs ({total}) do not make {nodes} equal nodes: "
                           "launch them as N x G GPUs of which the last rollout.num_ranks generate, and run "
                           "`megatron-rlcorr plan RECIPE --nodes N --gpus-per-node G --search` for the layout")
            return
        gpus = total // nodes
    _search(m, keys, nodes, gpus, split)


def _search(m: Mapper, keys: list[str], nodes: int, gpus: int, split: str) -> None:
    """Run plan --search for the launch of nodes x gpus and map its cheapest layout, or say why none."""
    how = (f"megatron-rlcorr train --config RECIPE --nproc {gpus}" if nodes == 1 else
           f"NNODES={nodes} GPUS_PER_NODE={gpus} bash tools/launch.sh RECIPE on every node")
    launch = (f"the launch gives the {nodes} x {gpus} GPUs{split} ({how}; `megatron-rlcorr plan RECIPE --nodes "
              f"{nodes} --gpus-per-node {gpus}` prints the commands once the layout fits)")
    search = f"megatron-rlcorr plan RECIPE --nodes {nodes} --gpus-per-node {gpus} --search"
    tree = apply_overrides(build_tree(m.flat), m.overrides)
    tree.setdefault("trainer", {})["logger"] = ["console"]
    try:
        candidates, why_none = search_with_reason(tree, nodes=nodes, gpus_per_node=gpus, gpu_memory_gib=GPU_MEMORY_GIB)
    except ValueError as err:
        _skip(m, keys, f"{launch}; the layout for them is not chosen here, as the recipe does not load ({err}): "
                       + _how_to_load(tree, search, err))
        return
    if not candidates:
        _skip(m, keys, f"{launch}; no layout of `{search}` fits them ({GPU_MEMORY_GIB:g} GiB GPUs): {why_none}")
        return
    _apply(m, candidates, nodes, gpus)
    _skip(m, keys, f"{launch}; the layout for them is plan --search's (the mapped parallel.* and model.recompute)")


def _how_to_load(tree: dict, search: str, err: ValueError) -> str:
    """What to do when the recipe does not load: what the error names, and the architecture when the
    checkpoint is not on this machine and none is given."""
    model = tree.get("model", {})
    no_model = model.get("architecture") is None and not _checkpoint_here(model.get("hf_checkpoint"))
    arch = ("import again with model.architecture=<name> (docs/scaling.md, Architectures, lists them), or run "
            f"`{search} model.architecture=<name>` and set the first layout it prints")
    if no_model and str(err).startswith(("model", "Hugging Face checkpoint")):
        return f"with the checkpoint not on this machine, {arch}"
    fix = f"set what it names in the recipe written, then run `{search}` and set the first layout it prints"
    return fix + (f" (the checkpoint is not on this machine either: give model.architecture=<name> too)"
                  if no_model else "")


def _checkpoint_here(path: Any) -> bool:
    return isinstance(path, str) and bool(path) and Path(path).expanduser().is_dir()


def _placement(m: Mapper) -> tuple[int, int] | None:
    """hybrid_engine false with the rollout's nodes x GPUs: rollout.placement separate on ranks of their
    own; returns (rollout nodes, GPUs per node), or None when the rollout shares the trainer's GPUs."""
    given = {kind: key for key, kind in _ROLLOUT.items() if m.pending(key)}
    hybrid = m.convert(_HYBRID, to_bool) if m.pending(_HYBRID) else None
    if hybrid is not False:
        if hybrid:
            m.map(_HYBRID, "rollout.placement", "colocated")
        for key in given.values():
            m.skip(key, f"the rollout's own GPUs are verl's with {_HYBRID}=False; here the rollout shares the "
                        "trainer's GPUs unless rollout.placement is separate")
        return None
    if len(given) < 2:
        m.skip(_HYBRID, "false, without both the rollout's own node count and GPUs per node: set "
                        "rollout.placement: separate and rollout.num_ranks (the rollout's GPUs) yourself")
        for key in given.values():
            m.skip(key, f"see {_HYBRID}")
        return None
    nodes, gpus = m.convert(given["nodes"], pos_int), m.convert(given["gpus"], pos_int)
    m.map(_HYBRID, "rollout.placement", "separate")
    for key in sorted(given.values(), key=lambda k: m.order[k]):
        m.map(key, "rollout.num_ranks", nodes * gpus)
    return nodes, gpus


def _skip(m: Mapper, keys: list[str], reason: str) -> None:
    """The reason on the first of the two keys the source sets, a pointer to it on the other."""
    for i, key in enumerate(keys):
        m.skip(key, reason if i == 0 else f"see {keys[0]}")


def _apply(m: Mapper, candidates: list[Candidate], nodes: int, gpus: int) -> None:
    source = {k: m.flat[f"parallel.{k}"] for k in ("tp", "pp", "cp", "ep") if f"parallel.{k}" in m.flat}
    keep = [c for c in candidates if all(getattr(c, k) in (v, None if k == "ep" else v) for k, v in source.items())]
    chosen = (keep or candidates)[0]
    given = ", ".join(f"{k}={v}" for k, v in source.items())
    written = f"tp {chosen.tp}, pp {chosen.pp}, cp {chosen.cp}" + (
        "" if chosen.ep is None else f", ep {chosen.ep}, etp 1") + f", recompute {chosen.recompute}"
    why = (f"(plan --search for {nodes} x {gpus} GPUs of {GPU_MEMORY_GIB:g} GiB: "
           + (f"the cheapest layout that fits with the source's {given}: {written})" if keep and source
              else f"the cheapest layout that fits: {written})"))
    layout = {"parallel.tp": chosen.tp, "parallel.pp": chosen.pp, "parallel.cp": chosen.cp, "parallel.vpp": None,
              "parallel.sequence_parallel": chosen.tp > 1, "model.recompute": RECOMPUTE_SETTINGS[chosen.recompute]}
    if chosen.ep is not None:
        layout.update({"parallel.ep": chosen.ep, "parallel.etp": 1})
    for verl_key, recipe_key, value in list(m.mapped):
        if recipe_key in layout and value != layout[recipe_key] and not verl_key.startswith("("):
            reason = (f"no layout with the source's {given} fits {nodes} x {gpus} GPUs of {GPU_MEMORY_GIB:g} GiB"
                      if source and not keep else "a layout that costs less fits")
            if recipe_key == "parallel.etp":
                reason = "plan --search keeps each expert whole on its rank, expert TP 1"
            m.unmap(verl_key, f"{show(value)}: superseded by plan --search's layout ({reason}; see the mapped "
                              f"{recipe_key})")
    m.mapped = [e for e in m.mapped if not (e[0].startswith("(") and e[1] in layout and e[2] != layout[e[1]])]
    for recipe_key, value in layout.items():
        if recipe_key in m.flat and m.flat[recipe_key] == value:
            continue
        if value is None and recipe_key not in m.flat:
            continue
        m.derive(recipe_key, value, why)
