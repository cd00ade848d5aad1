"""The RL loop's settings: the recipe's `trainer:` and `algorithm:` sections, and `RunSettings`,
what the loop reads of a whole run's settings (recipe.Recipe is one; the protocol keeps rl/ from
importing recipe/).

`AlgorithmSettings` gathers what the loop applies to rollouts (advantage estimator, DAPO dynamic
sampling, overlong penalty, KL in the reward) with the loss, the KL loss, the reference policy and
the rollout correction, whose own settings types live beside their code (training/losses.py,
training/kl.py, training/reference.py, config.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, Protocol

from ..config import RolloutCorrectionConfig
from ..correction.compiled import COMPILE_MODES, CompileMode
from ..data.tasks import DataSettings
from ..model.config import ModelConfig
from ..parallel.layout import ParallelSettings
from ..rollout.base import RolloutConfig
from ..settings import check_choice
from ..training.kl import KLLossSettings
from ..training.losses import LossConfig
from ..training.optimizer import OptimSettings
from ..training.reference import ReferenceSettings
from .advantages import OverlongPenalty
from .kl_reward import KLInRewardSettings
from .sampling import DynamicSampling


TrackerName = Literal["console", "tensorboard", "wandb", "mlflow"]
TRACKERS: tuple[str, ...] = ("console", "tensorboard", "wandb", "mlflow")


@dataclass(frozen=True)
class TrainerSettings:
    """Steps, batch sizes, seed, output, checkpoints and logging of a run."""

    RETIRED_KEYS: ClassVar[dict[str, str]] = {
        "tensorboard": "TensorBoard is now one of trainer.logger's trackers (verl's key): trainer.logger: [console, "
                       "tensorboard] writes it (the default), trainer.logger: [console] does not",
        "mini_batch_size": "the mini-batch is now counted in prompts, as verl's ppo_mini_batch_size: set "
                           "trainer.mini_batch_prompts to mini_batch_size / rollout.n (an optimizer step then "
                           "trains on mini_batch_prompts x n sequences over all data-parallel ranks; 0 = the "
                           "whole step batch)",
    }

    steps: int = 10                # RL steps (rollouts, then ppo_epochs passes over them); the lr schedule's length
    mini_batch_prompts: int = 0    # prompts (x rollout.n sequences) per optimizer step, all DP ranks; 0 = all
    micro_batch_size: int = 8      # sequences per forward pass on one rank (padded micro-batches)
    # > 0: pack sequences into micro-batches of at most this many tokens per rank (verl's
    # ppo_max_token_len_per_gpu with use_dynamic_bsz); micro_batch_size then sizes only score's calls
    max_tokens_per_micro_batch: int = 0
    ppo_epochs: int = 1            # passes over each step's batch, one optimizer step per mini-batch
    seed: int = 1234               # seeds initial weights (without hf_checkpoint), prompt draws, sampling, data order
    output_dir: str = "runs"       # the run writes to `<output_dir>/<name>/` (metrics, checkpoints, recipe)
    save_every: int = 0            # 0 = only at the end
    resume: bool = True            # continue from the latest checkpoint in runs/<name> if there is one
    log_every: int = 1             # log metrics (metrics.jsonl and the trackers) every K steps and at the last
    # Where metrics go besides runs/<name>/metrics.jsonl (always written): console (the progress line),
    # tensorboard, wandb, mlflow (verl's trainer.logger; wandb and mlflow are optional extras)
    logger: tuple[TrackerName, ...] = ("console", "tensorboard")
    project_name: str = "megatron-rlcorr"  # the tracker's project (wandb) / experiment (mlflow)
    experiment_name: str | None = None  # the tracker's run name; None: the recipe's name
    test_freq: int = 0             # validate every test_freq steps and at the last step; 0 = never in the loop
    val_before_train: bool = True  # validate the starting weights at step 0 (a fresh run; a resume does not repeat it)
    val_only: bool = False         # validate the starting weights once and stop: no training, no checkpoint
    log_val_generations: int = 0   # samples per validation written to runs/<name>/val_generations/step_<k>.jsonl
    exit_interval: int = 0         # Megatron's --exit-interval: save and stop after steps divisible by it; 0 = off
    save_hf: bool = False          # at the end of the run, also write <run_dir>/hf as a Hugging Face checkpoint
    save_hf_dtype: Literal["bfloat16", "float32"] = "bfloat16"  # the weights' dtype in the save_hf checkpoint
    timeout_minutes: int = 60      # every process group's collective timeout (long generations wait)
    async_save: bool = False       # write checkpoints from a background process while training goes on
    # The distributed optimizer's checkpoint format (Megatron's names): dp_reshardable, each rank writes its
    # own shard (resumes on the same tp/pp/cp/vpp, any DP size); fully_reshardable, gathered over DP, resumes
    # on any layout but every rank briefly holds its model-parallel slice's fp32 optimizer state (12 B/param)
    optimizer_checkpoint_format: Literal["dp_reshardable", "fully_reshardable"] = "dp_reshardable"
    dump_every: int = 0            # > 0: write every K-th step's rollouts to <run_dir>/dumps/ (rl/dumps.py)
    dump_max_samples: int = 1024   # sequences per dump at most

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch_size", "ppo_epochs", "log_every", "timeout_minutes", "dump_max_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("mini_batch_prompts", "save_every", "exit_interval", "max_tokens_per_micro_batch", "dump_every",
                     "test_freq", "log_val_generations"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for i, tracker in enumerate(self.logger):
            check_choice(f"logger[{i}]", tracker, TRACKERS)
        if len(set(self.logger)) != len(self.logger):
            raise ValueError(f"logger lists a tracker twice: {list(self.logger)}")


@dataclass(frozen=True)
class AlgorithmSettings:
    """Advantages, dynamic sampling, overlong penalty, the policy loss and the rollout correction."""

    # Per group of rollout.n samples of a prompt: grpo, (r - group mean) / (group std + 1e-6);
    # rloo, r - the mean of the group's other samples.
    advantage_estimator: Literal["grpo", "rloo"] = "grpo"
    norm_adv_by_std: bool = True   # grpo: divide by the group's std; false: r - group mean (Dr. GRPO); rloo ignores it
    dynamic_sampling: DynamicSampling = field(default_factory=DynamicSampling)
    overlong_penalty: OverlongPenalty = field(default_factory=OverlongPenalty)
    kl_loss: KLLossSettings = field(default_factory=KLLossSettings)
    kl_in_reward: KLInRewardSettings = field(default_factory=KLInRewardSettings)
    reference: ReferenceSettings = field(default_factory=ReferenceSettings)
    loss: LossConfig = field(default_factory=LossConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # How the trainer runs the rollout correction: eager (the default and the reference) or torch
    # (torch.compile of its tensor math, for a GPU where tools/bench_correction.py --compile shows it
    # faster; equal to eager within rtol 1e-5 with identical masks, not bit for bit; the first call
    # of each batch layout compiles; docs/correction.md)
    correction_compile: CompileMode = "eager"

    def __post_init__(self) -> None:
        check_choice("correction_compile", self.correction_compile, COMPILE_MODES)

    @property
    def uses_reference(self) -> bool:
        """A reference policy is built when a KL penalty (loss or reward) needs it."""
        return self.kl_loss.enabled or self.kl_in_reward.enabled


class RunSettings(Protocol):
    """What the trainer and the rollout ranks read of a run's settings (recipe.Recipe is one)."""

    name: str
    model: ModelConfig
    parallel: ParallelSettings
    rollout: RolloutConfig
    data: DataSettings
    algorithm: AlgorithmSettings
    optim: OptimSettings
    trainer: TrainerSettings
    raw: dict  # the resolved YAML tree, saved with the run

    @property
    def run_dir(self) -> Path: ...

    def check_layout(self, world_size: int) -> int:
        """Validate the settings against the launch; returns the data-parallel size."""
        ...
