"""The recipe: one YAML file that describes a whole RL run, validated before any process group exists.

Sections: model, parallel, rollout, data, algorithm (advantages, loss, rollout_correction), optim,
trainer. A recipe may start from another (`base: tiny_cpu.yaml`) and change some keys.
`load_recipe(path, overrides)` applies dotted `key=value` overrides, rejects unknown keys
with a "did you mean", checks types and value ranges, and `check_layout(world_size)` rejects a
parallel layout that does not fit the launch.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..config import RolloutCorrectionConfig, did_you_mean
from ..data.tasks import DataSettings, build_task, get_task
from ..model.config import ModelConfig
from ..parallel.layout import ParallelSettings
from ..rl.settings import AlgorithmSettings, TrainerSettings
from ..rollout.base import RolloutConfig, engine_max_model_len
from ..settings import from_mapping
from ..training.losses import LossConfig
from ..training.optimizer import OptimSettings
from .tree import read_tree


_SECTIONS = ("name", "model", "parallel", "rollout", "data", "algorithm", "optim", "trainer")


@dataclass(frozen=True)
class Recipe:
    """A whole run: every section's settings, composed and checked against each other."""

    name: str
    model: ModelConfig
    parallel: ParallelSettings
    rollout: RolloutConfig
    data: DataSettings
    algorithm: AlgorithmSettings
    optim: OptimSettings
    trainer: TrainerSettings
    raw: dict = field(default_factory=dict, repr=False)  # the resolved YAML tree, saved with each run

    @property
    def run_dir(self) -> Path:
        """<trainer.output_dir>/<name>: metrics, checkpoints and the resolved recipe of the run."""
        return Path(self.trainer.output_dir) / self.name

    def check_layout(self, world_size: int, *, here: bool = True) -> int:
        """Validate the whole run against the launch; returns the data-parallel size.

        here=False (`plan`, on a laptop for a cluster) checks what does not depend on this machine
        only: the layout, batch sizes, sequence lengths and rollout settings, but not the checkpoint
        and data files, Transformer Engine, the GPU's FP8 support or the rollout engine's installation."""
        dp = self.check_model_layout(world_size, here=here)
        if here:
            self._check_trackers()
            self._check_checkpoint()
            self._check_task()
        else:
            self._check_samples()
        self.check_rollout(world_size, here=here)
        prompts = self.data.prompts_per_step
        if prompts % dp:
            raise ValueError(f"data.prompts_per_step={prompts} must be divisible by the data-parallel size {dp} "
                             f"(world {world_size} / tp*pp*cp {self.parallel.model_parallel_size}): use "
                             f"{_multiple_near(prompts, dp)}")
        per_rank = self._check_mini_batch(dp)
        self._check_overlong()
        corr = self.algorithm.rollout_correction
        if (corr is not None and corr.bypass_mode and corr.use_policy_gradient and corr.rollout_is_batch_normalize
                and (per_rank != self.trainer.micro_batch_size or self.trainer.max_tokens_per_micro_batch)):
            raise ValueError(f"algorithm.rollout_correction.rollout_is_batch_normalize in bypass policy-gradient mode "
                             f"needs one micro-batch per rank: set trainer.micro_batch_size={per_rank} (the "
                             f"sequences per rank per mini-batch) and trainer.max_tokens_per_micro_batch: 0 (no "
                             f"packing), or rollout_is_batch_normalize: false")
        return dp

    @property
    def default_launch_world(self) -> int:
        """The ranks `megatron-rlcorr train` launches without --nproc: one model replica (parallel
        tp*pp*cp), plus rollout.num_ranks with rollout.placement separate (the rollout ranks come on
        top of the trainer's). No launch of fewer ranks can run the recipe."""
        rollout = self.rollout.num_ranks if self.rollout.separate else 0
        return self.parallel.model_parallel_size + rollout

    def check_launch(self, launch_world: int, *, here: bool = True) -> int:
        """check_layout for a torchrun launch of `launch_world` ranks: the ranks that train are all of
        them, or all but the last rollout.num_ranks with rollout.placement separate (an error then
        says so). Returns the data-parallel size."""
        self._check_offload_placement()  # not a matter of the launch's size: said without the trainer ranks
        trainers = self.rollout.trainer_world(launch_world)
        try:
            return self.check_layout(trainers, here=here)
        except ValueError as err:
            if not self.rollout.separate:
                raise
            raise ValueError(f"the trainer ranks are {trainers} ({launch_world} launched less rollout.num_ranks="
                             f"{self.rollout.num_ranks}, rollout.placement: separate): {err}") from None

    def _check_mini_batch(self, dp: int) -> int:
        """The sequences per DP rank per mini-batch, after checking the batch sizes divide."""
        prompts, n = self.data.prompts_per_step, self.rollout.n
        mini = self.trainer.mini_batch_prompts or prompts
        if prompts % mini or (mini * n) % dp:
            working = [m for m in divisors(prompts) if (m * n) % dp == 0]
            raise ValueError(f"trainer.mini_batch_prompts={mini} must divide data.prompts_per_step={prompts}, and its "
                             f"sequences (x rollout.n={n}) must split evenly over the data-parallel size {dp}: "
                             f"values that work: {_some(working)}")
        per_rank = mini * n // dp
        if self.trainer.max_tokens_per_micro_batch:
            self._check_token_budget()
        elif per_rank % self.trainer.micro_batch_size:
            raise ValueError(f"trainer.micro_batch_size={self.trainer.micro_batch_size} must divide the sequences per "
                             f"rank per mini-batch ({per_rank} = mini_batch_prompts {mini} x n {n} / dp {dp}): values "
                             f"that work: {_some(divisors(per_rank))}")
        return per_rank

    def _check_token_budget(self) -> None:
        """The packing budget must hold the longest sequence the run can produce (when the prompt
        length is bounded), padded as the step pads it."""
        budget, prompt = self.trainer.max_tokens_per_micro_batch, self.data.max_prompt_length
        if prompt is None:
            return
        from ..parallel.context import cp_pad_multiple

        p = self.parallel
        multiple = cp_pad_multiple(p.cp, tp_size=p.tp, sequence_parallel=p.sequence_parallel,
                                   token_alignment=self.model.token_alignment(sequence_parallel=p.sequence_parallel))
        longest = -(-(prompt + self.rollout.max_new_tokens) // multiple) * multiple // p.cp
        if budget < longest:
            raise ValueError(f"trainer.max_tokens_per_micro_batch={budget} cannot hold the longest sequence: "
                             f"data.max_prompt_length {prompt} + rollout.max_new_tokens {self.rollout.max_new_tokens}"
                             f", padded to a multiple of {multiple}, is {longest} tokens per context-parallel rank; "
                             f"set it to at least {longest}")

    def check_rollout(self, world_size: int, *, here: bool = True) -> None:
        """The rollout engine against the launch and the model: installed (here), its tensor-parallel
        size dividing the world and the heads, a precision it runs, a context that holds prompt +
        response, routing replay only for a MoE model."""
        rollout, model = self.rollout, self.model
        rtp = rollout.tensor_parallel_size
        heads, groups = model.num_attention_heads, model.num_query_groups
        working = [t for t in divisors(world_size) if heads % t == 0 and (groups % t == 0 or t % groups == 0)]
        if not rollout.separate and world_size % rtp:
            raise ValueError(f"rollout.tensor_parallel_size={rtp} must divide the world size {world_size} (every rank "
                             f"belongs to one rollout engine): launch a multiple of it, or use one of {_some(working)}")
        if heads % rtp or (groups % rtp and rtp % groups):
            raise ValueError(f"rollout.tensor_parallel_size={rtp} must divide the attention heads ({heads}), and the "
                             f"K/V heads ({groups}) must divide it or be divided by it: use one of {_some(working)}")
        engine_max_model_len(rollout, self.data.max_prompt_length, model.max_position_embeddings)
        self._check_offload_placement()
        if rollout.routing_replay and model.moe is None:
            raise ValueError("rollout.routing_replay: true replays the experts the engine routed each token to, and "
                             "this model is dense (no model.moe): set rollout.routing_replay: false, or use a "
                             "mixture-of-experts model")
        if rollout.engine == "vllm":
            from ..rollout.vllm_engine import check_vllm_settings

            check_vllm_settings(rollout, model, here=here)

    def _check_offload_placement(self) -> None:
        """Trainer offload frees the GPU for a colocated engine: refused with rollout.placement separate."""
        model = self.model
        offloaded = [key for key, on in (("model.offload_params", model.offload_params),
                                         ("model.offload_grads", model.offload_grads),
                                         ("optim.offload_optimizer", self.optim.offload_optimizer)) if on]
        if self.rollout.separate and offloaded:
            raise ValueError(f"{offloaded[0]}: true moves the trainer's states off the GPU while a colocated engine "
                             "generates, and rollout.placement is separate (the engine has GPUs of its own): set "
                             f"{offloaded[0]}: false")

    def _check_overlong(self) -> None:
        overlong, limit = self.algorithm.overlong_penalty, self.rollout.max_new_tokens
        if overlong.enabled and overlong.buffer >= limit:
            raise ValueError(f"algorithm.overlong_penalty.buffer={overlong.buffer} is not shorter than the response "
                             f"limit rollout.max_new_tokens={limit}: every response would be penalised; use a buffer "
                             f"below {limit} (DAPO: 4096 of 20480)")

    def check_model_layout(self, world_size: int, *, here: bool = True) -> int:
        """Validate the model's parallel layout against the launch (what building the model needs,
        e.g. for `score` and `export`); returns the data-parallel size. here=False: not whether
        this machine has what the model needs (model.implementation.check_layers_here: Transformer Engine where
        the layers or sequence parallelism need it, a GPU that runs the FP8 recipe)."""
        heads, groups, layers = self.model.num_attention_heads, self.model.num_query_groups, self.model.num_layers
        tp, pp, cp, vpp = self.parallel.tp, self.parallel.pp, self.parallel.cp, self.parallel.vpp or 1
        if heads % tp or groups % tp:
            raise ValueError(f"model heads ({heads}) and query groups ({groups}) must be divisible by parallel.tp={tp}: "
                             f"use one of {_some(divisors(math.gcd(heads, groups)))}")
        if layers % (pp * vpp):
            working = [p for p in divisors(layers) if layers % (p * vpp) == 0]
            raise ValueError(f"model.num_layers={layers} must be divisible by parallel.pp*vpp={pp}*{vpp}: use pp in "
                             f"{_some(working)}" + (" or another vpp" if vpp > 1 else ""))
        if world_size % (tp * pp * cp):
            pps = [p for p in divisors(layers) if world_size % (tp * p * cp) == 0 and layers % (p * vpp) == 0]
            raise ValueError(f"parallel: world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = "
                             f"{tp * pp * cp}; launch a multiple of {tp * pp * cp} processes, or use parallel.pp in "
                             f"{_some(pps)} (or change parallel.tp/cp)")
        self._check_expert_layout(world_size)
        dp = self.parallel.data_parallel_size(world_size)
        if here:  # the layers this machine builds: Transformer Engine's where needed, FP8 its GPU runs
            from ..model.implementation import check_layers_here

            check_layers_here(self.model, sequence_parallel=self.parallel.sequence_parallel)
        return dp

    def _check_expert_layout(self, world_size: int) -> None:
        """parallel.ep / parallel.etp against the model and the launch: experts to split (model.moe),
        sequence parallelism with TP, ep dividing the experts, etp their width, and ep * etp the ranks
        of a pipeline stage (Megatron regroups tp * cp * dp as etp x ep x expert-data-parallel).
        After the tp*pp*cp check."""
        p, moe = self.parallel, self.model.moe
        ep, etp = p.ep, p.etp
        if moe is None:
            if (ep, etp) != (1, 1):
                raise ValueError(f"parallel.ep={ep}, parallel.etp={etp}: expert parallelism needs a mixture-of-experts "
                                 "model (model.moe, or a Qwen3-MoE / Qwen2-MoE model.hf_checkpoint or architecture); "
                                 "this model is dense: set parallel.ep: 1 and parallel.etp: 1")
            return
        if p.tp > 1 and not p.sequence_parallel:
            raise ValueError(f"model.moe with parallel.tp={p.tp} needs parallel.sequence_parallel: true "
                             "(Megatron-Core's MoE layer trains with tensor parallelism only under sequence "
                             "parallelism), or parallel.tp: 1 (expert parallelism, parallel.ep, splits the experts "
                             "instead)")
        stage = world_size // p.pp  # the ranks of one pipeline stage: tp * cp * dp
        if moe.num_experts % ep:
            working = [e for e in divisors(moe.num_experts) if stage % (e * etp) == 0]
            raise ValueError(f"parallel.ep={ep} must divide model.moe.num_experts ({moe.num_experts}): each "
                             "expert-parallel rank holds num_experts / ep experts; use parallel.ep in "
                             f"{_some(working)}")
        if moe.ffn_hidden_size % etp:
            working = [t for t in divisors(moe.ffn_hidden_size) if stage % (ep * t) == 0]
            raise ValueError(f"parallel.etp={etp} must divide model.moe.ffn_hidden_size ({moe.ffn_hidden_size}): each "
                             f"expert's SwiGLU is split over etp ranks; use parallel.etp in {_some(working)}")
        if stage % (ep * etp):
            working = [e for e in divisors(moe.num_experts) if stage % (e * etp) == 0]
            raise ValueError(f"parallel.ep*etp = {ep}*{etp} = {ep * etp} must divide the {stage} ranks of a pipeline "
                             f"stage (tp*cp*dp: world size {world_size} / parallel.pp={p.pp}): use parallel.ep in "
                             f"{_some(working)}" + (" (with this etp)" if etp > 1 else "") + ", or launch a "
                             f"multiple of {p.pp * math.lcm(p.tp * p.cp, ep * etp)} processes (pp * lcm(tp*cp, "
                             "ep*etp))")

    def _check_trackers(self) -> None:
        """wandb / mlflow in trainer.logger need their package here (not for `plan` on another machine)."""
        from ..rl.trackers import check_installed

        try:
            check_installed(self.trainer.logger)
        except ValueError as err:
            raise ValueError(f"trainer: {err}") from None

    def _check_samples(self) -> None:
        if self.rollout.n < 2:
            raise ValueError(f"rollout.n={self.rollout.n}: group advantages ({self.algorithm.advantage_estimator}) "
                             "need at least 2 samples per prompt; set rollout.n >= 2")

    def _check_checkpoint(self) -> None:
        """A checkpoint named by path must be there when the run starts (an `architecture` preset
        lets the recipe load without it, for `plan`)."""
        checkpoint = self.model.hf_checkpoint
        if checkpoint is not None and not Path(checkpoint).is_dir():
            raise ValueError(f"model.hf_checkpoint={checkpoint} is not a directory: download the checkpoint (e.g. "
                             f"`huggingface-cli download <org/model> --local-dir {checkpoint}`) or point "
                             "model.hf_checkpoint at it")

    def _check_task(self) -> None:
        self._check_samples()
        try:
            task = build_task(self.data, tokenizer_dir=self.model.hf_checkpoint, seed=self.trainer.seed)
        except ValueError as err:
            raise ValueError(f"data: {err}") from None
        if self.model.vocab_size < task.tokenizer.vocab_size:
            what = "data.train_files' tokenizer" if self.data.train_files else f"task {self.data.task or 'digit_sum'!r}"
            raise ValueError(f"model.vocab_size={self.model.vocab_size} is smaller than the vocabulary of {what} "
                             f"({task.tokenizer.vocab_size} tokens): token ids would fall outside the model; use a "
                             f"model whose vocabulary covers the tokenizer (model.vocab_size >= "
                             f"{task.tokenizer.vocab_size})")
        rows = self.model.token_vocab_size
        if rows is not None and rows < task.tokenizer.vocab_size:
            raise ValueError(f"model.token_vocab_size={rows} is smaller than the vocabulary of the task's tokenizer "
                             f"({task.tokenizer.vocab_size} tokens): its ids from {rows} on could never be sampled; "
                             "leave model.token_vocab_size unset (the recipe takes it from the tokenizer)")
        self._check_reward_sources()
        self._check_validation()

    def _check_reward_sources(self) -> None:
        """A data.reward mapping must have a reward for every data_source of the train and val files:
        checked before the launch rather than at the first such row, mid-run."""
        spec = self.data.reward
        if isinstance(spec, str):
            return
        from ..data.datasets import data_source_counts
        from ..data.rewards import missing_source_error

        for key in ("train_files", "val_files"):
            for i, path in enumerate(getattr(self.data, key)):
                counts = data_source_counts(path)
                for source, count in counts.items():
                    if source not in spec:
                        where = f"data.{key}[{i}] {path} ({count} of its {sum(counts.values())} rows)"
                        raise missing_source_error(spec, source, where)

    def _check_validation(self) -> None:
        """Validation keys only with data.val_files, and those files readable (each file's first row)."""
        if not self.data.val_files:
            asked = [f"trainer.{k}={getattr(self.trainer, k)}" for k in ("test_freq", "val_only", "log_val_generations")
                     if getattr(self.trainer, k)]
            if asked:
                raise ValueError(f"{', '.join(asked)} validate on data.val_files, which is not set: set data.val_files "
                                 "(parquet / JSONL in the training data's schema) or remove these keys")
            return
        from ..rl.validation import open_val_dataset

        try:
            open_val_dataset(self.data, tokenizer_dir=self.model.hf_checkpoint)
        except ValueError as err:
            raise ValueError(f"data.val_files: {err}") from None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _some(values: Sequence[int], limit: int = 8) -> str:
    """Values for an error message: all of a short list, the first `limit` of a long one."""
    shown = ", ".join(map(str, values[:limit]))
    return shown + (", ..." if len(values) > limit else "") if values else "(none)"


def _multiple_near(value: int, multiple: int) -> str:
    below, above = value // multiple * multiple, -(-value // multiple) * multiple
    return " or ".join(str(v) for v in dict.fromkeys((below, above)) if v > 0)


def parse_recipe(tree: Mapping[str, Any]) -> Recipe:
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
    data = from_mapping(DataSettings, tree.get("data"), "data")
    return Recipe(
        name=str(tree.get("name") or "run"),
        model=with_token_vocab(ModelConfig.from_dict(tree.get("model")), data),
        parallel=from_mapping(ParallelSettings, tree.get("parallel"), "parallel"),
        rollout=from_mapping(RolloutConfig, tree.get("rollout"), "rollout"),
        data=data,
        algorithm=algo,
        optim=from_mapping(OptimSettings, tree.get("optim"), "optim"),
        trainer=from_mapping(TrainerSettings, tree.get("trainer"), "trainer"),
        raw=dict(tree),
    )


def with_token_vocab(model: ModelConfig, data: DataSettings) -> ModelConfig:
    """`model` with token_vocab_size, the rows that can get probability, set from the run's tokenizer.

    Decided here, once, for every consumer: the trainer's output-layer mask (pi_old, the update, the
    reference policy, `score`) and both rollout engines. The tokenizer is data.tokenizer, else the
    one in model.hf_checkpoint, else (a model without a checkpoint) the built-in task's. Where there is
    none to read (a checkpoint without tokenizer files, a file not on disk yet: `plan`), the model is
    returned as it is; a tokenizer larger than the model is left to the launch checks (_check_task).
    """
    found = _tokenizer_vocab(model, data)
    if found is None:
        return model
    size, what = found
    if size > model.vocab_size:
        return model
    if model.token_vocab_size is not None and model.token_vocab_size != size:
        raise ValueError(f"model.token_vocab_size={model.token_vocab_size} but {what} has {size} tokens: leave "
                         f"model.token_vocab_size unset (the recipe takes it from the tokenizer) or set it to {size}")
    return dataclasses.replace(model, token_vocab_size=size)


def _tokenizer_vocab(model: ModelConfig, data: DataSettings) -> tuple[int, str] | None:
    """(size, description) of the run's tokenizer (with_token_vocab), or None where none can be read."""
    directory = data.tokenizer or model.hf_checkpoint
    if directory is not None:
        from ..data.hf_tokenizer import REQUIRED_ANY, HFTokenizer

        if not any((Path(directory) / name).is_file() for name in REQUIRED_ANY):
            return None
        return HFTokenizer(directory).vocab_size, f"the tokenizer in {directory}"
    if data.train_files:
        return None  # build_task reports the missing tokenizer
    name = data.task or "digit_sum"
    try:
        return get_task(name, **data.task_args).tokenizer.vocab_size, f"task {name!r}'s tokenizer"
    except ValueError:
        return None  # reported by the launch checks (_check_task), with the fix


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """The recipe at `path` (after its `base:` chain) with dotted `key=value` overrides applied."""
    return parse_recipe(read_tree(Path(path), overrides))
