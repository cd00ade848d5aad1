"""The policy model: a Megatron-Core GPTModel of the Qwen2/LLaMA family, and its weights.

Architecture: token embedding; per layer RMSNorm -> GQA causal self-attention with rotary
embeddings (rotate-half, non-interleaved; optional q/k/v bias) -> residual -> RMSNorm -> SwiGLU
MLP down(silu(gate(x)) * up(x)) -> residual; final RMSNorm; output layer (tied to the embedding
or not). No dropout, no linear biases besides q/k/v.

Weights travel between the trainer, checkpoints and the rollout engine in one neutral naming of
full (unsharded) tensors:

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

Initialisation: every weight is drawn from its own generator seeded by (seed, neutral name), so a
seed gives the same model under any TP/PP/VPP layout (Megatron-Core's own initialisation depends
on the pipeline layout through the order in which stages draw random numbers). Distributions
follow Megatron-Core: N(0, std) for embedding, output layer, q/k/v, gate and up; N(0,
std/sqrt(2*num_layers)) for o and down; zero biases; unit norm weights.
"""
from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_type_hints

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .architecture import attention_head_dim, check_positive, check_positive_ints
from .config import did_you_mean
from .schema import coerce

if TYPE_CHECKING:  # megatron.core is imported only where a model is built (import time ~5 s)
    from .parallel.groups import ParallelGroups

Fp8Format = Literal["e4m3", "hybrid"]
Fp8RecipeName = Literal["delayed", "tensorwise", "blockwise", "mxfp8"]
ParamsDtype = Literal["float32", "bfloat16"]

# Logit given to Megatron's vocabulary padding: exp() of it underflows to 0 next to any real
# logit, and it stays finite (also after dividing by a sampling temperature), so log-softmax,
# entropy and cross-entropy over the padded vocabulary equal those over the real one.
PADDED_VOCAB_LOGIT = -1.0e30


@dataclass(frozen=True)
class Fp8Config:
    """FP8 training through Transformer Engine: number format and scaling recipe."""

    format: Fp8Format = "e4m3"
    recipe: Fp8RecipeName = "delayed"

    def __post_init__(self) -> None:
        _check_choice("fp8.format", self.format, Fp8Format)
        _check_choice("fp8.recipe", self.recipe, Fp8RecipeName)


@dataclass(frozen=True)
class ModelConfig:
    """The recipe's `model:` section (Megatron-Core names where one exists)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    ffn_hidden_size: int
    num_query_groups: int | None = None  # None: one K/V head per query head (no GQA)
    kv_channels: int | None = None       # head dimension; None: hidden_size // num_attention_heads
    max_position_embeddings: int = 4096
    rotary_base: float = 10000.0
    add_qkv_bias: bool = False
    tie_embeddings: bool = False
    norm_epsilon: float = 1e-6
    init_method_std: float = 0.02
    params_dtype: ParamsDtype | None = None  # None: "bfloat16" with bf16, else "float32"
    bf16: bool = False
    fp8: Fp8Config | None = None
    # Megatron pads the vocabulary to a multiple of this times the TP size (GEMM efficiency);
    # the padding never gets probability (PADDED_VOCAB_LOGIT).
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self) -> None:
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.params_dtype is None:
            object.__setattr__(self, "params_dtype", "bfloat16" if self.bf16 else "float32")
        if isinstance(self.fp8, Mapping):
            object.__setattr__(self, "fp8", _from_mapping(Fp8Config, self.fp8, "fp8"))
        check_positive_ints(self, ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                                   "num_query_groups", "ffn_hidden_size", "max_position_embeddings",
                                   "make_vocab_size_divisible_by"))
        check_positive(self, ("rotary_base", "norm_epsilon", "init_method_std"))
        attention_head_dim(self.hidden_size, self.num_attention_heads, self.num_query_groups, self.kv_channels)
        _check_choice("params_dtype", self.params_dtype, ParamsDtype)
        if self.params_dtype != ("bfloat16" if self.bf16 else "float32"):
            raise ValueError(f"params_dtype={self.params_dtype!r} does not match bf16={self.bf16}: use "
                             "params_dtype: bfloat16 with bf16: true, or float32 with bf16: false, or leave "
                             "params_dtype unset (the optimizer keeps float32 master weights either way)")
        if self.fp8 is not None and not self.bf16:
            raise ValueError("fp8 needs bf16: true (FP8 GEMMs run inside a BF16 model)")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def torch_params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.params_dtype == "bfloat16" else torch.float32

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any] | None) -> "ModelConfig":
        """From a recipe's `model:` mapping; unknown or missing keys raise ValueError."""
        return _from_mapping(cls, mapping or {}, "model")


