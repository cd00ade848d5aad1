"""The model's weights: one neutral naming of full tensors <-> this rank's Megatron-Core shards.

Weights travel between the trainer, checkpoints, Hugging Face files and the rollout engine in
one neutral naming of full (unsharded) tensors:

    embed.weight [V, H]            final_norm.weight [H]       lm_head.weight [V, H]
    layers.{i}.attn_norm.weight [H]       layers.{i}.mlp_norm.weight [H]
    layers.{i}.q.weight [nH*hd, H]  (+ q.bias)   layers.{i}.o.weight [H, nH*hd]
    layers.{i}.k.weight [nKV*hd, H] (+ k.bias)   layers.{i}.gate.weight [F, H]
    layers.{i}.v.weight [nKV*hd, H] (+ v.bias)   layers.{i}.up.weight [F, H]
                                                 layers.{i}.down.weight [H, F]

`i` counts layers over the whole model (all pipeline stages); V is the real vocabulary (Megatron's
padding removed); lm_head.weight is present (equal to embed.weight) when embeddings are tied.

Megatron-Core's layout, which export/load translate: linear_qkv fuses q, k and v per query group
([q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...] along the output dimension), and
tensor parallelism gives each rank whole groups; linear_fc1 holds [gate shard; up shard] per TP
rank; linear_proj and linear_fc2 are split along their input dimension; embedding and output
layer along the (padded) vocabulary.

With q/k norms (Qwen3) a layer also has `layers.{i}.q_norm.weight` and `k_norm.weight` [hd].

A MoE layer (architecture.MoeShape; E experts of width Fe, shared expert of width Fs) has, instead
of gate/up/down:

    layers.{i}.router.weight [E, H]
    layers.{i}.experts.{e}.gate.weight [Fe, H]   .up.weight [Fe, H]   .down.weight [H, Fe]
    layers.{i}.shared.gate.weight [Fs, H]  .up.weight [Fs, H]  .down.weight [H, Fs]   (Qwen2-MoE)
    layers.{i}.shared_gate.weight [1, H]                                              (Qwen2-MoE)

Loading (`load_full_weights`) reads from a weight source: a mapping of full tensors, the seeded
initialisation, or a Hugging Face checkpoint (hf.HFCheckpoint), each answering `read(name, dim,
start, stop)` with a slice. Every rank reads only the tensors its pipeline chunks hold and only
its tensor-parallel slice of them, so the whole model never exists on a rank.

Exporting (`iter_full_weights`) yields one full tensor at a time: its owning pipeline stage
gathers it over TP and broadcasts it over PP; a routed expert's owner (its pipeline stage and
expert-parallel rank) gathers it over ETP and broadcasts it over EP, then PP. Peak extra memory
is about one full tensor.

Seeded initial weights: each tensor is drawn from a generator seeded by (seed, neutral name), so
they do not depend on the layout. Distributions follow Megatron-Core: N(0, std) for embedding,
output layer, q/k/v, gate and up; N(0, std/sqrt(2*num_layers)) for o and down; zero biases;
unit norm weights.
"""
from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .architecture import DecoderShape
from .config import ModelConfig

if TYPE_CHECKING:
    from ..parallel.groups import ParallelGroups

class WeightSource(Protocol):
    """Full neutral tensors, read by slices (a Hugging Face checkpoint, the seeded initialisation,
    a mapping of tensors)."""

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of `name`; ValueError naming it when the source has no such tensor."""
        ...

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """[start, stop) along `dim` of `name` (the whole tensor when start is None), any dtype."""
        ...


class MappingSource:
    """A WeightSource over a mapping of full tensors (or anything with `[name]`)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._get(name).shape)

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        tensor = self._get(name)
        return tensor if start is None else tensor.narrow(dim, start, stop - start)

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"load_full_weights: missing {name}")
        return self.tensors[name]


