"""The call's host-sync contract (docs/api.md): no device-to-host synchronisation with
check_inputs=False, at most one with the default check_inputs=True.

On CPU a sync cannot be observed directly, so the test counts the calls that cause one on a GPU:
`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool/float/int(tensor)`, `tensor.__index__`, and
the ops whose output shape depends on data (`nonzero`, boolean-mask indexing, `masked_select`,
`unique`, `repeat_interleave` without `output_size`). Host-to-device copies of Python numbers
cannot be told apart from legitimate tensor creation on CPU and are not checked here.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

from megatron_rlcorr.config import RolloutCorrectionConfig
from megatron_rlcorr.correction import compute_rollout_correction
from tests.reference import cu_seqlens_of, padded_to_packed, random_batch

SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
DYNAMIC_SHAPE_METHODS = ("nonzero", "masked_select", "unique", "unique_consecutive", "argwhere")
DYNAMIC_SHAPE_FUNCTIONS = ("nonzero", "masked_select", "unique", "unique_consecutive", "argwhere", "where")


def _is_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in items)


@contextlib.contextmanager
def count_syncs():
    """Count calls that synchronise a GPU stream with the host; restores torch afterwards."""
    counts: Counter[str] = Counter()
    method_names = SYNC_METHODS + DYNAMIC_SHAPE_METHODS + ("__getitem__", "repeat_interleave")
    saved_methods = {name: getattr(torch.Tensor, name) for name in method_names}
    own_methods = {name: torch.Tensor.__dict__[name] for name in method_names if name in torch.Tensor.__dict__}
    saved_functions = {name: getattr(torch, name) for name in DYNAMIC_SHAPE_FUNCTIONS + ("repeat_interleave",)}

    def counting(name, original):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)
        return wrapper

    def getitem(self, index):
        if _is_bool_index(index):
            counts["__getitem__[bool]"] += 1
        return saved_methods["__getitem__"](self, index)

    def repeat_interleave_method(self, repeats, *args, **kwargs):
        if torch.is_tensor(repeats) and kwargs.get("output_size") is None:
            counts["repeat_interleave"] += 1
        return saved_methods["repeat_interleave"](self, repeats, *args, **kwargs)

    def repeat_interleave_function(input, repeats=None, *args, **kwargs):
        if (torch.is_tensor(repeats) or repeats is None) and kwargs.get("output_size") is None:
            counts["repeat_interleave"] += 1
        return saved_functions["repeat_interleave"](input, repeats, *args, **kwargs)

    def where(condition, *args, **kwargs):
        if not args and not kwargs:   # one-argument form == nonzero
            counts["where(cond)"] += 1
        return saved_functions["where"](condition, *args, **kwargs)

    try:
        for name in SYNC_METHODS + DYNAMIC_SHAPE_METHODS:
            setattr(torch.Tensor, name, counting(name, saved_methods[name]))
        torch.Tensor.__getitem__ = getitem
        torch.Tensor.repeat_interleave = repeat_interleave_method
        for name in DYNAMIC_SHAPE_FUNCTIONS:
            if name != "where":
                setattr(torch, name, counting(f"torch.{name}", saved_functions[name]))
        torch.where = where
        torch.repeat_interleave = repeat_interleave_function
        yield counts
    finally:
        for name in method_names:   # put back what torch.Tensor itself defined, drop the rest
            if name in own_methods:
                setattr(torch.Tensor, name, own_methods[name])
            else:
                delattr(torch.Tensor, name)
        for name, original in saved_functions.items():
            setattr(torch, name, original)


CONFIGS = {
    "disabled": {},
    "token_is": dict(rollout_is="token", rollout_is_threshold=2.0),
    "token_is_clip_bn": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_threshold_lower=0.5,
                             rollout_is_batch_normalize=True),
    "seq_is_bn": dict(rollout_is="sequence", rollout_is_batch_normalize=True),
    "token_rs": dict(rollout_rs="token", rollout_rs_threshold=2.0),
    "seq_rs": dict(rollout_rs="sequence", rollout_rs_threshold=3.0, rollout_rs_threshold_lower=0.1),
    "geo_rs_veto": dict(rollout_rs="geometric", rollout_rs_threshold=1.01, rollout_token_veto_threshold=1e-4),
    "veto_only": dict(rollout_token_veto_threshold=1e-4, bypass_mode=True, use_policy_gradient=True),
    "token_divergence": dict(rollout_rs="token_k1,token_k2,token_k3", rollout_rs_threshold="0.5_2.0,0.1,0.2"),
    "seq_divergence": dict(rollout_rs="seq_sum_k1,seq_mean_k2,seq_max_k3,seq_sum_k3,seq_mean_k1,seq_max_k2",
                           rollout_rs_threshold="0.2_5.0,0.1,1.0,2.0,0.8_1.25,2.0"),
    "dapo": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
                 rollout_rs="geometric", rollout_rs_threshold=1.01, rollout_rs_threshold_lower=0.99,
                 rollout_token_veto_threshold=1e-4),
}


def _call(kwargs, layout, check_inputs):
    batch = random_batch(3, batch=6, max_len=24, mask_dtype=torch.bool if layout == "padded" else torch.float32)
    cfg = RolloutCorrectionConfig(**kwargs)
    if layout == "padded":
        args = (batch.old, batch.rollout, batch.mask)
        cu = None
    else:
        args = tuple(padded_to_packed(x, batch.lengths, trailing=3)
                     for x in (batch.old, batch.rollout, batch.mask))
        cu = cu_seqlens_of(batch.lengths)
    with count_syncs() as counts:
        out = compute_rollout_correction(*args, cfg, cu_seqlens=cu, check_inputs=check_inputs)
    return out, counts


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_sync_without_checks(name, layout):
    out, counts = _call(CONFIGS[name], layout, check_inputs=False)
    assert sum(counts.values()) == 0, f"host syncs: {dict(counts)}"
    assert all(torch.is_tensor(v) for v in out.metrics.values())


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", ["disabled", "dapo", "seq_divergence", "token_is_clip_bn"])
def test_at_most_one_sync_with_checks(name, layout):
    _, counts = _call(CONFIGS[name], layout, check_inputs=True)
    assert sum(counts.values()) <= 1, f"host syncs: {dict(counts)}"


def test_counter_sees_syncs_and_restores_torch():
    x = torch.tensor([1.0, 2.0])
    with count_syncs() as counts:
        x.sum().item()
        bool(x.any())
        x[x > 1]
        torch.nonzero(x)
    assert counts["item"] == 1 and counts["__bool__"] == 1
    assert counts["__getitem__[bool]"] == 1 and counts["torch.nonzero"] == 1
    assert torch.Tensor.item is torch._C.TensorBase.item
    assert torch.Tensor.__getitem__ is torch._C.TensorBase.__getitem__
    assert torch.nonzero.__module__ != __name__
    with count_syncs() as counts:
        pass
    x.sum().item()
    assert sum(counts.values()) == 0
