import pytest
import torch

from megatron_rlcorr.rl.advantages import group_advantages, informative_groups, overlong_penalty


def test_grpo_normalises_within_groups():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.2, 0.4, 0.6, 0.8]])
    adv = group_advantages(rewards, "grpo")
    expected0 = (rewards[0] - 0.5) / (rewards[0].std() + 1e-6)
    torch.testing.assert_close(adv[0], expected0)
    torch.testing.assert_close(adv.mean(dim=-1), torch.zeros(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(group_advantages(rewards, "grpo", norm_by_std=False)[1],
                               torch.tensor([-0.3, -0.1, 0.1, 0.3]))


def test_rloo_is_reward_minus_mean_of_others():
    rewards = torch.tensor([[1.0, 2.0, 6.0]])
    adv = group_advantages(rewards, "rloo")
    expected = torch.tensor([[1.0 - 4.0, 2.0 - 3.5, 6.0 - 1.5]])
    torch.testing.assert_close(adv, expected)


def test_equal_rewards_give_zero_advantage_and_are_uninformative():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    assert torch.equal(informative_groups(rewards), torch.tensor([False, True]))
    assert torch.equal(group_advantages(rewards, "grpo")[0], torch.zeros(3))


@pytest.mark.parametrize("value, n", [(2 / 3, 8), (1 / 3, 8), (0.1, 8), (0.7, 5)])
@pytest.mark.parametrize("estimator, norm", [("grpo", True), ("grpo", False), ("rloo", True)])
def test_equal_non_representable_rewards_give_exactly_zero(value, n, estimator, norm):
    # float32 mean of 8 x 2/3 is off by an ulp: divided by std + 1e-6 that was +0.056 per sample
    rewards = torch.full((2, n), value)
    rewards[1, 0] = 0.0
    adv = group_advantages(rewards, estimator, norm)
    assert torch.equal(adv[0], torch.zeros(n))
    assert adv[1].abs().min() > 0


def test_grpo_epsilon_is_1e_6():
    # two samples 1e-6 apart: std = 7.07e-7, so the epsilon decides the scale
    rewards = torch.tensor([[0.0, 1e-6]])
    std = rewards.std()
    torch.testing.assert_close(group_advantages(rewards, "grpo")[0, 1], (1e-6 - 5e-7) / (std + 1e-6))
    assert abs(group_advantages(rewards, "grpo")[0, 1].item() - 0.2929) < 1e-3  # eps = 0 would give 0.7071


def test_single_sample_groups_are_rejected():
    with pytest.raises(ValueError, match="at least 2 samples"):
        group_advantages(torch.zeros(3, 1), "grpo")


def test_overlong_penalty_is_linear_in_the_buffer():
    lengths = torch.tensor([4, 12, 13, 14, 16])
    torch.testing.assert_close(overlong_penalty(lengths, max_new_tokens=16, buffer=4, penalty=1.0),
                               torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))
