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

Seeded initial weights: each tensor is drawn from a generator seeded by (seed, neutral name), so
they do not depend on the layout. Distributions follow Megatron-Core: N(0, std) for embedding,
output layer, q/k/v, gate and up; N(0, std/sqrt(2*num_layers)) for o and down; zero biases;
unit norm weights.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .config import ModelConfig

if TYPE_CHECKING:
    from ..parallel.groups import ParallelGroups

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


# Canonical order of a layer's neutral weights (biases only with add_qkv_bias).
_LAYER_ORDER = ("attn_norm.weight", "q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias", "o.weight",
                "mlp_norm.weight", "gate.weight", "up.weight", "down.weight")


def neutral_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every neutral weight name of the model with its full shape, in canonical order."""
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_query_groups * cfg.head_dim
    per_layer = {"attn_norm.weight": (h,), "q.weight": (q_dim, h), "q.bias": (q_dim,), "k.weight": (kv_dim, h),
                 "k.bias": (kv_dim,), "v.weight": (kv_dim, h), "v.bias": (kv_dim,), "o.weight": (h, q_dim),
                 "mlp_norm.weight": (h,), "gate.weight": (f, h), "up.weight": (f, h), "down.weight": (h, f)}
    names = [n for n in _LAYER_ORDER if cfg.add_qkv_bias or not n.endswith(".bias")]
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (v, h)}
    for i in range(cfg.num_layers):
        shapes.update({f"layers.{i}.{n}": per_layer[n] for n in names})
    shapes.update({"final_norm.weight": (h,), "lm_head.weight": (v, h)})
    return shapes


# How each Megatron-Core parameter of a layer maps to neutral names. Local-spec and TE-spec
# names both appear (TE fuses the norms into the following linear layer).
_LAYER_PARAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("attn_norm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ("attn_norm.weight",)),
    "self_attention.linear_qkv.weight": ("qkv", ("q.weight", "k.weight", "v.weight")),
    "self_attention.linear_qkv.bias": ("qkv", ("q.bias", "k.bias", "v.bias")),
    "self_attention.linear_proj.weight": ("split_input", ("o.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("mlp_norm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ("mlp_norm.weight",)),
    "mlp.linear_fc1.weight": ("gate_up", ("gate.weight", "up.weight")),
    "mlp.linear_fc2.weight": ("split_input", ("down.weight",)),
}


@dataclass(frozen=True)
class Slot:
    """One Megatron parameter of this rank and the neutral weights its full tensor holds."""

    param: torch.nn.Parameter
    layout: str  # replicated | vocab | qkv | gate_up | split_input
    names: tuple[str, ...]


def parameter_slots(model, tied: bool) -> list[Slot]:
    gpt = _unwrap(model)
    layer_index = {f"decoder.layers.{j}.": layer.layer_number - 1 for j, layer in enumerate(gpt.decoder.layers)}
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
            prefix = name[: name.index(".", len("decoder.layers.")) + 1] if name.startswith("decoder.layers.") else ""
            if prefix not in layer_index or name[len(prefix):] not in _LAYER_PARAMS:
                raise ValueError(f"no neutral name for Megatron parameter {name!r}")
            layout, names = _LAYER_PARAMS[name[len(prefix):]]
            i = layer_index[prefix]
            slots.append(Slot(param, layout, tuple(f"layers.{i}.{n}" for n in names)))
    return slots


def _unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def _is_tied(model) -> bool:
    return bool(_unwrap(model).share_embeddings_and_output_weights)


@torch.no_grad()
def export_full_weights(model_chunks: Sequence[Any], groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """All weights of the model, unsharded, float32, in the neutral naming, on every rank.

    Collective over the TP group (all-gather) and the PP group (each stage broadcasts its
    layers): every rank of the model-parallel group must call it. CP/DP replicas hold the same
    weights and need not coordinate. Memory: the whole model in float32 on every rank, on the
    parameters' device; meant for models that fit (pushing weights to an in-process rollout engine).
    """
    first = _unwrap(model_chunks[0])
    vocab_size = _real_vocab_size(first)
    tied = _is_tied(first)
    local: dict[str, torch.Tensor] = {}
    for chunk in model_chunks:
        for slot in parameter_slots(chunk, tied):
            if tied and slot.names == ("embed.weight",) and "embed.weight" in local:
                continue
            # A copy: the result must not alias the parameters the optimizer updates in place.
            full = _gather_tp(slot.param.detach().to(torch.float32, copy=True), slot.layout, groups)
            local.update(_to_neutral(full, slot, _unwrap(chunk).config, groups.tp_size, vocab_size))
    weights = _all_gather_stages(local, groups.pp)
    if tied:
        weights["lm_head.weight"] = weights["embed.weight"]
    return dict(sorted(weights.items(), key=lambda kv: _neutral_order(kv[0])))


@torch.no_grad()
def load_full_weights(model_chunks: Sequence[Any], weights: Mapping[str, torch.Tensor],
                      groups: ParallelGroups) -> None:
    """Set this rank's shards of every parameter from full neutral weights (inverse of export).

    `weights` needs the entries this rank's chunks hold (others are ignored); Megatron's
    vocabulary padding rows are set to zero. With tied embeddings lm_head.weight is not read.
    No communication.
    """
    for chunk in model_chunks:
        gpt = _unwrap(chunk)
        for slot in parameter_slots(gpt, _is_tied(gpt)):
            missing = [n for n in slot.names if n not in weights]
            if missing:
                raise KeyError(f"load_full_weights: missing {', '.join(missing)}")
            full = _from_neutral([weights[n] for n in slot.names], slot.layout, gpt.config, groups.tp_size)
            if slot.layout == "vocab":
                full = _pad_rows(full, slot.param.shape[0] * groups.tp_size)
            shard = _shard_tp(full, slot.layout, groups.tp_size, groups.tp_rank)
            if shard.shape != slot.param.shape:
                raise ValueError(f"{'/'.join(slot.names)}: shapes {[tuple(weights[n].shape) for n in slot.names]} "
                                 f"do not give this rank's parameter shape {tuple(slot.param.shape)}")
            slot.param.copy_(shard)


def _real_vocab_size(gpt) -> int:
    return getattr(gpt, "unpadded_vocab_size", gpt.vocab_size)


SPLIT_DIM = {"vocab": 0, "qkv": 0, "gate_up": 0, "split_input": 1}


def _gather_tp(shard: torch.Tensor, layout: str, groups: ParallelGroups) -> torch.Tensor:
    if layout == "replicated" or groups.tp_size == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(groups.tp_size)]
    dist.all_gather(parts, shard.contiguous(), group=groups.tp)
    return torch.cat(parts, dim=SPLIT_DIM[layout])


def _shard_tp(full: torch.Tensor, layout: str, tp_size: int, tp_rank: int) -> torch.Tensor:
    if layout == "replicated" or tp_size == 1:
        return full
    return full.chunk(tp_size, dim=SPLIT_DIM[layout])[tp_rank]


def _to_neutral(full: torch.Tensor, slot: Slot, config, tp_size: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """Neutral tensors held by a TP-gathered Megatron parameter."""
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


def _from_neutral(tensors: list[torch.Tensor], layout: str, config, tp_size: int) -> torch.Tensor:
    """The TP-gathered Megatron tensor built from neutral tensors (inverse of _to_neutral)."""
    if layout == "qkv":
        q, k, v = tensors
        groups, group_heads = config.num_query_groups, config.num_attention_heads // config.num_query_groups
        rest, hd = q.shape[1:], config.kv_channels
        per_group = torch.cat([q.reshape(groups, group_heads, hd, *rest), k.reshape(groups, 1, hd, *rest),
                               v.reshape(groups, 1, hd, *rest)], dim=1)
        return per_group.reshape(-1, *rest)
    if layout == "gate_up":
        gate, up = tensors
        rest = gate.shape[1:]
        per_rank = torch.stack([gate.reshape(tp_size, -1, *rest), up.reshape(tp_size, -1, *rest)], dim=1)
        return per_rank.reshape(-1, *rest)
    return tensors[0]


def _pad_rows(full: torch.Tensor, rows: int) -> torch.Tensor:
    if full.shape[0] > rows:
        raise ValueError(f"embedding has {full.shape[0]} rows, more than the model's padded vocabulary {rows}")
    return F.pad(full, (0, 0, 0, rows - full.shape[0]))


def _all_gather_stages(local: dict[str, torch.Tensor], pp_group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Union of every pipeline stage's tensors, on every stage (one broadcast per tensor)."""
    pp_size = dist.get_world_size(pp_group)
    if pp_size == 1:
        return local
    device = next(iter(local.values())).device
    merged: dict[str, torch.Tensor] = {}
    for stage in range(pp_size):
        src = dist.get_global_rank(pp_group, stage)
        is_src = stage == dist.get_rank(pp_group)
        manifest = [[(name, tuple(t.shape)) for name, t in local.items()] if is_src else None]
        dist.broadcast_object_list(manifest, src=src, group=pp_group, device=device)
        for name, shape in manifest[0]:
            tensor = local[name].contiguous() if is_src else torch.empty(shape, dtype=torch.float32, device=device)
            dist.broadcast(tensor, src=src, group=pp_group)
            merged.setdefault(name, tensor)
    return merged


def _neutral_order(name: str) -> tuple:
    head, _, rest = name.partition(".")
    if head == "layers":
        index, _, tail = rest.partition(".")
        return (1, int(index), _LAYER_ORDER.index(tail))
    return ({"embed": 0, "final_norm": 2, "lm_head": 3}[head], 0, 0)


