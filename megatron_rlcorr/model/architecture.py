"""The decoder architecture every implementation shares: shape, features and their rules.

`DecoderShape` is what the Megatron model, the plain-torch reference, the rollout engines and the
Hugging Face mapping agree on: token embedding; per layer RMSNorm -> GQA causal self-attention
with rotary embeddings (rotate-half; optional q/k/v bias; optional RMSNorm of each query and key
head before the rotation, as Qwen3) -> residual -> RMSNorm -> SwiGLU MLP -> residual; final
RMSNorm; output layer (tied to the embedding or not). Field names are Megatron-Core's.

Rotary frequencies: inv_freq_i = base^(-2i / head_dim); with `rope_scaling` (LLaMA-3.1) they are
rescaled by LLaMA 3's rule with Megatron-Core's fixed constants (low/high frequency factors 1 and
4, original context 8192), so only `rope_scaling_factor` is a setting.

Pure Python and torch: no Megatron-Core import.
"""
from __future__ import annotations

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

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                                   "num_query_groups", "ffn_hidden_size"))
        check_positive(self, ("rotary_base", "norm_epsilon", "rope_scaling_factor"))
        attention_head_dim(self.hidden_size, self.num_attention_heads, self.num_query_groups, self.kv_channels)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def layer_parameters(self) -> int:
        """Parameters of one decoder layer: two RMSNorms, q/k/v (+ Qwen2's biases, + Qwen3's
        per-head norms), the output projection and the SwiGLU MLP (gate, up, down)."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        attention = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.add_qkv_bias else 0)
        return 2 * h + attention + (2 * d if self.qk_layernorm else 0) + 3 * h * f

    @property
    def parameter_count(self) -> int:
        """All parameters as in the Hugging Face checkpoint (unpadded vocabulary; a tied head once)."""
        embedding = self.vocab_size * self.hidden_size
        head = 0 if self.tie_embeddings else embedding
        return embedding + self.num_layers * self.layer_parameters + self.hidden_size + head


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