def init_full_weights(cfg: ModelConfig, seed: int, layers: Iterable[int] | None = None) -> dict[str, torch.Tensor]:
    """Seeded initial weights (float32, neutral names) of `layers` (default all) plus the
    embedding, final norm and lm_head; each tensor is the same whatever subset is asked for."""
    wanted = {f"layers.{i}." for i in (range(cfg.num_layers) if layers is None else layers)}
    seeded = SeededWeights(cfg, seed)
    weights = {name: seeded[name] for name in seeded
               if not name.startswith("layers.") or name[: name.index(".", len("layers.")) + 1] in wanted}
    if cfg.tie_embeddings:
        weights["lm_head.weight"] = weights["embed.weight"]
    return weights


class SeededWeights(Mapping):
    """init_full_weights as a lazy mapping: each tensor is drawn when read (bounded memory)."""

    def __init__(self, cfg: ModelConfig, seed: int):
        self.cfg, self.seed, self.shapes = cfg, seed, neutral_weight_shapes(cfg)

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name == "lm_head.weight" and self.cfg.tie_embeddings:
            name = "embed.weight"
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        if name.endswith(".bias"):
            return torch.zeros(shape)
        # CPU generators use 32 bits of the seed: hash seed and name together.
        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}/{name}".encode()))
        std = self.cfg.init_method_std
        if name.endswith((".o.weight", ".down.weight")):
            std /= math.sqrt(2.0 * self.cfg.num_layers)
        return torch.randn(shape, generator=generator) * std

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.shapes:
            raise ValueError(f"load_full_weights: the model has no weight {name}")
        return self.shapes[name]

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        tensor = self[name]  # drawn whole: the generator's stream does not allow drawing a slice
        return tensor if start is None else tensor.narrow(dim, start, stop - start)


def as_weight_source(weights: WeightSource | Mapping[str, torch.Tensor]) -> WeightSource:
    """`weights` itself when it reads by slices, else a MappingSource over it."""
    return weights if hasattr(weights, "read") else MappingSource(weights)


# Canonical order of a layer's neutral weights (biases only with add_qkv_bias, q/k norms only
# with qk_layernorm; a MoE layer has the names from "router.weight" on instead of gate/up/down,
# `experts.{e}.` standing for each expert in turn).
_LAYER_ORDER = ("attn_norm.weight", "q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias",
                "q_norm.weight", "k_norm.weight", "o.weight", "mlp_norm.weight", "gate.weight", "up.weight",
                "down.weight", "router.weight", "experts.{e}.gate.weight", "experts.{e}.up.weight",
                "experts.{e}.down.weight", "shared.gate.weight", "shared.up.weight", "shared.down.weight",
                "shared_gate.weight")
_DENSE_MLP = ("gate.weight", "up.weight", "down.weight")


