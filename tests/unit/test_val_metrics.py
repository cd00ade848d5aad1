"""Validation metrics (rl/val_metrics.py): verl's process_validation_metrics names and meanings,
checked on cases small enough to compute by hand, and the unbiased pass@k estimator."""
import math
from collections import Counter
from itertools import combinations

import pytest
import torch

from megatron_rlcorr.rl.val_metrics import (pass_at_k, pass_at_k_metrics, process_validation_metrics, prompt_metrics,
                                            subset_sizes, validation_metrics)


def test_subset_sizes_are_powers_of_two_below_n_then_n():
    assert subset_sizes(1) == []
    assert subset_sizes(2) == [2]
    assert subset_sizes(3) == [2, 3]
    assert subset_sizes(8) == [2, 4, 8]
    assert subset_sizes(12) == [2, 4, 8, 12]


@pytest.mark.parametrize("n,c,k", [(4, 2, 2), (5, 1, 3), (6, 0, 2), (6, 6, 1), (7, 3, 1), (8, 2, 8), (10, 3, 4)])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_right_sample(n, c, k):
    """1 - C(n-c, k)/C(n, k) equals, by enumeration, the share of the k-subsets of n samples (c of
    them right) that contain at least one right sample."""
    right = set(range(c))
    subsets = list(combinations(range(n), k))
    enumerated = sum(bool(right & set(s)) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(enumerated, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)  # 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(5, 1, 3) == pytest.approx(0.6)    # 1 - C(4,3)/C(5,3) = 1 - 4/10
    assert pass_at_k(7, 3, 1) == pytest.approx(3 / 7)  # pass@1: the share of right samples
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(4, 5, 2)


def test_mean_and_population_std():
    metrics = prompt_metrics([1.0, 0.0, 1.0, 0.0])
    assert metrics["mean@4"] == 0.5 and metrics["std@4"] == 0.5  # np.std (ddof 0), as verl
    assert prompt_metrics([0.25]) == {"mean@1": 0.25}  # one sample: no std, no bootstrap


def test_bootstrap_names_bounds_and_determinism():
    values = [1.0, -1.0, -1.0, 1.0, -1.0, -1.0, -1.0, 0.5]
    preds = ["7", "3", "3", "7", "4", "3", "5", "7"]
    metrics = prompt_metrics(values, preds)
    for k in (2, 4, 8):
        for stat in ("best", "worst", "maj"):
            assert {f"{stat}@{k}/mean", f"{stat}@{k}/std"} <= metrics.keys()
        assert min(values) <= metrics[f"worst@{k}/mean"] <= metrics[f"maj@{k}/mean"] <= metrics[f"best@{k}/mean"] \
            <= max(values)
    assert metrics["best@8/mean"] > metrics["mean@8"] > metrics["worst@8/mean"]
    assert metrics["best@2/mean"] < metrics["best@4/mean"] < metrics["best@8/mean"]  # more tries, better best
    assert metrics == prompt_metrics(values, preds)  # seeded
    assert metrics != prompt_metrics(values, preds, seed=7)
    assert "maj@2/mean" not in prompt_metrics(values)  # maj needs the reward's pred


def test_equal_samples_give_that_value_everywhere():
    metrics = prompt_metrics([0.3] * 5, ["a", "b", "a", "c", "b"])
    for name, value in metrics.items():
        assert value == pytest.approx(0.0 if "std" in name else 0.3, abs=1e-12), name


def test_maj_is_the_first_value_of_the_majority_answer_in_each_draw():
    """maj@k against a plain re-implementation of verl's calc_maj_val on the same bootstrap draws:
    the most frequent pred (ties: the one that appears first) and the value of its first sample."""
    values = [0.9, 0.1, 0.8, 0.2, 0.7, 0.3]
    preds = ["A", "B", "A", "B", "C", "A"]
    seed, draws = 3, 200
    metrics = prompt_metrics(values, preds, seed=seed, n_bootstrap=draws)
    for k in subset_sizes(len(values)):
        idx = torch.randint(0, len(values), (draws, k), generator=torch.Generator().manual_seed(seed)).tolist()
        expected = []
        for row in idx:
            counts = Counter(preds[i] for i in row)  # insertion order = first appearance
            top = max(counts, key=counts.get)
            expected.append(next(values[i] for i in row if preds[i] == top))
        expected = torch.tensor(expected, dtype=torch.float64)
        assert metrics[f"maj@{k}/mean"] == pytest.approx(float(expected.mean()), abs=1e-12)
        assert metrics[f"maj@{k}/std"] == pytest.approx(float(expected.std(correction=0)), abs=1e-12)


def test_metrics_average_over_the_prompts_of_each_data_source():
    sources = ["a", "a", "a", "a", "b", "b"]
    prompts = [0, 0, 1, 1, 2, 2]
    infos = {"reward": [1.0, 1.0, 0.0, 0.0, 1.0, 0.0], "pred": ["x", "x", "y", "y", "x", "z"]}
    nested = process_validation_metrics(sources, prompts, infos)
    assert set(nested) == {"a", "b"} and set(nested["a"]) == {"reward"}  # pred: a string, no metrics of its own
    a = nested["a"]["reward"]
    assert a["mean@2"] == 0.5 and a["std@2"] == 0.0
    # each prompt's samples are equal: best = worst = maj = that value, averaged over the 2 prompts
    assert a["best@2/mean"] == a["worst@2/mean"] == a["maj@2/mean"] == 0.5
    b = nested["b"]["reward"]
    assert b["mean@2"] == 0.5 and b["std@2"] == 0.5
    assert b["worst@2/mean"] < 0.5 < b["best@2/mean"]


def test_a_prompts_metrics_do_not_depend_on_the_sample_order_of_other_prompts():
    sources = ["s"] * 8
    prompts = [0, 0, 0, 0, 1, 1, 1, 1]
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    order = [4, 5, 6, 7, 0, 1, 2, 3]  # the other prompt first (another layout's gather order)
    first = validation_metrics(sources, prompts, {"reward": rewards}, [r >= 1 for r in rewards])
    second = validation_metrics([sources[i] for i in order], [prompts[i] for i in order],
                                {"reward": [rewards[i] for i in order]}, [rewards[i] >= 1 for i in order])
    assert first == second


def test_names_core_and_aux_sections_as_verl():
    """With the reward's acc, acc is the core variable: its mean@N, best@N/* and maj@N/* are
    val-core, the rest (std, worst, smaller k, other variables) val-aux; pass@N is core."""
    sources = ["math"] * 4
    prompts = [0, 0, 0, 0]
    infos = {"reward": [1.0, -1.0, 1.0, -1.0], "score": [1.0, -1.0, 1.0, -1.0], "acc": [True, False, True, False],
             "pred": ["2", "3", "2", "4"]}
    flat = validation_metrics(sources, prompts, infos, [True, False, True, False])
    core = {name for name in flat if name.startswith("val-core/")}
    assert core == {"val-core/math/acc/mean@4", "val-core/math/acc/best@4/mean", "val-core/math/acc/best@4/std",
                    "val-core/math/acc/maj@4/mean", "val-core/math/acc/maj@4/std", "val-core/math/acc/pass@4"}
    assert flat["val-core/math/acc/mean@4"] == 0.5 and flat["val-aux/math/reward/mean@4"] == 0.0
    assert flat["val-aux/math/acc/std@4"] == 0.5
    assert {"val-aux/math/acc/worst@4/mean", "val-aux/math/acc/best@2/mean", "val-aux/math/score/maj@4/mean",
            "val-aux/math/acc/pass@1", "val-aux/math/acc/pass@2"} <= flat.keys()
    assert flat["val-aux/math/acc/pass@1"] == 0.5
    assert flat["val-aux/math/acc/pass@2"] == pytest.approx(5 / 6)
    assert flat["val-core/math/acc/pass@4"] == 1.0
    assert not any("/pred/" in name for name in flat)


def test_without_acc_the_reward_is_core_and_pass_counts_full_marks():
    flat = validation_metrics(["d", "d"], [0, 1], {"reward": [1.0, -1.0]}, [True, False])
    assert flat == {"val-core/d/reward/mean@1": 0.0, "val-core/d/acc/pass@1": 0.5}


def test_pass_at_k_metrics_per_source():
    got = pass_at_k_metrics(["a"] * 4 + ["b"] * 4, [0, 0, 0, 0, 1, 1, 1, 1],
                            [True, False, False, False, True, True, False, False])
    assert got["a"] == pytest.approx({1: 0.25, 2: 0.5, 4: 1.0})
    assert got["b"] == pytest.approx({1: 0.5, 2: 5 / 6, 4: 1.0})
