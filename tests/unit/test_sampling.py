"""Rollout collection: DAPO dynamic sampling, overlong penalty in the rewards, the padded batch."""
import math

import pytest
import torch

from megatron_rlcorr.rl.batch import build_step_batch, slice_batch
from megatron_rlcorr.data import EOS_ID, get_task
from megatron_rlcorr.data.tasks import Prompt
from megatron_rlcorr.rl.advantages import OverlongPenalty
from megatron_rlcorr.rollout import RolloutBatch, RolloutConfig
from megatron_rlcorr.rl.sampling import (DynamicSampling, RolloutGroups, derive_seed, dynamic_sample,
                                         generate_groups)

N = 2  # samples per prompt


def _groups(rewards_GN, tag=0):
    rewards = torch.tensor(rewards_GN, dtype=torch.float32)
    g = rewards.shape[0]
    return RolloutGroups(
        prompts=[Prompt(ids=[1, 3 + i], answer=f"{tag}.{i}") for i in range(g)],
        response_ids=[[5, EOS_ID]] * (g * N),
        logprobs=[torch.tensor([-0.5, -0.1])] * (g * N),
        finish_reasons=["eos"] * (g * N),
        scores_GN=rewards.clone(),
        rewards_GN=rewards,
        acc_GN=(rewards >= 1).float(),
    )


