"""The trainer's per-step metrics: fillers take part in no mean, and a step's extremes of the
correction's per-update maxima and minima are extremes, not means."""
import torch

from megatron_rlcorr.data.tasks import Prompt
from megatron_rlcorr.rl.sampling import RolloutGroups, SamplingStats
from megatron_rlcorr.rl.step_sampling import rollout_stats
from megatron_rlcorr.rl.step_metrics import combine_over_updates, rollout_metrics


def _with_invalid(batch, first, stats, dropped, generated):
    """rollout_stats as the trainer completes it (no invalid tokens)."""
    return {**rollout_stats(batch, first, stats, dropped, generated), "invalid_tokens": torch.tensor(0.0)}


def _groups(rewards_GN, lengths, filler=False):
    rewards = torch.tensor(rewards_GN)
    g, n = rewards.shape
    groups = RolloutGroups(prompts=[Prompt(ids=[1, 2], answer="x")] * g,
                           response_ids=[[5] * length for length in lengths],
                           logprobs=[torch.full((length,), -0.5) for length in lengths],
                           finish_reasons=["eos"] * (g * n), scores_GN=rewards, rewards_GN=rewards,
                           acc_GN=(rewards >= 1).float())
    return groups.as_fillers() if filler else groups


def test_fillers_take_part_in_no_mean():
    real = _groups([[1.0, -1.0]], lengths=[3, 5])
    fillers = _groups([[2 / 3, 2 / 3]], lengths=[8, 8], filler=True)
    batch = RolloutGroups.concat([real, fillers])
    stats = SamplingStats(gen_batches=3, informative_fraction=0.5, filler_fraction=0.5, generated_groups=4,
                          exhausted=True)
    sums = _with_invalid(batch, batch, stats, {"long": 0, "bad": 0}, 40)
    metrics = rollout_metrics(sums)
    assert metrics["response_length_max"] == 5.0  # the fillers' 8 are out
    assert sums["generated_tokens"] == 40.0
    assert metrics["reward/batch_score_mean"] == 0.0 and metrics["reward/batch_acc_mean"] == 0.5
    assert metrics["response_length_mean"] == 4.0  # (3 + 5) / 2: the fillers' 8-token responses are out
    assert metrics["dynamic_sampling/filler_fraction"] == 0.5 and sums["exhausted"] == 1.0
    assert metrics["dynamic_sampling/num_gen_batches"] == 3.0


def test_a_batch_of_fillers_only_reports_what_was_generated():
    """Dynamic sampling found no informative group: the whole batch is fillers. Length and
    truncation describe those generated responses, not an empty mean (0 tokens, all truncated)."""
    fillers = _groups([[1.0, 1.0], [-1.0, -1.0]], lengths=[3, 6, 4, 4], filler=True)
    fillers.finish_reasons[1] = "length"  # one of the four hit max_new_tokens
    stats = SamplingStats(gen_batches=2, informative_fraction=0.0, filler_fraction=1.0, generated_groups=4,
                          exhausted=True)
    metrics = rollout_metrics(_with_invalid(fillers, fillers, stats, {"long": 0, "bad": 0}, 17))
    assert metrics["response_length_mean"] == (3 + 6 + 4 + 4) / 4
    assert metrics["response_length_max"] == 6.0
    assert metrics["response/clip_fraction"] == 0.25
    assert metrics["dynamic_sampling/filler_fraction"] == 1.0  # the step says its batch held no real sample
    # with one real sample, the fillers are out again
    real = _groups([[1.0, -1.0]], lengths=[2, 2])
    real.finish_reasons[:] = ["length", "eos"]
    batch = RolloutGroups.concat([real, fillers])
    metrics = rollout_metrics(_with_invalid(batch, batch, stats, {"long": 0, "bad": 0}, 21))
    assert metrics["response_length_mean"] == 2.0 and metrics["response_length_max"] == 2.0
    assert metrics["response/clip_fraction"] == 0.5


def test_step_extremes_of_per_update_correction_metrics():
    values = [torch.tensor(1.5), torch.tensor(3.0), torch.tensor(0.5)]
    assert combine_over_updates("rollout_corr/rollout_is_seq_max", values) == 3.0
    assert combine_over_updates("rollout_corr/rollout_is_seq_max_deviation", values) == 3.0
    assert combine_over_updates("rollout_corr/rollout_is_min", values) == 0.5
    assert combine_over_updates("rollout_corr/rollout_is_mean", values) == torch.tensor(5 / 3)
    assert combine_over_updates("actor/grad_norm", values) == torch.tensor(5 / 3)
