"""One step's rollouts: prompts -> responses -> rewards -> DAPO dynamic sampling.

Reproducibility: every random draw is seeded from the run seed and a path of names and numbers
(`derive_seed`): a round's prompts from (seed, step, round), a prompt's samples from (seed, step,
round, prompt index). Step s draws the same prompts and samples whether the run got there
uninterrupted or resumed from a checkpoint, and under every parallel layout (rl/rollout_world.py
spreads the prompts over the engines); the caller supplies each round's prompts (a dataset's round
0 from its checkpointed read position, everything else drawn this way).

Dynamic sampling (verl's filter_groups) runs on the step's whole batch, the same on every rank,
and keeps it at exactly `num_groups` prompt groups (every data-parallel replica then trains on
the same number of sequences):
- the first generation batch has `num_groups` groups; groups whose `metric` (acc, score or
  reward) is the same for all their samples are dropped;
- more batches, sized by the keep rate seen so far, follow until `num_groups` informative groups
  are collected, at most `max_num_gen_batches` batches in all (0: no limit); surplus informative
  groups are discarded;
- if the limit is reached first, the batch is topped up with dropped groups marked as fillers
  (`on_exhausted: fill`): the batch builder gives them no advantage and an empty mask, so they
  count in no normaliser, mean or metric; their share is `dynamic_sampling/filler_fraction`.
  With `on_exhausted: error` the trainer stops the run instead, as verl does.

Each response gets a score (the task's reward), an acc (right or not) and a reward (score plus
the overlong penalty): verl's three dynamic-sampling metrics.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, ClassVar, Literal

import torch

from ..data import Prompt, Task
from ..rollout import RolloutConfig, RolloutEngine
from ..settings import check_choice
from .advantages import OverlongPenalty, informative_groups, overlong_penalty


def derive_seed(base: int, *parts: object) -> int:
    """A 63-bit seed from the run seed and a path of names/numbers (stable across processes)."""
    digest = hashlib.sha256(repr((base, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_generator(base: int, *parts: object, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(derive_seed(base, *parts))


@dataclass(frozen=True)
class RoutingLayout:
    """What a rollout's recorded MoE routing holds: per token `layers` x `topk` expert indices of
    `dtype`, for the response and, with `prompt`, for the prompt's positions but the last."""

    layers: int
    topk: int
    dtype: torch.dtype
    prompt: bool

    @staticmethod
    def of(routed: list[torch.Tensor | None], prompt_routed: list[torch.Tensor | None] | None) -> RoutingLayout | None:
        """From the first recorded tensor (None when nothing is recorded here yet)."""
        first = next((x for x in routed if x is not None), None)
        if first is None:
            return None
        return RoutingLayout(layers=first.shape[1], topk=first.shape[2], dtype=first.dtype,
                             prompt=prompt_routed is not None)


