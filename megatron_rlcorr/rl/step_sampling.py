"""One step's rollouts: the step's prompts, every round of dynamic sampling, and their statistics.

The ranks that generate run this: every rank when colocated (rl/trainer.py), the rollout ranks
when rollout.placement is separate (rl/async_rollout.py). Either way the result depends only on
(seed, step) and the engine's weights: prompts are drawn from (seed, step, round), a prompt's
samples from (seed, step, round, prompt index), and a dataset is read in order from
`data_position`, which the generating side advances and the trainer checkpoints.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from ..data.datasets import PromptDataset
from ..data.tasks import Prompt, Task, build_task
from ..rollout import make_engine
from ..rollout.base import engine_max_model_len
from .rollout_world import sample_round
from .sampling import (
    RolloutGroups,
    SamplingStats,
    derive_seed,
    dynamic_sample,
    seeded_generator,
)
from .validation import load_val_prompts

if TYPE_CHECKING:
    from ..parallel.groups import ParallelGroups
    from ..rollout import RolloutEngine
    from .settings import RunSettings


class StepSampler:
    """The step's prompts and rollouts for `recipe` with `engine` (collective over the generating ranks)."""

    def __init__(self, recipe: RunSettings, task: Task, engine: RolloutEngine, groups: ParallelGroups,
                 device: torch.device) -> None:
        self.recipe, self.task, self.engine, self.groups, self.device = recipe, task, engine, groups, device
        # A dataset is read in order (its position is in every checkpoint); built-in tasks draw.
        self.dataset = task if isinstance(task, PromptDataset) else None
        self.data_position = 0

    def step_prompts(self) -> tuple[list[Prompt] | None, dict[str, torch.Tensor]]:
        """The step's round-0 prompts from the dataset (None for built-in tasks) and the data
        metrics. Every rank reads the same `prompts_per_step` prompts from the same position, so
        all agree on the next position (and checkpoint it)."""
        if self.dataset is None:
            return None, {}
        taken = self.dataset.take(self.data_position, self.recipe.data.prompts_per_step)
        self.data_position = taken.next_position
        metrics = {"data/epoch": torch.tensor(self.data_position / self.dataset.num_rows),
                   "data/round0_dropped_long_prompts": torch.tensor(float(taken.dropped_long)),
                   "data/round0_skipped_bad_rows": torch.tensor(float(taken.skipped_bad))}
        return taken.prompts, metrics

    def sample_step(self, step: int, step_prompts: list[Prompt] | None
                    ) -> tuple[RolloutGroups, RolloutGroups, SamplingStats, dict[str, int], int]:
        """The step's whole batch after dynamic sampling (the same on every rank, tokens only
        where generated: rollout_world.py), round 0's groups, the sampling stats, the prompts the
        top-up rounds skipped, and the tokens generated over all rounds. Collective over the
        generating ranks."""
        recipe, seed = self.recipe, self.recipe.trainer.seed
        dropped = {"long": 0, "bad": 0}
        generated = {"tokens": 0}

        def draw(round_: int, num_prompts: int) -> RolloutGroups:
            prompt_generator = seeded_generator(seed, "prompts", step, round_)
            if round_ == 0 and step_prompts is not None:
                prompts = step_prompts
            elif self.dataset is not None:  # top-up rounds draw at random, off the epoch order
                drawn = self.dataset.draw(num_prompts, prompt_generator)
                prompts, dropped["long"], dropped["bad"] = (drawn.prompts, dropped["long"] + drawn.dropped_long,
                                                            dropped["bad"] + drawn.skipped_bad)
            else:
                prompts = self.task.sample_prompts(num_prompts, prompt_generator)
            seeds = [derive_seed(seed, "samples", step, round_, i) for i in range(len(prompts))]
            drawn = sample_round(self.engine, self.task, prompts, seeds, rollout=recipe.rollout,
                                 overlong=recipe.algorithm.overlong_penalty, groups=self.groups, device=self.device)
            generated["tokens"] += int(drawn.lengths_B.sum())  # every round's, for tokens/s
            return drawn

        batch, first, stats = dynamic_sample(draw, recipe.data.prompts_per_step, recipe.algorithm.dynamic_sampling)
        return batch, first, stats, dropped, generated["tokens"]


