"""`megatron-rlcorr plan`: the parameter and memory formulas against hand-computed cases, the
cluster recipes on their clusters, broken layouts refused with the fix, the JSON and the search.
(tests/distributed/test_memory_model.py compares the formulas with a CPU model's allocations.)"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from megatron_rlcorr.cli import main
from megatron_rlcorr.plan import plan_report
from megatron_rlcorr.recipe import load_recipe
from megatron_rlcorr.recipe.memory import GiB, estimate_memory, in_flight_micro_batches, parameter_counts
from megatron_rlcorr.rollout import RolloutConfig

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_cpu.yaml"
R32 = ROOT / "recipes" / "dapo_qwen2.5_32b_rollout_corr.yaml"
R7 = ROOT / "recipes" / "dapo_qwen2.5_7b_rollout_corr.yaml"
CLUSTER_RECIPES = [(R32, 16), (R7, 1), (ROOT / "recipes" / "dapo_qwen2.5_32b_rollout_corr_fp8.yaml", 16),
                   (ROOT / "recipes" / "dapo_qwen2.5_7b_rollout_corr_fp8.yaml", 1),
                   (ROOT / "recipes" / "dapo_qwen3_30b_a3b_rollout_corr.yaml", 1)]

# A small model whose numbers are easy to follow by hand: h 64, 4 heads of 16, 2 K/V groups, ffn 128,
# 4 layers, a 1000-token vocabulary padded to 1024 (a multiple of 128 x tp 2), bf16, TP 2 + SP, PP 2.
HAND = ["model.vocab_size=1000", "model.hidden_size=64", "model.num_layers=4", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.ffn_hidden_size=128", "model.make_vocab_size_divisible_by=128",
        "model.bf16=true", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
        "trainer.max_tokens_per_micro_batch=512", "data.max_prompt_length=16"]


def _hand_recipe(*extra):
    return load_recipe(TINY, [*HAND, *extra])


def test_parameters_per_stage_by_hand():
    counts = parameter_counts(_hand_recipe().model, _hand_recipe().parallel)
    norms = 2 * 64                                          # replicated over TP
    matrices = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128  # q,k,v; o; gate, up, down = 36,864
    per_layer = norms + matrices // 2                       # 18,560 on each TP rank
    embedding = 1024 * 64 // 2                              # padded vocabulary, its TP half
    assert counts.padded_vocab_size == 1024
    assert counts.per_stage == (2 * per_layer + embedding, 2 * per_layer + 64 + embedding)  # + final norm + head
    assert counts.per_gpu_max == 69_952
    assert counts.total == 1000 * 64 * 2 + 4 * (norms + matrices) + 64 == 276_032


def test_qwen2_5_32b_on_tp8_pp2_by_hand():
    recipe = load_recipe(R32)
    counts = parameter_counts(recipe.model, recipe.parallel)
    h, f, kv = 5120, 27648, 1024
    layer_matrices = h * (h + 2 * kv) + (h + 2 * kv) + h * h + 3 * h * f   # with the q/k/v bias: 487,595,008
    per_layer = 2 * h + layer_matrices // 8
    head = 152_576 * h // 8                                               # 152,064 padded to a multiple of 1024
    assert counts.per_stage == (32 * per_layer + head, 32 * per_layer + h + head)
    assert counts.total == 32_763_876_352


def test_memory_terms_by_hand():
    recipe = _hand_recipe()
    memory = estimate_memory(recipe, 8, 80 * GiB)          # 1 x 8: dp 2, the distributed optimizer shards over 2
    last = 69_952
    assert memory.weights == last * 2 and memory.gradients == last * 4 and memory.optimizer == last * 12 / 2
    # per token per layer: norm inputs and outputs 8h / 2 (SP) + q,k,v and attention output (4*64 + 4*32) / 2
    # + the MLP 6*128 / 2 = 832 bytes; 2 layers; 512 tokens; the last stage holds 1 micro-batch (1F1B).
    assert memory.activations == 512 * 2 * 832
    # bf16 logits and their bf16 gradient (2 + 2 bytes) + two float32 chunks of 1/16 of the tokens (0.5)
    assert memory.logits == 4.5 * 512 * 1024 / 2
    fp32_head = estimate_memory(_hand_recipe("model.fp32_lm_head=true"), 8, 80 * GiB)
    # float32 logits and gradient (4 + 4) + chunks (0.5), + the output weight's float32 copy and its gradient
    assert fp32_head.logits == 8.5 * 512 * 1024 / 2 + 8 * (1024 / 2) * 64
    assert memory.rollout == memory.rollout_resident == 276_032 * 2   # the embedded engine's bf16 copy
    assert memory.total == last * 12 + 512 * 2 * 832 + 4.5 * 512 * 512 + 276_032 * 2
    lagged = estimate_memory(_hand_recipe("rollout.policy_lag=2"), 8, 80 * GiB)  # 3 weight sets
    assert lagged.rollout == lagged.rollout_resident == 3 * 276_032 * 2
    assert lagged.total == memory.total + 2 * 276_032 * 2
    # The first stage holds pp micro-batches under 1F1B, more when interleaved (x 1 + (pp-1)/(pp*vpp)).
    assert in_flight_micro_batches(_hand_recipe().parallel) == 2
    assert in_flight_micro_batches(load_recipe(TINY, [*HAND, "parallel.pp=4", "parallel.vpp=2"]).parallel) == 5.5


def test_recompute_and_vllm_terms_by_hand():
    full = estimate_memory(_hand_recipe("model.recompute={granularity: full, num_layers: 1}"), 8, 80 * GiB)
    assert full.activations == 512 * (2 * 2 * 64 / 2 + 832)           # 2 layer inputs (2h / SP) + one live layer
    selective = estimate_memory(_hand_recipe("model.recompute={granularity: selective, modules: [mlp]}"), 8, 80 * GiB)
    assert selective.activations == 512 * 2 * (832 - 6 * 128 / 2)
    def with_vllm(**settings):
        return dataclasses.replace(_hand_recipe(), rollout=RolloutConfig(engine="vllm", gpu_memory_utilization=0.5,
                                                                         **settings))

    asleep = estimate_memory(with_vllm(), 8, 80 * GiB)
    assert asleep.rollout == 40 * GiB and asleep.rollout_resident == 0
    assert asleep.total == 69_952 * 12 + 40 * GiB                       # generation is the larger phase
    awake = estimate_memory(with_vllm(sleep_level=0), 8, 80 * GiB)
    assert awake.total == 69_952 * 12 + 512 * 2 * 832 + 4.5 * 512 * 512 + 40 * GiB


@pytest.mark.parametrize("recipe, nodes", CLUSTER_RECIPES, ids=lambda v: getattr(v, "stem", v))
def test_cluster_recipes_validate_and_fit(recipe, nodes):
    report = plan_report(recipe, [], nodes=nodes, gpus_per_node=8, gpu_memory_gib=80)
    assert report["fits"], report["memory_gib_per_gpu"]
    assert 0 < report["memory_gib_per_gpu"]["total"] <= 80
    memory = report["memory_gib_per_gpu"]
    assert memory["activations"] > 0 and memory["logits"] > 0 and memory["optimizer"] > 0


def test_plan_reports_qwen2_5_32b_exactly(capsys):
    assert main(["plan", str(R32), "--nodes", "16", "--gpus-per-node", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["params_total"] == 32_763_876_352
    assert set(report["memory_gib_per_gpu"]) == {"weights", "gradients", "optimizer", "activations", "logits",
                                                 "rollout", "total"}
    assert report["world_size"] == 128 and report["layout"]["dp"] == 8
    assert report["command"].startswith("NNODES=16 GPUS_PER_NODE=8 NODE_RANK=<0..15>")
    assert report["command"].endswith(f"bash tools/launch.sh {R32}")
    assert report["torchrun"] == ("python -m torch.distributed.run --nnodes=16 --node-rank=$NODE_RANK "
                                  "--nproc-per-node=8 --master-addr=$MASTER_ADDR --master-port=29500 "
                                  f"-m megatron_rlcorr.train --config {R32}")
    assert main(["plan", str(R32), "--nodes", "16", "--gpus-per-node", "8"]) == 0
    text = capsys.readouterr().out
    assert "32,763,876,352 in total" in text and "fits" in text and "tools/launch.sh" in text


def test_a_layout_that_does_not_fit_exits_1(capsys):
    assert main(["plan", str(R32), "--nodes", "16", "--gpus-per-node", "8", "parallel.pp=1"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit" in out
    # no launch command for a layout that does not fit
    assert "tools/launch.sh" not in out and "torchrun" not in out
    assert "launch: none printed, as this layout does not fit" in out


def test_json_of_a_layout_that_does_not_fit_carries_no_launch_command(capsys):
    """--json agrees with the text: no launch command (null) beside "fits": false, one where it fits."""
    assert main(["plan", str(R32), "--nodes", "16", "--gpus-per-node", "8", "--json", "parallel.pp=1"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] is False and report["trainer_fits"] is False
    assert report["command"] is None and report["torchrun"] is None
    assert main(["plan", str(R32), "--nodes", "16", "--gpus-per-node", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] is True and "tools/launch.sh" in report["command"] and "--nnodes=16" in report["torchrun"]


def test_search_names_divisibility_when_no_layout_validates(capsys):
    # 500 prompts: every data-parallel size of 128 ranks (a power of two > 2) leaves a remainder
    assert main(["plan", str(R32), "--nodes", "16", "--gpus-per-node", "8", "--search",
                 "data.prompts_per_step=500"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("no layout of the search space fits: no layout validates for 128 trainer ranks")
    assert "data.prompts_per_step=500 must be divisible by the data-parallel size" in out
    assert "token budget" not in out and "more GPUs" not in out


def test_search_names_memory_when_layouts_validate_but_none_fits(capsys):
    assert main(["plan", str(R32), "--nodes", "1", "--gpus-per-node", "8", "--search",
                 "data.prompts_per_step=8", "trainer.mini_batch_prompts=8"]) == 1
    out = capsys.readouterr().out
    assert "every layout that validates needs at least" in out and "GiB per GPU, more than the 72.0 GiB usable" in out


@pytest.mark.parametrize("overrides, nodes, message", [
    (["parallel.tp=3"], 16, r"parallel.tp=3: use one of 1, 2, 4, 8"),
    (["parallel.pp=3"], 16, r"pp\*vpp=3\*1: use pp in 1, 2, 4, 8, 16, 32, 64"),
    (["rollout.tensor_parallel_size=3"], 16, r"rollout.tensor_parallel_size=3 must divide the world size 128.*"
                                             r"use one of 1, 2, 4, 8"),
    (["data.prompts_per_step=500"], 16, r"data.prompts_per_step=500 must be divisible by the data-parallel size 8.*"
                                        r"use 496 or 504"),
    (["trainer.mini_batch_prompts=3"], 16, r"trainer.mini_batch_prompts=3 .* values that work: 1, 2, 4, 8"),
    (["trainer.max_tokens_per_micro_batch=8192"], 16, r"set it to at least 22528"),
    ([], 3, r"world size 24 is not divisible by tp\*pp\*cp = 8\*2\*1 = 16"),
    (["model.num_attention_heads=48"], 16, r"model.num_attention_heads=48 disagrees with model.architecture: "
                                           r"qwen2.5-32b \(40\)"),
])
def test_broken_layouts_are_refused_with_the_fix(overrides, nodes, message, capsys):
    assert main(["plan", str(R32), "--nodes", str(nodes), "--gpus-per-node", "8", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: plan {R32}: ")
    assert re.search(message, err), err


def test_fp8_alignment_is_checked_against_the_token_budget():
    with pytest.raises(ValueError, match="padded to a multiple of 128"):
        plan_report(ROOT / "recipes" / "dapo_qwen2.5_32b_rollout_corr_fp8.yaml",
                    ["trainer.max_tokens_per_micro_batch=22500"], nodes=16, gpus_per_node=8)


def test_search_proposes_layouts_that_fit_cheapest_first(capsys):
    assert main(["plan", str(R32), "--nodes", "16", "--gpus-per-node", "8", "--search", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert len(found) >= 3
    seconds = [c["seconds_estimate"] for c in found]
    assert seconds == sorted(seconds)
    for candidate in found:
        assert candidate["tp"] <= 8 and 128 % (candidate["tp"] * candidate["pp"] * candidate["cp"]) == 0
        assert candidate["memory_gib_per_gpu"]["total"] <= 80
        report = plan_report(R32, candidate["overrides"], nodes=16, gpus_per_node=8)   # each one plans and fits
        assert report["fits"]
    assert ("parallel.tp=8", "parallel.pp=2") in {tuple(c["overrides"][:2]) for c in found}  # the recipe's own


def test_a_checkpoint_on_disk_must_agree_with_the_preset(tmp_path, tiny_hf):
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.presets import preset_config

    same = tmp_path / "qwen2.5-1.5b"
    same.mkdir()
    (same / "config.json").write_text(json.dumps(preset_config("qwen2.5-1.5b")))
    cfg = ModelConfig.from_dict({"architecture": "Qwen2.5-1.5B", "hf_checkpoint": str(same)})
    assert (cfg.hidden_size, cfg.num_layers, cfg.tie_embeddings) == (1536, 28, True)
    with pytest.raises(ValueError, match=r"model.architecture: qwen2.5-1.5b-instruct disagrees with .*config.json in "
                                         r"max_position_embeddings \(max_position_embeddings\): checkpoint 131072, "
                                         r"preset 32768: use the preset of this checkpoint"):
        ModelConfig.from_dict({"architecture": "qwen2.5-1.5b-instruct", "hf_checkpoint": str(same)})
    with pytest.raises(ValueError, match=r"disagrees with .* in vocab_size .*; hidden_size \(hidden_size\): "
                                         r"checkpoint 64, preset 3584;"):
        ModelConfig.from_dict({"architecture": "qwen2.5-7b", "hf_checkpoint": str(tiny_hf / "model")})
    with pytest.raises(ValueError, match=r"model.hidden_size=4096 disagrees with model.architecture: qwen2.5-7b "
                                         r"\(3584\)"):
        ModelConfig.from_dict({"architecture": "qwen2.5-7b", "hidden_size": 4096})


def test_a_planned_recipe_needs_its_checkpoint_to_launch():
    recipe = load_recipe(R7)
    assert recipe.check_layout(8, here=False) == 2
    with pytest.raises(ValueError, match="model.hf_checkpoint=/path/to/Qwen2.5-7B is not a directory: download"):
        recipe.check_layout(8)


def test_plan_runs_without_the_trackers_packages(tmp_path, monkeypatch):
    """A recipe that logs to wandb launches only where wandb is installed (the launch check refuses it
    with the install line), but plan runs anywhere, as the imported verl DAPO recipes log to wandb."""
    import megatron_rlcorr.rl.trackers as trackers

    monkeypatch.setattr(trackers, "OPTIONAL_TRACKERS", {**trackers.OPTIONAL_TRACKERS,
                                                        "wandb": ("no_such_package_for_the_test", "wandb")})
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base: {R32}\ntrainer:\n  logger: [console, wandb]\n")
    with pytest.raises(ValueError, match=r"pip install -e \.\[wandb\]"):
        trackers.check_installed(load_recipe(recipe).trainer.logger)      # what the launch check runs
    report = plan_report(recipe, [], nodes=16, gpus_per_node=8)
    assert report["fits"]
    assert report["memory_gib_per_gpu"] == plan_report(R32, [], nodes=16, gpus_per_node=8)["memory_gib_per_gpu"]
    assert main(["plan", str(recipe), "--nodes", "16", "--gpus-per-node", "8", "--search"]) == 0
