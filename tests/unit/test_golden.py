"""compute_rollout_correction reproduces the seed's golden outputs (the metrics of docs/math.md).

Weights within rtol 1e-5, masks identical, every stored metric within rtol 1e-4 (`*_std` as
variances, tests/reference.py: std_close), and the API returns every metric key the seed returned.
"""
import pytest
import torch

from megatron_rlcorr.config import RolloutCorrectionConfig
from megatron_rlcorr.correction import compute_rollout_correction
from tests.reference import GOLDEN, compare_metrics, golden_cases, parse_config

CASES = golden_cases()


def _ids():
    return [f"{i}-{c['config'].get('rollout_is')}-{c['config'].get('rollout_rs')}-"
            f"{tuple(c['old_log_prob'].shape)}" for i, c in enumerate(CASES)]


@pytest.fixture(scope="module", params=range(len(CASES)), ids=_ids())
def golden(request):
    case = CASES[request.param]
    cfg = RolloutCorrectionConfig(**case["config"])
    out = compute_rollout_correction(case["old_log_prob"], case["rollout_log_prob"],
                                     case["response_mask"], cfg)
    return case, out


@pytest.mark.skipif(not CASES, reason=f"{GOLDEN} not present")
def test_weights(golden):
    case, out = golden
    if case["is_weights"] is None:
        assert out.is_weights is None
        return
    assert out.is_weights.dtype == torch.float32
    assert out.is_weights.shape == case["old_log_prob"].shape
    torch.testing.assert_close(out.is_weights, case["is_weights"], rtol=1e-5, atol=0)


@pytest.mark.skipif(not CASES, reason=f"{GOLDEN} not present")
def test_mask(golden):
    case, out = golden
    expected = case["modified_response_mask"]
    assert out.response_mask.dtype == case["response_mask"].dtype
    assert torch.equal(out.response_mask, expected), (
        f"{int((out.response_mask != expected).sum())} positions differ")


@pytest.mark.skipif(not CASES, reason=f"{GOLDEN} not present")
def test_metric_keys(golden):
    case, out = golden
    missing = sorted(set(case["metrics"]) - set(out.metrics))
    assert not missing, f"missing metrics: {missing}"
    for name, value in out.metrics.items():
        assert torch.is_tensor(value) and value.dim() == 0, name


@pytest.mark.skipif(not CASES, reason=f"{GOLDEN} not present")
def test_metric_values(golden):
    case, out = golden
    problems = compare_metrics(out.metrics, case["metrics"], parse_config(case["config"]),
                               std_as_variance=True)
    assert not problems, "\n".join(problems)
