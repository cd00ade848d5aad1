"""Rollout engines: the interface, the embedded (precision-emulating) engine and the factory."""
from __future__ import annotations

import torch

from collections.abc import Sequence

from ..model.architecture import DecoderShape
from .base import RolloutBatch, RolloutConfig, RolloutEngine
from .embedded import EmbeddedEngine, random_weights

__all__ = ["EmbeddedEngine", "RolloutBatch", "RolloutConfig", "RolloutEngine", "make_engine", "random_weights"]


def make_engine(cfg: RolloutConfig, shape: DecoderShape, *, eos_token_id: int | Sequence[int] | None,
                pad_token_id: int = 0, device: torch.device | str = "cpu") -> RolloutEngine:
    """The engine `cfg.engine` names, running `cfg.precision`; weights come later via load_weights."""
    if cfg.engine == "embedded":
        return EmbeddedEngine(shape, precision=cfg.precision, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                              logprobs=cfg.logprobs, device=device)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ImportError("rollout.engine='vllm' needs vLLM, which is not installed (the 'vllm' extra: "
                          "pip install 'megatron-rlcorr[vllm]' on a GPU machine; vLLM pins its own torch "
                          "version). Use rollout.engine='embedded' to run without it.") from None
    raise NotImplementedError("rollout.engine='vllm': vLLM is installed, but this release has no adapter that "
                              "pushes trainer weights into a vLLM engine; use rollout.engine='embedded'")
