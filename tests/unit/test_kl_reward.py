"""KL in the reward (verl's use_kl_in_reward): the penalty on each response's reward, and the
fixed and adaptive controllers of its coefficient."""
import pytest
import torch

from megatron_rlcorr.rl.kl_reward import KLController, KLInRewardSettings, kl_penalised_rewards


def test_rewards_lose_beta_times_the_summed_kl_of_their_response_tokens():
    rewards = torch.tensor([1.0, -1.0, 0.5])
    log_probs = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0], [-3.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, 9.0], [-3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # the last: a filler
    controller = KLController(KLInRewardSettings(enabled=True, coef=0.1, type="kl"))
    penalised, metrics = kl_penalised_rewards(rewards, log_probs, ref, mask, controller, None)
    kl_sum = torch.tensor([0.5 - 1.0 + 0.0, 1.0 + 0.0, 0.0])  # k1 = logp - ref on the mask
    torch.testing.assert_close(penalised, rewards - 0.1 * kl_sum)
    # mean over the sequences with tokens of their per-token mean: (-0.5 / 3 + 1.0 / 2) / 2
    torch.testing.assert_close(metrics["actor/reward_kl_penalty"], torch.tensor((-0.5 / 3 + 0.5) / 2))
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    assert controller.value == pytest.approx(0.1)  # fixed


def test_adaptive_controller_follows_verl():
    settings = KLInRewardSettings(enabled=True, coef=0.2, controller="adaptive", target_kl=0.1, horizon=1000)
    controller = KLController(settings)
    controller.update(torch.tensor(0.15), num_sequences=100)  # error 0.5, clipped to 0.2
    assert float(controller.value) == pytest.approx(0.2 * (1 + 0.2 * 100 / 1000))
    controller.update(torch.tensor(0.09), num_sequences=50)  # error -0.1
    assert float(controller.value) == pytest.approx(0.2 * 1.02 * (1 - 0.1 * 50 / 1000))
    restored = KLController(settings)
    restored.load_state_dict(controller.state_dict())
    assert float(restored.value) == float(controller.value)


@pytest.mark.parametrize("kwargs, message", [({"type": "k5"}, "type must be one of"),
                                             ({"controller": "pid"}, "controller must be one of"),
                                             ({"coef": -1.0}, "coef must be"), ({"horizon": 0}, "horizon >= 1")])
def test_settings_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KLInRewardSettings(**kwargs)
