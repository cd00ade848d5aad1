"""`plan` with trainer offload (recipe/memory.py, training/offload.py): while the engine generates,
the offloaded states leave the GPU; training holds them all as before."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlcorr.cli import main
from megatron_rlcorr.plan import plan_report
from megatron_rlcorr.recipe import load_recipe
from megatron_rlcorr.recipe.memory import GiB, estimate_memory, stage_estimates

R32 = Path(__file__).resolve().parents[2] / "recipes" / "dapo_qwen2.5_32b_rollout_corr.yaml"
ALL = ["model.offload_params=true", "model.offload_grads=true", "optim.offload_optimizer=true"]


def _stages(*overrides):
    return stage_estimates(load_recipe(R32, list(overrides)), 128, 80 * GiB)


def test_offload_takes_the_training_states_out_of_the_generation_phase():
    for base, moved in zip(_stages(), _stages(*ALL), strict=True):  # stage by stage
        states = base.weights + base.gradients + base.optimizer
        assert states > 10 * GiB and base.offloaded == 0.0
        assert base.generation_phase == states + base.rollout  # without offload the states stay beside the engine
        assert moved.offloaded == pytest.approx(states)
        assert moved.generation_phase == pytest.approx(base.generation_phase - states)
        assert moved.generation_phase == pytest.approx(moved.rollout)  # the engine's share, nothing of training
        assert moved.training_phase == base.training_phase             # training holds every state again
        assert moved.total == max(moved.training_phase, moved.generation_phase)
        assert base.total == max(base.training_phase, base.generation_phase)
    assert estimate_memory(load_recipe(R32, ALL), 128, 80 * GiB).total < \
        estimate_memory(load_recipe(R32, []), 128, 80 * GiB).total


@pytest.mark.parametrize("override, term", [("model.offload_params=true", "weights"),
                                            ("model.offload_grads=true", "gradients"),
                                            ("optim.offload_optimizer=true", "optimizer")])
def test_each_offload_setting_moves_its_own_state(override, term):
    for base, moved in zip(_stages(), _stages(override), strict=True):
        assert moved.offloaded == getattr(base, term) > 0
        assert moved.generation_phase == pytest.approx(base.generation_phase - getattr(base, term))


def test_plan_reports_the_phases_and_what_is_offloaded(capsys):
    report = plan_report(R32, ALL, nodes=16, gpus_per_node=8)
    base = plan_report(R32, [], nodes=16, gpus_per_node=8)
    memory = base["memory_gib_per_gpu"]
    states = memory["weights"] + memory["gradients"] + memory["optimizer"]
    assert report["offload"] == {"params": True, "grads": True, "optimizer": True}
    assert report["phases_gib_per_gpu"]["offloaded"] == pytest.approx(states, abs=0.02)
    assert report["phases_gib_per_gpu"]["generation"] == pytest.approx(
        base["phases_gib_per_gpu"]["generation"] - states, abs=0.02)
    assert main(["plan", str(R32), "--nodes", "16", "--gpus-per-node", "8", *ALL]) == 0
    out = capsys.readouterr().out
    assert "offloaded while generating: params, grads, optimizer" in out
    assert main(["plan", str(R32), "--nodes", "16", "--gpus-per-node", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["offload"] == {"params": False, "grads": False, "optimizer": False}
