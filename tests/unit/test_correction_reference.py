"""compute_rollout_correction vs the float64 reference on random batches (docs/math.md, docs/api.md).

Heavy-tailed log-ratios, catastrophic tokens, empty rows, interior mask holes, NaN/inf/1e4
garbage at masked positions, float32/bf16/fp16 inputs, bool/float masks, padded and packed
layouts, every IS/RS/veto option and several combinations. Every batch is regenerated until
no decision sits within float32 rounding of its threshold (tests/reference.py `clean_batch`).
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rlcorr.config import RolloutCorrectionConfig
from megatron_rlcorr.correction import compute_rollout_correction, core
from tests.reference import (Batch, RefResult, clean_batch, compare_metrics, cu_seqlens_of,
                             padded_to_packed, parse_config)

CONFIGS = {
    "disabled": {},
    "token_is": dict(rollout_is="token", rollout_is_threshold=2.0),
    "token_is_clip": dict(rollout_is="token", rollout_is_threshold=1.5, rollout_is_threshold_lower=0.5),
    "token_is_bn": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True),
    "seq_is_bn": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True),
    "seq_is_clip": dict(rollout_is="sequence", rollout_is_threshold=5.0, rollout_is_threshold_lower=0.2),
    "token_rs": dict(rollout_rs="token", rollout_rs_threshold=2.0),
    "token_rs_lower": dict(rollout_is="token", rollout_rs="token", rollout_rs_threshold=3.0,
                           rollout_rs_threshold_lower=0.5),
    "seq_rs": dict(rollout_rs="sequence", rollout_rs_threshold=3.0),
    "geo_rs": dict(rollout_rs="geometric", rollout_rs_threshold=1.05),
    "dapo": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
                 rollout_rs="geometric", rollout_rs_threshold=1.01, rollout_rs_threshold_lower=0.99,
                 rollout_token_veto_threshold=1e-4),
    "veto_only_pg": dict(rollout_token_veto_threshold=1e-4, bypass_mode=True, use_policy_gradient=True),
    "seq_is_token_rs_veto": dict(rollout_is="sequence", rollout_is_threshold=5.0, rollout_rs="token",
                                 rollout_rs_threshold=3.0, rollout_rs_threshold_lower=0.5,
                                 rollout_token_veto_threshold=1e-4),
    "token_k1": dict(rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"),
    "token_k1_asym": dict(rollout_rs="token_k1", rollout_rs_threshold="0.9_3.0"),
    "token_k2": dict(rollout_rs="token_k2", rollout_rs_threshold=0.1),
    "token_k3": dict(rollout_is="token", rollout_rs="token_k3", rollout_rs_threshold=0.2),
    "seq_sum_k1": dict(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.2_5.0"),
    "seq_sum_k2": dict(rollout_rs="seq_sum_k2", rollout_rs_threshold=2.0),
    "seq_sum_k3": dict(rollout_rs="seq_sum_k3", rollout_rs_threshold=2.0),
    "seq_mean_k1": dict(rollout_rs="seq_mean_k1", rollout_rs_threshold=1.25,
                        rollout_rs_threshold_lower=0.9),
    "seq_mean_k2": dict(rollout_rs="seq_mean_k2", rollout_rs_threshold=0.08),
    "seq_mean_k3": dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.1),
    "seq_max_k2": dict(rollout_rs="seq_max_k2", rollout_rs_threshold=2.0),
    "seq_max_k3": dict(rollout_rs="seq_max_k3", rollout_rs_threshold=1.0),
    "k1_max_k3_string": dict(rollout_is="token", rollout_rs="token_k1,seq_max_k3",
                             rollout_rs_threshold="0.5_2.0,3.0", rollout_token_veto_threshold=1e-4),
    "sum_k2_mean_k1_list": dict(rollout_rs=["seq_sum_k2", "seq_mean_k1"], rollout_rs_threshold=[4.0, 1.2],
                                rollout_rs_threshold_lower=0.9),
    "mean_k3_token_k2_shared": dict(rollout_is="sequence", rollout_is_batch_normalize=True,
                                    rollout_rs="seq_mean_k3,token_k2", rollout_rs_threshold=0.3),
}

# (seed, input dtype, mask dtype, layout): four input variants per configuration
VARIANTS = {
    "f32-float-padded": (0, torch.float32, torch.float32, "padded"),
    "bf16-bool-packed": (1, torch.bfloat16, torch.bool, "packed"),
    "fp16-float-packed64": (2, torch.float16, torch.float32, "packed64"),
    "bf16-float-padded": (3, torch.bfloat16, torch.float32, "padded"),
}


def _run(batch: Batch, kwargs: dict, layout: str, check_inputs: bool = True):
    cfg = RolloutCorrectionConfig(**kwargs)
    if layout == "padded":
        return compute_rollout_correction(batch.old, batch.rollout, batch.mask, cfg,
                                          check_inputs=check_inputs), None
    trailing = 5
    spans = batch.lengths
    cu = cu_seqlens_of(spans, torch.int64 if layout == "packed64" else torch.int32)
    old = padded_to_packed(batch.old, spans, trailing, fill=float("nan"))
    rollout = padded_to_packed(batch.rollout, spans, trailing, fill=1e4)
    mask = padded_to_packed(batch.mask, spans, trailing, fill=0)
    out = compute_rollout_correction(old, rollout, mask, cfg, cu_seqlens=cu,
                                     check_inputs=check_inputs)
    return out, (spans, trailing, old, mask)


def assert_matches_reference(out, ref: RefResult, kwargs: dict, input_mask: torch.Tensor,
                             pack=None) -> None:
    """Implementation output == reference: weights (rtol 1e-5), mask (exact), every metric."""
    expected_w = ref.is_weights
    expected_keep = ref.keep
    if pack is not None:
        spans, trailing = pack[0], pack[1]
        expected_keep = padded_to_packed(expected_keep, spans, trailing, fill=False)
        if expected_w is not None:
            expected_w = padded_to_packed(expected_w, spans, trailing, fill=0.0)
    if expected_w is None:
        assert out.is_weights is None
    else:
        assert out.is_weights.dtype == torch.float32
        assert out.is_weights.shape == expected_w.shape
        torch.testing.assert_close(out.is_weights.double(), expected_w, rtol=1e-5, atol=0)
    assert out.response_mask.dtype == input_mask.dtype
    assert out.response_mask.shape == expected_keep.shape
    got_keep = out.response_mask.bool() if out.response_mask.dtype == torch.bool else out.response_mask != 0
    diff = torch.nonzero(got_keep != expected_keep).flatten(0).tolist()
    assert not diff, f"mask differs at {len(diff)} positions, first {diff[:5]}"
    if out.response_mask.dtype != torch.bool:
        assert set(out.response_mask.unique().tolist()) <= {0.0, 1.0}
    for name, value in out.metrics.items():
        assert torch.is_tensor(value) and value.dim() == 0, name
        assert math.isfinite(float(value)), f"{name} = {float(value)}"
    problems = compare_metrics(out.metrics, ref.metrics, parse_config(kwargs))
    assert not problems, "\n".join(problems)
    extra = sorted(set(out.metrics) - set(ref.metrics))
    assert not extra, f"metrics docs/math.md does not define for this config: {extra}"


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_reference(name, variant):
    seed, dtype, mask_dtype, layout = VARIANTS[variant]
    kwargs = CONFIGS[name]
    batch, ref = clean_batch(seed + 17 * list(CONFIGS).index(name), kwargs, batch=12, max_len=64,
                             dtype=dtype, mask_dtype=mask_dtype, catastrophic=0.004)
    out, pack = _run(batch, kwargs, layout)
    input_mask = batch.mask if pack is None else pack[3]
    assert_matches_reference(out, ref, kwargs, input_mask, pack)


# Small and odd shapes (one row, one-token rows, many short rows) with CPU row blocks of every size.
SHAPES = [(1, 1), (1, 7), (1, 200), (2, 1), (3, 64), (40, 7)]


@pytest.mark.parametrize("block_tokens", [1, 64, 1 << 18])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{b}x{t}" for b, t in SHAPES])
def test_odd_shapes_match_reference(monkeypatch, shape, block_tokens):
    monkeypatch.setattr(core, "CPU_BLOCK_TOKENS", block_tokens)
    rows, max_len = shape
    checked = 0
    for i, name in enumerate(CONFIGS):
        variant = list(VARIANTS)[i % len(VARIANTS)]
        seed, dtype, mask_dtype, layout = VARIANTS[variant]
        kwargs = CONFIGS[name]
        batch, ref = clean_batch(1000 * rows + 10 * max_len + i, kwargs, batch=rows, max_len=max_len,
                                 dtype=dtype, mask_dtype=mask_dtype, catastrophic=0.01, empty_rows=False)
        out, pack = _run(batch, kwargs, layout, check_inputs=i % 2 == 0)
        if not ref.metrics:  # no valid token at all (mask holes): the reference reports no metrics
            continue
        assert_matches_reference(out, ref, kwargs, batch.mask if pack is None else pack[3], pack)
        checked += 1
    assert checked >= len(CONFIGS) // 2


@pytest.mark.parametrize("name", ["token_is_bn", "dapo", "k1_max_k3_string", "seq_sum_k1"])
def test_packed_equals_padded(name):
    """The packed layout (cu_seqlens, trailing padding) gives the padded layout's result."""
    kwargs = CONFIGS[name]
    batch, _ = clean_batch(40 + len(name), kwargs, batch=10, max_len=40)
    padded, _ = _run(batch, kwargs, "padded", check_inputs=False)
    packed, (spans, trailing, _, _) = _run(batch, kwargs, "packed", check_inputs=False)
    if padded.is_weights is not None:
        torch.testing.assert_close(packed.is_weights,
                                   padded_to_packed(padded.is_weights, spans, trailing), rtol=1e-5, atol=0)
    assert torch.equal(packed.response_mask, padded_to_packed(padded.response_mask, spans, trailing))
    assert set(packed.metrics) == set(padded.metrics)
    for key, value in padded.metrics.items():
        torch.testing.assert_close(packed.metrics[key], value, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("threshold", [1.2, 2.0, 10.0])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_is_thresholds(level, threshold):
    kwargs = dict(rollout_is=level, rollout_is_threshold=threshold, rollout_token_veto_threshold=1e-3)
    batch, ref = clean_batch(7, kwargs, batch=8, max_len=32, scale=0.5)
    out, _ = _run(batch, kwargs, "padded")
    assert_matches_reference(out, ref, kwargs, batch.mask)


@pytest.mark.parametrize("upper,lower", [(1.5, None), (4.0, 0.25), (1.001, 0.999)])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_rs_thresholds(level, upper, lower):
    kwargs = dict(rollout_rs=level, rollout_rs_threshold=upper, rollout_rs_threshold_lower=lower)
    batch, ref = clean_batch(8, kwargs, batch=8, max_len=32, scale=0.05)
    out, _ = _run(batch, kwargs, "padded")
    assert_matches_reference(out, ref, kwargs, batch.mask)


def test_equivalent_divergence_forms():
    """verl's strings, lists, and a k1 upper with rollout_rs_threshold_lower mean the same."""
    forms = [
        dict(rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.5_2.0,3.0"),
        dict(rollout_rs=["token_k1", "seq_max_k3"], rollout_rs_threshold=[2.0, 3.0],
             rollout_rs_threshold_lower=0.5),
        dict(rollout_rs=" token_k1 , seq_max_k3 ", rollout_rs_threshold=["0.5_2.0", 3.0]),
    ]
    batch, ref = clean_batch(3, forms[0], batch=8, max_len=32)
    for kwargs in forms:
        out, _ = _run(batch, kwargs, "padded")
        assert_matches_reference(out, ref, forms[0], batch.mask)


# ---- explicit cases for the places where the contract does better than the seed ------------

def _two_rows(lr_rows, rollout=-2.0):
    lr = torch.tensor(lr_rows, dtype=torch.float32)
    roll = torch.full_like(lr, rollout) - lr.clamp(min=0)
    return roll + lr, roll, torch.ones_like(lr)


def test_k1_bounds_apply_to_rho():
    """token_k1 with [0.9, 3.0] keeps rho = 2.5 and rejects rho = 1/2.5 (verl inverts this)."""
    old, roll, mask = _two_rows([[math.log(2.5), 0.0], [-math.log(2.5), 0.0]])
    cfg = RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="0.9_3.0")
    out = compute_rollout_correction(old, roll, mask, cfg)
    assert out.response_mask.tolist() == [[1.0, 1.0], [0.0, 1.0]]


def test_k3_kl_is_clamped_and_finite():
    old, roll, mask = _two_rows([[100.0, 0.0], [0.0, 0.0]], rollout=-3.0)
    out = compute_rollout_correction(old, roll, mask, RolloutCorrectionConfig())
    expected = (math.expm1(20.0) - 20.0) / 4
    assert math.isclose(float(out.metrics["rollout_corr/k3_kl"]), expected, rel_tol=1e-5)


def test_veto_applies_without_rs_in_policy_gradient_mode():
    old, roll, mask = _two_rows([[0.01, -12.0, 0.0], [0.02, 0.0, -0.01]])
    cfg = RolloutCorrectionConfig(rollout_is="sequence", bypass_mode=True, use_policy_gradient=True,
                                  rollout_token_veto_threshold=1e-4)
    out = compute_rollout_correction(old, roll, mask, cfg)
    assert out.response_mask.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert float(out.metrics["rollout_corr/rollout_is_veto_fraction"]) == 0.5
    # the vetoed row keeps its IS weight: rejection travels in the mask only
    assert float(out.is_weights[0, 0]) == pytest.approx(math.exp(max(-11.99, -20.0)), rel=1e-4)


def test_rejected_tokens_keep_their_weights():
    old, roll, mask = _two_rows([[0.1, 2.0, -0.2]])
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=10.0,
                                  rollout_rs="token", rollout_rs_threshold=3.0)
    out = compute_rollout_correction(old, roll, mask, cfg)
    assert out.response_mask.tolist() == [[1.0, 0.0, 1.0]]
    torch.testing.assert_close(out.is_weights, torch.tensor([[math.exp(0.1), math.exp(2.0), math.exp(-0.2)]]),
                               rtol=1e-6, atol=0)
