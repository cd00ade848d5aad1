"""The RL loop's settings: the recipe's `trainer:` and `algorithm:` sections.

`AlgorithmSettings` gathers what the loop applies to rollouts (advantage estimator, DAPO dynamic
sampling and overlong penalty) with the loss and the rollout correction, whose own settings types
live beside their code (training/losses.py, config.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..config import RolloutCorrectionConfig
from ..training.losses import LossConfig
from .advantages import OverlongPenalty
from .sampling import DynamicSampling


@dataclass(frozen=True)
class TrainerSettings:
    """Steps, batch sizes, seed, output, checkpoints and logging of a run."""

    steps: int = 10
    mini_batch_size: int = 0       # sequences per optimizer step over all DP ranks; 0 = the whole rollout batch
    micro_batch_size: int = 8      # sequences per forward pass on one rank
    ppo_epochs: int = 1
    seed: int = 1234
    output_dir: str = "runs"
    save_every: int = 0            # 0 = only at the end
    resume: bool = True            # continue from the latest checkpoint in runs/<name> if there is one
    log_every: int = 1
    tensorboard: bool = True       # when tensorboard is installed
    exit_interval: int = 0         # Megatron's --exit-interval: save and stop after steps divisible by it; 0 = off
    save_hf: bool = False          # at the end of the run, also write <run_dir>/hf as a Hugging Face checkpoint
    save_hf_dtype: Literal["bfloat16", "float32"] = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch_size", "ppo_epochs", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("mini_batch_size", "save_every", "exit_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class AlgorithmSettings:
    """Advantages, dynamic sampling, overlong penalty, the policy loss and the rollout correction."""

    advantage_estimator: Literal["grpo", "rloo"] = "grpo"
    norm_adv_by_std: bool = True
    dynamic_sampling: DynamicSampling = field(default_factory=DynamicSampling)
    overlong_penalty: OverlongPenalty = field(default_factory=OverlongPenalty)
    loss: LossConfig = field(default_factory=LossConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