def _from_mapping(cls, mapping, section: str):
    if not isinstance(mapping, Mapping):
        raise ValueError(f"{section} must be a mapping, got {type(mapping).__name__}: {mapping!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in mapping:
        if key not in fields:
            raise ValueError(f"unknown {section} setting {key!r}{did_you_mean(str(key), list(fields))}; "
                             f"allowed: {', '.join(fields)}")
    missing = [name for name, f in fields.items() if f.default is dataclasses.MISSING and name not in mapping]
    if missing:
        raise ValueError(f"{section} is missing required setting(s): {', '.join(missing)}")
    hints = get_type_hints(cls)
    return cls(**{key: coerce(value, hints[key], f"{section}.{key}") for key, value in mapping.items()})


def _check_choice(name: str, value, literal) -> None:
    choices = literal.__args__
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
                         f"{did_you_mean(str(value), [str(c) for c in choices])}")


def pad_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """The vocabulary size Megatron-Core's embedding/output layer use: a multiple of divisible_by*tp."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


# ---- building the model ----------------------------------------------------------------------

def transformer_config(cfg: ModelConfig, groups: ParallelGroups):
    """Megatron-Core TransformerConfig for `cfg` under the parallel layout of `groups`."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if cfg.num_query_groups % groups.tp_size or cfg.num_attention_heads % groups.tp_size:
        raise ValueError(f"num_attention_heads ({cfg.num_attention_heads}) and num_query_groups "
                         f"({cfg.num_query_groups}) must be divisible by parallel.tp={groups.tp_size}")
    stages = groups.pp_size * (groups.vpp_size or 1)
    if cfg.num_layers % stages:
        raise ValueError(f"num_layers ({cfg.num_layers}) must be divisible by pp*vpp = {stages}")
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.add_qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        # Weights are set by load_full_weights (seeded per name); skip Megatron's own draw.
        perform_initialization=False,
        use_cpu_initialization=True,
        params_dtype=cfg.torch_params_dtype,
        pipeline_dtype=cfg.torch_params_dtype,
        bf16=cfg.bf16,
        tensor_model_parallel_size=groups.tp_size,
        pipeline_model_parallel_size=groups.pp_size,
        virtual_pipeline_model_parallel_size=groups.vpp_size,
        context_parallel_size=groups.cp_size,
        **_fp8_settings(cfg.fp8),
    )


def _fp8_settings(fp8: Fp8Config | None) -> dict[str, Any]:
    """TransformerConfig's `fp8` / `fp8_recipe` for this Megatron-Core version."""
    if fp8 is None:
        return {}
    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    if "fp8_recipe" not in names:
        if fp8.recipe != "delayed":
            raise ValueError(f"fp8.recipe={fp8.recipe!r} needs a Megatron-Core with TransformerConfig.fp8_recipe; "
                             "this one only has delayed scaling")
        return {"fp8": fp8.format}
    from megatron.core.enums import Fp8Recipe

    supported = [r.value for r in Fp8Recipe]
    if fp8.recipe not in supported:
        raise ValueError(f"fp8.recipe={fp8.recipe!r} is not supported by the installed Megatron-Core "
                         f"(supported: {', '.join(supported)})")
    return {"fp8": fp8.format, "fp8_recipe": fp8.recipe}


