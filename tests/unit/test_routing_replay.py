"""Routing replay pieces on one process (training/routing_replay.py, rl/batch.py, microbatches.py):
where the engine's routed experts land in the StepBatch, how a micro-batch's targets are laid out for
the router (padded, packed, CP, SP), the -1 merge with the free top-k, the recompute queue, clearing,
and the metric sums. The model-level checks are in tests/distributed/test_routing_replay.py."""
import types

import pytest
import torch

from megatron_rlcorr.data.tasks import Prompt
from megatron_rlcorr.rl.batch import batch_to, build_step_batch, routed_experts, slice_batch
from megatron_rlcorr.rl.sampling import RolloutGroups
from megatron_rlcorr.training.microbatches import PackingRules, plan_packed, plan_padded
from megatron_rlcorr.training.routing_replay import RoutingReplay, moe_layer_indices, router_rows, routing_metrics
from megatron_rlcorr.training.step_types import StepBatch, check_batch

L, K = 2, 2  # MoE layers, top-k


class _Groups:
    """What rl/batch.routed_experts reads of RolloutGroups."""

    def __init__(self, prompts, responses, routed, prompt_routed=None):
        self._prompts, self.response_ids = prompts, responses
        self.routed_experts, self.prompt_routed_experts = routed, prompt_routed

    def prompt_ids(self):
        return self._prompts


def _rows(n, start):
    """[n, L, K] rows whose values encode their row: start + j, + 100 per layer, + 50 for the second expert."""
    j = torch.arange(start, start + n)[:, None, None]
    return (j + 100 * torch.arange(L)[None, :, None] + 50 * torch.arange(K)[None, None, :]).to(torch.uint8)


def test_routed_experts_sit_at_the_positions_of_their_forward():
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10, 11]]
    groups = _Groups(prompts, responses, routed=[_rows(2, 0), _rows(4, 10)], prompt_routed=[_rows(2, 40), None])
    out = routed_experts(groups, width=8)
    assert out.dtype == torch.int16 and out.shape == (2, 8, L, K)
    # row 0: prompt positions 0, 1 (len(prompt) - 1 rows), response rows at 2, 3; the last token (4) and padding -1
    assert out[0, :2, 0, 0].tolist() == [40, 41] and out[0, 2:4, 0, 0].tolist() == [0, 1]
    assert out[0, 2, 1].tolist() == [100, 150]
    assert (out[0, 4:] == -1).all()
    # row 1: no prompt routing (position 0 is free: -1), response rows at 1..4, then -1
    assert (out[1, 0] == -1).all() and out[1, 1:5, 0, 0].tolist() == [10, 11, 12, 13]
    assert (out[1, 5:] == -1).all()
    assert routed_experts(_Groups(prompts, responses, routed=None), width=8) is None
    with pytest.raises(ValueError, match=r"sample 1: routed_experts has shape \(3, 2, 2\), expected \(4, 2, 2\)"):
        routed_experts(_Groups(prompts, responses, routed=[_rows(2, 0), _rows(3, 0)]), width=8)


def test_step_batch_without_routing_slices_and_moves():
    rewards = torch.tensor([[1.0, -1.0]])
    groups = RolloutGroups(prompts=[Prompt(ids=[1, 2], answer="x")], response_ids=[[5, 6], [7]],
                           logprobs=[torch.full((2,), -0.5), torch.full((1,), -0.5)], finish_reasons=["eos"] * 2,
                           scores_GN=rewards, rewards_GN=rewards, acc_GN=rewards)
    batch, _ = build_step_batch(groups, torch.tensor([1.0, -1.0]))
    assert batch.routed_experts_BTLK is None  # a dense model's engine records none
    assert slice_batch(batch, 1, 2).routed_experts_BTLK is None and batch_to(batch, "cpu").routed_experts_BTLK is None
    routed = torch.arange(2 * 4 * L * K, dtype=torch.int16).view(2, 4, L, K)
    with_routing = StepBatch(**{**batch.__dict__, "routed_experts_BTLK": routed})
    assert torch.equal(slice_batch(with_routing, 1, 2).routed_experts_BTLK, routed[1:2])
    check_batch(with_routing)
    with pytest.raises(ValueError, match=r"routed_experts_BTLK has shape \(2, 3, 2, 2\), expected tokens_BT's"):
        check_batch(StepBatch(**{**batch.__dict__, "routed_experts_BTLK": routed[:, :3]}))
    with pytest.raises(ValueError, match="must be an integer"):
        check_batch(StepBatch(**{**batch.__dict__, "routed_experts_BTLK": routed.float()}))


