"""The decoder architecture every implementation shares: shape, features and their rules.

`DecoderShape` is what the Megatron model, the plain-torch reference, the rollout engines and the
Hugging Face mapping agree on: token embedding; per layer RMSNorm -> GQA causal self-attention
with rotary embeddings (rotate-half; optional q/k/v bias; optional RMSNorm of each query and key
head before the rotation, as Qwen3) -> residual -> RMSNorm -> SwiGLU MLP -> residual; final
RMSNorm; output layer (tied to the embedding or not). Field names are Megatron-Core's.

Mixture of experts (`MoeShape`, Qwen3-MoE / Qwen2-MoE): in every layer not listed in
`dense_layers` the SwiGLU MLP is replaced by `num_experts` SwiGLU experts of width
`ffn_hidden_size` and a router (a bias-free linear, hidden -> num_experts, in the layer's dtype).
Each token goes to the `router_topk` experts of largest router logit (ties: the lower index, as
torch.topk) and gets their outputs weighted by
- softmax over the top-k logits (`pre_softmax: false`; Qwen3-MoE, HF `norm_topk_prob: true`), or
- softmax over all experts, top-k of it, not renormalised (`pre_softmax: true`; Qwen2-MoE, HF
  `norm_topk_prob: false`).
Both select the same experts (softmax is monotone). Qwen2-MoE adds a shared expert (a SwiGLU of
width `shared_expert_ffn_hidden_size`) every token goes through, scaled by sigmoid(shared_gate . x).

Rotary frequencies: inv_freq_i = base^(-2i / head_dim); with `rope_scaling` (LLaMA-3.1) they are
rescaled by LLaMA 3's rule with Megatron-Core's fixed constants (low/high frequency factors 1 and
4, original context 8192), so only `rope_scaling_factor` is a setting.

Pure Python and torch: no Megatron-Core import.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch

# LLaMA 3's rope scaling as Megatron-Core implements it: only the factor is configurable.
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_CONTEXT = 8192


def check_positive_ints(owner: Any, names: Iterable[str]) -> None:
    """ValueError naming the first field of `owner` that is not an integer >= 1."""
    for name in names:
        value = getattr(owner, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_positive(owner: Any, names: Iterable[str]) -> None:
    for name in names:
        if not getattr(owner, name) > 0:
            raise ValueError(f"{name} must be > 0, got {getattr(owner, name)!r}")


def attention_head_dim(hidden_size: int, num_attention_heads: int, num_query_groups: int,
                       kv_channels: int | None) -> int:
    """The head dimension (kv_channels, or hidden_size / heads), after checking that the K/V groups
    divide the heads and that rotary embeddings can rotate pairs of it."""
    if num_attention_heads % num_query_groups:
        raise ValueError(f"num_query_groups ({num_query_groups}) must divide num_attention_heads "
                         f"({num_attention_heads})")
    if kv_channels is None and hidden_size % num_attention_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_attention_heads "
                         f"({num_attention_heads}); or set kv_channels (the head dimension)")
    if kv_channels is not None and (isinstance(kv_channels, bool) or not isinstance(kv_channels, int)
                                    or kv_channels < 1):
        raise ValueError(f"kv_channels must be a positive integer or null, got {kv_channels!r}")
    head_dim = kv_channels or hidden_size // num_attention_heads
    if head_dim % 2:
        raise ValueError(f"the head dimension ({head_dim}) must be even for rotary embeddings; "
                         "change hidden_size/num_attention_heads or kv_channels")
    return head_dim


@dataclass(frozen=True)
class MoeShape:
    """The mixture-of-experts part of the architecture (module docstring); the recipe's `model.moe`."""

    num_experts: int                    # routed experts per MoE layer (HF num_experts / num_local_experts)
    router_topk: int                    # experts each token is routed to (HF num_experts_per_tok)
    ffn_hidden_size: int                # each routed expert's SwiGLU inner size (HF moe_intermediate_size)
    # Layers (0-based) that keep the dense SwiGLU MLP of model.ffn_hidden_size (HF mlp_only_layers, and
    # the layers decoder_sparse_step skips); every other layer is a MoE layer.
    dense_layers: tuple[int, ...] = ()
    # false: weights = softmax over the top-k logits (Qwen3-MoE, HF norm_topk_prob: true); true: softmax over
    # all experts, then top-k, not renormalised (Qwen2-MoE, HF norm_topk_prob: false)
    pre_softmax: bool = False
    # A shared expert every token goes through, scaled by sigmoid(shared_gate . x) (Qwen2-MoE
    # shared_expert_intermediate_size); None: none
    shared_expert_ffn_hidden_size: int | None = None

    def __post_init__(self) -> None:
        check_positive_ints(self, ("num_experts", "router_topk", "ffn_hidden_size"))
        if self.router_topk > self.num_experts:
            raise ValueError(f"moe.router_topk ({self.router_topk}) exceeds moe.num_experts ({self.num_experts})")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.dense_layers):
            raise ValueError(f"moe.dense_layers must be layer indices >= 0, got {list(self.dense_layers)}")
        if self.shared_expert_ffn_hidden_size is not None:
            check_positive_ints(self, ("shared_expert_ffn_hidden_size",))

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def expert_parameters(self, hidden_size: int) -> int:
        """Parameters of one routed expert (gate, up, down)."""
        return 3 * hidden_size * self.ffn_hidden_size

    def block_parameters(self, hidden_size: int, *, active: bool = False) -> int:
        """Parameters of one MoE block: router, routed experts (only router_topk of them when
        `active`: what one token computes with), shared expert and its gate."""
        experts = self.router_topk if active else self.num_experts
        shared = 0 if self.shared_expert_ffn_hidden_size is None else (
            3 * hidden_size * self.shared_expert_ffn_hidden_size + hidden_size)
        return self.num_experts * hidden_size + experts * self.expert_parameters(hidden_size) + shared