def use_transformer_engine() -> bool:
    """True when Transformer Engine layers can be used: CUDA present and TE importable."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def _layer_spec(cfg: ModelConfig, groups: ParallelGroups):
    from megatron.core.models.gpt import gpt_layer_specs

    if use_transformer_engine():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    if cfg.fp8 is not None:
        raise ValueError("model.fp8 needs Transformer Engine on a CUDA machine; remove fp8 to run without it")
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    if groups.cp_size > 1:
        from .parallel.cp_attention import ContextParallelAttention

        # Megatron's DotProductAttention rejects context parallelism; ours attends over the
        # all-gathered K/V with the causal mask on global zigzag positions.
        spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    return spec


def build_gpt_model(cfg: ModelConfig, groups: ParallelGroups, *, pre_process: bool | None = None,
                    post_process: bool | None = None, vp_stage: int | None = None, seed: int = 1234,
                    init_weights: bool = True):
    """This rank's GPTModel chunk (TE layers with CUDA + Transformer Engine, else local layers).

    pre_process / post_process default to whether this is the first / last pipeline stage (for
    virtual chunk `vp_stage`). Weights are `init_full_weights(cfg, seed)`, identical for every
    parallel layout; with init_weights=False they stay uninitialised (load_full_weights or a
    checkpoint must follow). `seed` also seeds Megatron's TP RNG tracker if nobody did yet.
    The output layer is vocabulary-parallel ([b, s, V_padded / tp] per TP rank); logits of
    Megatron's vocabulary padding are PADDED_VOCAB_LOGIT.
    """
    from megatron.core.models.gpt import GPTModel

    if pre_process is None:
        pre_process = groups.is_pipeline_first_stage(vp_stage)
    if post_process is None:
        post_process = groups.is_pipeline_last_stage(vp_stage)
    padded_vocab = pad_vocab_size(cfg.vocab_size, groups.tp_size, cfg.make_vocab_size_divisible_by)
    model = GPTModel(
        config=transformer_config(cfg, groups),
        transformer_layer_spec=_layer_spec(cfg, groups),
        vocab_size=padded_vocab,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=cfg.rotary_base,
        pg_collection=groups.pg_collection,
        vp_stage=vp_stage,
    )
    model.unpadded_vocab_size = cfg.vocab_size  # export_full_weights strips the padding rows
    _mark_tensor_parallel_params(model, cfg.tie_embeddings)
    # The local spec's torch norms ignore params_dtype (Megatron's Float16Module would cast them).
    for param in model.parameters():
        if param.dtype != cfg.torch_params_dtype:
            param.data = param.data.to(cfg.torch_params_dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if post_process and padded_vocab > cfg.vocab_size:
        mask_padding = _padded_vocab_mask_hook(cfg.vocab_size, padded_vocab, groups.tp_rank)
        model.output_layer.register_forward_hook(mask_padding)
    _seed_megatron_rng(seed, groups)
    if init_weights:
        load_full_weights([model], _SeededWeights(cfg, seed), groups)
    return model


def _mark_tensor_parallel_params(model, tied: bool) -> None:
    """Set Megatron's `tensor_model_parallel` / `partition_dim` on TP-split parameters.

    With use_cpu_initialization=True and perform_initialization=False Megatron-Core's parallel
    linear layers skip the call that sets them; the optimizer's grad norm (and clipping) then
    counts only TP rank 0's shard of every split weight.
    """
    for slot in _slots(model, tied):
        if slot.layout != "replicated" and not getattr(slot.param, "tensor_model_parallel", False):
            slot.param.tensor_model_parallel = True
            slot.param.partition_dim = _SPLIT_DIM[slot.layout]
            slot.param.partition_stride = 1


def _padded_vocab_mask_hook(vocab_size: int, padded_vocab: int, tp_rank: int) -> Callable:
    """Forward hook of the output layer: padding columns get PADDED_VOCAB_LOGIT."""

    def hook(module, args, output):
        logits, bias = output
        width = logits.shape[-1]
        first_id = 0 if width == padded_vocab else tp_rank * width  # TP-gathered or vocab-parallel
        real_columns = vocab_size - first_id
        if real_columns >= width:
            return output
        is_padding = torch.arange(width, device=logits.device) >= real_columns
        return logits.masked_fill(is_padding, PADDED_VOCAB_LOGIT), bias

    return hook


def _seed_megatron_rng(seed: int, groups: ParallelGroups) -> None:
    """Seed Megatron's tensor-parallel RNG tracker unless the entry point already did.

    DotProductAttention forks the tracker's "model-parallel-rng" state around (zero) dropout, so a
    model cannot run before the tracker is seeded.
    """
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME

    if _MODEL_PARALLEL_RNG_TRACKER_NAME not in tensor_parallel.get_cuda_rng_tracker().get_states():
        tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=groups.tp_rank, ep_rank=0, etp_rank=0)


# ---- weights: neutral names <-> Megatron parameters -----------------------------------------

def init_full_weights(cfg: ModelConfig, seed: int, layers: Iterable[int] | None = None) -> dict[str, torch.Tensor]:
    """Seeded initial weights (float32, neutral names) of `layers` (default all) plus the
    embedding, final norm and lm_head; each tensor is the same whatever subset is asked for."""
    wanted = {f"layers.{i}." for i in (range(cfg.num_layers) if layers is None else layers)}
    seeded = _SeededWeights(cfg, seed)
    weights = {name: seeded[name] for name in seeded
               if not name.startswith("layers.") or name[: name.index(".", len("layers.")) + 1] in wanted}
    if cfg.tie_embeddings:
        weights["lm_head.weight"] = weights["embed.weight"]
    return weights


class _SeededWeights(Mapping):
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
class _Slot:
    """One Megatron parameter of this rank and the neutral weights its full tensor holds."""

    param: torch.nn.Parameter
    layout: str  # replicated | vocab | qkv | gate_up | split_input
    names: tuple[str, ...]


def _slots(model, tied: bool) -> list[_Slot]:
    gpt = _unwrap(model)
    layer_index = {f"decoder.layers.{j}.": layer.layer_number - 1 for j, layer in enumerate(gpt.decoder.layers)}
    slots = []
    for name, param in gpt.named_parameters():
        if name == "embedding.word_embeddings.weight":
            slots.append(_Slot(param, "vocab", ("embed.weight",)))
        elif name == "output_layer.weight":
            # A tied model keeps a copy of the embedding on the last pipeline stage.
            slots.append(_Slot(param, "vocab", ("embed.weight" if tied else "lm_head.weight",)))
        elif name == "decoder.final_layernorm.weight":
            slots.append(_Slot(param, "replicated", ("final_norm.weight",)))
        else:
            prefix = name[: name.index(".", len("decoder.layers.")) + 1] if name.startswith("decoder.layers.") else ""
            if prefix not in layer_index or name[len(prefix):] not in _LAYER_PARAMS:
                raise ValueError(f"no neutral name for Megatron parameter {name!r}")
            layout, names = _LAYER_PARAMS[name[len(prefix):]]
            i = layer_index[prefix]
            slots.append(_Slot(param, layout, tuple(f"layers.{i}.{n}" for n in names)))
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
        for slot in _slots(chunk, tied):
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
        for slot in _slots(gpt, _is_tied(gpt)):
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


_SPLIT_DIM = {"vocab": 0, "qkv": 0, "gate_up": 0, "split_input": 1}


def _gather_tp(shard: torch.Tensor, layout: str, groups: ParallelGroups) -> torch.Tensor:
    if layout == "replicated" or groups.tp_size == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(groups.tp_size)]
    dist.all_gather(parts, shard.contiguous(), group=groups.tp)
    return torch.cat(parts, dim=_SPLIT_DIM[layout])


def _shard_tp(full: torch.Tensor, layout: str, tp_size: int, tp_rank: int) -> torch.Tensor:
    if layout == "replicated" or tp_size == 1:
        return full
    return full.chunk(tp_size, dim=_SPLIT_DIM[layout])[tp_rank]


def _to_neutral(full: torch.Tensor, slot: _Slot, config, tp_size: int, vocab_size: int) -> dict[str, torch.Tensor]:
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


# ---- the single-process reference -----------------------------------------------------------

def reference_forward(weights: Mapping[str, torch.Tensor], cfg: ModelConfig, tokens_BT: torch.Tensor) -> torch.Tensor:
    """float32 logits [B, T, vocab_size] of the architecture above, in plain torch.

    Positions are 0..T-1 for every row (right padding). With tied embeddings the output layer
    is embed.weight (lm_head.weight is not read). Differentiable with respect to `weights`.
    The independent reference for the parallel model and for rollout engines.
    """
    w = {name: t.float() for name, t in weights.items()}
    batch, seq = tokens_BT.shape
    n_heads, n_groups, hd = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim
    cos_TD, sin_TD = _rotary_cos_sin(seq, hd, cfg.rotary_base, tokens_BT.device)
    causal_TT = torch.ones(seq, seq, dtype=torch.bool, device=tokens_BT.device).tril()
    x_BTH = w["embed.weight"][tokens_BT]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h_BTH = _rms_norm(x_BTH, w[p + "attn_norm.weight"], cfg.norm_epsilon)
        q, k, v = (F.linear(h_BTH, w[p + n + ".weight"], w.get(p + n + ".bias")) for n in ("q", "k", "v"))
        q_BNTD = _rotate(q.view(batch, seq, n_heads, hd).transpose(1, 2), cos_TD, sin_TD)
        k_BGTD = _rotate(k.view(batch, seq, n_groups, hd).transpose(1, 2), cos_TD, sin_TD)
        v_BGTD = v.view(batch, seq, n_groups, hd).transpose(1, 2)
        k_BNTD = k_BGTD.repeat_interleave(n_heads // n_groups, dim=1)
        v_BNTD = v_BGTD.repeat_interleave(n_heads // n_groups, dim=1)
        scores = q_BNTD @ k_BNTD.transpose(-1, -2) / math.sqrt(hd)
        probs = scores.masked_fill(~causal_TT, float("-inf")).softmax(dim=-1)
        attn_BTH = (probs @ v_BNTD).transpose(1, 2).reshape(batch, seq, n_heads * hd)
        x_BTH = x_BTH + F.linear(attn_BTH, w[p + "o.weight"])
        h_BTH = _rms_norm(x_BTH, w[p + "mlp_norm.weight"], cfg.norm_epsilon)
        mlp = F.silu(F.linear(h_BTH, w[p + "gate.weight"])) * F.linear(h_BTH, w[p + "up.weight"])
        x_BTH = x_BTH + F.linear(mlp, w[p + "down.weight"])
    x_BTH = _rms_norm(x_BTH, w["final_norm.weight"], cfg.norm_epsilon)
    return F.linear(x_BTH, w["embed.weight" if cfg.tie_embeddings else "lm_head.weight"])


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _rotary_cos_sin(seq: int, head_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles_TD = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv_freq).repeat(1, 2)
    return angles_TD.cos(), angles_TD.sin()


def _rotate(x: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half (non-interleaved) convention."""
    first, second = x.chunk(2, dim=-1)
    return x * cos_TD + torch.cat([-second, first], dim=-1) * sin_TD
