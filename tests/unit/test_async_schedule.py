"""rl/async_rollout.py without processes: which batches the trainer asks for (the schedule in the
module docstring: batch t with the weights after step max(0, t - 1 - S)), the staleness each sample
carries, and the objects that travel between the roles (round trip through the message format)."""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest
import torch

from megatron_rlcorr.rl.async_rollout import RolloutClient, StepRollouts, _pack, _unpack
from megatron_rlcorr.rl.sampling import RolloutGroups


def _client(staleness: int) -> RolloutClient:
    client = RolloutClient.__new__(RolloutClient)  # the schedule only: no process groups
    client.staleness, client.inflight, client.requested, client.received, client.data_position = \
        staleness, deque(), 0, 0, 0
    return client


def _versions(staleness: int, steps: int) -> dict[int, int]:
    """batch -> the version of the weights it is generated with, following the trainer's requests:
    first_requests at the start, then requests_after each step (Trainer._push_remote)."""
    client = _client(staleness)
    client.start(0)
    versions = {t: 0 for t in client.first_requests(0, steps)}
    for step in range(1, steps + 1):
        for t in client.requests_after(step, steps, last=step == steps):
            assert t not in versions, f"batch {t} asked for twice"
            versions[t] = step
    return versions


@pytest.mark.parametrize("staleness", [1, 2, 3])
def test_every_batch_is_asked_for_once_with_the_weights_s_steps_old(staleness):
    steps = 9
    versions = _versions(staleness, steps)
    assert sorted(versions) == list(range(1, steps + 1))
    for t, version in versions.items():
        assert version == max(0, t - 1 - staleness)          # rollout.policy_lag: S emulates exactly this
        assert 0 <= (t - 1) - version <= staleness          # never older than S


def _rollouts(step: int, version: int, position: int) -> StepRollouts:
    share = RolloutGroups(prompts=[SimpleNamespace(ids=[1, 2])], response_ids=[[3], [4, 5]],
                          logprobs=[torch.tensor([-0.5]), torch.tensor([-0.25, -1.0])],
                          finish_reasons=["eos", "length"], scores_GN=torch.tensor([[1.0, 0.0]]),
                          rewards_GN=torch.tensor([[1.0, 0.0]]), acc_GN=torch.tensor([[1.0, 0.0]]))
    return StepRollouts(step=step, policy_version=version, share=share, sums={"x": torch.tensor(2.0)},
                        data_metrics={}, data_position=position, gen_s=0.5)


def test_a_resumed_run_asks_only_for_the_batches_it_does_not_hold():
    client = _client(2)
    client.inflight.extend([_rollouts(5, 2, 50), _rollouts(6, 3, 60)])  # saved with the checkpoint of step 4
    client.data_position = 40
    client.start(4)
    assert client.first_requests(4, 20) == [7]   # step 4 + S + 1, with the checkpoint's weights
    assert client.next_position == 60            # the rollout ranks read on after the batches held
    assert client.first_requests(4, 6) == []     # the run ends before: nothing more to generate
    fresh = _client(2)
    fresh.start(0)
    assert fresh.first_requests(0, 20) == [1, 2, 3]
    assert client.requests_after(5, 20, last=True) == []  # exit_interval: nothing in flight past the save


def test_staleness_of_every_sample_and_the_message_round_trip():
    message = _rollouts(step=7, version=4, position=3)
    assert message.policy_versions_B.tolist() == [4, 4]
    assert message.staleness(6).tolist() == [2.0, 2.0]
    back = _unpack(_pack(message))
    assert back.step == 7 and back.policy_version == 4 and back.data_position == 3
    assert back.share.response_ids == [[3], [4, 5]]
    assert torch.equal(back.share.logprobs[1], message.share.logprobs[1])
    assert torch.equal(back.policy_versions_B, message.policy_versions_B)
