"""The compiled correction (`correction/compiled.py`, `algorithm.correction_compile: torch`) equals
the eager call, the reference: masks exactly, weights and every metric within compiled.RTOL.

On the CPU the call is compiled with the "aot_eager" backend: Dynamo traces the plan's code and
AOTAutograd functionalises it, as with Inductor, which catches a graph that breaks or traces
wrongly cheaply; Inductor itself compiles C++ here (about two minutes of CPU time per graph on the
2-core development machine), so its comparison runs on a GPU (tests/gpu/test_correction_cuda.py).
One call per setting and layout compiles a variant in one graph; a second batch of other sizes
reuses it (dynamic shapes), and that call makes no host sync.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch._dynamo.utils import counters

from megatron_rlcorr.config import RolloutCorrectionConfig
from megatron_rlcorr.correction import compute_rollout_correction
from megatron_rlcorr.correction.compiled import (
    COMPILE_MODES, RTOL, compute_rollout_correction_compiled, correction_function)
from megatron_rlcorr.rl.settings import AlgorithmSettings
from megatron_rlcorr.settings import from_mapping
from megatron_rlcorr.training.losses import LossConfig
from megatron_rlcorr.training.step_types import StepConfig
from tests.reference import cu_seqlens_of, padded_to_packed, random_batch
from tests.unit.test_host_sync import SYNC_METHODS

BACKEND = "aot_eager"
# Dynamo's config for the compilations of the tests: its fake-tensor cache (a memo of the ops' output
# metadata while tracing; the traced graph is the same) off, as it costs more than it saves on this
# code with dynamic shapes: a trace takes about a fifth less CPU without it (2-core CPU, 2026-11-28).
TRACE_CONFIG = dict(fake_tensor_cache_enabled=False)
SETTINGS = {
    "token_is": RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0),
    "seq_is": RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_threshold_lower=0.5),
    "dapo": RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
                                    rollout_rs="geometric", rollout_rs_threshold=1.01,
                                    rollout_rs_threshold_lower=0.99, rollout_token_veto_threshold=1e-4),
}


def inputs(seed: int, rows: int, width: int, layout: str, mask_dtype: torch.dtype):
    """(old, rollout, mask, cu_seqlens): garbage at masked positions; packed with 3 trailing tokens
    of no sequence whose mask says 1."""
    b = random_batch(seed, batch=rows, max_len=width, mask_dtype=mask_dtype)
    if layout == "padded":
        return b.old, b.rollout, b.mask, None
    fills = (0.0, 0.0, 1.0)
    packed = [padded_to_packed(x, b.lengths, trailing=3, fill=f) for x, f in zip((b.old, b.rollout, b.mask), fills)]
    return (*packed, cu_seqlens_of(b.lengths))


def assert_equal_to_eager(got, want) -> None:
    assert got.response_mask.dtype == want.response_mask.dtype
    assert torch.equal(got.response_mask, want.response_mask)
    if want.is_weights is None:
        assert got.is_weights is None
    else:
        torch.testing.assert_close(got.is_weights, want.is_weights, rtol=RTOL, atol=1e-7)
    assert got.metrics.keys() == want.metrics.keys()
    for key, value in want.metrics.items():
        torch.testing.assert_close(got.metrics[key], value, rtol=RTOL, atol=1e-7, msg=key)


@contextlib.contextmanager
def count_sync_methods():
    """Calls of the tensor methods that synchronise a GPU (`.item()`, `.tolist()`, ...; the ones
    tests/unit/test_host_sync.py counts). Not its torch functions: Dynamo guards on the functions a
    graph calls (torch.where), so replacing them would recompile the graph under test; an op with a
    data-dependent shape would break the graph, which the test rules out."""
    counts: Counter[str] = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}
    own = {name for name in SYNC_METHODS if name in torch.Tensor.__dict__}

    def counting(name, original):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)
        return wrapper

    try:
        for name, original in saved.items():
            setattr(torch.Tensor, name, counting(name, original))
        yield counts
    finally:
        for name, original in saved.items():
            if name in own:
                setattr(torch.Tensor, name, original)
            else:
                delattr(torch.Tensor, name)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_compiled_equals_eager(name, layout):
    """One graph (no break) per setting and layout; a batch of other sizes reuses it (no recompile)
    and, with check_inputs=False, makes no host sync (Dynamo's guards included)."""
    torch._dynamo.reset()  # the variants other tests compiled do not count against the recompile limit
    cfg = SETTINGS[name]
    mask_dtype = torch.bool if (name, layout) == ("dapo", "packed") else torch.float32
    first = inputs(7, 8, 40, layout, mask_dtype)
    second = inputs(8, 11, 29, layout, mask_dtype)
    # past Dynamo's recompile limit the call would run eagerly: fail instead of comparing eager with eager
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, **TRACE_CONFIG):
        breaks = sum(counters["graph_break"].values())
        got = compute_rollout_correction_compiled(*first[:3], cfg, first[3], backend=BACKEND)
        assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    assert_equal_to_eager(got, compute_rollout_correction(*first[:3], cfg, first[3]))
    with torch.compiler.set_stance("fail_on_recompile"):
        got = compute_rollout_correction_compiled(*second[:3], cfg, second[3], backend=BACKEND)
        assert_equal_to_eager(got, compute_rollout_correction(*second[:3], cfg, second[3]))
        with count_sync_methods() as syncs:
            compute_rollout_correction_compiled(*second[:3], cfg, second[3], check_inputs=False, backend=BACKEND)
    assert sum(syncs.values()) == 0, f"host syncs: {dict(syncs)}"


