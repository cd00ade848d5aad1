"""Streamed weight sync: the trainer's sharded weights as full tensors, bucket by bucket.

After every optimizer step the rollout engine needs the new weights. Gathering the whole model
first (`weights.export_full_weights`) costs the full model in float32 on every rank: ~131 GB
for a 32B model. `weight_buckets` instead walks the model one tensor at a time
(`weights.iter_full_weights`: the owning pipeline stage all-gathers the tensor's TP shards and
broadcasts it over PP; a routed expert comes from its expert-parallel owner), casts it to the
engine's dtype and packs consecutive tensors into buckets of at most `bucket_bytes` (a tensor
larger than that travels alone). The consumer (an engine's `load_weights`, a writer) takes a
bucket before the next is gathered, so the extra memory of a rank is one bucket plus the tensor
in flight (its float32 gather and the cast copy).

Collective like `iter_full_weights` (over TP and PP, and for routed experts over ETP and EP, which
spans data-parallel ranks): every rank of the model-parallel group (with expert parallelism,
every rank) must drain the whole stream, also the ranks that host no engine (they drop each
bucket). Names are the neutral ones (`embed.weight`, `layers.{i}.q.weight`, ...), or Hugging
Face's with `hf_names=True` (what vLLM's `load_weights` takes). A tied model's `lm_head.weight`
is not sent: the consumer ties it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import torch

from .hf import hf_name
from .weights import iter_full_weights

if TYPE_CHECKING:
    from ..parallel.groups import ParallelGroups

MiB = 1 << 20
Bucket = list[tuple[str, torch.Tensor]]


def weight_buckets(model_chunks: Sequence[Any], groups: ParallelGroups, *, dtype: torch.dtype,
                   bucket_bytes: int, hf_names: bool = False) -> Iterator[Bucket]:
    """Lists of (name, full tensor in `dtype`), each list at most `bucket_bytes` (module docstring)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: Bucket = []
    size = 0
    for name, tensor in iter_full_weights(model_chunks, groups, dtype):
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((hf_name(name) if hf_names else name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def flatten(buckets: Iterable[Bucket]) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a bucket stream, for consumers that take one tensor at a time."""
    for bucket in buckets:
        yield from bucket


def drain(buckets: Iterable[Bucket]) -> None:
    """Take part in the stream's collectives and keep nothing (ranks that host no engine)."""
    for _ in buckets:
        pass
