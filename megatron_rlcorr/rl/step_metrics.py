"""A step's metrics from its parts: the rollout statistics of the step's batch (rollout_metrics)
and the updates' results (train_metrics), combined over a step's updates (combine_over_updates).

The rollout statistics are sums over the step's whole batch (rl/step_sampling.rollout_stats, the
invalid tokens added by the trainer), so every ratio here is over every replica's samples; 0-d
tensors, as every metric until the once-per-step log.
"""
from __future__ import annotations

import torch

from ..training.step import StepResult


def rollout_metrics(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rewards, lengths and dynamic sampling of the step's batch; fillers take part in no mean."""
    samples = sums["batch_samples"].clamp(min=1)
    valid_tokens = sums["response_tokens"] - sums["invalid_tokens"]
    return {
        "reward_mean": sums["round0_score"] / sums["round0_samples"],
        "reward/acc_mean": sums["round0_acc"] / sums["round0_samples"],
        "reward/batch_score_mean": sums["batch_score"] / samples,
        "reward/batch_reward_mean": sums["batch_reward"] / samples,
        "reward/batch_acc_mean": sums["batch_acc"] / samples,
        "response_length_mean": sums["described_tokens"] / sums["described_samples"].clamp(min=1),
        "response_length_max": sums["response_length_max"],
        # truncated at max_new_tokens
        "response/clip_fraction": 1 - sums["described_eos"] / sums["described_samples"].clamp(min=1),
        "rollout_corr/invalid_rollout_token_fraction": sums["invalid_tokens"] / sums["response_tokens"].clamp(min=1),
        "dynamic_sampling/num_gen_batches": sums["gen_batches"],
        "dynamic_sampling/informative_fraction": sums["informative_fraction"],
        "dynamic_sampling/filler_fraction": sums["filler_fraction"],
        "batch/valid_response_tokens": valid_tokens,
        "data/topup_dropped_long_prompts": sums["dropped_long_prompts"],
        "data/topup_skipped_bad_rows": sums["skipped_bad_rows"],
    }


def train_metrics(results: list[StepResult]) -> dict[str, torch.Tensor]:
    """The step's view of its mini-batch updates: means, but the extremes of the correction's
    per-mini-batch maxima and minima (bypass mode), and the lr of the last update."""
    keys = results[0].metrics.keys()
    metrics = {k: combine_over_updates(k, [r.metrics[k].float() for r in results]) for k in keys}
    if "actor/lr" in keys:
        metrics["actor/lr"] = results[-1].metrics["actor/lr"]
    metrics["loss"] = metrics.get("actor/pg_loss", torch.tensor(float("nan")))
    metrics["grad_norm"] = torch.stack([r.grad_norm.float() for r in results]).mean()
    metrics["lr"] = metrics.get("actor/lr", torch.tensor(float("nan")))
    metrics["actor/skipped_updates"] = torch.tensor(float(sum(not r.update_successful for r in results)))
    return metrics


def combine_over_updates(name: str, values: list[torch.Tensor]) -> torch.Tensor:
    """A step's value of a metric reported by each update: the largest of the correction's
    maxima, the smallest of its minima, the mean otherwise."""
    stacked = torch.stack(values)
    if name.startswith("rollout_corr/") and name.endswith(("_max", "_max_deviation")):
        return stacked.max()
    if name.startswith("rollout_corr/") and name.endswith("_min"):
        return stacked.min()
    return stacked.mean()