class _Draws:
    """draw(round, k): round r returns groups from a script (informative = unequal rewards)."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def __call__(self, round_, k):
        self.calls.append((round_, k))
        pattern = self.script[min(round_, len(self.script) - 1)]
        return _groups([pattern[i % len(pattern)] for i in range(k)], tag=round_)


def test_dynamic_sampling_tops_up_with_informative_groups_and_keeps_the_size():
    # Round 0: 1 of 4 informative; round 1 (sized by the keep rate 1/4): all informative.
    draws = _Draws([[[1, 1], [0, 1], [0, 0], [1, 1]], [[0, 1]]])
    batch, first, stats = dynamic_sample(draws, 4, DynamicSampling(True, "reward", max_num_gen_batches=4))
    assert draws.calls == [(0, 4), (1, 4)]  # ceil(3 / 0.25) = 12, capped at a full batch of 4
    assert len(batch) == 4 and batch.rewards_GN.shape == (4, N)
    assert [p.answer for p in batch.prompts] == ["0.1", "1.0", "1.1", "1.2"]
    assert torch.all(batch.rewards_GN.amax(1) > batch.rewards_GN.amin(1))
    assert len(first) == 4 and first.prompts[0].answer == "0.0"
    assert stats.gen_batches == 2 and stats.filler_fraction == 0.0 and stats.informative_fraction == 0.25
    assert stats.generated_groups == 8


def test_dynamic_sampling_fills_with_dropped_groups_when_batches_run_out():
    draws = _Draws([[[1, 1], [0, 1], [0, 0]], [[1, 1]]])
    batch, _, stats = dynamic_sample(draws, 3, DynamicSampling(True, "reward", max_num_gen_batches=3))
    assert [c[0] for c in draws.calls] == [0, 1, 2]  # verl's count: three generation batches in all
    assert len(batch) == 3
    assert [p.answer for p in batch.prompts] == ["0.1", "0.0", "0.2"]  # informative first, then fillers
    assert batch.filler_G.tolist() == [False, True, True]
    assert math.isclose(stats.filler_fraction, 2 / 3)
    assert stats.gen_batches == 3 and stats.exhausted


def test_no_limit_generates_until_the_batch_is_full():
    # one informative group per batch of 2: with max_num_gen_batches 0 (verl: no limit) it takes 4 batches
    draws = _Draws([[[0, 1], [1, 1]], [[0, 0], [0, 1]]])
    batch, _, stats = dynamic_sample(draws, 2, DynamicSampling(True, "reward", max_num_gen_batches=0))
    assert stats.gen_batches == 2 and not stats.exhausted and not batch.filler_G.any()


@pytest.mark.parametrize("metric, kept", [("acc", ["0.1"]), ("score", ["0.0", "0.1"]), ("reward", ["0.0", "0.1"])])
def test_the_metric_decides_which_groups_are_informative(metric, kept):
    # group 0: scores 0.5 and 0.2 (both wrong: acc constant 0); group 1: 1.0 and 0.0 (acc varies)
    groups = _groups([[0.5, 0.2], [1.0, 0.0], [0.3, 0.3]])
    batch, _, stats = dynamic_sample(lambda r, k: groups, 3, DynamicSampling(True, metric, max_num_gen_batches=1))
    assert [p.answer for p, filler in zip(batch.prompts, batch.filler_G) if not filler] == kept


def test_dynamic_sampling_disabled_returns_round_zero_unfiltered():
    draws = _Draws([[[1, 1], [0, 0]]])
    batch, first, stats = dynamic_sample(draws, 2, DynamicSampling(False))
    assert batch is first and draws.calls == [(0, 2)]
    assert stats.gen_batches == 1 and stats.informative_fraction == 0.0 and not batch.filler_G.any()


def test_dynamic_sampling_drops_surplus_informative_groups():
    draws = _Draws([[[0, 1]]])
    batch, _, stats = dynamic_sample(draws, 3, DynamicSampling(True, "reward", max_num_gen_batches=1))
    assert len(batch) == 3 and stats.gen_batches == 1 and stats.filler_fraction == 0.0


class _FixedEngine:
    """Returns scripted responses: response i has length lengths[i % len]."""

    def __init__(self, lengths):
        self.lengths = lengths
        self.sampling = []

    def sample_groups(self, prompts, *, n, seeds, max_new_tokens, temperature, top_p, top_k):
        assert len(seeds) == len(prompts)
        self.sampling.append(dict(temperature=temperature, top_p=top_p, top_k=top_k))
        rows = [p for p in prompts for _ in range(n)]
        responses = [[3] * (self.lengths[i % len(self.lengths)] - 1) + [EOS_ID] for i in range(len(rows))]
        return RolloutBatch(prompt_ids=rows, response_ids=responses,
                            logprobs=[torch.full((len(r),), -1.0) for r in responses],
                            finish_reasons=["eos"] * len(rows))


def test_overlong_penalty_enters_rewards_but_not_scores():
    task = get_task("digit_sum", digits=1)
    cfg = RolloutConfig(max_new_tokens=8, n=4)
    overlong = OverlongPenalty(enabled=True, buffer=4, penalty=1.0)
    engine = _FixedEngine([2, 4, 6, 8])  # excess over 8 - 4: 0, 0, 2, 4 -> penalty 0, 0, -0.5, -1
    gen = torch.Generator().manual_seed(0)
    prompts = task.sample_prompts(2, gen)
    groups = generate_groups(engine, task, prompts, rollout=cfg, overlong=overlong, seeds=[0, 1])
    torch.testing.assert_close(groups.rewards_GN - groups.scores_GN,
                               torch.tensor([[0.0, 0.0, -0.5, -1.0]] * 2))
    off = generate_groups(engine, task, prompts, rollout=cfg, overlong=OverlongPenalty(enabled=False),
                          seeds=[0, 1])
    assert torch.equal(off.rewards_GN, off.scores_GN)
    assert off.prompts == groups.prompts == prompts


def test_generate_groups_samples_with_the_rollout_settings_top_k_included():
    task = get_task("digit_sum", digits=1)
    engine = _FixedEngine([2])
    prompts = task.sample_prompts(2, torch.Generator().manual_seed(0))
    for rollout in (RolloutConfig(n=2, temperature=0.7, top_p=0.9, top_k=5), RolloutConfig(n=2, top_k=-1)):
        generate_groups(engine, task, prompts, rollout=rollout, overlong=OverlongPenalty(enabled=False), seeds=[0, 1])
        assert engine.sampling[-1] == dict(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k)


def test_step_batch_layout_and_invalid_rollout_tokens():
    groups = _groups([[1.0, 0.0]])
    groups.prompts[0] = Prompt(ids=[1, 7, 8], answer="x")
    groups.response_ids = [[4, 5, EOS_ID], [6]]
    groups.logprobs = [torch.tensor([-0.5, float("nan"), -0.25]), torch.tensor([0.3])]  # NaN and > 0: invalid
    batch, invalid = build_step_batch(groups, torch.tensor([2.0, -1.0]), pad_multiple=4)
    assert batch.tokens_BT.shape == (2, 8)  # longest 6, rounded up to 4
    assert batch.tokens_BT[0].tolist() == [1, 7, 8, 4, 5, EOS_ID, 0, 0]
    assert batch.targets_BT[0].tolist() == [7, 8, 4, 5, EOS_ID, 0, 0, 0]
    assert batch.response_mask_BT[0].tolist() == [0, 0, 1, 0, 1, 0, 0, 0]  # NaN token masked
    assert batch.response_mask_BT[1].tolist() == [0] * 8  # positive log-prob masked
    assert int(invalid) == 2
    assert batch.rollout_log_probs_BT[0].tolist() == [0, 0, -0.5, 0, -0.25, 0, 0, 0]
    assert torch.isfinite(batch.rollout_log_probs_BT).all()
    assert batch.advantages_BT[0].tolist() == [0, 0, 2, 0, 2, 0, 0, 0]
    assert batch.tokens_BT.dtype == torch.int64 and batch.response_mask_BT.dtype == torch.float32
    half = slice_batch(batch, 1, 2)
    assert half.tokens_BT.shape == (1, 8) and torch.equal(half.tokens_BT[0], batch.tokens_BT[1])


def test_derived_seeds_are_stable_and_distinct():
    assert derive_seed(1234, "prompts", 3, 0, 0) == derive_seed(1234, "prompts", 3, 0, 0)
    seeds = {derive_seed(1234, kind, step, rank, r) for kind in ("prompts", "samples") for step in range(3)
             for rank in range(2) for r in range(2)}
    assert len(seeds) == 24
    assert derive_seed(1234, "x") == 5800224822184682756  # fixed: resumed runs depend on it


@pytest.mark.parametrize("rewards", [[[0.0, 0.0]], [[1.0, 1.0]]])
def test_all_uninformative_batch_still_has_full_size(rewards):
    batch, _, stats = dynamic_sample(lambda r, k: _groups(rewards * k), 2,
                                     DynamicSampling(True, "reward", max_num_gen_batches=2))
    assert len(batch) == 2 and stats.filler_fraction == 1.0 and stats.gen_batches == 2


def test_fillers_are_inert_in_the_batch():
    # a real group and a filler group whose rewards (2/3, not representable) are all equal
    groups = RolloutGroups.concat([_groups([[1.0, 0.0]]), _groups([[2 / 3, 2 / 3]], tag=1).as_fillers()])
    groups.logprobs = [torch.tensor([-0.5, -0.1]), torch.tensor([-0.4, -0.2]),
                       torch.tensor([float("nan"), -0.3]), torch.tensor([0.5, -0.1])]  # fillers' invalid tokens
    advantages = torch.tensor([1.0, -1.0, 0.3, 0.3])  # even a (wrongly) non-zero filler advantage
    batch, invalid = build_step_batch(groups, advantages)
    assert batch.response_mask_BT[2:].sum() == 0 and batch.response_mask_BT[:2].sum() == 4
    assert batch.advantages_BT[2:].abs().sum() == 0
    assert int(invalid) == 0  # the fillers' bad tokens are not counted either


def test_rewards_may_return_score_and_acc():
    class Task:
        def reward(self, prompt, response):
            return {"score": 0.5, "acc": 1.0} if response[0] == 3 else 1.0

    from megatron_rlcorr.rl.sampling import score_response

    assert score_response(Task(), None, [3]) == (0.5, 1.0)
    assert score_response(Task(), None, [4]) == (1.0, 1.0)  # a plain float: acc is full marks
    assert score_response(get_task("digit_sum", digits=1), Prompt(ids=[1], answer="07"), [5]) == (0.0, 0.0)
