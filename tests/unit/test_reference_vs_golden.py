"""The test reference (tests/reference.py) reproduces the seed's golden outputs.

If this fails, the reference -- not the implementation -- misreads the contract (docs/math.md).
"""
import pytest
import torch

from tests.reference import GOLDEN, compare_metrics, golden_cases, parse_config, reference_correction

CASES = golden_cases()


@pytest.mark.skipif(not CASES, reason=f"{GOLDEN} not present")
@pytest.mark.parametrize("index", range(len(CASES)))
def test_reference_reproduces_golden(index):
    case = CASES[index]
    ref = reference_correction(case["old_log_prob"], case["rollout_log_prob"],
                               case["response_mask"], case["config"])
    if case["is_weights"] is None:
        assert ref.is_weights is None
    else:
        torch.testing.assert_close(ref.is_weights, case["is_weights"].double(), rtol=1e-5, atol=0)
    assert torch.equal(ref.keep.float(), case["modified_response_mask"])
    assert set(ref.metrics) == set(case["metrics"])
    problems = compare_metrics(case["metrics"], ref.metrics, parse_config(case["config"]),
                               std_as_variance=True)
    assert not problems, "\n".join(problems)
