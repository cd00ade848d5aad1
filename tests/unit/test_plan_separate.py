"""`plan` with rollout.placement separate (plan.py, recipe/memory.py, recipe/layout_search.py): the
layout is checked and searched over the trainer ranks (the launch less rollout.num_ranks), a
trainer rank's memory holds no engine, and a rollout rank holds the engine alone, as much as the
colocated engine's share, one weight set whatever rollout.max_staleness."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlcorr.cli import main
from megatron_rlcorr.plan import plan_report
from megatron_rlcorr.recipe import load_recipe
from megatron_rlcorr.recipe.layout_search import search_layouts
from megatron_rlcorr.recipe.memory import GiB, rollout_rank_bytes, stage_estimates

ROOT = Path(__file__).resolve().parents[2]
R7 = ROOT / "recipes" / "dapo_qwen2.5_7b_rollout_corr.yaml"  # vLLM, rollout tensor_parallel_size 2
TINY = ROOT / "recipes" / "tiny_cpu.yaml"                    # the embedded engine, bf16
SEPARATE = ["rollout.placement=separate", "rollout.num_ranks=8"]  # on 2 x 8 GPUs: 8 train (pp 4, dp 2)
SHARE = 0.55 * 80 * GiB  # the recipe's gpu_memory_utilization of an 80 GiB GPU


def test_trainer_memory_holds_no_engine():
    # 16 launched, 8 generate: the trainer ranks' estimate is the colocated one of 8 ranks without the engine.
    separate = stage_estimates(load_recipe(R7, SEPARATE), 8, 80 * GiB)
    colocated = stage_estimates(load_recipe(R7, []), 8, 80 * GiB)
    for apart, together in zip(separate, colocated, strict=True):
        assert together.rollout == pytest.approx(SHARE)
        assert (apart.rollout, apart.rollout_resident) == (0.0, 0.0)
        for term in ("weights", "gradients", "optimizer", "activations", "logits"):
            assert getattr(apart, term) == getattr(together, term)
        assert apart.total == apart.training_phase == together.training_phase  # sleep_level 2: nothing resident
        assert apart.total < together.total


@pytest.mark.parametrize("recipe, overrides", [(R7, ["rollout.num_ranks=2"]), (R7, ["rollout.max_staleness=3"]),
                                               (TINY, ["rollout.num_ranks=1"]), (TINY, ["rollout.max_staleness=3"])])
def test_a_rollout_rank_holds_the_colocated_engine_share(recipe, overrides):
    separate = load_recipe(recipe, ["rollout.placement=separate", "rollout.num_ranks=4", *overrides])
    colocated = load_recipe(recipe, [])
    engine = rollout_rank_bytes(separate, 80 * GiB)
    assert engine == stage_estimates(colocated, 8, 80 * GiB)[0].rollout  # max_staleness adds no weight copy
    if recipe == TINY:
        assert engine == separate.model.decoder_shape.parameter_count * 2  # one bf16 copy
    else:
        assert engine == pytest.approx(SHARE)


def test_plan_report_names_trainer_and_rollout_ranks():
    report = plan_report(R7, SEPARATE, nodes=2, gpus_per_node=8)
    assert (report["world_size"], report["placement"], report["trainer_ranks"]) == (16, "separate", 8)
    assert report["layout"]["dp"] == 2  # 8 trainer ranks / pp 4
    assert report["rollout_ranks"] == {"count": 8, "ranks": [8, 15], "engines": 4, "max_staleness": 1,
                                       "engine_gib_per_gpu": 44.0, "fits": True}
    assert report["memory_gib_per_gpu"]["rollout"] == 0.0 and report["fits"]
    assert "NNODES=2 GPUS_PER_NODE=8" in report["command"]  # the launch is the whole world
    colocated = plan_report(R7, [], nodes=1, gpus_per_node=8)
    assert (colocated["placement"], colocated["trainer_ranks"], colocated["rollout_ranks"]) == ("colocated", 8, None)


def test_fits_needs_the_rollout_rank_to_fit_too():
    # The trainer side of tiny_cpu fits anywhere; vLLM at 0.95 of the GPU leaves less than the headroom.
    report = plan_report(TINY, ["rollout.placement=separate", "rollout.num_ranks=1"], nodes=1, gpus_per_node=3,
                         gpu_memory_gib=1.0)
    assert report["rollout_ranks"]["fits"] and report["fits"]
    assert report["rollout_ranks"]["engine_gib_per_gpu"] == pytest.approx(
        load_recipe(TINY).model.decoder_shape.parameter_count * 2 / GiB, abs=0.005)
    report = plan_report(R7, [*SEPARATE, "rollout.gpu_memory_utilization=0.95"], nodes=2, gpus_per_node=8)
    assert report["memory_gib_per_gpu"]["total"] <= report["usable_gib"]
    assert report["trainer_fits"] and not report["rollout_ranks"]["fits"] and not report["fits"]
    assert report["command"] is None and report["torchrun"] is None  # no launch for a layout that does not fit


def test_printed_plan(capsys):
    assert main(["plan", str(R7), "--nodes", "2", "--gpus-per-node", "8", *SEPARATE, "rollout.max_staleness=2"]) == 0
    out = capsys.readouterr().out
    assert ("ranks: 16 = 8 trainer ranks (0..7) + 8 rollout ranks (8..15: 4 engine(s) of tensor_parallel_size 2); "
            "rollout.placement: separate, the trainer trains on batches at most 2 step(s) stale") in out
    assert "memory per trainer GPU (GiB, estimate)" in out and "a trainer rank holds no engine" in out
    assert "memory per rollout GPU (GiB, estimate): 44.00, vLLM's gpu_memory_utilization share" in out
    assert "phases:" not in out  # no generation phase on a trainer rank
    assert main(["plan", str(R7), "--nodes", "2", "--gpus-per-node", "8", "--json", *SEPARATE]) == 0
    assert json.loads(capsys.readouterr().out)["trainer_ranks"] == 8


@pytest.mark.parametrize("overrides, message", [
    (["rollout.num_ranks=2"], "the trainer ranks are 6 (8 launched less rollout.num_ranks=2, rollout.placement: "
                              "separate): parallel: world size 6 is not divisible"),
    (["rollout.num_ranks=8"], "rollout.num_ranks=8 leaves no trainer in a launch of 8 ranks"),
])
def test_layout_checked_over_the_trainer_ranks(capsys, overrides, message):
    assert main(["plan", str(R7), "--nodes", "1", "--gpus-per-node", "8", "rollout.placement=separate",
                 *overrides]) == 2
    assert message in capsys.readouterr().err
    # the same layout on the 8 trainer ranks of a colocated launch is fine (pp 4 divides 8)
    assert plan_report(R7, [], nodes=1, gpus_per_node=8)["layout"]["dp"] == 2


def test_search_over_the_trainer_ranks():
    found = search_layouts(R7, SEPARATE, nodes=2, gpus_per_node=8, gpu_memory_gib=80)
    assert found
    for c in found:
        assert c.tp * c.pp * c.cp * c.dp == 8 and c.memory.rollout == 0.0  # layouts of the 8 trainer ranks
    assert search_layouts(R7, [*SEPARATE, "rollout.gpu_memory_utilization=0.95"], nodes=2, gpus_per_node=8,
                          gpu_memory_gib=80) == []  # the rollout ranks' engine does not fit
