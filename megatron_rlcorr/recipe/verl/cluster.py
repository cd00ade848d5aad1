"""The layout for the source's cluster: trainer.nnodes x trainer.n_gpus_per_node -> `parallel` and
`model.recompute`, chosen as `megatron-rlcorr plan RECIPE --nodes N --gpus-per-node G --search`
chooses (recipe/layout_search.py).

When: the recipe loads, which needs the model's architecture: model.hf_checkpoint's config.json
readable here, or model.architecture given (`import-verl SCRIPT --out R.yaml
model.architecture=qwen2.5-32b`). Otherwise the report says which command chooses it.
Which: among the layouts that fit GPUs of GPU_MEMORY_GIB (plan's default), the cheapest that keeps
the tp/pp/cp the source sets, else the cheapest of all; the source's other settings (offload, the
engine's share, the token budget, ...) stay as mapped. The trackers are left out of the search:
they change no memory, and planning needs none of their extras installed.
"""
from __future__ import annotations

from ..layout_search import RECOMPUTE_SETTINGS, Candidate, search_tree
from ..tree import apply_overrides
from .core import Mapper
from .tables import build_tree
from .values import pos_int, show

GPU_MEMORY_GIB = 80.0
_NODES, _GPUS = "trainer.nnodes", "trainer.n_gpus_per_node"
KEYS = (_NODES, _GPUS)


def choose_layout(m: Mapper) -> None:
    """Map trainer.nnodes / n_gpus_per_node (verl's defaults 1 and 8) to the layout (module docstring)."""
    keys = [k for k in (_NODES, _GPUS) if m.has(k)]
    if not keys:
        return
    nodes = m.convert(_NODES, pos_int) if m.pending(_NODES) else 1
    gpus = m.convert(_GPUS, pos_int) if m.pending(_GPUS) else 8
    keys = sorted((k for k in keys if k not in m.done), key=lambda k: m.order[k])
    how = (f"megatron-rlcorr train --config RECIPE --nproc {gpus}" if nodes == 1 else
           f"NNODES={nodes} GPUS_PER_NODE={gpus} bash tools/launch.sh RECIPE on every node")
    launch = (f"the launch gives the {nodes} x {gpus} GPUs ({how}; `megatron-rlcorr plan RECIPE --nodes {nodes} "
              f"--gpus-per-node {gpus}` prints the commands)")
    search = f"megatron-rlcorr plan RECIPE --nodes {nodes} --gpus-per-node {gpus} --search"
    tree = apply_overrides(build_tree(m.flat), m.overrides)
    tree.setdefault("trainer", {})["logger"] = ["console"]
    try:
        candidates = search_tree(tree, nodes=nodes, gpus_per_node=gpus, gpu_memory_gib=GPU_MEMORY_GIB)
    except ValueError as err:
        _skip(m, keys, f"{launch}; the layout for them is not chosen here, as the recipe does not load ({err}): "
                       "with the checkpoint not on this machine, import again with model.architecture=<name> "
                       f"(docs/scaling.md, Architectures, lists them), or run `{search} model.architecture=<name>` and "
                       "set the first layout it prints")
        return
    if not candidates:
        _skip(m, keys, f"{launch}; no layout of `{search}` fits them ({GPU_MEMORY_GIB:g} GiB GPUs): shorten the "
                       "token budget (trainer.max_tokens_per_micro_batch), offload more, or lower "
                       "rollout.gpu_memory_utilization")
        return
    _apply(m, candidates, nodes, gpus)
    _skip(m, keys, f"{launch}; the layout for them is plan --search's (the mapped parallel.* and model.recompute)")


def _skip(m: Mapper, keys: list[str], reason: str) -> None:
    """The reason on the first of the two keys the source sets, a pointer to it on the other."""
    for i, key in enumerate(keys):
        m.skip(key, reason if i == 0 else f"see {keys[0]}")


def _apply(m: Mapper, candidates: list[Candidate], nodes: int, gpus: int) -> None:
    source = {k: m.flat[f"parallel.{k}"] for k in ("tp", "pp", "cp") if f"parallel.{k}" in m.flat}
    keep = [c for c in candidates if all(getattr(c, k) == v for k, v in source.items())]
    chosen = (keep or candidates)[0]
    given = ", ".join(f"{k}={v}" for k, v in source.items())
    why = (f"(plan --search for trainer.nnodes {nodes} x trainer.n_gpus_per_node {gpus}, {GPU_MEMORY_GIB:g} GiB GPUs: "
           + (f"the cheapest layout that fits with the source's {given})" if keep and source
              else "the cheapest layout that fits)"))
    layout = {"parallel.tp": chosen.tp, "parallel.pp": chosen.pp, "parallel.cp": chosen.cp, "parallel.vpp": None,
              "parallel.sequence_parallel": chosen.tp > 1, "model.recompute": RECOMPUTE_SETTINGS[chosen.recompute]}
    for verl_key, recipe_key, value in list(m.mapped):
        if recipe_key in layout and value != layout[recipe_key] and not verl_key.startswith("("):
            reason = (f"no layout with the source's {given} fits {nodes} x {gpus} GPUs of {GPU_MEMORY_GIB:g} GiB"
                      if source and not keep else "a layout that costs less fits")
            m.unmap(verl_key, f"{show(value)}: superseded by plan --search's layout ({reason}; see the mapped "
                              f"{recipe_key})")
    m.mapped = [e for e in m.mapped if not (e[0].startswith("(") and e[1] in layout and e[2] != layout[e[1]])]
    for recipe_key, value in layout.items():
        if recipe_key in m.flat and m.flat[recipe_key] == value:
            continue
        if value is None and recipe_key not in m.flat:
            continue
        m.derive(recipe_key, value, why)