def neutral_weight_shapes(shape: DecoderShape | ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every neutral weight name of the model with its full shape, in canonical order."""
    if isinstance(shape, ModelConfig):
        shape = shape.decoder_shape
    h, f, v, hd = shape.hidden_size, shape.ffn_hidden_size, shape.vocab_size, shape.head_dim
    q_dim, kv_dim = shape.num_attention_heads * hd, shape.num_query_groups * hd
    per_layer = {"attn_norm.weight": (h,), "q.weight": (q_dim, h), "q.bias": (q_dim,), "k.weight": (kv_dim, h),
                 "k.bias": (kv_dim,), "v.weight": (kv_dim, h), "v.bias": (kv_dim,), "q_norm.weight": (hd,),
                 "k_norm.weight": (hd,), "o.weight": (h, q_dim), "mlp_norm.weight": (h,), "gate.weight": (f, h),
                 "up.weight": (f, h), "down.weight": (h, f)}
    attention = [n for n in _LAYER_ORDER[:_LAYER_ORDER.index("gate.weight")]
                 if (shape.add_qkv_bias or not n.endswith(".bias"))
                 and (shape.qk_layernorm or n not in ("q_norm.weight", "k_norm.weight"))]
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (v, h)}
    for i in range(shape.num_layers):
        shapes.update({f"layers.{i}.{n}": per_layer[n] for n in attention})
        if shape.is_moe_layer(i):
            shapes.update({f"layers.{i}.{n}": dims for n, dims in _moe_shapes(shape).items()})
        else:
            shapes.update({f"layers.{i}.{n}": per_layer[n] for n in _DENSE_MLP})
    shapes.update({"final_norm.weight": (h,), "lm_head.weight": (v, h)})
    return shapes


def _moe_shapes(shape: DecoderShape) -> dict[str, tuple[int, ...]]:
    """The MoE block's neutral names (within a layer) and full shapes, in canonical order."""
    moe, h = shape.moe, shape.hidden_size
    fe, fs = moe.ffn_hidden_size, moe.shared_expert_ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {"router.weight": (moe.num_experts, h)}
    for e in range(moe.num_experts):
        shapes.update({f"experts.{e}.gate.weight": (fe, h), f"experts.{e}.up.weight": (fe, h),
                       f"experts.{e}.down.weight": (h, fe)})
    if fs is not None:
        shapes.update({"shared.gate.weight": (fs, h), "shared.up.weight": (fs, h), "shared.down.weight": (h, fs),
                       "shared_gate.weight": (1, h)})
    return shapes


# How each Megatron-Core parameter of a layer maps to neutral names. Local-spec and TE-spec
# names both appear (TE fuses the norms into the following linear layer).
_LAYER_PARAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("attn_norm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ("attn_norm.weight",)),
    "self_attention.linear_qkv.weight": ("qkv", ("q.weight", "k.weight", "v.weight")),
    "self_attention.linear_qkv.bias": ("qkv", ("q.bias", "k.bias", "v.bias")),
    "self_attention.q_layernorm.weight": ("replicated", ("q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("k_norm.weight",)),
    "self_attention.linear_proj.weight": ("split_input", ("o.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("mlp_norm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ("mlp_norm.weight",)),
    "mlp.linear_fc1.weight": ("gate_up", ("gate.weight", "up.weight")),
    "mlp.linear_fc2.weight": ("split_input", ("down.weight",)),
    # MoE blocks: the router (replicated everywhere), the shared expert (split over TP like a dense MLP)
    "mlp.router.weight": ("replicated", ("router.weight",)),
    "mlp.shared_experts.linear_fc1.weight": ("gate_up", ("shared.gate.weight", "shared.up.weight")),
    "mlp.shared_experts.linear_fc2.weight": ("split_input", ("shared.down.weight",)),
    "mlp.shared_experts.gate_weight": ("replicated", ("shared_gate.weight",)),
}
# The routed experts: this rank's local expert k (global index local_expert_indices[k], parallel.ep) is
# split over the expert-tensor-parallel group (parallel.etp). SequentialMLP (local spec) and
# TEGroupedMLP (Transformer Engine) name them differently.
_EXPERT_PARAMS = (
    (re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.weight"), "gate_up", ("gate.weight", "up.weight")),
    (re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight"), "split_input", ("down.weight",)),
    (re.compile(r"mlp\.experts\.linear_fc1\.weight(\d+)"), "gate_up", ("gate.weight", "up.weight")),
    (re.compile(r"mlp\.experts\.linear_fc2\.weight(\d+)"), "split_input", ("down.weight",)),
)


@dataclass(frozen=True)
class Slot:
    """One Megatron parameter of this rank and the neutral weights its full tensor holds.

    `expert`: a routed expert's weight, split over the expert-tensor-parallel group (and held by
    one expert-parallel rank only) instead of the tensor-parallel group."""

    param: torch.nn.Parameter
    layout: str  # replicated | vocab | qkv | gate_up | split_input
    names: tuple[str, ...]
    expert: bool = False


def parameter_slots(model, tied: bool) -> list[Slot]:
    gpt = _unwrap(model)
    layers = {f"decoder.layers.{j}.": layer for j, layer in enumerate(gpt.decoder.layers)}
    slots = []
    for name, param in gpt.named_parameters():
        if name == "embedding.word_embeddings.weight":
            slots.append(Slot(param, "vocab", ("embed.weight",)))
        elif name == "output_layer.weight":
            # A tied model keeps a copy of the embedding on the last pipeline stage.
            slots.append(Slot(param, "vocab", ("embed.weight" if tied else "lm_head.weight",)))
        elif name == "decoder.final_layernorm.weight":
            slots.append(Slot(param, "replicated", ("final_norm.weight",)))
        else:
            slots.append(_layer_slot(name, param, layers))
    return slots


def _layer_slot(name: str, param: torch.nn.Parameter, layers: dict[str, Any]) -> Slot:
    prefix = name[: name.index(".", len("decoder.layers.")) + 1] if name.startswith("decoder.layers.") else ""
    if prefix not in layers:
        raise ValueError(f"no neutral name for Megatron parameter {name!r}")
    layer, tail = layers[prefix], name[len(prefix):]
    i = layer.layer_number - 1
    if tail in _LAYER_PARAMS:
        layout, names = _LAYER_PARAMS[tail]
        return Slot(param, layout, tuple(f"layers.{i}.{n}" for n in names))
    for pattern, layout, names in _EXPERT_PARAMS:
        match = pattern.fullmatch(tail)
        if match:
            expert = layer.mlp.local_expert_indices[int(match.group(1))]
            return Slot(param, layout, tuple(f"layers.{i}.experts.{expert}.{n}" for n in names), expert=True)
    raise ValueError(f"no neutral name for Megatron parameter {name!r}")


def _unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def _is_tied(model) -> bool:
    return bool(_unwrap(model).share_embeddings_and_output_weights)


def _real_vocab_size(gpt) -> int:
    return getattr(gpt, "unpadded_vocab_size", gpt.vocab_size)


# ---- export: Megatron shards -> full neutral tensors -------------------------------------------

def takes_part_in_export(groups: ParallelGroups) -> bool:
    """Whether this rank must iterate iter_full_weights when one copy of the weights is wanted
    (an export): the ranks of the first data/context-parallel replica, or every rank when the
    experts are laid out across replicas (parallel.ep > 1, or parallel.etp neither 1 nor tp: the
    expert groups then span data-parallel ranks)."""
    if groups.ep_size == 1 and groups.etp_size in (1, groups.tp_size):
        return groups.dp_rank == 0 and groups.cp_rank == 0
    return True


@torch.no_grad()
def iter_full_weights(model_chunks: Sequence[Any], groups: ParallelGroups,
                      dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """(neutral name, full tensor in `dtype`) for every weight of the model, layer by layer, one
    at a time, on every rank that iterates (lm_head.weight is not repeated when embeddings are tied).

    Collective contract: a tensor is gathered by its owner and broadcast from it. Dense weights:
    the first pipeline stage holding them all-gathers the shards over TP and broadcasts over PP.
    Routed experts (held by one expert-parallel rank, split over ETP): the ranks of the owning
    (stage, EP rank) all-gather over ETP, broadcast over EP within the stage, then over PP. So every
    rank of each TP, ETP, EP and PP group that contains an iterating rank must consume the whole
    iterator: with ep = 1 (and etp 1 or tp) the model-parallel group of one data/context-parallel
    replica suffices (the others hold the same weights); with expert parallelism, which spans
    data-parallel ranks, every rank must iterate (takes_part_in_export says which). Each tensor is
    a fresh copy on the parameters' device, never an alias of a parameter.
    """
    first = _unwrap(model_chunks[0])
    tied, vocab_size = _is_tied(first), _real_vocab_size(first)
    mine: dict[tuple[str, ...], tuple[Any, Slot]] = {}
    for chunk in model_chunks:
        for slot in parameter_slots(chunk, tied):
            mine.setdefault(slot.names, (_unwrap(chunk), slot))
    device = next(first.parameters()).device
    for names, (stage, ep_rank, expert) in _owners([(n, slot.expert) for n, (_, slot) in mine.items()], groups):
        tensors: dict[str, torch.Tensor] = {}
        if stage == groups.pp_rank and (not expert or ep_rank == groups.ep_rank):
            gpt, slot = mine[names]
            group, size = (groups.etp, groups.etp_size) if expert else (groups.tp, groups.tp_size)
            full = _gather_tp(slot.param.detach(), slot.layout, group, size)
            tensors = _to_neutral(full, slot, gpt.config, size, vocab_size)
        for name in names:
            if name in tensors:
                tensor = tensors[name].to(dtype, copy=True).contiguous()
            else:
                tensor = torch.empty(first.neutral_shapes[name], dtype=dtype, device=device)
            if expert and groups.ep_size > 1 and stage == groups.pp_rank:
                dist.broadcast(tensor, src=dist.get_global_rank(groups.ep, ep_rank), group=groups.ep)
            if groups.pp_size > 1:
                dist.broadcast(tensor, src=dist.get_global_rank(groups.pp, stage), group=groups.pp)
            yield name, tensor


def _owners(local: list[tuple[tuple[str, ...], bool]],
            groups: ParallelGroups) -> list[tuple[tuple[str, ...], tuple[int, int, bool]]]:
    """(slot names, (the first pipeline stage holding them, the first expert-parallel rank of that
    stage holding them, whether they are a routed expert's)) over all stages and expert-parallel
    ranks, in canonical order; `local` is this rank's (slot names, expert) list."""
    per_ep = [local]
    if groups.ep_size > 1:  # each EP rank of a stage holds other experts
        per_ep = [None] * groups.ep_size
        dist.all_gather_object(per_ep, local, group=groups.ep)
    per_stage = [per_ep]
    if groups.pp_size > 1:
        per_stage = [None] * groups.pp_size
        dist.all_gather_object(per_stage, per_ep, group=groups.pp)
    owner: dict[tuple[str, ...], tuple[int, int, bool]] = {}
    for stage, stage_lists in enumerate(per_stage):
        for ep_rank, slots in enumerate(stage_lists):
            for names, expert in slots:
                owner.setdefault(tuple(names), (stage, ep_rank, expert))
    return sorted(owner.items(), key=lambda item: _neutral_order(item[0][0]))


@torch.no_grad()
def export_full_weights(model_chunks: Sequence[Any], groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """All weights of the model, unsharded, float32, in the neutral naming, on every rank
    (iter_full_weights collected; lm_head.weight aliases embed.weight when tied).

    Memory: the whole model in float32 on every rank; meant for models that fit (the embedded
    rollout engine). Streaming consumers use iter_full_weights.
    """
    weights = dict(iter_full_weights(model_chunks, groups))
    if _is_tied(model_chunks[0]):
        weights["lm_head.weight"] = weights["embed.weight"]
    return dict(sorted(weights.items(), key=lambda item: _neutral_order(item[0])))


SPLIT_DIM = {"vocab": 0, "qkv": 0, "gate_up": 0, "split_input": 1}


def _gather_tp(shard: torch.Tensor, layout: str, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """The full Megatron parameter from its shards over `group` (TP, or ETP for a routed expert)."""
    if layout == "replicated" or size == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=SPLIT_DIM[layout])


def _to_neutral(full: torch.Tensor, slot: Slot, config, tp_size: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """Neutral tensors held by a gathered Megatron parameter (`tp_size`: the ranks it was split over)."""
    if slot.layout == "vocab":
        return {slot.names[0]: full[:vocab_size]}
    if slot.layout == "qkv":
        groups, group_heads = config.num_query_groups, config.num_attention_heads // config.num_query_groups
        rest = full.shape[1:]
        per_group = full.reshape(groups, group_heads + 2, config.kv_channels, *rest)
        q = per_group[:, :group_heads].reshape(-1, *rest)
        k, v = per_group[:, group_heads].reshape(-1, *rest), per_group[:, group_heads + 1].reshape(-1, *rest)
        return dict(zip(slot.names, (q, k, v)))
    if slot.layout == "gate_up":
        # TP rank r holds [gate rows of r; up rows of r].
        per_rank = full.reshape(tp_size, 2, -1, *full.shape[1:])
        gate, up = per_rank[:, 0].reshape(-1, *full.shape[1:]), per_rank[:, 1].reshape(-1, *full.shape[1:])
        return dict(zip(slot.names, (gate, up)))
    return {slot.names[0]: full}


def _neutral_order(name: str) -> tuple:
    head, _, rest = name.partition(".")
    if head == "layers":
        index, _, tail = rest.partition(".")
        expert = 0
        if tail.startswith("experts."):
            number, _, sub = tail[len("experts."):].partition(".")
            tail, expert = f"experts.{{e}}.{sub}", int(number)
        return (1, int(index), _LAYER_ORDER.index(tail), expert)
    return ({"embed": 0, "final_norm": 2, "lm_head": 3}[head], 0, 0, 0)


# ---- load: weight source -> this rank's Megatron shards ------------------------------------------

@torch.no_grad()
def load_full_weights(model_chunks: Sequence[Any], weights: WeightSource | Mapping[str, torch.Tensor],
                      groups: ParallelGroups) -> None:
    """Set this rank's shards of every parameter from full neutral weights (inverse of export).

    `weights` is a WeightSource or a mapping of full tensors; only the tensors this rank's chunks
    hold are read, and only this TP rank's slice of each. Megatron's vocabulary padding rows are
    set to zero; with tied embeddings lm_head.weight is not read. No communication.
    """
    source = as_weight_source(weights)
    for chunk in model_chunks:
        gpt = _unwrap(chunk)
        for slot in parameter_slots(gpt, _is_tied(gpt)):
            for name in slot.names:
                if source.shape(name) != gpt.neutral_shapes[name]:
                    raise ValueError(f"{name} has shape {source.shape(name)}, the model needs "
                                     f"{gpt.neutral_shapes[name]}")
            split = (groups.etp_size, groups.etp_rank) if slot.expert else (groups.tp_size, groups.tp_rank)
            shard = _read_shard(source, slot, gpt, *split)
            if shard.shape != slot.param.shape:
                raise ValueError(f"{'/'.join(slot.names)}: the slice read has shape {tuple(shard.shape)}, this "
                                 f"rank's parameter {tuple(slot.param.shape)}")
            slot.param.copy_(shard)


def _read_shard(source: WeightSource, slot: Slot, gpt, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's part of a slot, read slice by slice (Megatron's layouts: weights.py docstring)."""
    names, rows = slot.names, slot.param.shape[0]
    if slot.layout == "replicated":
        return source.read(names[0])
    if slot.layout == "vocab":
        start, real = tp_rank * rows, _real_vocab_size(gpt)
        part = source.read(names[0], 0, min(start, real), min(start + rows, real))
        return F.pad(part, (0, 0, 0, rows - part.shape[0]))
    if slot.layout == "split_input":
        width = slot.param.shape[1]
        return source.read(names[0], 1, tp_rank * width, (tp_rank + 1) * width)
    if slot.layout == "gate_up":
        half = rows // 2
        return torch.cat([source.read(n, 0, tp_rank * half, (tp_rank + 1) * half) for n in names])
    config = gpt.config
    local_groups, hd = config.num_query_groups // tp_size, config.kv_channels
    group_rows = (config.num_attention_heads // config.num_query_groups) * hd
    first = tp_rank * local_groups
    q = source.read(names[0], 0, first * group_rows, (first + local_groups) * group_rows)
    k, v = (source.read(n, 0, first * hd, (first + local_groups) * hd) for n in names[1:])
    return _fuse_qkv(q, k, v, local_groups, hd)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, hd: int) -> torch.Tensor:
    """Megatron's linear_qkv rows for `groups` query groups: [q heads of g, k_g, v_g] per group."""
    rest = q.shape[1:]
    per_group = torch.cat([q.reshape(groups, -1, hd, *rest), k.reshape(groups, 1, hd, *rest),
                           v.reshape(groups, 1, hd, *rest)], dim=1)
    return per_group.reshape(-1, *rest)