@pytest.mark.parametrize("packed", [False, True])
def test_targets_are_cut_like_the_tokens(packed):
    """plan.split of [B, T, L, K] keeps the trailing dims and gives each layer's slice the cut of a
    [B, T] tensor (CP rank 0 of 2, zigzag), padding filled with -1."""
    lengths = torch.tensor([5, 3, 7])
    if packed:
        plan = plan_packed(lengths, 7, PackingRules(max_tokens=8, multiple=4), cp_size=2, cp_rank=0, cp_group=None,
                           dp_group=None, device=torch.device("cpu"))
    else:
        plan = plan_padded(lengths, 7, micro_batch_size=1, multiple=4, cp_size=2, cp_rank=0, cp_group=None,
                           device=torch.device("cpu"))
    x = torch.randint(0, 8, (3, 7, L, K))
    parts = plan.split(x, fill=-1)
    for l in range(L):
        for k in range(K):
            expected = plan.split(x[:, :, l, k], fill=-1)
            assert all(torch.equal(p[..., l, k], e) for p, e in zip(parts, expected))
    assert any((p == -1).any() for p in parts)  # the padded cells


def test_router_rows_follow_megatrons_token_order():
    """The router sees hidden states [S, B, H] (under sequence parallelism TP rank r holds rows
    r * S/tp .. of S), flattened to [S * B] rows: S-major."""
    x_bs = torch.arange(8).view(2, 4)  # [b=2, s=4] token ids of a padded micro-batch
    hidden_sb = x_bs.t()
    assert router_rows(x_bs, packed=False, sp_size=1, sp_rank=0).tolist() == hidden_sb.reshape(-1).tolist()
    assert router_rows(x_bs, packed=False, sp_size=1, sp_rank=0).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert router_rows(x_bs, packed=False, sp_size=2, sp_rank=1).tolist() == [2, 6, 3, 7]
    packed = torch.arange(6)  # THD: one row [1, n] -> [n, 1]
    assert router_rows(packed, packed=True, sp_size=2, sp_rank=0).tolist() == [0, 1, 2]
    routed = torch.arange(2 * 4 * L * K).view(2, 4, L, K)
    assert torch.equal(router_rows(routed, packed=False, sp_size=2, sp_rank=0),
                       routed.transpose(0, 1)[:2].reshape(4, L, K))


def test_moe_layer_indices():
    assert moe_layer_indices(types.SimpleNamespace(moe_layer_freq=[0, 1, 1, 0, 1], num_layers=5)) == [1, 2, 4]
    assert moe_layer_indices(types.SimpleNamespace(moe_layer_freq=2, num_layers=5)) == [0, 2, 4]


# ---- the router's replay ------------------------------------------------------------------------

class _Router(torch.nn.Module):
    def __init__(self, layer_number):
        super().__init__()
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self.layer_number, self.router_replay = layer_number, RouterReplay()


