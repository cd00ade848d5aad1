"""`plan` for mixture-of-experts models (recipe/memory.py, recipe/layout_search.py): parameters per rank
with expert parallelism by hand and against a real Megatron-Core build, expert optimizer states
sharded over the expert-data-parallel group, MoE activations, the search over EP, and the
Qwen3-MoE presets on their clusters, with parameter counts checked against transformers' model of
the published config."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlcorr.cli import main
from megatron_rlcorr.plan import plan_report
from megatron_rlcorr.recipe import load_recipe
from megatron_rlcorr.recipe.memory import (GiB, estimate_memory, expert_optimizer_group_size, parameter_counts,
                                          stage_estimates)
from tests.unit.test_plan import HAND, TINY

ROOT = Path(__file__).resolve().parents[2]
R30 = ROOT / "recipes" / "dapo_qwen3_30b_a3b_rollout_corr.yaml"

# The hand model of test_plan.py (h 64, 4 heads of 16, 2 K/V groups, dense ffn 128, 4 layers, vocabulary
# 1000 padded to 1024, bf16, TP 2 + SP, PP 2) with layer 0 dense and layers 1-3 MoE: 8 experts of width 32,
# top-2, and a shared expert of width 48 (Qwen2-MoE's).
MOE = ["model.moe={num_experts: 8, router_topk: 2, ffn_hidden_size: 32, dense_layers: [0], "
       "shared_expert_ffn_hidden_size: 48}"]


def _moe_recipe(*extra):
    return load_recipe(TINY, [*HAND, *MOE, *extra])


def test_moe_parameters_per_rank_by_hand():
    recipe = _moe_recipe("parallel.ep=4")
    counts = parameter_counts(recipe.model, recipe.parallel)
    norms = 2 * 64                                          # replicated over TP
    attention = 64 * (64 + 2 * 32) + 64 * 64                # q,k,v; o
    dense_mlp = 3 * 64 * 128
    router, shared, gate, expert = 8 * 64, 3 * 64 * 48, 64, 3 * 64 * 32   # router and shared gate: replicated
    dense_layer = norms + (attention + dense_mlp) // 2                    # 18,560 on each TP rank
    experts = 8 // 4 * expert                                             # ep 4: 2 whole experts (etp 1)
    moe_layer = norms + attention // 2 + router + shared // 2 + gate + experts
    embedding = 1024 * 64 // 2
    assert counts.per_stage == (dense_layer + moe_layer + embedding, 2 * moe_layer + 64 + embedding)
    assert counts.experts_per_stage == (experts, 2 * experts)
    full_moe = norms + attention + router + shared + gate
    assert counts.total == 1000 * 64 * 2 + 64 + (norms + attention + dense_mlp) + 3 * (full_moe + 8 * expert)
    assert counts.active == counts.total - 3 * 6 * expert                # 2 of the 8 experts per MoE layer
    # expert tensor parallelism splits each expert's SwiGLU: ep 2 x etp 2 holds 4 half experts
    split = parameter_counts(_moe_recipe().model, _moe_recipe("parallel.ep=2", "parallel.etp=2").parallel)
    assert split.experts_per_stage == (4 * expert // 2, 2 * 4 * expert // 2)


def test_moe_memory_terms_by_hand():
    """World 8 (TP 2 x PP 2 x DP 2) with EP 4: a stage's 4 ranks hold 4 expert shards, each on one rank
    (expert-data-parallel size 1), so Adam's expert states are not sharded while the dense ones are over
    DP 2; the last stage holds two MoE layers."""
    recipe = _moe_recipe("parallel.ep=4")
    counts = parameter_counts(recipe.model, recipe.parallel)
    last, experts = counts.per_stage[1], counts.experts_per_stage[1]
    first_stage, memory = stage_estimates(recipe, 8, 80 * GiB)
    assert memory.weights == last * 2 and memory.gradients == last * 4
    assert memory.optimizer == (last - experts) * 12 / 2 + experts * 12 / 1
    # per token: a dense layer 832 bytes (test_plan.py); a MoE layer replaces the MLP's 6 * 128 / 2 with
    # the k = 2 routed copies (4h input + weighted output, 6 * 32 gate/up + SwiGLU) and the router's float32
    # logits and probabilities (8 * 8), over TP 2 by SP, and the shared expert's 6 * 48 / TP 2
    moe_layer = 832 - 6 * 128 // 2 + (2 * (4 * 64 + 6 * 32) + 8 * 8) // 2 + 6 * 48 // 2
    assert memory.activations == 512 * 2 * moe_layer                     # 1 micro-batch in flight
    assert first_stage.activations == 2 * 512 * (832 + moe_layer)        # 2 in flight under 1F1B
    # selective `mlp` recomputes the dense MLP only (Megatron-Core leaves the experts alone)
    selective = stage_estimates(_moe_recipe("parallel.ep=4", "model.recompute={granularity: selective, "
                                                                 "modules: [mlp]}"), 8, 80 * GiB)
    assert selective[1].activations == memory.activations
    assert selective[0].activations == 2 * 512 * (832 - 6 * 128 // 2 + moe_layer)
    # with EP 2 the expert states are sharded over the expert-data-parallel size 4 / 2
    ep2 = _moe_recipe("parallel.ep=2")
    counts2 = parameter_counts(ep2.model, ep2.parallel)
    assert estimate_memory(ep2, 8, 80 * GiB).optimizer == (
        (counts2.per_stage[1] - counts2.experts_per_stage[1]) * 12 / 2 + counts2.experts_per_stage[1] * 12 / 2)


def test_memory_per_gpu_drops_as_ep_grows():
    totals = [estimate_memory(_moe_recipe(f"parallel.ep={ep}"), 8, 80 * GiB) for ep in (1, 2, 4)]
    for smaller, larger in zip(totals[1:], totals):
        assert smaller.weights < larger.weights and smaller.total < larger.total


# ---- against Megatron-Core's own model --------------------------------------------------------------

# Small enough to build in a second: the hand model's MoE layers at h 32, 4 layers (layer 0 dense), 4 experts.
BUILD = dict(vocab_size=100, hidden_size=32, num_layers=4, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=48, max_position_embeddings=64, make_vocab_size_divisible_by=8,
             moe=dict(num_experts=4, router_topk=2, ffn_hidden_size=24, dense_layers=[0],
                      shared_expert_ffn_hidden_size=16))
# (tp, pp, vpp, ep, etp) on 2 processes: EP over DP, EP over TP (with SP), expert TP, interleaved PP (stage 0
# holds layers 0 (dense) and 2, stage 1 layers 1 and 3)
BUILD_LAYOUTS = [(1, 1, None, 2, 1), (2, 1, None, 2, 1), (2, 1, None, 1, 2), (1, 2, 2, 1, 1)]


def _optimizer_shards(groups) -> dict[str, int]:
    """The float32 master-weight elements this rank's distributed optimizer holds, for the dense and the
    expert parameters (Megatron-Core chains one optimizer for each), of the bf16 BUILD model."""
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.training.optimizer import OptimSettings, build_model_and_optimizer

    _, optimizer, _ = build_model_and_optimizer(ModelConfig(**BUILD, bf16=True), OptimSettings(), groups, seed=1,
                                                total_steps=1)
    shards = {"dense": 0, "experts": 0}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        experts = all(not getattr(p, "allreduce", True) for group in opt.model_float16_groups for p in group)
        shards["experts" if experts else "dense"] += sum(p.numel() for g in opt.shard_fp32_from_float16_groups
                                                         for p in g)
    return shards


def _count_worker(rank, world, layouts):
    from tests.dist import hide_gpus

    hide_gpus()
    from megatron_rlcorr.model.build import build_model_chunks
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups, destroy_parallel_groups

    enable_cpu_megatron()
    groups = build_parallel_groups(1, 1, 1, ep=2)
    shards = _optimizer_shards(groups)   # EP 2 over DP 2: expert-data-parallel size 1
    destroy_parallel_groups()
    found = [shards]
    for tp, pp, vpp, ep, etp in layouts:
        groups = build_parallel_groups(tp, pp, 1, vpp, sequence_parallel=tp > 1, ep=ep, etp=etp)
        params = [p for chunk in build_model_chunks(ModelConfig(**BUILD), groups, init_weights=False)
                  for p in chunk.parameters()]
        # Megatron-Core marks expert parameters allreduce=False (reduced over the expert-data-parallel group)
        found.append(dict(pp_rank=groups.pp_rank, params=sum(p.numel() for p in params),
                          experts=sum(p.numel() for p in params if not getattr(p, "allreduce", True))))
        destroy_parallel_groups()
    return found


def test_parameters_per_rank_equal_a_megatron_build():
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.parallel.layout import ParallelSettings
    from tests.dist import run_distributed

    per_rank = run_distributed(_count_worker, 2, BUILD_LAYOUTS)
    model = ModelConfig(**BUILD)
    # the distributed optimizer: the dense master weights sharded over DP 2 (the two shards add up to them),
    # each rank's experts unsharded (expert-data-parallel size 1), as memory.stage_estimates counts them
    counts = parameter_counts(model, ParallelSettings(ep=2))
    shards = [found[0] for found in per_rank]
    assert [s["experts"] for s in shards] == [counts.experts_per_stage[0]] * 2
    assert sum(s["dense"] for s in shards) == counts.per_stage[0] - counts.experts_per_stage[0]
    assert expert_optimizer_group_size(ParallelSettings(ep=2), 2) == 1
    for index, (tp, pp, vpp, ep, etp) in enumerate(BUILD_LAYOUTS, start=1):
        counts = parameter_counts(model, ParallelSettings(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp))
        for rank in (found[index] for found in per_rank):
            where = f"tp{tp} pp{pp} vpp{vpp} ep{ep} etp{etp}, stage {rank['pp_rank']}"
            assert rank["params"] == counts.per_stage[rank["pp_rank"]], where
            # expert parameters (reduced and sharded over the expert-data-parallel group) on every layout
            assert rank["experts"] == counts.experts_per_stage[rank["pp_rank"]] > 0, where


# ---- the Qwen3-MoE presets on their clusters --------------------------------------------------------

def _hf_counts(architecture: str, *, tp: int, pp: int, ep: int, etp: int) -> dict[str, int | list[int]]:
    """Parameter counts from transformers' model of the preset's config.json (on the meta device), with
    no use of our formulas: total; active (each MoE layer's experts scaled by top-k / experts); and the
    parameters one rank of each pipeline stage holds: expert tensors / (ep * etp), the router and the
    norms whole, the attention projections / tp, embedding and head over the vocabulary padded to a
    multiple of 128 * tp, / tp."""
    import torch
    import transformers

    from megatron_rlcorr.model.presets import preset_config

    config = preset_config(architecture)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    layers, vocab, h = config["num_hidden_layers"], config["vocab_size"], config["hidden_size"]
    padded = -(-vocab // (128 * tp)) * 128 * tp
    total = active = 0
    stages = [0] * pp
    for name, param in model.named_parameters():
        total += param.numel()
        is_expert = ".mlp.experts." in name
        active += param.numel() * config["num_experts_per_tok"] // config["num_experts"] if is_expert else param.numel()
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            stages[0 if "embed" in name else -1] += padded * h // tp
            continue
        if name == "model.norm.weight":
            stages[-1] += param.numel()
            continue
        layer = int(name.split(".")[2])
        if is_expert:
            share = param.numel() // (ep * etp)
        elif name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight", "mlp.gate.weight")):
            share = param.numel()
        else:
            assert ".self_attn." in name and name.endswith("_proj.weight"), name
            share = param.numel() // tp
        stages[layer * pp // layers] += share
    return dict(total=total, active=active, per_stage=stages)


def test_qwen3_30b_a3b_recipe_fits_one_node_with_exact_counts(capsys):
    recipe = load_recipe(R30)
    assert recipe.rollout.routing_replay and recipe.rollout.engine == "vllm" and recipe.model.moe is not None
    p = recipe.parallel
    report = plan_report(R30, [], nodes=1, gpus_per_node=8, gpu_memory_gib=80)
    assert report["fits"], report["memory_gib_per_gpu"]
    hf = _hf_counts("qwen3-30b-a3b", tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp)
    assert report["params_total"] == hf["total"] and report["params_active"] == hf["active"]
    assert report["params_per_gpu_max"] == max(hf["per_stage"])
    assert list(parameter_counts(recipe.model, p).per_stage) == hf["per_stage"]
    assert report["layout"]["ep"] == p.ep > 1 and report["moe"]["experts_per_ep_rank"] == 128 // p.ep
    assert main(["plan", str(R30), "--nodes", "1", "--gpus-per-node", "8"]) == 0
    text = capsys.readouterr().out
    assert f"{hf['total']:,} in total, {hf['active']:,} active per token (top-8 of 128 experts in 48 MoE layers)" \
        in text
    assert f"ep={p.ep} etp={p.etp}" in text and "fits" in text


# Qwen3-235B-A22B on 32 x 8: TP 4 x PP 2 (47 layers a stage), the 128 GPUs of a stage split the experts by EP
R235 = ["model.architecture=qwen3-235b-a22b", "model.hf_checkpoint=/path/to/Qwen3-235B-A22B",
        "rollout.tensor_parallel_size=16", "parallel.tp=4", "parallel.pp=2"]


def test_qwen3_235b_a22b_fits_32_nodes_with_ep_and_memory_drops_as_ep_grows():
    reports = {ep: plan_report(R30, [*R235, f"parallel.ep={ep}"], nodes=32, gpus_per_node=8) for ep in (8, 32, 128)}
    hf = _hf_counts("qwen3-235b-a22b", tp=4, pp=2, ep=32, etp=1)
    assert reports[32]["fits"] and reports[128]["fits"]
    assert reports[32]["params_total"] == hf["total"] and reports[32]["params_active"] == hf["active"]
    assert reports[32]["params_per_gpu_max"] == max(hf["per_stage"])
    # the training phase (states + activations) strictly drops; the total is the larger phase, and from EP 32
    # on that is generation (vLLM's share, the states offloaded), so it stops dropping there
    training = [reports[ep]["phases_gib_per_gpu"]["training"] for ep in (8, 32, 128)]
    weights = [reports[ep]["memory_gib_per_gpu"]["weights"] for ep in (8, 32, 128)]
    totals = [reports[ep]["memory_gib_per_gpu"]["total"] for ep in (8, 32, 128)]
    assert training == sorted(training, reverse=True) and len(set(training)) == 3
    assert weights == sorted(weights, reverse=True) and len(set(weights)) == 3
    assert totals == sorted(totals, reverse=True) and not reports[8]["fits"]
    # EP that does not divide the 128 experts, or the 128 ranks of a stage, is refused with the fix
    with pytest.raises(ValueError, match=r"parallel.ep=3 must divide model.moe.num_experts \(128\)"):
        plan_report(R30, [*R235, "parallel.ep=3"], nodes=32, gpus_per_node=8)
    with pytest.raises(ValueError, match=r"ep\*etp = 128\*2 = 256 must divide the 128 ranks of a pipeline stage"):
        plan_report(R30, [*R235, "parallel.ep=128", "parallel.etp=2"], nodes=32, gpus_per_node=8)


def test_search_proposes_expert_parallel_layouts_that_fit(capsys):
    assert main(["plan", str(R30), "--nodes", "1", "--gpus-per-node", "8", "--search", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found and all(c["ep"] > 1 for c in found)  # without EP the experts do not fit one node
    seconds = [c["seconds_estimate"] for c in found]
    assert seconds == sorted(seconds)
    for candidate in found[:3]:
        assert f"parallel.ep={candidate['ep']}" in candidate["overrides"] and "parallel.etp=1" in candidate["overrides"]
        assert plan_report(R30, candidate["overrides"], nodes=1, gpus_per_node=8)["fits"]
    recipe = load_recipe(R30)
    assert (recipe.parallel.tp, recipe.parallel.pp, recipe.parallel.ep) == (found[0]["tp"], found[0]["pp"],
                                                                            found[0]["ep"])  # the recipe's own


def test_docs_quote_the_current_moe_plan(capsys, monkeypatch):
    """docs/scaling.md quotes plan's output for the Qwen3-30B-A3B recipe: it must be what plan prints."""
    import re

    text = (ROOT / "docs" / "scaling.md").read_text()
    quoted = re.search(r"```text\n(plan: recipes/dapo_qwen3_30b_a3b_rollout_corr\.yaml.*?)```", text, re.S).group(1)
    monkeypatch.chdir(ROOT)
    assert main(["plan", "recipes/dapo_qwen3_30b_a3b_rollout_corr.yaml", "--nodes", "1", "--gpus-per-node", "8"]) == 0
    assert capsys.readouterr().out == quoted
