"""All-rank generation (rl/rollout_world.py): every rank generates, and a step's rollouts are the
same under every parallel layout, down to the last token and log-prob bit."""
from pathlib import Path

import pytest
import torch

from tests.dist import run_distributed

pytestmark = [pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_cpu.yaml"
# Dynamic sampling with top-up rounds: the later rounds' prompts are drawn and spread too.
COMMON = ["data.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=6", "trainer.micro_batch_size=4",
          "algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.max_num_gen_batches=3",
          "trainer.logger=[console]"]


def _view(groups):
    """What a rollout is: prompts, tokens, log-probs, finish reasons, rewards, fillers, and the routed
    experts (with their dtype) where the engine recorded them."""
    def listed(xs):
        return None if xs is None else [(str(x.dtype), x.tolist()) for x in xs]

    return {"prompts": [p.ids for p in groups.prompts], "responses": groups.response_ids,
            "logprobs": [x.tolist() for x in groups.logprobs], "finish": groups.finish_reasons,
            "rewards": groups.rewards_GN.tolist(), "fillers": groups.filler_G.tolist(),
            "routed": listed(groups.routed_experts), "prompt_routed": listed(groups.prompt_routed_experts)}


def _trainer_rollouts(rank, world_size, layouts):
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups, destroy_parallel_groups
    from megatron_rlcorr.recipe import load_recipe
    from megatron_rlcorr.rl.rollout_world import share_of_replica
    from megatron_rlcorr.rl.trainer import Trainer

    enable_cpu_megatron()
    out = []
    for overrides in layouts:
        recipe = load_recipe(TINY, [*COMMON, *overrides])
        p = recipe.parallel
        groups = build_parallel_groups(p.tp, p.pp, p.cp, p.vpp)
        try:
            trainer = Trainer(recipe, groups)
            trainer._push_weights()
            views = []
            for step in (1, 2):  # two steps: different prompts and seeds, same weights
                batch, _, stats, _, generated = trainer.sampler.sample_step(step, None)
                share = share_of_replica(batch, groups)
                views.append({"share": _view(share), "dp_rank": groups.dp_rank, "dp_size": groups.dp_size,
                              "gen_batches": stats.gen_batches, "generated": generated,
                              "engine_ran": trainer.engine.weights is not None})
            out.append(views)
        finally:
            destroy_parallel_groups()
    return out


def _slice(view, start, end, n):
    rows = slice(start * n, end * n)
    return {"prompts": view["prompts"][start:end], "responses": view["responses"][rows],
            "logprobs": view["logprobs"][rows], "finish": view["finish"][rows],
            "rewards": view["rewards"][start:end], "fillers": view["fillers"][start:end],
            **{key: None if view[key] is None else view[key][rows] for key in ("routed", "prompt_routed")}}


def test_one_process_dp2_tp2_pp2_and_cp2_sample_identical_rollouts():
    layouts = {"dp2": [], "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "cp2": ["parallel.cp=2"]}
    (reference,), = run_distributed(_trainer_rollouts, 1, [[]])
    per_rank = run_distributed(_trainer_rollouts, 2, list(layouts.values()))
    for step in range(2):
        whole = reference[step]["share"]
        assert len(whole["prompts"]) == 4 and all(whole["responses"])
        assert reference[step]["gen_batches"] >= 1
        for index, name in enumerate(layouts):
            for rank in range(2):
                got = per_rank[rank][index][step]
                assert got["engine_ran"], (name, rank)  # every rank generated
                d, size = got["dp_rank"], got["dp_size"]
                per_replica = 4 // size
                assert got["share"] == _slice(whole, d * per_replica, (d + 1) * per_replica, 4), (name, rank, step)
                assert got["gen_batches"] == reference[step]["gen_batches"], name
                assert got["generated"] == reference[step]["generated"], name
    assert reference[0]["share"]["prompts"] != reference[1]["share"]["prompts"]


class _SeededEngine:
    """A stand-in engine whose samples are a function of (prompt, seed, sample index) only, as the
    interface requires; responses of 1 to 4 tokens, some ending in EOS. It records MoE routing as an
    engine of 300 experts (int16), 2 MoE layers and top-2 would, prompt rows included."""

    def sample_groups(self, prompts, *, n, seeds, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0):
        from megatron_rlcorr.rollout import RolloutBatch

        rows, responses, logprobs, finish, routed, prompt_routed = [], [], [], [], [], []
        for prompt, seed in zip(prompts, seeds):
            for j in range(n):
                g = torch.Generator().manual_seed(seed + j)
                length = int(torch.randint(1, max_new_tokens + 1, (1,), generator=g))
                ids = torch.randint(3, 20, (length,), generator=g).tolist()
                eos = bool(torch.rand(1, generator=g) < 0.5)
                if eos:
                    ids[-1] = 2
                rows.append(list(prompt))
                responses.append(ids)
                logprobs.append(-torch.rand(length, generator=g))
                finish.append("eos" if eos else "length")
                routed.append(torch.randint(0, 300, (length, 2, 2), generator=g, dtype=torch.int16))
                prompt_routed.append(torch.randint(0, 300, (len(prompt) - 1, 2, 2), generator=g, dtype=torch.int16))
        return RolloutBatch(prompt_ids=rows, response_ids=responses, logprobs=logprobs, finish_reasons=finish,
                            routed_experts=routed, prompt_routed_experts=prompt_routed)


def _world_rollouts(rank, world_size, layouts):
    """sample_round over prompts of 13 (uneven chunks) and 3 (fewer prompts than engines), then
    each replica's share of a 12-group batch, on rollout groups of `rollout_tp` ranks."""
    from megatron_rlcorr.data import get_task
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups, destroy_parallel_groups
    from megatron_rlcorr.rl.advantages import OverlongPenalty
    from megatron_rlcorr.rl.rollout_world import sample_round, share_of_replica
    from megatron_rlcorr.rl.sampling import RolloutGroups
    from megatron_rlcorr.rollout import RolloutConfig

    enable_cpu_megatron()
    task = get_task("digit_sum", digits=1)
    prompts = task.sample_prompts(16, torch.Generator().manual_seed(0))
    rollout = RolloutConfig(n=3, max_new_tokens=4)
    overlong = OverlongPenalty(enabled=True, buffer=2, penalty=1.0)
    out = []
    for tp, rollout_tp in layouts:
        groups = build_parallel_groups(tp, 1, 1, rollout_tp=rollout_tp)
        try:
            rounds = [sample_round(_SeededEngine(), task, prompts[:k], [100 * i for i in range(k)], rollout=rollout,
                                   overlong=overlong, groups=groups) for k in (13, 3)]
            batch = RolloutGroups.concat([rounds[0].select(list(range(1, 10))), rounds[1]])  # 12 groups
            share = share_of_replica(batch, groups)
            out.append({"share": _view(share), "dp_rank": groups.dp_rank, "dp_size": groups.dp_size})
        finally:
            destroy_parallel_groups()
    return out


def test_rollout_groups_of_two_ranks_spread_and_return_the_samples():
    layouts = [(1, 1), (1, 2), (2, 2), (2, 1)]  # (training tp, rollout tp): dp4 / dp2 replicas
    (reference,), = run_distributed(_world_rollouts, 1, [(1, 1)])
    whole = reference["share"]
    assert len(whole["prompts"]) == 12 and all(whole["responses"])
    assert [len(r) for _, r in whole["routed"]] == [len(r) for r in whole["responses"]]
    assert {dtype for dtype, _ in whole["routed"] + whole["prompt_routed"]} == {"torch.int16"}
    per_rank = run_distributed(_world_rollouts, 4, layouts)
    for index, layout in enumerate(layouts):
        for rank in range(4):
            got = per_rank[rank][index]
            d, size = got["dp_rank"], got["dp_size"]
            per_replica = 12 // size
            assert got["share"] == _slice(whole, d * per_replica, (d + 1) * per_replica, 3), (layout, rank)


def _hand_round():
    """4 prompts x 2 samples by hand: multi-turn samples (a response mask with inserted tokens, NaN
    log-probs there) and single-turn ones (no mask) mixed."""
    from megatron_rlcorr.data import Prompt
    from megatron_rlcorr.rl.sampling import RolloutGroups

    gen = torch.Generator().manual_seed(0)
    prompts = [Prompt(ids=[1, 5 + g], answer="") for g in range(4)]
    responses, logprobs, masks = [], [], []
    for b in range(8):
        length = 3 + b
        responses.append([int(x) for x in torch.randint(2, 60, (length,), generator=gen)])
        mask = None if b % 3 == 0 else [int(k % 4 != 2) for k in range(length)]
        lp = -torch.rand(length, generator=gen)
        if mask is not None:
            lp[torch.tensor(mask) == 0] = float("nan")
        logprobs.append(lp)
        masks.append(mask)
    scores = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    return prompts, RolloutGroups(prompts=prompts, response_ids=responses, logprobs=logprobs, finish_reasons=["eos"] * 8,
                                  scores_GN=scores, rewards_GN=scores, acc_GN=scores, response_masks=masks)


def _masked_share(rank, world_size, tp):
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups, destroy_parallel_groups
    from megatron_rlcorr.rl.rollout_world import chunk_bounds, gather_round, share_of_replica

    enable_cpu_megatron()
    groups = build_parallel_groups(tp, 1, 1)
    try:
        prompts, whole = _hand_round()
        start, end = chunk_bounds(len(prompts), world_size)[rank]  # the embedded engine: one per rank
        local = whole.select(list(range(start, end))) if end > start else None
        share = share_of_replica(gather_round(local, prompts, whole.n, groups), groups)
        return {"dp_rank": groups.dp_rank, "dp_size": groups.dp_size, "ids": share.response_ids,
                "masks": [m or [1] * len(r) for m, r in zip(share.response_masks, share.response_ids)],
                "logprobs": [x.tolist() for x in share.logprobs]}
    finally:
        destroy_parallel_groups()


@pytest.mark.parametrize("world_size, tp", [(2, 1), (4, 2)])
def test_multi_turn_masks_reach_the_replica_that_trains_them(world_size, tp):
    """All-rank generation's transfer carries each sample's response mask (and its NaN log-probs at
    inserted tokens) to the replica that trains it: every rank's share equals the one-process batch's."""
    _, whole = _hand_round()
    for got in run_distributed(_masked_share, world_size, tp):
        per = 4 // got["dp_size"]
        want = whole.select(list(range(got["dp_rank"] * per, (got["dp_rank"] + 1) * per)))
        assert got["ids"] == want.response_ids
        assert got["masks"] == [m or [1] * len(r) for m, r in zip(want.response_masks, want.response_ids)]
        assert str(got["logprobs"]) == str([x.tolist() for x in want.logprobs])  # NaN where inserted, bit for bit
