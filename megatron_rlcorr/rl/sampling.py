"""One step's rollouts for one data-parallel rank: prompts -> responses -> rewards -> DAPO dynamic sampling.

Reproducibility: every random draw uses a fresh generator seeded from (run seed, purpose, step,
data-parallel rank, round), so step s draws the same prompts and samples whether the run got
there uninterrupted or resumed from a checkpoint; the caller supplies each round's prompts (a
dataset's round 0 from its checkpointed read position, everything else drawn this way).

Dynamic sampling keeps the per-rank batch at exactly `num_groups` prompt groups (the training
step's collectives and normalisers expect the same micro-batch count on every rank):
- round 0 generates `num_groups` groups; groups whose rewards are all equal (zero advantage, no
  gradient) are dropped;
- up to `max_rounds` extra rounds generate more groups, sized by the keep rate seen so far,
  until `num_groups` informative groups are collected; surplus informative groups are discarded;
- if the rounds run out first, the batch is topped up with dropped groups. They have zero
  advantage, so they add no gradient but keep the shapes; their share is reported as
  `dynamic_sampling/filler_fraction`.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

from .advantages import OverlongPenalty, informative_groups, overlong_penalty
from ..data import Prompt, Task
from ..rollout import RolloutConfig, RolloutEngine


def derive_seed(base: int, *parts: object) -> int:
    """A 63-bit seed from the run seed and a path of names/numbers (stable across processes)."""
    digest = hashlib.sha256(repr((base, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_generator(base: int, *parts: object, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(derive_seed(base, *parts))


@dataclass
class RolloutGroups:
    """G prompt groups of n samples each; sample j of group g is at flat index g * n + j."""

    prompts: list[Prompt]               # [G]
    response_ids: list[list[int]]       # [G * n]
    logprobs: list[torch.Tensor]        # [G * n], float32 per response token (engine numerics)
    finish_reasons: list[str]           # [G * n]
    scores_GN: torch.Tensor             # task reward
    rewards_GN: torch.Tensor            # score + overlong penalty: what advantages are computed from

    @property
    def n(self) -> int:
        return self.scores_GN.shape[1]

    def __len__(self) -> int:
        return len(self.prompts)

    def prompt_ids(self) -> list[list[int]]:
        return [p.ids for p in self.prompts for _ in range(self.n)]

    def response_lengths(self) -> torch.Tensor:
        return torch.tensor([len(r) for r in self.response_ids], dtype=torch.float32)

    def select(self, group_idx: list[int]) -> "RolloutGroups":
        rows = [g * self.n + j for g in group_idx for j in range(self.n)]
        return RolloutGroups(
            prompts=[self.prompts[g] for g in group_idx],
            response_ids=[self.response_ids[r] for r in rows],
            logprobs=[self.logprobs[r] for r in rows],
            finish_reasons=[self.finish_reasons[r] for r in rows],
            scores_GN=self.scores_GN[group_idx].reshape(len(group_idx), self.n),
            rewards_GN=self.rewards_GN[group_idx].reshape(len(group_idx), self.n),
        )

    @staticmethod
    def concat(parts: list["RolloutGroups"]) -> "RolloutGroups":
        return RolloutGroups(
            prompts=[p for part in parts for p in part.prompts],
            response_ids=[r for part in parts for r in part.response_ids],
            logprobs=[x for part in parts for x in part.logprobs],
            finish_reasons=[f for part in parts for f in part.finish_reasons],
            scores_GN=torch.cat([part.scores_GN for part in parts]),
            rewards_GN=torch.cat([part.rewards_GN for part in parts]),
        )


def generate_groups(engine: RolloutEngine, task: Task, prompts: list[Prompt], *, rollout: RolloutConfig,
                    overlong: OverlongPenalty, sample_generator: torch.Generator) -> RolloutGroups:
    """Sample `rollout.n` responses for each prompt and score them."""
    n, num_prompts = rollout.n, len(prompts)
    out = engine.generate([p.ids for p in prompts for _ in range(n)], max_new_tokens=rollout.max_new_tokens,
                          temperature=rollout.temperature, top_p=rollout.top_p, generator=sample_generator)
    scores = [task.reward(prompts[i // n], response) for i, response in enumerate(out.response_ids)]
    scores_GN = torch.tensor(scores, dtype=torch.float32).reshape(num_prompts, n)
    rewards_GN = scores_GN
    if overlong.enabled:
        lengths_GN = torch.tensor(out.response_lengths, dtype=torch.float32).reshape(num_prompts, n)
        rewards_GN = scores_GN + overlong_penalty(lengths_GN, rollout.max_new_tokens, overlong.buffer,
                                                  overlong.penalty)
    return RolloutGroups(prompts=prompts, response_ids=out.response_ids, logprobs=list(out.logprobs),
                         finish_reasons=list(out.finish_reasons), scores_GN=scores_GN, rewards_GN=rewards_GN)


@dataclass(frozen=True)
class DynamicSampling:
    """DAPO dynamic sampling: drop prompt groups whose rewards are all equal, then top the batch up."""

    enabled: bool = False
    max_rounds: int = 4  # extra generation rounds per step to refill dropped groups

    def __post_init__(self) -> None:
        if self.max_rounds < 0:
            raise ValueError(f"max_rounds must be >= 0, got {self.max_rounds}")


@dataclass
class SamplingStats:
    rounds: int                 # generation rounds run (1 = no top-up)
    informative_fraction: float  # share of round-0 groups with unequal rewards
    filler_fraction: float       # share of the batch made of uninformative fillers
    generated_groups: int        # groups generated over all rounds


def dynamic_sample(draw: Callable[[int, int], RolloutGroups], num_groups: int, *, enabled: bool,
                   max_rounds: int) -> tuple[RolloutGroups, RolloutGroups, SamplingStats]:
    """(batch of exactly `num_groups` groups, round-0 groups, stats); `draw(round, k)` generates k groups.

    Round 0's groups are returned too: their reward is an unbiased estimate of the policy's
    reward, which the filtered batch is not.
    """
    first = draw(0, num_groups)
    if not enabled:
        return first, first, SamplingStats(1, _informative_share(first), 0.0, num_groups)
    kept, dropped, generated, rounds = [], [], 0, 0
    batch = first
    while True:
        mask = informative_groups(batch.rewards_GN).tolist()
        kept.append(batch.select([g for g, keep in enumerate(mask) if keep]))
        dropped.append(batch.select([g for g, keep in enumerate(mask) if not keep]))
        generated, rounds = generated + len(batch), rounds + 1
        have = sum(len(k) for k in kept)
        if have >= num_groups or rounds > max_rounds:
            break
        batch = draw(rounds, _top_up_size(num_groups - have, have / generated, num_groups))
    fillers_needed = max(num_groups - have, 0)
    informative = RolloutGroups.concat(kept).select(list(range(min(have, num_groups))))
    parts = [informative]
    if fillers_needed:
        parts.append(RolloutGroups.concat(dropped).select(list(range(fillers_needed))))
    stats = SamplingStats(rounds, _informative_share(first), fillers_needed / num_groups, generated)
    return RolloutGroups.concat(parts), first, stats


def _top_up_size(missing: int, keep_rate: float, num_groups: int) -> int:
    """Groups to generate so that about `missing` survive, at most a full batch."""
    if keep_rate <= 0:
        return num_groups
    return min(num_groups, max(missing, math.ceil(missing / keep_rate)))


def _informative_share(groups: RolloutGroups) -> float:
    return float(informative_groups(groups.rewards_GN).float().mean())
