"""Input validation (check_inputs=True, docs/api.md) and the edge cases (docs/correction.md: empty batches, empty
sequences, trailing padding)."""
from __future__ import annotations

import math
import re

import pytest
import torch

from megatron_rlcorr.config import RolloutCorrectionConfig
from megatron_rlcorr.correction import compute_rollout_correction
from tests.reference import clean_batch, compare_metrics, parse_config, reference_correction

CFG = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
                              rollout_rs="token", rollout_rs_threshold=3.0, rollout_token_veto_threshold=1e-4)
FULL = dict(rollout_is="token", rollout_is_batch_normalize=True, rollout_rs="token_k1,seq_max_k3",
            rollout_rs_threshold="0.5_2.0,3.0", rollout_token_veto_threshold=1e-4)


def _inputs(batch=4, length=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(batch, length, generator=g) * 3 - 0.5
    old = rollout + 0.1 * torch.randn(batch, length, generator=g)
    mask = torch.ones(batch, length)
    mask[:, 12:] = 0   # 48 valid positions
    return old, rollout, mask


def _has_count(message: str, count: int) -> bool:
    return re.search(rf"(?<![\d.]){count}(?![\d.])", message) is not None


def _raises(old, rollout, mask, *, tensor: str, count: int | None = None, cu_seqlens=None):
    with pytest.raises(ValueError) as info:
        compute_rollout_correction(old, rollout, mask, CFG, cu_seqlens=cu_seqlens)
    message = str(info.value)
    assert tensor in message, f"message does not name {tensor}: {message}"
    if count is not None:
        assert _has_count(message, count), f"message does not give the count {count}: {message}"
    return message


# ---- shapes and dtypes -----------------------------------------------------------------------

def test_shape_mismatch_rollout():
    old, rollout, mask = _inputs()
    _raises(old, rollout[:, :15], mask, tensor="rollout_log_prob")


def test_shape_mismatch_mask():
    old, rollout, mask = _inputs()
    _raises(old, rollout, mask[:3], tensor="response_mask")


def test_integer_log_probs_rejected():
    old, rollout, mask = _inputs()
    _raises(old.long(), rollout, mask, tensor="old_log_prob")


def test_log_prob_dtype_mismatch_is_fine_or_named():
    """Mixed float dtypes are all 'any float dtype' (docs/api.md): either accepted or named."""
    old, rollout, mask = _inputs()
    try:
        out = compute_rollout_correction(old.bfloat16(), rollout, mask, CFG)
    except ValueError as err:
        assert "old_log_prob" in str(err) or "rollout_log_prob" in str(err)
    else:
        assert out.is_weights.dtype == torch.float32


def test_float_cu_seqlens_rejected():
    old, rollout, mask = _inputs()
    _raises(old.flatten(), rollout.flatten(), mask.flatten(), tensor="cu_seqlens",
            cu_seqlens=torch.tensor([0.0, 16.0, 64.0]))


def test_packed_requires_one_dimensional_inputs():
    old, rollout, mask = _inputs()
    with pytest.raises(ValueError):
        compute_rollout_correction(old, rollout, mask, CFG,
                                   cu_seqlens=torch.tensor([0, 16, 64], dtype=torch.int32))


# ---- values at valid positions ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["old_log_prob", "rollout_log_prob"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.5])
def test_bad_values_at_valid_positions(name, bad):
    old, rollout, mask = _inputs()
    target = old if name == "old_log_prob" else rollout
    bad_positions = [(0, 1), (1, 5), (2, 7), (3, 0), (3, 11), (0, 3), (2, 2)]  # 7 valid positions
    for i, j in bad_positions:
        target[i, j] = bad
    target[0, 14] = bad  # masked: not counted
    _raises(old, rollout, mask, tensor=name, count=len(bad_positions))


def test_non_binary_mask():
    old, rollout, mask = _inputs()
    mask[0, 0], mask[1, 1], mask[2, 2] = 0.5, 2.0, -1.0
    _raises(old, rollout, mask, tensor="response_mask", count=3)


def test_nan_in_mask():
    old, rollout, mask = _inputs()
    mask[1, 3] = float("nan")
    _raises(old, rollout, mask, tensor="response_mask", count=1)


@pytest.mark.parametrize("cu,why", [
    ([1, 16, 64], "does not start at 0"),
    ([0, 40, 30, 64], "decreasing"),
    ([0, 16, 80], "past the end"),
    ([], "empty"),
])
def test_bad_cu_seqlens(cu, why):
    old, rollout, mask = (x.flatten() for x in _inputs())
    with pytest.raises(ValueError) as info:
        compute_rollout_correction(old, rollout, mask, CFG, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    assert "cu_seqlens" in str(info.value), why


@pytest.mark.parametrize("cu", [[1, 16, 64], [0, 40, 30, 64], [0, 16, 80], [-5, 10, 1000]])
def test_unchecked_bad_cu_seqlens_never_index_out_of_bounds(cu):
    """check_inputs=False promises valid offsets; broken ones give meaningless numbers, never a
    read or write outside the tensors (offsets are clamped into [0, N] and made non-decreasing)."""
    old, rollout, mask = (x.flatten() for x in _inputs())
    out = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(**FULL),
                                     cu_seqlens=torch.tensor(cu, dtype=torch.int32), check_inputs=False)
    assert out.response_mask.shape == mask.shape and out.is_weights.shape == mask.shape
    assert all(value.dim() == 0 for value in out.metrics.values())


def test_cu_seqlens_without_sequences():
    """cu_seqlens == [0]: no sequence, every token trailing padding. Either a ValueError naming
    cu_seqlens or an all-empty result; never a crash inside the math."""
    old, rollout, mask = (x.flatten() for x in _inputs())
    try:
        out = compute_rollout_correction(old, rollout, mask, CFG, cu_seqlens=torch.tensor([0], dtype=torch.int32))
    except ValueError as err:
        assert "cu_seqlens" in str(err)
    else:
        assert not out.response_mask.any()
        _assert_finite(out)


def test_two_dimensional_cu_seqlens():
    old, rollout, mask = (x.flatten() for x in _inputs())
    with pytest.raises(ValueError, match="cu_seqlens"):
        compute_rollout_correction(old, rollout, mask, CFG, cu_seqlens=torch.tensor([[0, 16], [16, 64]]))


def test_garbage_at_masked_positions_is_fine():
    old, rollout, mask = _inputs()
    junk = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e4, -1e4])
    old[:, 12:] = junk.repeat(4)[:4 * 4].view(4, 4)
    rollout[:, 12:] = junk.flip(0).repeat(4)[:4 * 4].view(4, 4)
    mask[1, 3] = 0
    old[1, 3] = float("nan")
    for check_inputs in (True, False):
        out = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(**FULL),
                                         check_inputs=check_inputs)
        assert torch.isfinite(out.is_weights).all()
        assert (out.is_weights[mask == 0] == 0).all()
        assert (out.response_mask[mask == 0] == 0).all()
        for name, value in out.metrics.items():
            assert math.isfinite(float(value)), name