class Generation(NamedTuple):
    """What a generating rank holds: the engine, its StepSampler (and the task) and the validation prompts."""

    engine: RolloutEngine
    sampler: StepSampler
    val_task: Task | None
    val_prompts: list[Prompt]


def build_generation(recipe: RunSettings, groups: ParallelGroups, device: torch.device) -> Generation:
    """The engine (weights come later), the step sampler over the task and the validation prompts
    (data.val_files, read once: every usable row, in file order) of a generating rank."""
    trainer = recipe.trainer
    task = build_task(recipe.data, tokenizer_dir=recipe.model.hf_checkpoint, seed=trainer.seed)
    tok = task.tokenizer
    max_model_len = engine_max_model_len(recipe.rollout, recipe.data.max_prompt_length,
                                         recipe.model.max_position_embeddings)
    engine = make_engine(recipe.rollout, recipe.model, eos_token_id=tok.eos_ids, pad_token_id=tok.pad_id,
                         device=device, max_model_len=max_model_len, seed=trainer.seed)
    val_task, val_prompts = (load_val_prompts(recipe.data, tokenizer_dir=recipe.model.hf_checkpoint)
                             if recipe.data.val_files else (None, []))
    return Generation(engine, StepSampler(recipe, task, engine, groups, device), val_task, val_prompts)


def rollout_stats(rollouts: RolloutGroups, first: RolloutGroups, stats: SamplingStats,
                  dropped: dict[str, int], generated_tokens: int) -> dict[str, torch.Tensor]:
    """The step's rollout statistics as float64 scalars (the same on every rank): sums over round
    0's samples as generated; sums and the longest response of the trained batch without its
    fillers, which take part in no mean; the response tokens of every generation round. (The
    trainer adds `invalid_tokens`, which it counts while building its batch.)

    Response length and truncation describe the batch's real samples; a batch of fillers only
    (dynamic sampling found no informative group) describes its fillers, which were generated
    too, rather than an empty mean's length 0 and truncation 1."""
    real = ~rollouts.filler_G
    described = real if bool(real.any()) else torch.ones_like(real)
    lengths_GN = rollouts.response_lengths().reshape(-1, rollouts.n)
    eos_GN = torch.tensor([r == "eos" for r in rollouts.finish_reasons]).reshape(-1, rollouts.n)
    values = {
        "round0_score": first.scores_GN.sum(), "round0_acc": first.acc_GN.sum(), "round0_samples": first.scores_GN.numel(),
        "batch_reward": rollouts.rewards_GN[real].sum(), "batch_score": rollouts.scores_GN[real].sum(),
        "batch_acc": rollouts.acc_GN[real].sum(), "batch_samples": rollouts.scores_GN[real].numel(),
        "response_tokens": lengths_GN[real].sum(),
        "described_samples": lengths_GN[described].numel(), "described_tokens": lengths_GN[described].sum(),
        "described_eos": eos_GN[described].sum(),
        "all_tokens": sum(len(p) for p in rollouts.prompt_ids()) + lengths_GN.sum(), "gen_batches": stats.gen_batches,
        "informative_fraction": stats.informative_fraction, "filler_fraction": stats.filler_fraction,
        "exhausted": stats.exhausted, "dropped_long_prompts": dropped["long"], "skipped_bad_rows": dropped["bad"],
        "generated_tokens": generated_tokens,
        "response_length_max": lengths_GN[described].max() if described.any() else 0.0,
    }
    return {name: torch.tensor(float(value), dtype=torch.float64) for name, value in values.items()}