@dataclass
class RolloutGroups:
    """G prompt groups of n samples each; sample j of group g is at flat index g * n + j.

    Under all-rank generation a rank holds the statistics of every group but the tokens and
    log-probs only of those its engine generated: the others' `response_ids` and `logprobs` (and
    routed experts) are None until rollout_world.share_of_replica fetches them. `source_G` is the
    rollout group that generated each group.

    MoE models: `routed_experts` and `prompt_routed_experts` carry the engine's recorded routing per
    sequence (rollout.base.RolloutBatch's layout: [len(response), MoE layers, k] and [len(prompt) - 1,
    MoE layers, k], small ints), in the same g * n + j order, and `routing` says what they hold (so a
    rank that holds none of them yet can receive them). None for dense models.
    """

    prompts: list[Prompt]                   # [G]
    response_ids: list[list[int] | None]    # [G * n]
    logprobs: list[torch.Tensor | None]     # [G * n], float32 per response token (engine numerics)
    finish_reasons: list[str]               # [G * n]
    scores_GN: torch.Tensor                 # task reward
    rewards_GN: torch.Tensor                # score + overlong penalty: what advantages are computed from
    acc_GN: torch.Tensor                    # 1.0 for a right answer (the reward's own "acc", else score >= 1)
    # Fillers: uninformative groups that keep the batch's shape when dynamic sampling runs out of
    # batches. They take part in nothing: no advantage, no normaliser, no mean, no metric.
    filler_G: torch.Tensor | None = None
    lengths_B: torch.Tensor | None = None   # [G * n] response lengths (from response_ids when None)
    source_G: torch.Tensor | None = None    # [G] int64, 0 when None
    routed_experts: list[torch.Tensor | None] | None = None         # [G * n] each [len(response), MoE layers, k]
    prompt_routed_experts: list[torch.Tensor | None] | None = None  # [G * n] each [len(prompt) - 1, MoE layers, k]
    routing: RoutingLayout | None = None    # what the two hold; from the first recorded tensor when None
    # Multi-turn rollouts (rollout/tools/loop.py): per sample, 1 on each response token the engine sampled and 0 on
    # the tokens inserted between turns (tool responses, the template's turn markers), which have no rollout
    # log-prob and take part in nothing the trainer computes. None (the list, or an entry): all sampled.
    response_masks: list[list[int] | None] | None = None

    def __post_init__(self) -> None:
        if self.filler_G is None:
            self.filler_G = torch.zeros(len(self.prompts), dtype=torch.bool)
        if self.lengths_B is None:
            self.lengths_B = torch.tensor([len(r) for r in self.response_ids], dtype=torch.int64)
        if self.source_G is None:
            self.source_G = torch.zeros(len(self.prompts), dtype=torch.int64)
        if self.routing is None and self.routed_experts is not None:
            self.routing = RoutingLayout.of(self.routed_experts, self.prompt_routed_experts)
        assert self.routed_experts is not None or self.prompt_routed_experts is None, \
            "prompt_routed_experts without routed_experts (engines record the response's routing with the prompt's)"

    @property
    def n(self) -> int:
        return self.scores_GN.shape[1]

    def __len__(self) -> int:
        return len(self.prompts)

    def prompt_ids(self) -> list[list[int]]:
        return [p.ids for p in self.prompts for _ in range(self.n)]

    def response_lengths(self) -> torch.Tensor:
        return self.lengths_B.float()

    def metric_GN(self, metric: str) -> torch.Tensor:
        """The dynamic-sampling metric: acc, score, or reward (score + overlong penalty)."""
        return {"acc": self.acc_GN, "score": self.scores_GN, "reward": self.rewards_GN}[metric]

    def select(self, group_idx: list[int]) -> "RolloutGroups":
        rows = [g * self.n + j for g in group_idx for j in range(self.n)]

        def pick(xs: list | None) -> list | None:
            return None if xs is None else [xs[r] for r in rows]

        return RolloutGroups(
            prompts=[self.prompts[g] for g in group_idx],
            response_ids=[self.response_ids[r] for r in rows],
            logprobs=[self.logprobs[r] for r in rows],
            finish_reasons=[self.finish_reasons[r] for r in rows],
            scores_GN=self.scores_GN[group_idx].reshape(len(group_idx), self.n),
            rewards_GN=self.rewards_GN[group_idx].reshape(len(group_idx), self.n),
            acc_GN=self.acc_GN[group_idx].reshape(len(group_idx), self.n),
            filler_G=self.filler_G[group_idx].reshape(len(group_idx)),
            lengths_B=self.lengths_B[rows].reshape(len(rows)),
            source_G=self.source_G[group_idx].reshape(len(group_idx)),
            routed_experts=pick(self.routed_experts),
            prompt_routed_experts=pick(self.prompt_routed_experts),
            routing=self.routing,
            response_masks=pick(self.response_masks),
        )

    def as_fillers(self) -> "RolloutGroups":
        return dataclasses.replace(self, filler_G=torch.ones(len(self), dtype=torch.bool))

    @staticmethod
    def concat(parts: list["RolloutGroups"]) -> "RolloutGroups":
        layouts = {part.routing for part in parts}
        assert len(layouts) <= 1, f"concatenating rollouts of different routing records: {layouts}"

        def joined(field: str) -> list | None:
            lists = [getattr(part, field) for part in parts]
            return None if any(x is None for x in lists) else [x for xs in lists for x in xs]

        return RolloutGroups(
            prompts=[p for part in parts for p in part.prompts],
            response_ids=[r for part in parts for r in part.response_ids],
            logprobs=[x for part in parts for x in part.logprobs],
            finish_reasons=[f for part in parts for f in part.finish_reasons],
            scores_GN=torch.cat([part.scores_GN for part in parts]),
            rewards_GN=torch.cat([part.rewards_GN for part in parts]),
            acc_GN=torch.cat([part.acc_GN for part in parts]),
            filler_G=torch.cat([part.filler_G for part in parts]),
            lengths_B=torch.cat([part.lengths_B for part in parts]),
            source_G=torch.cat([part.source_G for part in parts]),
            routed_experts=joined("routed_experts"),
            prompt_routed_experts=joined("prompt_routed_experts"),
            routing=next(iter(layouts), None),
            response_masks=_joined_masks(parts),
        )


