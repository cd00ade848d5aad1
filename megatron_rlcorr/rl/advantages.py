"""Outcome advantages for grouped rollouts (GRPO, RLOO), DAPO's dynamic-sampling filter and its
soft overlong penalty. Rewards come as [groups, samples_per_prompt]."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

ADV_EPS = 1e-6


def group_advantages(rewards_GN: torch.Tensor, estimator: Literal["grpo", "rloo"],
                     norm_by_std: bool = True) -> torch.Tensor:
    """Per-sample advantage from the rewards of its prompt group.

    grpo: (r - group mean) / (group std + eps) (std unbiased; without norm_by_std, r - mean).
    rloo: r - mean of the OTHER samples of the group = n/(n-1) * (r - group mean).
    A group whose rewards are all equal gets exactly 0: in float32 the mean of n equal values
    that are not exactly representable (2/3, say) can differ from them by an ulp, and dividing
    that by std + eps = eps made +0.056 per sample of such a group (verl computes it so).
    """
    n = rewards_GN.shape[-1]
    if n < 2:
        raise ValueError(f"group advantages need at least 2 samples per prompt (rollout.n), got {n}")
    centred = rewards_GN - rewards_GN.mean(dim=-1, keepdim=True)
    centred = centred * informative_groups(rewards_GN)[:, None]
    if estimator == "rloo":
        return centred * (n / (n - 1))
    if not norm_by_std:
        return centred
    return centred / (rewards_GN.std(dim=-1, keepdim=True) + ADV_EPS)


def informative_groups(rewards_GN: torch.Tensor) -> torch.Tensor:
    """bool [groups]: groups whose rewards are not all equal (DAPO dynamic sampling keeps these)."""
    return (rewards_GN.amax(dim=-1) - rewards_GN.amin(dim=-1)) > 0


@dataclass(frozen=True)
class OverlongPenalty:
    """DAPO soft overlong punishment: responses within `buffer` tokens of the limit lose up to `penalty`."""

    enabled: bool = False  # add the penalty (<= 0) to each response's reward
    buffer: int = 4        # tokens before rollout.max_new_tokens where the penalty starts; >= 1, below that limit
    penalty: float = 1.0   # reward lost at the limit, linearly from 0 at max_new_tokens - buffer; >= 0

    def __post_init__(self) -> None:
        if self.buffer < 1 or self.penalty < 0:
            raise ValueError(f"buffer must be >= 1 and penalty >= 0, got buffer={self.buffer}, penalty={self.penalty}")


def overlong_penalty(response_lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (<= 0): linear from 0 at max_new_tokens - buffer to -penalty at the limit."""
    start = max_new_tokens - buffer
    excess = (response_lengths.float() - start).clamp(min=0, max=buffer)
    return -penalty * excess / buffer