@dataclass(frozen=True)
class DecoderShape:
    """Architecture hyper-parameters of the decoder (Megatron-Core names)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-6
    kv_channels: int | None = None  # head dim; None = hidden_size // num_attention_heads
    add_qkv_bias: bool = False
    qk_layernorm: bool = False      # RMSNorm over head_dim of every query and key head (Qwen3)
    tie_embeddings: bool = False
    rope_scaling: bool = False      # LLaMA 3.x rotary frequency scaling
    rope_scaling_factor: float = 8.0
    moe: MoeShape | None = None     # mixture of experts; None: a dense model

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                                   "num_query_groups", "ffn_hidden_size"))
        check_positive(self, ("rotary_base", "norm_epsilon", "rope_scaling_factor"))
        attention_head_dim(self.hidden_size, self.num_attention_heads, self.num_query_groups, self.kv_channels)
        if self.moe is not None:
            beyond = [i for i in self.moe.dense_layers if i >= self.num_layers]
            if beyond:
                raise ValueError(f"moe.dense_layers {beyond} are not layers of a {self.num_layers}-layer model "
                                 f"(0..{self.num_layers - 1})")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) has experts instead of the dense MLP."""
        return self.moe is not None and self.moe.is_moe_layer(layer)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The MoE layers, in order: the second axis of recorded routing ([tokens, MoE layers, top-k])."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def attention_parameters(self) -> int:
        """Parameters of one layer outside its MLP: two RMSNorms, q/k/v (+ Qwen2's biases, + Qwen3's
        per-head norms) and the output projection."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        attention = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.add_qkv_bias else 0)
        return 2 * h + attention + (2 * d if self.qk_layernorm else 0)

    @property
    def layer_parameters(self) -> int:
        """Parameters of one dense decoder layer: attention_parameters and the SwiGLU MLP (gate, up, down)."""
        return self.attention_parameters + 3 * self.hidden_size * self.ffn_hidden_size

    def layer_parameter_count(self, layer: int, *, active: bool = False) -> int:
        """Parameters of decoder layer `layer`; `active`: only the top-k routed experts of a MoE layer."""
        if not self.is_moe_layer(layer):
            return self.layer_parameters
        return self.attention_parameters + self.moe.block_parameters(self.hidden_size, active=active)

    # cached (the shape is frozen): the sums run over every layer, and plan --search asks per candidate
    @functools.cached_property
    def parameter_count(self) -> int:
        """All parameters as in the Hugging Face checkpoint (unpadded vocabulary; a tied head once)."""
        return self._count(active=False)

    @functools.cached_property
    def active_parameter_count(self) -> int:
        """Parameters one token computes with: parameter_count with only router_topk experts per
        MoE layer (the "A3B" of Qwen3-30B-A3B; embedding and output layer included)."""
        return self._count(active=True)

    def _count(self, *, active: bool) -> int:
        embedding = self.vocab_size * self.hidden_size
        head = 0 if self.tie_embeddings else embedding
        layers = sum(self.layer_parameter_count(i, active=active) for i in range(self.num_layers))
        return embedding + layers + self.hidden_size + head


def rotary_inv_freq(shape: DecoderShape, device: torch.device | str | None = None) -> torch.Tensor:
    """float32 [head_dim / 2] inverse frequencies of the rotary embedding (module docstring)."""
    exponents = torch.arange(0, shape.head_dim, 2, dtype=torch.float32, device=device) / shape.head_dim
    inv_freq = 1.0 / (shape.rotary_base ** exponents)
    if shape.rope_scaling:
        inv_freq = _llama3_scaled(inv_freq, shape.rope_scaling_factor)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Long wavelengths divided by `factor`, short ones kept, a linear blend in between."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_LOW_FREQ_FACTOR
    high_freq_wavelen = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_HIGH_FREQ_FACTOR
    smooth = (LLAMA3_ORIGINAL_CONTEXT / wavelen - LLAMA3_LOW_FREQ_FACTOR) / (
        LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)