class _Chunk(torch.nn.Module):
    """A model chunk with routers at global layers 1 and 3 (MoE layers 0 and 1)."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(moe_layer_freq=[0, 1, 0, 1], num_layers=4, num_moe_experts=4,
                                            sequence_parallel=False, moe_aux_loss_coeff=0.0)
        self.routers = torch.nn.ModuleList([_Router(4), _Router(2)])


def _topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def test_replay_router_merges_targets_queues_for_recompute_and_clears():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    chunk = _Chunk()
    driver = RoutingReplay.of([chunk])
    assert RoutingReplay.of([chunk]) is driver  # one driver per model
    replays = driver.routers[id(chunk)]
    assert [r.moe_index for r in replays] == [0, 1]  # layer order, global MoE index
    assert chunk.routers[1].router_replay is replays[0] and chunk.routers[0].router_replay is replays[1]
    assert not any(r in RouterReplay.global_router_replay_instances for r in replays)
    router = replays[0]
    scores = torch.tensor([[4.0, 3, 2, 1], [1, 2, 3, 4], [0, 5, 1, 2]], requires_grad=True)
    # outside a pass: Megatron's top-k
    assert router.get_replay_topk(scores, 2, None, None, _topk)[1].tolist() == [[0, 1], [3, 2], [1, 3]]

    driver.active = types.SimpleNamespace(expects_backward=True)
    driver.in_forward = True
    router.forward_target = torch.tensor([[3, 2], [-1, -1], [0, 2]])  # row 1: not recorded, free
    with torch.no_grad():  # a checkpointed forward
        values, chosen = router.get_replay_topk(scores, 2, None, None, _topk)
    assert chosen.tolist() == [[3, 2], [3, 2], [0, 2]]
    assert values.tolist() == [[1.0, 2.0], [4.0, 3.0], [0.0, 1.0]]  # gathered from the live scores
    assert len(router.recompute_queue) == 1
    driver.in_forward = False  # the recompute in backward: the forward's routing, with gradients
    values, chosen = router.get_replay_topk(scores, 2, None, None, _topk)
    assert chosen.tolist() == [[3, 2], [3, 2], [0, 2]] and not router.recompute_queue
    values.sum().backward()
    assert scores.grad.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [1, 0, 1, 0]]
    with pytest.raises(RuntimeError, match="found no queued routing"):
        router.get_replay_topk(scores, 2, None, None, _topk)
    driver.in_forward = True
    with torch.no_grad():
        router.get_replay_topk(scores, 2, None, None, _topk)
    with pytest.raises(AssertionError, match="never recomputed"):
        driver.check_empty()
    router.clear()
    router.forward_target = None
    driver.active = None
    driver.check_empty()


def test_metric_sums_per_layer_then_mean_over_layers():
    chunk = _Chunk()
    driver = RoutingReplay.of([chunk])
    free = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])
    engine = torch.tensor([[1, 0], [1, 3], [-1, -1], [0, 1]])  # same set, differs, not recorded, differs
    compare = torch.tensor([True, True, True, False])  # the last is not a response token
    valid = torch.tensor([True, True, True, False])
    driver.accumulate(0, free, free, engine, compare, valid, num_experts=4)       # layer 0: 1 of 2 differ
    driver.accumulate(1, free, engine.clamp(min=0), engine, compare, valid, num_experts=4)  # layer 1: same counts
    driver.accumulate(1, free[:1], free[:1], engine[:1], compare[:1], valid[:1], num_experts=4)  # + 0 of 1
    driver.engine_routing = True
    metrics = routing_metrics([chunk], None, torch.device("cpu"))
    # layer 0: 1/2, layer 1: 1/3
    torch.testing.assert_close(metrics["moe/routing_mismatch_fraction"], torch.tensor((1 / 2 + 1 / 3) / 2))
    # tokens per expert of the valid rows: layer 0 [0,1] [1,2] [2,3] -> [1, 2, 2, 1]: 2 / 1.5; layer 1
    # [1,0] [1,3] [0,0] and [0,1] -> [4, 3, 0, 1]: 4 / 2
    torch.testing.assert_close(metrics["moe/expert_load_max_over_mean"], torch.tensor((2 / 1.5 + 4 / 2) / 2))
    assert "moe/aux_loss" not in metrics
    assert driver.compared_L.sum() == 0 and not driver.engine_routing  # reset for the next step


def test_fused_router_is_refused_and_dense_models_have_no_driver():
    chunk = _Chunk()
    chunk.config.moe_router_fusion = True  # Transformer Engine's fused top-k never calls RouterReplay
    with pytest.raises(ValueError, match="moe_router_fusion"):
        RoutingReplay.of([chunk])
    dense = torch.nn.Linear(1, 1)
    dense.config = types.SimpleNamespace(num_moe_experts=None)
    assert RoutingReplay.of([dense]) is None
    assert routing_metrics([dense], None, torch.device("cpu")) == {}
