"""The rollout engine interface: what the trainer needs from vLLM or from the embedded engine.

An engine receives the trainer's full weights after every optimizer step (`load_weights`) and
samples responses (`generate`), reporting the log-probability its own numerics assign to every
sampled token. Those log-probs are `rollout_log_prob` in the rollout correction.

Log-prob convention (`RolloutConfig.logprobs`):
- "tempered" (default): log_softmax(logits / temperature) of the sampled token, BEFORE top-p
  truncation, computed from the engine's logits cast to float32. This is the distribution the
  trainer recomputes (it divides its logits by the same temperature and never truncates), so the
  ratio between the two measures numerical mismatch only. It equals vLLM's "processed_logprobs"
  whenever top_p == 1. With temperature 0 (greedy) the untempered log_softmax(logits) is reported.
- "processed": the log-probability under the distribution actually sampled from: tempered, then
  top-p truncated and renormalised (vLLM's "processed_logprobs" with top_p < 1). Under this
  convention top-p truncation itself shows up as off-policy mass in the correction.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from ..settings import check_choice

EngineName = Literal["embedded", "vllm"]
Precision = Literal["fp32", "bf16", "fp8"]
LogprobsMode = Literal["tempered", "processed"]
FinishReason = Literal["eos", "length"]

ENGINES: tuple[str, ...] = ("embedded", "vllm")
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp8")
LOGPROBS_MODES: tuple[str, ...] = ("tempered", "processed")


@dataclass(frozen=True)
class RolloutConfig:
    """The `rollout` section of a recipe.

    `n` is the number of samples per prompt (the group size of GRPO/RLOO); engines generate one
    response per prompt they are given, so callers repeat each prompt `n` times.
    """

    engine: EngineName = "embedded"
    precision: Precision = "bf16"
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    n: int = 8
    logprobs: LogprobsMode = "tempered"
    weight_sync_bucket_mb: int = 512  # the weight stream to the engine moves this much at a time

    def __post_init__(self) -> None:
        check_choice("engine", self.engine, ENGINES)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("logprobs", self.logprobs, LOGPROBS_MODES)
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = no nucleus truncation), got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {self.n}")
        if self.weight_sync_bucket_mb < 1:
            raise ValueError(f"weight_sync_bucket_mb must be >= 1 (MiB per bucket of the weight stream), "
                             f"got {self.weight_sync_bucket_mb}")

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the weights travel in to the engine (every rank of the stream's collectives
        uses it)."""
        return weight_dtype(self.precision)


def weight_dtype(precision: Precision) -> torch.dtype:
    """The dtype an engine of `precision` takes its weights in: its compute dtype, except that
    FP8 emulation quantises from float32 (a bf16 copy first would round twice)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


@dataclass
class RolloutBatch:
    """Sampled responses, one per input prompt, in input order.

    response_ids[i] includes the final EOS token when finish_reasons[i] == "eos" (the trainer
    trains on it); logprobs[i] is a float32 tensor with one entry per response token, under the
    convention of `RolloutConfig.logprobs` (see the module docstring).
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[torch.Tensor]
    finish_reasons: list[FinishReason]

    def __post_init__(self) -> None:
        sizes = {len(self.prompt_ids), len(self.response_ids), len(self.logprobs), len(self.finish_reasons)}
        assert len(sizes) == 1, f"RolloutBatch fields disagree on the number of samples: {sizes}"

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]


@runtime_checkable
class RolloutEngine(Protocol):
    """A sampler of the trainer's policy with its own numerics (precision, kernels)."""

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the trainer should send the weights in."""
        ...

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace all weights from a mapping or a stream of (name, tensor) pairs, consumed once:
        full, unsharded float tensors with the neutral names of `model.weights.neutral_weight_shapes`
        (embed.weight, layers.{i}.q.weight, ..., lm_head.weight; a tied model's lm_head may be left out)."""
        ...

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, generator: torch.Generator | None = None) -> RolloutBatch:
        """One sampled response per prompt; stops a sequence at EOS or after max_new_tokens."""
        ...