def test_bool_and_float_masks_agree():
    old, rollout, mask = _inputs()
    a = compute_rollout_correction(old, rollout, mask, CFG)
    b = compute_rollout_correction(old, rollout, mask.bool(), CFG)
    assert b.response_mask.dtype == torch.bool and a.response_mask.dtype == torch.float32
    assert torch.equal(a.response_mask.bool(), b.response_mask)
    torch.testing.assert_close(a.is_weights, b.is_weights, rtol=0, atol=0)
    for key in a.metrics:
        torch.testing.assert_close(a.metrics[key], b.metrics[key], rtol=0, atol=0)


# ---- edge cases (docs/correction.md) -------------------------------------------------------------

def _assert_finite(out):
    for name, value in out.metrics.items():
        assert math.isfinite(float(value)), f"{name} = {float(value)}"
    if out.is_weights is not None:
        assert torch.isfinite(out.is_weights).all()


def test_all_tokens_rejected():
    old, rollout, mask = _inputs()
    old = rollout - 1.0   # every ratio 1/e, outside [1/1.5, 1.5]
    kwargs = dict(rollout_is="token", rollout_is_batch_normalize=True, rollout_rs="token",
                  rollout_rs_threshold=1.5, rollout_token_veto_threshold=1e-4)
    out = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(**kwargs))
    assert not out.response_mask.any()
    _assert_finite(out)
    assert float(out.metrics["rollout_corr/rollout_rs_masked_fraction"]) == 1.0
    assert float(out.metrics["rollout_corr/rollout_rs_seq_masked_fraction"]) == 1.0
    ref = reference_correction(old, rollout, mask, kwargs)
    assert not compare_metrics(out.metrics, ref.metrics, parse_config(kwargs))


def test_all_sequences_vetoed():
    old, rollout, mask = _inputs()
    old[:, 0] = rollout[:, 0] - 15.0
    kwargs = dict(rollout_is="sequence", rollout_is_batch_normalize=True, rollout_token_veto_threshold=1e-4)
    out = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(**kwargs))
    assert not out.response_mask.any()
    _assert_finite(out)
    assert float(out.metrics["rollout_corr/rollout_is_veto_fraction"]) == 1.0


