"""Rollout engines: the interface (base), the embedded (precision-emulating) engine (embedded; its
batches embedded_batch, its sampler token_sampling), the vLLM adapter (vllm_engine) and the
factory."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .base import RolloutBatch, RolloutConfig, RolloutEngine
from .embedded import EmbeddedEngine, random_weights

if TYPE_CHECKING:
    from ..model.config import ModelConfig
    from ..parallel.groups import ParallelGroups

__all__ = ["EmbeddedEngine", "RolloutBatch", "RolloutConfig", "RolloutEngine", "load_model_weights", "make_engine",
           "random_weights"]


def make_engine(cfg: RolloutConfig, model: ModelConfig, *, eos_token_id: int | Sequence[int] | None,
                pad_token_id: int = 0, device: torch.device | str = "cpu", token_vocab_size: int | None = None,
                max_model_len: int | None = None, seed: int = 0) -> RolloutEngine:
    """The engine `cfg.engine` names, running `cfg.precision`; weights come later via load_weights.

    Neither engine samples a row from `token_vocab_size` on (the tokenizer's size; by default
    `model.token_vocab_size`, which the recipe sets and the trainer's output layer masks too).
    vLLM also takes `model.hf_checkpoint` (its config and tokenizer), `max_model_len` and
    `seed`; its import happens here, and only for engine: vllm. `cfg.policy_lag` goes to the
    embedded engine (RolloutConfig refuses it for vLLM).
    """
    if token_vocab_size is None:
        token_vocab_size = model.token_vocab_size
    if cfg.engine == "embedded":
        return EmbeddedEngine(model.decoder_shape, precision=cfg.precision, eos_token_id=eos_token_id,
                              pad_token_id=pad_token_id, logprobs=cfg.logprobs, device=device,
                              policy_lag=cfg.policy_lag, token_vocab_size=token_vocab_size,
                              fp32_lm_head=model.fp32_lm_head)
    from .vllm_engine import VLLMEngine

    return VLLMEngine(cfg, model, eos_token_id=eos_token_id, token_vocab_size=token_vocab_size,
                      max_model_len=max_model_len, seed=seed, device=device)


def load_model_weights(engine: RolloutEngine, cfg: RolloutConfig, model_chunks: Sequence,
                       groups: ParallelGroups) -> None:
    """Stream the Megatron model's full weights into `engine` (model/weight_stream.py: collective
    over TP and PP, and over every rank with expert parallelism) in the dtype and buckets `cfg` sets, waking the engine's weight memory first.
    The trainer's weight sync and `eval` both load an engine this way."""
    from ..model.weight_stream import MiB, flatten, weight_buckets

    buckets = weight_buckets(model_chunks, groups, dtype=cfg.weight_dtype, bucket_bytes=cfg.weight_sync_bucket_mb * MiB,
                             hf_names=cfg.engine == "vllm")
    if torch.cuda.is_available():  # return the trainer's cached blocks: a colocated engine allocates its own
        torch.cuda.empty_cache()
    engine.wake_up(["weights"])
    engine.load_weights(flatten(buckets))
