"""On a CPU the padded token phases run in blocks of rows; any block size gives the one-block result."""
import pytest
import torch

from megatron_rlcorr.config import RolloutCorrectionConfig
from megatron_rlcorr.correction import compute_rollout_correction, core

CONFIGS = {
    "token_is_bn_token_rs": dict(rollout_is="token", rollout_is_batch_normalize=True, rollout_rs="token",
                                 rollout_rs_threshold=1.5, rollout_token_veto_threshold=1e-3),
    "dapo": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
                 rollout_rs="geometric", rollout_rs_threshold=1.1, rollout_rs_threshold_lower=0.9,
                 rollout_token_veto_threshold=1e-4),
    "divergence": dict(rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="1.5,0.2"),
}


def _batch(mask_dtype):
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(13, 40, generator=g) * 3
    rollout = (old + 0.3 * torch.randn(13, 40, generator=g)).clamp(max=0.0)
    lengths = torch.randint(0, 41, (13,), generator=g)
    mask = (torch.arange(40) < lengths[:, None]).to(mask_dtype)
    old[mask == 0] = float("nan")  # masked garbage never reaches any output
    return old, rollout, mask


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
def test_blocks_match_one_block(monkeypatch, name, mask_dtype):
    cfg = RolloutCorrectionConfig(**CONFIGS[name])
    old, rollout, mask = _batch(mask_dtype)
    one = compute_rollout_correction(old, rollout, mask, cfg)
    monkeypatch.setattr(core, "CPU_BLOCK_TOKENS", 3 * 40)  # blocks of 3 rows, the last one shorter
    assert len(core._row_blocks(mask, None)) == 5
    blocked = compute_rollout_correction(old, rollout, mask, cfg)
    assert blocked.response_mask.dtype == mask.dtype
    assert torch.equal(blocked.response_mask, one.response_mask)
    assert 0 < blocked.response_mask.sum() < mask.sum()  # something was rejected, something kept
    if one.is_weights is not None:
        torch.testing.assert_close(blocked.is_weights, one.is_weights, rtol=1e-6, atol=0)
    assert blocked.metrics.keys() == one.metrics.keys()
    for key, value in one.metrics.items():
        torch.testing.assert_close(blocked.metrics[key], value, rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool, torch.int64])
def test_input_mask_is_returned_when_no_rule_can_reject(mask_dtype):
    old, rollout, mask = _batch(mask_dtype)
    before = mask.clone()
    out = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(rollout_is="token"))
    assert out.response_mask is mask
    assert torch.equal(mask, before)
    assert torch.equal(out.is_weights == 0, mask == 0)  # the float32 input mask is used as it is

    with_rule = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(
        rollout_is="token", rollout_rs="token", rollout_rs_threshold=1.2))
    assert with_rule.response_mask is not mask and with_rule.response_mask.dtype == mask_dtype
    assert torch.equal(mask, before)
    assert 0 < with_rule.response_mask.sum() < mask.sum()


@pytest.mark.parametrize("side", ["above_one", "below_one"])
def test_token_ratio_extremes_ignore_padding(side):
    """Masked positions carry rho = 1 internally; rows whose valid ratios all lie on one side of 1
    must not report it as their extreme."""
    sign = 1.0 if side == "above_one" else -1.0
    log_ratio = sign * torch.tensor([[0.1, 0.3, 0.2, 0.0, 0.0], [0.05, 0.4, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float32)
    rollout = torch.full_like(log_ratio, -1.0)
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=10.0)
    metrics = compute_rollout_correction(rollout + log_ratio, rollout, mask, cfg).metrics
    valid = log_ratio[mask.bool()].double()
    assert metrics["rollout_corr/rollout_is_max"].item() == pytest.approx(valid.max().exp().item(), rel=1e-6)
    assert metrics["rollout_corr/rollout_is_min"].item() == pytest.approx(valid.min().exp().item(), rel=1e-6)
