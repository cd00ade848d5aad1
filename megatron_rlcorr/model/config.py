"""The policy model's settings: the recipe's `model:` section (architecture, precision, FP8).

The architecture is architecture.DecoderShape's (Megatron-Core field names). With
`hf_checkpoint: DIR` it comes from the checkpoint's config.json (hf_config.py) and the weights from its
safetensors; architecture keys also given in the recipe must agree with config.json.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ..settings import check_choice, from_mapping
from .architecture import DecoderShape, MoeShape, check_positive_ints
from .hf_config import checkpoint_agrees_with_preset, merge_architecture, merge_preset
from .presets import preset_architecture

Fp8Format = Literal["e4m3", "hybrid"]
Fp8RecipeName = Literal["delayed", "tensorwise", "blockwise", "mxfp8"]
ParamsDtype = Literal["float32", "bfloat16"]
# Megatron-LM's --transformer-impl: Transformer Engine's layers, or Megatron-Core's own (torch) ones.
TransformerImpl = Literal["transformer_engine", "local"]

# What every rank's token count must be a multiple of under Transformer Engine's FP8 recipes: its
# FP8 GEMMs need the token (inner, for the weight gradient) dimension to be a multiple of 16;
# MXFP8 scales blocks of 32; blockwise scaling all-gathers FP8 data under sequence parallelism
# only when each rank holds whole 128-token blocks (else it warns and gathers in BF16).
FP8_TOKEN_ALIGNMENT = 16
MXFP8_TOKEN_ALIGNMENT = 32
BLOCKWISE_SEQUENCE_PARALLEL_TOKEN_ALIGNMENT = 128

# Logit given to Megatron's vocabulary padding: exp() of it underflows to 0 next to any real
# logit, and it stays finite (also after dividing by a sampling temperature), so log-softmax,
# entropy and cross-entropy over the padded vocabulary equal those over the real one.
PADDED_VOCAB_LOGIT = -1.0e30


@dataclass(frozen=True)
class Fp8Config:
    """FP8 training through Transformer Engine: number format and scaling recipe."""

    format: Fp8Format = "e4m3"      # e4m3: E4M3 for every FP8 tensor; hybrid: E4M3 forward, E5M2 gradients
    # Transformer Engine's scaling: delayed (per-tensor scales from an amax history), tensorwise (per-tensor,
    # current), blockwise (per-block scales; compute capability 9.0+ and CUDA >= 12.9), mxfp8 (one scale per
    # 32 elements; compute capability 10.x, Blackwell). delayed and tensorwise need compute capability 8.9+.
    # A recipe this machine's GPU cannot run is refused at recipe load by train, score and export (`plan`,
    # which needs no GPU, plans it).
    # A Megatron-Core without TransformerConfig.fp8_recipe runs delayed only.
    recipe: Fp8RecipeName = "delayed"

    def __post_init__(self) -> None:
        check_choice("fp8.format", self.format, Fp8Format)
        check_choice("fp8.recipe", self.recipe, Fp8RecipeName)


# How routed tokens reach the ranks holding their experts (Megatron-Core's moe_token_dispatcher_type).
TokenDispatcher = Literal["allgather", "alltoall"]


@dataclass(frozen=True)
class MoeConfig(MoeShape):
    """The recipe's `model.moe:` section: the experts (MoeShape, architecture.py) and how they train.

    Expert parallelism is parallel.ep / parallel.etp; routing replay is rollout.routing_replay.
    """

    # Weight of Megatron-Core's load-balancing loss (aux_loss) in the policy loss. 0 (default, as verl and
    # slime run RL): the router is trained by the policy gradient alone; > 0 adds coeff * aux_loss per MoE
    # layer and logs moe/aux_loss.
    aux_loss_coeff: float = 0.0
    # allgather: every rank of the expert group sees every token and computes its experts' share (the CPU path);
    # alltoall: tokens are sent to the ranks of their experts only (the GPU default). None: allgather without
    # CUDA, alltoall with it.
    token_dispatcher: TokenDispatcher | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.aux_loss_coeff >= 0:
            raise ValueError(f"moe.aux_loss_coeff must be >= 0, got {self.aux_loss_coeff!r}")
        if self.token_dispatcher is not None:
            check_choice("moe.token_dispatcher", self.token_dispatcher, TokenDispatcher)

    @property
    def shape(self) -> MoeShape:
        """The architecture alone (what the rollout engines and the Hugging Face mapping take)."""
        return MoeShape(**{f.name: getattr(self, f.name) for f in dataclasses.fields(MoeShape)})

    def dispatcher(self) -> TokenDispatcher:
        """token_dispatcher, resolved for this process (allgather without CUDA, alltoall with it)."""
        return self.token_dispatcher or ("alltoall" if torch.cuda.is_available() else "allgather")


RecomputeGranularity = Literal["full", "selective"]
RecomputeMethod = Literal["uniform", "block"]
RecomputeModule = Literal["core_attn", "mlp", "layernorm"]


@dataclass(frozen=True)
class RecomputeSettings:
    """Activation recomputation (Megatron-Core's recompute_*): memory for compute.

    full: keep only the input of each recomputed chunk of layers and run the chunk again in the
    backward pass; `method: uniform` cuts each pipeline stage's layers into chunks of
    `num_layers`, `method: block` recomputes the first `num_layers` layers of every stage.
    selective: recompute only `modules` of every layer (by default core attention, whose
    activations grow with the square of the sequence without flash attention).
    """

    granularity: RecomputeGranularity = "full"                # full: rerun whole layers; selective: only `modules`
    method: RecomputeMethod = "uniform"                       # full only
    num_layers: int = 1                                       # full only
    modules: tuple[RecomputeModule, ...] = ("core_attn",)     # selective only

    def __post_init__(self) -> None:
        check_choice("recompute.granularity", self.granularity, RecomputeGranularity)
        check_choice("recompute.method", self.method, RecomputeMethod)
        if self.num_layers < 1:
            raise ValueError(f"recompute.num_layers must be >= 1, got {self.num_layers}")
        object.__setattr__(self, "modules", tuple(self.modules))
        for module in self.modules:
            check_choice("recompute.modules[]", module, RecomputeModule)
        if self.granularity == "selective" and not self.modules:
            raise ValueError("recompute.modules is empty: selective recomputation needs at least one module "
                             "(core_attn, mlp, layernorm), or use granularity: full")

    def transformer_config_fields(self) -> dict[str, Any]:
        if self.granularity == "full":
            return dict(recompute_granularity="full", recompute_method=self.method,
                        recompute_num_layers=self.num_layers)
        return dict(recompute_granularity="selective", recompute_modules=list(self.modules))


@dataclass(frozen=True)
class ModelConfig:
    """The recipe's `model:` section (Megatron-Core names where one exists)."""

    vocab_size: int                      # tokens of the vocabulary, unpadded; must cover the task's tokenizer
    hidden_size: int                     # model width: the embedding and residual-stream size
    num_layers: int                      # decoder layers; divisible by parallel.pp * parallel.vpp
    num_attention_heads: int             # query heads; divisible by parallel.tp
    ffn_hidden_size: int                 # the SwiGLU MLP's inner size (HF intermediate_size)
    num_query_groups: int | None = None  # None: one K/V head per query head (no GQA)
    kv_channels: int | None = None       # head dimension; None: hidden_size // num_attention_heads
    max_position_embeddings: int = 4096  # context length (tokens): prompt + response may not exceed it
    rotary_base: float = 10000.0         # rotary embedding base theta (HF rope_theta); > 0
    add_qkv_bias: bool = False           # biases on the query, key and value projections (Qwen2)
    qk_layernorm: bool = False           # RMSNorm of every query and key head (Qwen3)
    tie_embeddings: bool = False         # the output layer shares the embedding's weights (HF tie_word_embeddings)
    norm_epsilon: float = 1e-6           # RMSNorm epsilon (HF rms_norm_eps); > 0
    rope_scaling: bool = False           # LLaMA 3.x rotary frequency scaling
    rope_scaling_factor: float = 8.0     # with rope_scaling: long wavelengths are divided by it; > 0
    # Standard deviation of the seeded normal initialisation (divided by sqrt(2 * num_layers) for the
    # attention output and MLP down projections); unused with hf_checkpoint; > 0.
    init_method_std: float = 0.02
    params_dtype: ParamsDtype | None = None  # None: "bfloat16" with bf16, else "float32"
    bf16: bool = False                   # bfloat16 weights and compute (float32 master weights); false: float32
    # With bf16: the output layer (each rank's vocabulary shard) in float32 from the bf16 hidden states, in the
    # trainer and the embedded engine, so log-probs carry no bf16 rounding of the logits (a mismatch lever:
    # docs/troubleshooting.md); costs float32 copies of the weight shard, hidden states and logits (and
    # their gradients). Without bf16 the output layer is float32 already.
    fp32_lm_head: bool = False
    fp8: Fp8Config | None = None
    # Mixture of experts (MoeConfig: experts, top-k, expert width, dense layers, router softmax, shared
    # expert, aux-loss coefficient, dispatcher); None: a dense model. From a checkpoint's config.json
    # with hf_checkpoint (Qwen3-MoE, Qwen2-MoE).
    moe: MoeConfig | None = None
    # Which layers the model is built from: transformer_engine (Transformer Engine's fused layers; BF16,
    # FP8, sequence parallelism) or local (Megatron-Core's torch layers: the CPU path; no FP8, no sequence
    # parallelism, attention materialises an L x L score matrix per head). None: transformer_engine where
    # CUDA is available, local without it.
    transformer_impl: TransformerImpl | None = None
    recompute: RecomputeSettings | None = None  # activation recomputation; None: keep every activation
    # While the rollout engine generates, keep the trainer's weights (DDP's parameter buffers) in host memory
    # (pinned on CUDA), copied back before the trainer's next pass (verl's param_offload; training/offload.py)
    offload_params: bool = False
    # While the rollout engine generates, free the trainer's gradient buffers (their contents are not needed
    # between steps: every mini-batch starts from zero) (verl's grad_offload; training/offload.py)
    offload_grads: bool = False
    # Megatron pads the vocabulary to a multiple of this times the TP size (GEMM efficiency);
    # the padding never gets probability (PADDED_VOCAB_LOGIT).
    make_vocab_size_divisible_by: int = 128
    # Rows of the vocabulary that can get probability: the tokenizer's size where the checkpoint pads
    # its vocabulary beyond it (Qwen2.5: 151,665 of 152,064). Rows from it on get PADDED_VOCAB_LOGIT in
    # every trainer log-prob and are never sampled by either rollout engine. None: the recipe sets it
    # from the tokenizer (data.tokenizer, else model.hf_checkpoint's, else the built-in task's); a value
    # given must equal that tokenizer's size; without a tokenizer, every row of vocab_size.
    token_vocab_size: int | None = None
    # A Hugging Face checkpoint directory: architecture from its config.json, initial weights from
    # its safetensors (instead of the seeded initialisation).
    hf_checkpoint: str | None = None
    # A published architecture by name (presets.py: qwen2.5-32b, llama-3.1-8b, ...), so a recipe can
    # be planned before the checkpoint is on disk; a checkpoint that is there must agree with it.
    architecture: str | None = None

    def __post_init__(self) -> None:
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.params_dtype is None:
            object.__setattr__(self, "params_dtype", "bfloat16" if self.bf16 else "float32")
        if isinstance(self.fp8, Mapping):
            object.__setattr__(self, "fp8", from_mapping(Fp8Config, self.fp8, "fp8"))
        if isinstance(self.moe, Mapping):
            object.__setattr__(self, "moe", from_mapping(MoeConfig, self.moe, "moe"))
        if isinstance(self.recompute, Mapping):
            object.__setattr__(self, "recompute", from_mapping(RecomputeSettings, self.recompute, "recompute"))
        self.decoder_shape  # noqa: B018 - validates the architecture fields
        check_positive_ints(self, ("max_position_embeddings", "make_vocab_size_divisible_by"))
        if self.token_vocab_size is not None and not 1 <= self.token_vocab_size <= self.vocab_size:
            raise ValueError(f"token_vocab_size={self.token_vocab_size} must be in [1, vocab_size={self.vocab_size}]: "
                             "the tokenizer's ids must be rows of the model (or leave it unset)")
        if not self.init_method_std > 0:
            raise ValueError(f"init_method_std must be > 0, got {self.init_method_std!r}")
        check_choice("params_dtype", self.params_dtype, ParamsDtype)
        if self.transformer_impl is not None:
            check_choice("transformer_impl", self.transformer_impl, TransformerImpl)
        if self.params_dtype != ("bfloat16" if self.bf16 else "float32"):
            raise ValueError(f"params_dtype={self.params_dtype!r} does not match bf16={self.bf16}: use "
                             "params_dtype: bfloat16 with bf16: true, or float32 with bf16: false, or leave "
                             "params_dtype unset (the optimizer keeps float32 master weights either way)")
        if self.fp8 is not None and not self.bf16:
            raise ValueError("fp8 needs bf16: true (FP8 GEMMs run inside a BF16 model)")
        if self.fp8 is not None and self.transformer_impl == "local":
            raise ValueError("fp8 needs transformer_impl: transformer_engine (Megatron-Core's local layers have no "
                             "FP8 GEMMs): remove fp8, or set transformer_impl: transformer_engine (or leave it unset)")

    @functools.cached_property
    def decoder_shape(self) -> DecoderShape:
        """The architecture alone, as the reference forward and the rollout engines take it (built once:
        the config is frozen, and the memory model asks for it per layer)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(DecoderShape)}
        return DecoderShape(**{**fields, "moe": None if self.moe is None else self.moe.shape})

    @property
    def sampled_vocab_size(self) -> int:
        """The rows that can get probability: token_vocab_size, else every row of vocab_size."""
        return self.token_vocab_size or self.vocab_size

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def token_alignment(self, *, sequence_parallel: bool = False) -> int:
        """What each rank's token count must be a multiple of (fp8_token_alignment)."""
        return fp8_token_alignment(None if self.fp8 is None else self.fp8.recipe, sequence_parallel=sequence_parallel)

    @property
    def torch_params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.params_dtype == "bfloat16" else torch.float32

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any] | None) -> "ModelConfig":
        """From a recipe's `model:` mapping; unknown or missing keys raise ValueError. With
        `hf_checkpoint`, the architecture keys come from its config.json (hf_config.read_architecture);
        with `architecture`, from the named preset, checked against the checkpoint when it exists
        (a checkpoint not on disk yet is reported by the launch checks, not here: `plan` needs none)."""
        mapping = dict(mapping or {})
        checkpoint, name = mapping.get("hf_checkpoint"), mapping.get("architecture")
        if name is not None:
            preset = preset_architecture(str(name))
            if checkpoint is not None and Path(str(checkpoint)).is_dir():
                checkpoint_agrees_with_preset(str(checkpoint), preset, str(name))
            mapping = merge_preset(mapping, preset, str(name))
        elif checkpoint is not None:
            mapping = merge_architecture(mapping, str(checkpoint))
        return from_mapping(cls, mapping, "model")


def fp8_token_alignment(recipe: str | None, *, sequence_parallel: bool) -> int:
    """What each rank's token count must be a multiple of under the FP8 `recipe` (None: no FP8, 1):
    16 for Transformer Engine's FP8 GEMMs, 32 for MXFP8's blocks, 128 for blockwise scaling with
    sequence parallelism (its FP8 all-gather of whole 128-token blocks)."""
    if recipe is None:
        return 1
    if recipe == "mxfp8":
        return MXFP8_TOKEN_ALIGNMENT
    if recipe == "blockwise" and sequence_parallel:
        return BLOCKWISE_SEQUENCE_PARALLEL_TOKEN_ALIGNMENT
    return FP8_TOKEN_ALIGNMENT


def pad_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """The vocabulary size Megatron-Core's embedding/output layer use: a multiple of divisible_by*tp."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple

