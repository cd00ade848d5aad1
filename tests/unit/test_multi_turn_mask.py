"""Multi-turn samples' response masks (rl/batch.py): the tokens inserted between turns stay in the
sequence but take part in nothing. The correction on a batch with inserted tokens (holding garbage
log-probs) equals the correction on the same samples' model tokens alone, built by hand as a
single-turn batch: IS weights, rejections and metrics."""
import math

import pytest
import torch

from megatron_rlcorr.config import RolloutCorrectionConfig, preset
from megatron_rlcorr.correction import compute_rollout_correction
from megatron_rlcorr.data import Prompt
from megatron_rlcorr.rl.batch import build_step_batch
from megatron_rlcorr.rl.sampling import RolloutGroups

G, N = 2, 3


def groups_of(responses, logprobs, masks=None) -> RolloutGroups:
    prompts = [Prompt(ids=[1, 2 + g], answer="") for g in range(G)]
    scores = torch.zeros(G, N)
    return RolloutGroups(prompts=prompts, response_ids=responses, logprobs=logprobs, finish_reasons=["eos"] * (G * N),
                         scores_GN=scores, rewards_GN=scores, acc_GN=scores, response_masks=masks)


def multi_turn_and_compact(seed: int = 0):
    """(multi-turn groups, their model tokens alone as single-turn groups, per-sample model positions)."""
    gen = torch.Generator().manual_seed(seed)
    multi, compact, masks, lp_multi, lp_compact = [], [], [], [], []
    for b in range(G * N):
        turns = [int(x) for x in torch.randint(1, 6, (3,), generator=gen)]  # model, inserted, model
        mask = [1] * turns[0] + [0] * turns[1] + [1] * turns[2] + ([0, 0, 1] if b % 2 else [])
        ids = [int(x) for x in torch.randint(3, 50, (len(mask),), generator=gen)]
        lp = -torch.rand(len(mask), generator=gen) * 2
        lp[torch.tensor(mask) == 0] = float("nan")  # inserted tokens have no rollout log-prob
        multi.append(ids)
        masks.append(mask)
        lp_multi.append(lp)
        compact.append([t for t, m in zip(ids, mask) if m])
        lp_compact.append(lp[torch.tensor(mask, dtype=torch.bool)])
    return groups_of(multi, lp_multi, masks), groups_of(compact, lp_compact), masks


def old_log_probs(batch, sampled_BT: torch.Tensor, seed: int, garbage: float) -> torch.Tensor:
    """The trainer's log-probs: the same value per sampled token in both batches (drawn in order),
    `garbage` at every other position (an inserted token's log-prob must change nothing)."""
    gen = torch.Generator().manual_seed(seed)
    old = torch.full_like(batch.rollout_log_probs_BT, garbage)
    rows = sampled_BT.nonzero()[:, 0]
    scale = torch.where(rows % 2 == 0, 0.01, 0.3)  # near and far samples: some kept, some rejected
    values = (batch.rollout_log_probs_BT[sampled_BT] + scale * torch.randn(len(rows), generator=gen)).clamp(max=-1e-3)
    old[sampled_BT] = values
    return old


CONFIGS = {
    "token_is": preset("decoupled_token_is"),
    "seq_is": preset("decoupled_seq_is"),
    "seq_is_rs": preset("decoupled_seq_is_rs"),
    "geo_rs": preset("decoupled_geo_rs"),
    "token_rs_veto": RolloutCorrectionConfig(rollout_is="token", rollout_rs="token", rollout_rs_threshold=1.5,
                                             rollout_rs_threshold_lower=0.7, rollout_token_veto_threshold=0.2),
}


def test_the_batch_keeps_inserted_tokens_out_of_the_mask():
    multi, compact, masks = multi_turn_and_compact()
    batch, invalid = build_step_batch(multi, torch.arange(G * N, dtype=torch.float32))
    assert int(invalid) == 0  # the inserted tokens' NaN log-probs are not invalid: they are not in the mask
    for b, mask in enumerate(masks):
        start = 1  # prompt of 2 tokens: the response's log-probs from position 1
        row = batch.response_mask_BT[b, start:start + len(mask)]
        assert row.tolist() == [float(m) for m in mask] and batch.response_mask_BT[b].sum() == sum(mask)
        assert (batch.advantages_BT[b, start:start + len(mask)] == torch.tensor(mask) * float(b)).all()
        assert torch.isfinite(batch.rollout_log_probs_BT).all()
        # the sequence still holds every token: the model reads the inserted ones
        assert batch.tokens_BT[b, 2:2 + len(mask)].tolist() == multi.response_ids[b]
    assert int(batch.response_mask_BT.sum()) == sum(len(r) for r in compact.response_ids)


def test_an_invalid_log_prob_on_a_model_token_is_still_caught():
    multi, _, masks = multi_turn_and_compact()
    multi.logprobs[0] = multi.logprobs[0].clone()
    multi.logprobs[0][0] = float("nan")  # a model token: the engine's bug
    batch, invalid = build_step_batch(multi, torch.zeros(G * N))
    assert int(invalid) == 1 and batch.response_mask_BT[0].sum() == sum(masks[0]) - 1


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("garbage", [-30.0, 0.0, 4.0])
def test_the_correction_sees_the_model_tokens_alone(name, garbage):
    multi, compact, _ = multi_turn_and_compact(seed=4)
    mb, _ = build_step_batch(multi, torch.ones(G * N))
    cb, _ = build_step_batch(compact, torch.ones(G * N))
    m_sampled, c_sampled = mb.response_mask_BT.bool(), cb.response_mask_BT.bool()
    old_m = old_log_probs(mb, m_sampled, seed=7, garbage=garbage)
    old_c = old_log_probs(cb, c_sampled, seed=7, garbage=garbage)
    assert torch.equal(old_m[m_sampled], old_c[c_sampled])
    got = compute_rollout_correction(old_m, mb.rollout_log_probs_BT, mb.response_mask_BT, CONFIGS[name])
    want = compute_rollout_correction(old_c, cb.rollout_log_probs_BT, cb.response_mask_BT, CONFIGS[name])
    if want.is_weights is not None:
        assert torch.equal(got.is_weights[m_sampled], want.is_weights[c_sampled])
        assert not got.is_weights[~m_sampled].any()  # no weight on an inserted token (or padding)
    kept = int(want.response_mask.sum())
    if name in ("seq_is_rs", "geo_rs", "token_rs_veto"):  # the rule rejects some tokens and keeps others
        assert 0 < kept < int(c_sampled.sum())
    assert torch.equal(got.response_mask[m_sampled], want.response_mask[c_sampled])
    assert not got.response_mask[~m_sampled].any()
    assert got.metrics.keys() == want.metrics.keys()
    for key in want.metrics:
        a, b = float(got.metrics[key]), float(want.metrics[key])
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-7), key


def test_dynamic_samplings_select_and_concat_keep_each_samples_mask():
    multi, compact, masks = multi_turn_and_compact()
    picked = multi.select([1])
    assert picked.response_masks == masks[N:2 * N]
    joined = RolloutGroups.concat([picked, compact.select([0])])  # a part without masks: all sampled
    assert joined.response_masks == masks[N:2 * N] + [None] * N
    batch, _ = build_step_batch(joined, torch.zeros(2 * N))
    assert batch.response_mask_BT[N:].sum() == sum(len(r) for r in compact.response_ids[:N])
    assert RolloutGroups.concat([compact, compact]).response_masks is None
