"""Shape rules of the decoder, shared by the training model's config and the rollout engines'.

Pure Python: the rollout engines use it without any Megatron-side config.
"""
from __future__ import annotations

from typing import Any, Iterable


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
