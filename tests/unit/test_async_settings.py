"""rollout.placement / num_ranks / max_staleness (rollout/base.py RolloutConfig, recipe/recipe.py
check_rollout, train.py load_and_check): every bad combination is refused when the recipe is
loaded, by a ValueError naming the setting; the good ones give the trainer world (launch world less
the rollout ranks), the staleness (max_staleness, 1 when unset) and a data-parallel size of the
trainer ranks only, which the batch-size checks use."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rlcorr.recipe import load_recipe
from megatron_rlcorr.rollout import RolloutConfig
from megatron_rlcorr.train import load_and_check

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")
SEPARATE = ["rollout.placement=separate", "rollout.num_ranks=1"]


def refused(overrides: list[str], world: int = 3) -> str:
    with pytest.raises(ValueError) as err:
        load_and_check(TINY, overrides, world)
    return str(err.value)


@pytest.mark.parametrize("world, num_ranks", [(1, 1), (2, 2), (2, 3)])
def test_num_ranks_that_leaves_no_trainer(world, num_ranks):
    message = refused(["rollout.placement=separate", f"rollout.num_ranks={num_ranks}"], world)
    assert f"rollout.num_ranks={num_ranks}" in message and f"launch of {world} ranks" in message


def test_num_ranks_not_a_multiple_of_the_rollout_tensor_parallel_size():
    with pytest.raises(ValueError, match=r"rollout.num_ranks=3 must be a multiple of rollout.tensor_parallel_size=2"):
        RolloutConfig(engine="vllm", tensor_parallel_size=2, placement="separate", num_ranks=3)
    # through the recipe too (the placement check comes before any vLLM check)
    with pytest.raises(ValueError, match=r"rollout.num_ranks=3 must be a multiple"):
        load_recipe(TINY, ["rollout.engine=vllm", "rollout.tensor_parallel_size=2", "rollout.placement=separate",
                           "rollout.num_ranks=3"])
    assert RolloutConfig(engine="vllm", tensor_parallel_size=2, placement="separate", num_ranks=4).num_ranks == 4


@pytest.mark.parametrize("staleness", [0, -1])
def test_max_staleness_below_one(staleness):
    message = refused([*SEPARATE, f"rollout.max_staleness={staleness}"])
    assert f"rollout.max_staleness={staleness}" in message and "at least 1 step stale" in message


@pytest.mark.parametrize("setting", ["rollout.num_ranks=1", "rollout.max_staleness=2"])
def test_separate_settings_refused_when_colocated(setting):
    name = setting.split("=")[0]
    for overrides in ([setting], ["rollout.placement=colocated", setting]):
        message = refused(overrides, world=2)
        assert f"{name} is a setting of rollout.placement: separate" in message and "colocated" in message


def test_policy_lag_refused_with_separate():
    message = refused([*SEPARATE, "rollout.policy_lag=1"])
    assert "rollout.policy_lag=1" in message and "rollout.max_staleness" in message


def test_separate_needs_num_ranks():
    # unset: the message says what to set (one engine's ranks), not "got None"
    assert refused(["rollout.placement=separate"]) == (
        "rollout: rollout.placement: separate needs rollout.num_ranks, the ranks at the end of the launch that "
        "generate and never train, and it is not set: set rollout.num_ranks: 1 (one rollout engine) or more, and "
        "launch that many ranks beyond the trainer's")
    with pytest.raises(ValueError, match=r"set rollout.num_ranks: 2 \(one rollout engine\)"):
        RolloutConfig(engine="vllm", tensor_parallel_size=2, placement="separate")
    message = refused(["rollout.placement=separate", "rollout.num_ranks=0"])
    assert "rollout.num_ranks=0: rollout.placement: separate needs at least one rollout rank" in message
    assert "set rollout.num_ranks: 1 or more, or rollout.placement: colocated" in message


@pytest.mark.parametrize("setting", ["model.offload_params", "model.offload_grads", "optim.offload_optimizer"])
def test_offload_refused_with_separate(setting):
    # a message about offload only: not prefixed with the trainer ranks, whatever the launch's size
    for world in (3, 5):  # a layout that fits (dp 2), and one that does not (dp 3 of 16 prompts)
        message = refused([*SEPARATE, f"{setting}=true"], world)
        assert message.startswith(f"{setting}: true moves the trainer's states off the GPU") and "trainer ranks" \
            not in message
        assert message.endswith(f"set {setting}: false")
    load_and_check(TINY, [f"{setting}=true"], 2)  # colocated, the same offload loads


@pytest.mark.parametrize("setting, value", [("num_ranks", "1.5"), ("num_ranks", "true"), ("num_ranks", "one"),
                                            ("max_staleness", "2.0"), ("max_staleness", "false")])
def test_non_integer_values(setting, value):
    overrides = ["rollout.placement=separate", *(["rollout.num_ranks=1"] if setting != "num_ranks" else []),
                 f"rollout.{setting}={value}"]
    message = refused(overrides)
    assert f"rollout.{setting}" in message and "integer" in message


def test_unknown_placement_names_the_choices():
    message = refused(["rollout.placement=seperate", "rollout.num_ranks=1"])
    assert "placement must be one of 'colocated', 'separate'" in message and "separate" in message


def test_trainer_world_and_staleness():
    colocated = RolloutConfig()
    assert not colocated.separate and colocated.trainer_world(4) == 4 and colocated.staleness == 0
    assert RolloutConfig(policy_lag=2).staleness == 2
    separate = RolloutConfig(placement="separate", num_ranks=3)
    assert separate.separate and separate.max_staleness is None and separate.staleness == 1  # unset: 1
    assert [separate.trainer_world(w) for w in (4, 5, 8)] == [1, 2, 5]
    assert RolloutConfig(placement="separate", num_ranks=1, max_staleness=3).staleness == 3


def test_data_parallel_size_counts_the_trainer_ranks_only():
    # tiny_cpu: 16 prompts per step. Colocated on 3 ranks: dp 3 does not divide them.
    assert "data-parallel size 3" in refused([], world=3)
    recipe = load_and_check(TINY, SEPARATE, 3)  # 3 ranks, 1 generates: dp 2
    assert recipe.rollout.trainer_world(3) == 2 and recipe.parallel.data_parallel_size(2) == 2
    assert recipe.check_layout(recipe.rollout.trainer_world(3)) == 2
    # 5 ranks, 2 generate: dp 3, which the prompts per step do not split over (named as such) ...
    message = refused(["rollout.placement=separate", "rollout.num_ranks=2"], world=5)
    assert "data.prompts_per_step=16" in message and "data-parallel size 3" in message and "world 3" in message
    # ... while 6 ranks with 2 generating train on dp 4
    assert load_and_check(TINY, ["rollout.placement=separate", "rollout.num_ranks=2"], 6).check_layout(4) == 4