def test_correction_function_selects_the_call():
    assert correction_function("eager") is compute_rollout_correction
    assert correction_function("torch") is compute_rollout_correction_compiled
    with pytest.raises(ValueError, match="correction_compile must be one of 'eager', 'torch', got 'inductor'"):
        correction_function("inductor")


def test_step_config_validates_the_setting():
    cfg = RolloutCorrectionConfig()
    assert StepConfig(loss=LossConfig(), correction=cfg, micro_batch_size=1).correction_compile == "eager"
    assert StepConfig(loss=LossConfig(), correction=cfg, micro_batch_size=1, correction_compile="torch")
    with pytest.raises(ValueError, match=r"correction_compile must be one of 'eager', 'torch', got 'torc'.*"
                                         r"did you mean \"torch\""):
        StepConfig(loss=LossConfig(), correction=cfg, micro_batch_size=1, correction_compile="torc")
    assert COMPILE_MODES == ("eager", "torch")


def test_recipe_key_is_checked_when_the_recipe_loads():
    assert from_mapping(AlgorithmSettings, {}, "algorithm").correction_compile == "eager"
    assert from_mapping(AlgorithmSettings, {"correction_compile": "torch"}, "algorithm").correction_compile == "torch"
    with pytest.raises(ValueError, match="algorithm.correction_compile must be one of 'eager', 'torch', got 'yes'"):
        from_mapping(AlgorithmSettings, {"correction_compile": "yes"}, "algorithm")


@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_step_correction_runs_the_selected_call(mode, monkeypatch):
    """training/step.py calls the correction the setting selects (the compiled call replaced by a
    recorder here: the compilation itself is tested above)."""
    from megatron_rlcorr.correction import compiled
    from megatron_rlcorr.training.step import StepBatch, step_correction

    calls = []

    def recorder(*args, **kwargs):
        calls.append(mode)
        return compute_rollout_correction(*args, **kwargs)

    monkeypatch.setattr(compiled, "compute_rollout_correction_compiled", recorder)
    old, rollout, mask, _ = inputs(7, 4, 16, "padded", torch.float32)
    batch = StepBatch(tokens_BT=torch.zeros(4, 16, dtype=torch.long), targets_BT=torch.zeros(4, 16, dtype=torch.long),
                      response_mask_BT=mask, rollout_log_probs_BT=rollout, advantages_BT=torch.zeros(4, 16))
    groups = type("Groups", (), {"dp": None, "dp_size": 1})()
    got, metrics = step_correction(old, batch, SETTINGS["dapo"], groups, correction_compile=mode)
    want = compute_rollout_correction(old, rollout, mask, SETTINGS["dapo"])
    assert calls == ([mode] if mode == "torch" else [])
    assert torch.equal(got.mask_BT, want.response_mask) and metrics.keys() == want.metrics.keys()