def _joined_masks(parts: list[RolloutGroups]) -> list[list[int] | None] | None:
    """The parts' response masks in one list (None entries where a part has none); None when no part has any."""
    if all(part.response_masks is None for part in parts):
        return None
    return [m for part in parts for m in (part.response_masks or [None] * len(part.response_ids))]


def score_response(task: Task, prompt: Prompt, response_ids: list[int]) -> tuple[float, float]:
    """(score, acc) of one response. A reward may return a float, or a mapping with "score" and
    optionally "acc" (as verl's reward functions do); without "acc" a response is right when its
    score is full marks (>= 1: dapo_math's +1, an exact built-in-task answer)."""
    result = task.reward(prompt, response_ids)
    if isinstance(result, Mapping):
        score = float(result["score"])
        return score, float(result.get("acc", score >= 1.0))
    return float(result), float(float(result) >= 1.0)


def generate_groups(engine: RolloutEngine, task: Task, prompts: list[Prompt], *, rollout: RolloutConfig,
                    overlong: OverlongPenalty, seeds: list[int]) -> RolloutGroups:
    """Sample `rollout.n` responses for each prompt (prompt i's from seeds[i]) and score them."""
    n, num_prompts = rollout.n, len(prompts)
    out = engine.sample_groups([p.ids for p in prompts], n=n, seeds=seeds, max_new_tokens=rollout.max_new_tokens,
                               temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k)
    scored = [score_response(task, prompts[i // n], response) for i, response in enumerate(out.response_ids)]
    scores_GN, acc_GN = torch.tensor(scored, dtype=torch.float32).reshape(num_prompts, n, 2).unbind(-1)
    rewards_GN = scores_GN
    if overlong.enabled:
        lengths_GN = torch.tensor(out.response_lengths, dtype=torch.float32).reshape(num_prompts, n)
        rewards_GN = scores_GN + overlong_penalty(lengths_GN, rollout.max_new_tokens, overlong.buffer,
                                                  overlong.penalty)
    return RolloutGroups(prompts=prompts, response_ids=out.response_ids, logprobs=list(out.logprobs),
                         finish_reasons=list(out.finish_reasons), scores_GN=scores_GN.contiguous(),
                         rewards_GN=rewards_GN, acc_GN=acc_GN.contiguous(),
                         routed_experts=None if out.routed_experts is None else list(out.routed_experts),
                         prompt_routed_experts=(None if out.prompt_routed_experts is None
                                                else list(out.prompt_routed_experts)))


FilterMetric = Literal["acc", "score", "reward"]
OnExhausted = Literal["fill", "error"]


@dataclass(frozen=True)
class DynamicSampling:
    """The recipe's `algorithm.dynamic_sampling` (verl's `algorithm.filter_groups`): drop prompt
    groups whose `metric` is equal for all their samples, then generate more until the batch is
    full, at most `max_num_gen_batches` generation batches per step in all (0: no limit)."""

    RETIRED_KEYS: ClassVar[dict[str, str]] = {
        "max_rounds": "max_rounds counted the extra rounds; the limit is now max_num_gen_batches, verl's count of "
                      "all generation batches of a step, the first included (0 = no limit): max_rounds: k is "
                      "max_num_gen_batches: k + 1",
    }

    enabled: bool = False                 # drop groups whose metric is equal for all samples; generate more to refill
    metric: FilterMetric = "acc"          # acc (verl's default in the DAPO scripts), score, or reward (+ overlong)
    max_num_gen_batches: int = 10         # generation batches per step at most, the first included; 0: no limit
    on_exhausted: OnExhausted = "fill"    # fill: inert fillers; error: stop the run, as verl does

    def __post_init__(self) -> None:
        check_choice("metric", self.metric, FilterMetric)
        check_choice("on_exhausted", self.on_exhausted, OnExhausted)
        if self.max_num_gen_batches < 0:
            raise ValueError(f"max_num_gen_batches must be >= 0 (0 = no limit), got {self.max_num_gen_batches}")


@dataclass
class SamplingStats:
    gen_batches: int             # generation batches run (1 = no top-up)
    informative_fraction: float  # share of round-0 groups whose metric is not constant
    filler_fraction: float       # share of the batch made of (inert) uninformative fillers
    generated_groups: int        # groups generated over all batches
    exhausted: bool              # the batch limit was reached before the batch was full


def dynamic_sample(draw: Callable[[int, int], RolloutGroups], num_groups: int,
                   settings: DynamicSampling) -> tuple[RolloutGroups, RolloutGroups, SamplingStats]:
    """(batch of exactly `num_groups` groups, round-0 groups, stats); `draw(round, k)` generates k groups.

    Round 0's groups are returned too: their reward is an unbiased estimate of the policy's
    reward, which the filtered batch is not. Fillers, when the limit is reached first, come last
    in the batch, marked in `filler_G`.
    """
    first = draw(0, num_groups)
    if not settings.enabled:
        return first, first, SamplingStats(1, _informative_share(first, "acc"), 0.0, num_groups, False)
    limit = settings.max_num_gen_batches
    kept, dropped, generated, batches = [], [], 0, 0
    batch = first
    while True:
        mask = informative_groups(batch.metric_GN(settings.metric)).tolist()
        kept.append(batch.select([g for g, keep in enumerate(mask) if keep]))
        dropped.append(batch.select([g for g, keep in enumerate(mask) if not keep]))
        generated, batches = generated + len(batch), batches + 1
        have = sum(len(k) for k in kept)
        if have >= num_groups or (limit and batches >= limit):
            break
        batch = draw(batches, _top_up_size(num_groups - have, have / generated, num_groups))
    fillers_needed = max(num_groups - have, 0)
    parts = [RolloutGroups.concat(kept).select(list(range(min(have, num_groups))))]
    if fillers_needed:
        parts.append(RolloutGroups.concat(dropped).select(list(range(fillers_needed))).as_fillers())
    stats = SamplingStats(batches, _informative_share(first, settings.metric), fillers_needed / num_groups,
                          generated, exhausted=fillers_needed > 0)
    return RolloutGroups.concat(parts), first, stats


def _top_up_size(missing: int, keep_rate: float, num_groups: int) -> int:
    """Groups to generate so that about `missing` survive, at most a full batch."""
    if keep_rate <= 0:
        return num_groups
    return min(num_groups, max(missing, math.ceil(missing / keep_rate)))


def _informative_share(groups: RolloutGroups, metric: str) -> float:
    return float(informative_groups(groups.metric_GN(metric)).float().mean())
