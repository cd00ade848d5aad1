"""The recipe: one YAML file that describes a whole RL run, validated before any process group exists.

Sections: model, parallel, rollout, data, algorithm (advantages, loss, rollout_correction), optim,
trainer. A recipe may start from another (`base: tiny_cpu.yaml`) and change some keys.
`load_recipe(path, overrides)` applies dotted `key=value` overrides, rejects unknown keys
with a "did you mean", checks types and value ranges, and `check_layout(world_size)` rejects a
parallel layout that does not fit the launch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml

from .config import RolloutCorrectionConfig, did_you_mean
from .schema import apply_overrides, from_mapping


@dataclass(frozen=True)
class ParallelSettings:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vpp is not None and (self.vpp < 1 or self.pp == 1):
            raise ValueError(f"vpp (virtual pipeline stages) needs pp > 1 and vpp >= 1, got pp={self.pp}, vpp={self.vpp}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1")

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def layout(self, world_size: int) -> dict[str, int | None]:
        """What a per-rank checkpoint depends on: which rank holds which shard."""
        return {"world_size": world_size, "tp": self.tp, "pp": self.pp, "cp": self.cp, "vpp": self.vpp}

    def data_parallel_size(self, world_size: int) -> int:
        if world_size % self.model_parallel_size:
            raise ValueError(f"parallel: world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*"
                             f"{self.cp} = {self.model_parallel_size}; launch a multiple of {self.model_parallel_size} "
                             f"processes or change parallel.tp/pp/cp")
        return world_size // self.model_parallel_size


@dataclass(frozen=True)
class DataSettings:
    task: str = "digit_sum"
    task_args: dict = field(default_factory=dict)
    prompts_per_step: int = 32  # global, over all data-parallel ranks

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")


@dataclass(frozen=True)
class DynamicSampling:
    """DAPO dynamic sampling: drop prompt groups whose rewards are all equal, then top the batch up."""

    enabled: bool = False
    max_rounds: int = 4  # extra generation rounds per step to refill dropped groups

    def __post_init__(self) -> None:
        if self.max_rounds < 0:
            raise ValueError(f"max_rounds must be >= 0, got {self.max_rounds}")


@dataclass(frozen=True)
class OverlongPenalty:
    """DAPO soft overlong punishment: responses within `buffer` tokens of the limit lose up to `penalty`."""

    enabled: bool = False
    buffer: int = 4
    penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.buffer < 1 or self.penalty < 0:
            raise ValueError(f"buffer must be >= 1 and penalty >= 0, got buffer={self.buffer}, penalty={self.penalty}")


@dataclass(frozen=True)
class OptimSettings:
    lr: float = 1e-3
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_style: Literal["constant", "linear", "cosine"] = "constant"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup_steps < 0 or self.clip_grad < 0:
            raise ValueError("warmup_steps and clip_grad must be >= 0")


@dataclass(frozen=True)
class TrainerSettings:
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

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch_size", "ppo_epochs", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("mini_batch_size", "save_every", "exit_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class AlgorithmSettings:
    advantage_estimator: Literal["grpo", "rloo"] = "grpo"
    norm_adv_by_std: bool = True
    dynamic_sampling: DynamicSampling = field(default_factory=DynamicSampling)
    overlong_penalty: OverlongPenalty = field(default_factory=OverlongPenalty)
    loss: Any = None                   # losses.LossConfig
    rollout_correction: Any = None     # config.RolloutCorrectionConfig


_SECTIONS = ("name", "model", "parallel", "rollout", "data", "algorithm", "optim", "trainer")


@dataclass(frozen=True)
class Recipe:
    name: str
    model: Any            # model.ModelConfig
    parallel: ParallelSettings
    rollout: Any          # rollout.RolloutConfig
    data: DataSettings
    algorithm: AlgorithmSettings
    optim: OptimSettings
    trainer: TrainerSettings
    raw: dict = field(default_factory=dict, repr=False)  # the resolved YAML tree, saved with each run

    @property
    def run_dir(self) -> Path:
        """<trainer.output_dir>/<name>: metrics, checkpoints and the resolved recipe of the run."""
        return Path(self.trainer.output_dir) / self.name

    def check_layout(self, world_size: int) -> int:
        """Validate the layout against the launch; returns the data-parallel size."""
        dp = self.parallel.data_parallel_size(world_size)
        self._check_task()
        prompts = self.data.prompts_per_step
        if prompts % dp:
            raise ValueError(f"data.prompts_per_step={prompts} must be divisible by the data-parallel size {dp} "
                             f"(world {world_size} / tp*pp*cp {self.parallel.model_parallel_size})")
        mini = self.trainer.mini_batch_size
        total = prompts * self.rollout.n
        if mini and (total % mini or mini % dp):
            raise ValueError(f"trainer.mini_batch_size={mini} must divide the rollout batch (prompts_per_step*n = "
                             f"{total}) and be divisible by the data-parallel size {dp}")
        per_rank = (mini or total) // dp
        if per_rank % self.trainer.micro_batch_size:
            raise ValueError(f"trainer.micro_batch_size={self.trainer.micro_batch_size} must divide the sequences per "
                             f"rank per mini-batch ({per_rank})")
        corr = self.algorithm.rollout_correction
        if (corr is not None and corr.bypass_mode and corr.use_policy_gradient and corr.rollout_is_batch_normalize
                and per_rank != self.trainer.micro_batch_size):
            raise ValueError(f"algorithm.rollout_correction.rollout_is_batch_normalize in bypass policy-gradient mode "
                             f"needs one micro-batch per rank: set trainer.micro_batch_size={per_rank} (the "
                             f"sequences per rank per mini-batch) or rollout_is_batch_normalize: false")
        heads = self.model.num_attention_heads
        if heads % self.parallel.tp or self.model.num_query_groups % self.parallel.tp:
            raise ValueError(f"model heads ({heads}) and query groups ({self.model.num_query_groups}) must be divisible "
                             f"by parallel.tp={self.parallel.tp}")
        if self.model.num_layers % (self.parallel.pp * (self.parallel.vpp or 1)):
            raise ValueError(f"model.num_layers={self.model.num_layers} must be divisible by parallel.pp*vpp")
        return dp

    def _check_task(self) -> None:
        from .data import get_task

        if self.rollout.n < 2:
            raise ValueError(f"rollout.n={self.rollout.n}: group advantages ({self.algorithm.advantage_estimator}) "
                             "need at least 2 samples per prompt; set rollout.n >= 2")
        try:
            task = get_task(self.data.task, **self.data.task_args)
        except ValueError as err:
            raise ValueError(f"data: {err}") from None
        if self.model.vocab_size < task.tokenizer.vocab_size:
            raise ValueError(f"model.vocab_size={self.model.vocab_size} is smaller than the vocabulary of task "
                             f"{self.data.task!r} ({task.tokenizer.vocab_size} tokens); set model.vocab_size >= "
                             f"{task.tokenizer.vocab_size}")


def parse_recipe(tree: Mapping[str, Any]) -> Recipe:
    from .losses import LossConfig
    from .model import ModelConfig
    from .rollout import RolloutConfig

    if not isinstance(tree, Mapping):
        raise ValueError(f"a recipe must be a YAML mapping, got {type(tree).__name__}")
    for key in tree:
        if key not in _SECTIONS:
            raise ValueError(f"unknown recipe section {key!r}{did_you_mean(str(key), _SECTIONS)}; "
                             f"allowed: {', '.join(_SECTIONS)}")
    algorithm = dict(tree.get("algorithm") or {})
    loss = from_mapping(LossConfig, algorithm.pop("loss", None), "algorithm.loss")
    try:
        correction = RolloutCorrectionConfig.from_dict(algorithm.pop("rollout_correction", None))
    except ValueError as err:
        raise ValueError(f"algorithm.rollout_correction: {err}") from None
    algo = from_mapping(AlgorithmSettings, algorithm, "algorithm")
    algo = AlgorithmSettings(**{**algo.__dict__, "loss": loss, "rollout_correction": correction})
    return Recipe(
        name=str(tree.get("name") or "run"),
        model=_section(ModelConfig, tree.get("model"), "model"),
        parallel=from_mapping(ParallelSettings, tree.get("parallel"), "parallel"),
        rollout=_section(RolloutConfig, tree.get("rollout"), "rollout"),
        data=from_mapping(DataSettings, tree.get("data"), "data"),
        algorithm=algo,
        optim=from_mapping(OptimSettings, tree.get("optim"), "optim"),
        trainer=from_mapping(TrainerSettings, tree.get("trainer"), "trainer"),
        raw=dict(tree),
    )


def _section(cls, mapping, name):
    if hasattr(cls, "from_dict"):
        try:
            return cls.from_dict(mapping or {})
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
    return from_mapping(cls, mapping, name)


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """The recipe at `path` (after its `base:` chain) with dotted `key=value` overrides applied."""
    tree = _read_tree(Path(path), ())
    apply_overrides(tree, overrides)
    return parse_recipe(tree)


def _read_tree(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    """The YAML tree of `path`; a top-level `base: other.yaml` (relative to this file) is loaded
    first and this file's settings are merged over it (_merge_sections)."""
    if not path.is_file():
        raise ValueError(f"recipe {path} not found" + (f" (the base of {chain[-1]})" if chain else ""))
    if path.resolve() in chain:
        raise ValueError(f"recipe {path}: circular base chain {' -> '.join(map(str, chain))}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"recipe {path} is not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ValueError(f"recipe {path} must be a YAML mapping, got {type(tree).__name__}")
    base = tree.pop("base", None)
    if base is None:
        return tree
    if not isinstance(base, str):
        raise ValueError(f"recipe {path}: base must be a path to another recipe, got {base!r}")
    return _merge_sections(_read_tree(path.parent / base, (*chain, path.resolve())), tree)


def _merge_sections(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Sections merge key by key; a key's value replaces the base's whole (an
    algorithm.rollout_correction block is never half inherited)."""
    merged = dict(base)
    for section, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(section), Mapping):
            merged[section] = {**merged[section], **value}
        else:
            merged[section] = value
    return merged