def test_empty_sequences_get_zero_weight_and_are_not_counted():
    old, rollout, mask = _inputs()
    mask[1] = 0
    mask[3] = 0
    old[1] = float("nan")
    kwargs = dict(rollout_is="sequence", rollout_is_batch_normalize=True, rollout_rs="geometric",
                  rollout_rs_threshold=1.2, rollout_token_veto_threshold=1e-4)
    out = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(**kwargs))
    assert (out.is_weights[1] == 0).all() and (out.is_weights[3] == 0).all()
    ref = reference_correction(old, rollout, mask, kwargs)
    problems = compare_metrics(out.metrics, ref.metrics, parse_config(kwargs))
    assert not problems, "\n".join(problems)
    # only two sequences count: sequence fractions are multiples of 1/2
    for key in ("rollout_is_veto_fraction", "rollout_rs_seq_masked_fraction", "rollout_is_ratio_fraction_low"):
        twice = 2 * float(out.metrics[f"rollout_corr/{key}"])
        assert twice == round(twice), key


@pytest.mark.parametrize("packed", [False, True])
def test_all_empty_batch(packed):
    old, rollout, mask = _inputs()
    mask.zero_()
    old[0, 0] = float("nan")
    cu = None
    if packed:
        old, rollout, mask = old.flatten(), rollout.flatten(), mask.flatten()
        cu = torch.tensor([0, 0, 16, 16, 64], dtype=torch.int32)
    out = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(**FULL), cu_seqlens=cu)
    assert (out.is_weights == 0).all()
    assert not out.response_mask.any()
    _assert_finite(out)


def test_batch_without_rows():
    empty = torch.zeros(0, 16)
    out = compute_rollout_correction(empty, empty, empty, RolloutCorrectionConfig(**FULL))
    assert out.is_weights.shape == (0, 16) and out.response_mask.shape == (0, 16)
    _assert_finite(out)


def test_single_valid_token():
    old, rollout, mask = _inputs()
    mask.zero_()
    mask[2, 4] = 1
    kwargs = dict(FULL, rollout_rs="token", rollout_rs_threshold=3.0)
    out = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(**kwargs))
    _assert_finite(out)
    assert float(out.metrics["rollout_corr/rollout_is_std"]) == 0.0
    assert float(out.metrics["rollout_corr/rollout_is_seq_std"]) == 0.0
    ref = reference_correction(old, rollout, mask, kwargs)
    assert not compare_metrics(out.metrics, ref.metrics, parse_config(kwargs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    batch, ref = clean_batch(5, FULL, batch=6, max_len=32, dtype=dtype)
    out = compute_rollout_correction(batch.old, batch.rollout, batch.mask, RolloutCorrectionConfig(**FULL))
    assert out.is_weights.dtype == torch.float32
    torch.testing.assert_close(out.is_weights.double(), ref.is_weights, rtol=1e-5, atol=0)
    assert torch.equal(out.response_mask.bool(), ref.keep)
    problems = compare_metrics(out.metrics, ref.metrics, parse_config(FULL))
    assert not problems, "\n".join(problems)


def test_weights_are_detached():
    old, rollout, mask = _inputs()
    old.requires_grad_(True)
    out = compute_rollout_correction(old, rollout, mask, CFG)
    assert not out.is_weights.requires_grad


@pytest.mark.parametrize("copies", [1, 3])
def test_equal_sequence_statistics_have_exactly_zero_spread(copies):
    """One sequence, or identical sequences (duplicate GRPO responses): every spread of a
    per-sequence value is exactly 0, not the rounding left by sum x^2 - (sum x)^2 / n on large x."""
    g = torch.Generator().manual_seed(5)
    rollout = -torch.rand(1, 300, generator=g) * 3 - 0.5
    old = rollout + 0.6 * torch.randn(1, 300, generator=g)  # large sequence statistics (k3 sum ~ 60)
    old, rollout = old.clamp(max=0).repeat(copies, 1), rollout.repeat(copies, 1)
    mask = torch.ones(copies, 300)
    cfg = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=1e9,
                                  rollout_rs="seq_sum_k3,seq_mean_k2,seq_max_k3",
                                  rollout_rs_threshold="1e6,1e6,1e6")
    metrics = compute_rollout_correction(old, rollout, mask, cfg).metrics
    assert metrics["rollout_corr/rollout_rs_seq_sum_k3_mean"].item() > 10.0
    for option in ("seq_sum_k3", "seq_mean_k2", "seq_max_k3"):
        assert metrics[f"rollout_corr/rollout_rs_{option}_std"].item() == 0.0, option
        assert metrics[f"rollout_corr/rollout_rs_{option}_seq_std"].item() == 0.0, option
    assert metrics["rollout_corr/rollout_is_seq_std"].item() == 0.0
