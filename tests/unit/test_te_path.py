"""The Transformer Engine path, decided and checked on the CPU: which layers a model is built
from (model.transformer_impl; no silent fall back to the local layers on a CUDA machine without
Transformer Engine), the FP8 token alignment per recipe, FP8 recipes refused where the GPU cannot
run them (at recipe load, not in `plan`), Megatron-LM's GPU defaults in the TransformerConfig, and
setup.py's torch and Transformer Engine requirements.

A "CUDA machine" here is torch.cuda.is_available() patched to True, with Transformer Engine
unimportable (a None entry in sys.modules) or replaced by a stand-in module; nothing touches a GPU.
"""
from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_rlcorr.model import build, implementation
from megatron_rlcorr.model.config import ModelConfig, fp8_token_alignment
from megatron_rlcorr.plan import plan_report
from megatron_rlcorr.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_cpu.yaml"
R32_FP8 = ROOT / "recipes" / "dapo_qwen2.5_32b_rollout_corr_fp8.yaml"
CFG = dict(vocab_size=1000, hidden_size=128, num_layers=2, num_attention_heads=8, num_query_groups=2,
           ffn_hidden_size=256, add_qkv_bias=True, rotary_base=1e6)


class _Layout:
    """What transformer_config reads of ParallelGroups."""
    tp_size, pp_size, cp_size, vpp_size, pp_rank, tp_rank = 2, 1, 1, None, 0, 0
    ep_size, etp_size = 1, 1

    def __init__(self, sequence_parallel=False):
        self.sequence_parallel = sequence_parallel

    def is_pipeline_first_stage(self, vp_stage=None):
        return True

    def is_pipeline_last_stage(self, vp_stage=None):
        return True


def _cuda(monkeypatch, available=True):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)


def _no_transformer_engine(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)


def _fake_transformer_engine(monkeypatch, **checks):
    """A stand-in transformer_engine.pytorch whose quantization module answers the FP8 checks
    (`check_fp8_support` etc.: (supported, reason)); unnamed checks say supported."""
    package, torch_part = types.ModuleType("transformer_engine"), types.ModuleType("transformer_engine.pytorch")
    quantization = types.ModuleType("transformer_engine.pytorch.quantization")
    for name in ("check_fp8_support", "check_fp8_block_scaling_support", "check_mxfp8_support"):
        answer = checks.get(name, (True, ""))
        setattr(quantization, name, lambda answer=answer: answer)
    package.pytorch, torch_part.quantization = torch_part, quantization
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", torch_part)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.quantization", quantization)


def _gpu(monkeypatch, capability, cuda_version, name="NVIDIA H100 80GB HBM3"):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.version, "cuda", cuda_version)


# ---- model.transformer_impl --------------------------------------------------------------------

def test_transformer_impl_is_validated_at_config_time():
    assert ModelConfig(**CFG).transformer_impl is None
    assert ModelConfig(**CFG, transformer_impl="local").transformer_impl == "local"
    with pytest.raises(ValueError, match="transformer_impl"):
        ModelConfig(**CFG, transformer_impl="te")
    with pytest.raises(ValueError, match="fp8 needs transformer_impl: transformer_engine"):
        ModelConfig(**CFG, bf16=True, fp8={"recipe": "tensorwise"}, transformer_impl="local")


def test_without_cuda_the_default_is_the_local_layers_and_transformer_engine_is_refused(monkeypatch):
    _cuda(monkeypatch, False)
    assert implementation.resolve_transformer_impl(None) == "local"
    assert implementation.resolve_transformer_impl("local") == "local"
    with pytest.raises(ValueError, match="transformer_engine needs a CUDA GPU.*transformer_impl: local"):
        implementation.resolve_transformer_impl("transformer_engine")


@pytest.mark.parametrize("requested", [None, "transformer_engine"])
def test_cuda_without_transformer_engine_fails_with_the_fix(monkeypatch, requested):
    _cuda(monkeypatch)
    _no_transformer_engine(monkeypatch)
    with pytest.raises(ValueError) as err:
        implementation.resolve_transformer_impl(requested)
    message = str(err.value)
    assert "Transformer Engine does not import" in message and "pip install -e .[te]" in message
    assert "model.transformer_impl: local" in message
    assert implementation.resolve_transformer_impl("local") == "local"  # the explicit choice still builds


def test_cuda_with_transformer_engine_defaults_to_it(monkeypatch):
    _cuda(monkeypatch)
    _fake_transformer_engine(monkeypatch)
    assert implementation.resolve_transformer_impl(None) == "transformer_engine"
    assert implementation.resolve_transformer_impl("local") == "local"


def test_building_a_model_on_cuda_without_transformer_engine_raises_before_anything_is_built(monkeypatch):
    _cuda(monkeypatch)
    _no_transformer_engine(monkeypatch)
    with pytest.raises(ValueError, match=r"pip install -e \.\[te\]"):
        build.build_gpt_model(ModelConfig(**CFG), _Layout())


def test_the_gpu_tier_fails_rather_than_skips_without_transformer_engine(monkeypatch):
    from tests.gpu.te import require_transformer_engine

    _cuda(monkeypatch)
    _no_transformer_engine(monkeypatch)
    fix = r"the GPU tier needs Transformer Engine: .*pip install -e \.\[te\]"
    with pytest.raises(pytest.fail.Exception, match=fix):
        require_transformer_engine()
    _fake_transformer_engine(monkeypatch)
    require_transformer_engine()


def test_train_refuses_at_recipe_load_and_plan_does_not_need_the_machine(monkeypatch):
    _cuda(monkeypatch)
    _no_transformer_engine(monkeypatch)
    recipe = load_recipe(TINY)
    with pytest.raises(ValueError, match=r"pip install -e \.\[te\]"):
        recipe.check_model_layout(1)
    assert recipe.check_model_layout(1, here=False) == 1
    assert load_recipe(TINY, ["model.transformer_impl=local"]).check_model_layout(1) == 1


# ---- sequence parallelism ------------------------------------------------------------------------

def _fake_transformer_engine_layers(monkeypatch, fused_wgrad: bool = False):
    """transformer_config as on a CUDA machine with Transformer Engine: the decision, TE's fused
    RoPE (which TransformerConfig checks for) and optionally apex's fused weight-gradient kernel."""
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(implementation, "resolve_transformer_impl", lambda requested: requested or "transformer_engine")
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda",
                        types.ModuleType("fused_weight_gradient_mlp_cuda") if fused_wgrad else None)


def test_sequence_parallel_reaches_the_transformer_config(monkeypatch):
    _fake_transformer_engine_layers(monkeypatch)  # TE's norms split the sequence
    cfg = ModelConfig(**CFG)
    assert build.transformer_config(cfg, _Layout(True)).sequence_parallel is True
    assert build.transformer_config(cfg, _Layout(False)).sequence_parallel is False


def test_sequence_parallel_with_the_local_layers_uses_the_sequence_parallel_norm(monkeypatch):
    """The local layers run sequence parallelism with SequenceParallelRMSNorm (Megatron's torch norm
    wrapper refuses it): every hidden-size norm's weight is tagged for the TP all-reduce of its
    gradient, the query/key norms (summed by name) are not; without SP the block keeps Megatron's."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    _cuda(monkeypatch, False)  # the CPU default: local layers
    cfg = ModelConfig(**CFG, qk_layernorm=True)
    config = build.transformer_config(cfg, _Layout(True))
    assert config.sequence_parallel is True
    block = build._local_block_spec(cfg, _Layout(True), config, None)
    assert block.layer_norm is build.SequenceParallelRMSNorm
    layer = block.layer_specs[0].submodules
    assert layer.input_layernorm is layer.pre_mlp_layernorm is build.SequenceParallelRMSNorm
    norm = layer.input_layernorm(config, 16, eps=1e-6)
    assert norm.weight.sequence_parallel is True and norm.eps == 1e-6
    head_norm = layer.self_attention.submodules.q_layernorm(config, 8, eps=1e-6)
    assert not hasattr(head_norm.weight, "sequence_parallel")
    x = torch.randn(3, 16)
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (16,), eps=1e-6))
    plain = build.transformer_config(cfg, _Layout(False))
    assert build._local_block_spec(cfg, _Layout(False), plain, None).layer_norm is WrappedTorchNorm


def test_moe_with_tensor_parallelism_needs_sequence_parallelism(monkeypatch):
    """Megatron-Core's MoE layer trains under TP only with sequence parallelism: refused at build
    time with the fix, built with it (the local layers on the CPU)."""
    _cuda(monkeypatch, False)
    cfg = ModelConfig(**CFG, moe=dict(num_experts=4, router_topk=2, ffn_hidden_size=64, dense_layers=[0]))
    with pytest.raises(ValueError, match="model.moe with parallel.tp=2 needs parallel.sequence_parallel: true"):
        build.transformer_config(cfg, _Layout(False))
    config = build.transformer_config(cfg, _Layout(True))
    assert config.sequence_parallel is True and config.num_moe_experts == 4 and config.moe_layer_freq == [0, 1]


# ---- Megatron-LM's GPU defaults --------------------------------------------------------------------

GPU_DEFAULTS = ("apply_rope_fusion", "bias_activation_fusion", "deallocate_pipeline_outputs")


@pytest.mark.parametrize("fused_wgrad", [True, False])
def test_transformer_engine_gets_megatron_lms_gpu_defaults(monkeypatch, fused_wgrad):
    _fake_transformer_engine_layers(monkeypatch, fused_wgrad=fused_wgrad)
    cfg = ModelConfig(**CFG, bf16=True)
    trained = build.transformer_config(cfg, _Layout(), main_grads=True)
    assert all(getattr(trained, name) is True for name in GPU_DEFAULTS)
    assert trained.use_cpu_initialization is False and trained.perform_initialization is False
    # Accumulating into DDP's main_grad inside the GEMM needs apex's kernel (Megatron's output layer
    # raises without it) and main_grad buffers: never for a model without DDP.
    assert trained.gradient_accumulation_fusion is fused_wgrad
    assert build.transformer_config(cfg, _Layout(), main_grads=False).gradient_accumulation_fusion is False


def test_the_cpu_path_keeps_host_initialisation_and_no_fused_kernels(monkeypatch):
    _cuda(monkeypatch, False)
    kernel = types.ModuleType("fused_weight_gradient_mlp_cuda")
    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", kernel)
    config = build.transformer_config(ModelConfig(**CFG), _Layout(), main_grads=True)
    assert config.use_cpu_initialization is True and config.perform_initialization is False
    assert not any(getattr(config, name) for name in (*GPU_DEFAULTS, "gradient_accumulation_fusion"))
    assert implementation.implementation_fields("local", main_grads=True) == {"use_cpu_initialization": True}


# ---- FP8: alignment ------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe, sequence_parallel, expected", [
    (None, False, 1), (None, True, 1),
    ("delayed", False, 16), ("tensorwise", True, 16),      # FP8 GEMMs: the token dimension a multiple of 16
    ("blockwise", False, 16), ("blockwise", True, 128),    # whole 128-token blocks for the FP8 all-gather
    ("mxfp8", False, 32), ("mxfp8", True, 32),             # MXFP8's 32-element scaling blocks
])
def test_fp8_token_alignment_per_recipe(recipe, sequence_parallel, expected):
    assert fp8_token_alignment(recipe, sequence_parallel=sequence_parallel) == expected
    fp8 = None if recipe is None else {"recipe": recipe}
    assert ModelConfig(**CFG, bf16=True, fp8=fp8).token_alignment(sequence_parallel=sequence_parallel) == expected


def test_blockwise_with_sequence_parallelism_pads_128_tokens_per_rank():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rlcorr.training.microbatches import sequence_multiple

    def multiple(recipe, **kw):
        return sequence_multiple(TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, bf16=True,
                                                   fp8="e4m3", fp8_recipe=recipe, **kw))

    assert multiple("blockwise", tensor_model_parallel_size=2, sequence_parallel=True) == 256
    assert multiple("tensorwise", tensor_model_parallel_size=2, sequence_parallel=True) == 32
    assert multiple("blockwise", tensor_model_parallel_size=2) == 16   # no SP: each rank holds the whole sequence


def test_plan_checks_the_token_budget_against_the_recipes_alignment():
    # tp 8 with sequence parallelism: 2048 + 20000 tokens pad to 22144 (16 x 8) with tensorwise,
    # to 22528 (128 x 8) with blockwise
    overrides = ["rollout.max_new_tokens=20000", "trainer.max_tokens_per_micro_batch=22144"]
    assert plan_report(R32_FP8, overrides, nodes=16, gpus_per_node=8)
    with pytest.raises(ValueError, match="padded to a multiple of 1024, is 22528"):
        plan_report(R32_FP8, [*overrides, "model.fp8.recipe=blockwise"], nodes=16, gpus_per_node=8)


# ---- FP8: recipes the GPU cannot run ---------------------------------------------------------------

@pytest.mark.parametrize("recipe, capability, cuda, refused", [
    ("tensorwise", (9, 0), "12.4", None),
    ("delayed", (8, 0), "12.4", "compute capability 8.9"),           # A100
    ("tensorwise", (8, 9), "12.0", "CUDA 12.1"),                     # Ada needs CUDA 12.1
    ("tensorwise", (8, 9), "12.1", None),
    ("blockwise", (9, 0), "12.8", "CUDA 12.9"),
    ("blockwise", (9, 0), "12.9", None),
    ("blockwise", (10, 0), "13.0", None),
    ("blockwise", (8, 9), "13.0", "compute capability 9.0"),
    ("mxfp8", (9, 0), "12.9", "compute capability 10"),               # H100
    ("mxfp8", (10, 0), "12.9", None),                                 # B200
    ("mxfp8", (12, 0), "12.9", "12.0"),                               # RTX Blackwell: not yet in TE
])
def test_fp8_recipe_rules_follow_transformer_engines_checks(recipe, capability, cuda, refused):
    reason = implementation.fp8_recipe_unsupported(recipe, capability, cuda)
    assert reason is None if refused is None else refused in reason


def _fp8_recipe(recipe, *extra):
    return load_recipe(R32_FP8, [f"model.fp8.recipe={recipe}", *extra])


def test_an_fp8_recipe_this_gpu_cannot_run_is_refused_at_recipe_load(monkeypatch):
    _cuda(monkeypatch)
    _fake_transformer_engine(monkeypatch)
    _gpu(monkeypatch, (9, 0), "12.8")
    with pytest.raises(ValueError, match=r"model.fp8.recipe='blockwise' cannot run on this machine: .*CUDA 12.9.*"
                                         r"NVIDIA H100 80GB HBM3 has compute capability 9.0, torch's CUDA is 12.8"):
        _fp8_recipe("blockwise").check_model_layout(128)
    with pytest.raises(ValueError, match="compute capability 10"):
        _fp8_recipe("mxfp8").check_model_layout(128)
    assert _fp8_recipe("tensorwise").check_model_layout(128) == 8
    _gpu(monkeypatch, (9, 0), "12.9")
    assert _fp8_recipe("blockwise").check_model_layout(128) == 8


def test_transformer_engines_own_refusal_is_the_last_word(monkeypatch):
    """An older Transformer Engine (2.6) runs blockwise on Hopper only: its check, not our rule, decides."""
    _cuda(monkeypatch)
    _fake_transformer_engine(monkeypatch, check_fp8_block_scaling_support=(
        False, "FP8 block scaled GEMM requires Hopper and CUDA >= 12.9."))
    _gpu(monkeypatch, (10, 0), "12.9", name="NVIDIA B200")
    with pytest.raises(ValueError, match="Transformer Engine: FP8 block scaled GEMM requires Hopper"):
        _fp8_recipe("blockwise").check_model_layout(128)


def test_fp8_on_a_machine_without_cuda_is_refused_for_train_but_plans(monkeypatch):
    _cuda(monkeypatch, False)
    for recipe in ("tensorwise", "blockwise", "mxfp8"):
        with pytest.raises(ValueError, match="model.fp8 needs Transformer Engine's layers on a CUDA machine"):
            _fp8_recipe(recipe, "parallel.sequence_parallel=false").check_model_layout(128)
        with pytest.raises(ValueError, match="needs Transformer Engine's layers"):  # its own layout: SP too
            _fp8_recipe(recipe).check_model_layout(128)
        assert plan_report(R32_FP8, [f"model.fp8.recipe={recipe}"], nodes=16, gpus_per_node=8)["fits"]


# ---- setup.py ------------------------------------------------------------------------------------

def _setup_requirements():
    """install_requires and extras_require as setup.py states them (read, not run)."""
    call = next(node for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords
              if k.arg in ("install_requires", "extras_require")}
    return kwargs["install_requires"], kwargs["extras_require"]


def _requirement(requirements, name, python="3.11"):
    from packaging.requirements import Requirement

    found = [Requirement(r) for r in requirements]
    found = [r for r in found if r.name == name and (r.marker is None or r.marker.evaluate({"python_version": python}))]
    assert len(found) == 1, (name, python, requirements)
    return found[0]


def test_the_torch_floor_is_megatron_cores_and_a_gpu_machines_own_build_meets_it():
    from packaging.specifiers import SpecifierSet

    torch_req = _requirement(_setup_requirements()[0], "torch")
    mcore_floor = SpecifierSet(">=2.6.0")  # megatron-core 0.16.1 - 0.19's metadata
    # NGC's pre-release builds and CUDA builds are kept (pip checks an installed torch this way);
    # PEP 440 puts 2.6.0a0 before 2.6.0, which a plain ">=2.6" would reject.
    for version in ("2.6.0a0+ecf3bae40a.nv25.01", "2.7.0a0+7c8ec84dab.nv25.03", "2.11.0+cu130", "2.13.0"):
        assert torch_req.specifier.contains(version, prereleases=True), version
    assert not mcore_floor.contains("2.6.0a0+ecf3bae40a.nv25.01", prereleases=True)
    for version in ("2.4.1", "2.5.1+cu124"):
        assert not torch_req.specifier.contains(version, prereleases=True), version


@pytest.mark.parametrize("python, admitted, refused", [
    ("3.11", ["2.9.0", "2.11.0"], ["2.8.0", "2.12.0", "2.20.2"]),     # megatron-core 0.16.1: >=2.9,<2.12
    ("3.12", ["2.9.0", "2.17.1", "2.20.2"], ["2.8.0", "2.21.0"]),     # 0.17-0.19: built on 2.14-2.17, ran with 2.20.2
])
def test_the_te_extra_is_the_range_the_installed_megatron_core_supports(python, admitted, refused):
    te = _requirement(_setup_requirements()[1]["te"], "transformer-engine", python)
    assert te.extras == {"pytorch"}
    assert all(te.specifier.contains(v) for v in admitted) and not any(te.specifier.contains(v) for v in refused)


# ---- GPU-side initialisation (Megatron-Core's use_cpu_initialization=False branch) ----------------

def _device_init_worker(rank, world, cfg_dict, tokens):
    """The same seeded model built through Megatron-Core's host and device allocation branches
    (use_cpu_initialization True / False; on the CPU the device is the host, parallel/cpu.py)."""
    from tests.dist import hide_gpus

    hide_gpus()
    from megatron_rlcorr.model import build, implementation
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups

    enable_cpu_megatron()
    groups = build_parallel_groups(world, 1, 1)
    out = {}
    fields = implementation.implementation_fields
    for host in (True, False):
        implementation.implementation_fields = lambda impl, *, main_grads, host=host: {"use_cpu_initialization": host}
        try:
            model = build.build_gpt_model(ModelConfig(**cfg_dict), groups, seed=5)
        finally:
            implementation.implementation_fields = fields
        with torch.no_grad():
            logits = model(tokens, None, None)
        marks = {name: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", None))
                 for name, p in model.named_parameters()}
        out[host] = dict(config=model.config.use_cpu_initialization, logits=logits, marks=marks)
    return out


def test_device_allocation_with_skipped_initialisation_loads_and_marks_the_same_model():
    """With perform_initialization=False Megatron-Core's device branch leaves the weights empty and
    unmarked, as its host branch does: load_full_weights fills every shard and
    _mark_tensor_parallel_params marks the split ones, so TP 2 gives the same model either way."""
    from megatron_rlcorr.model.reference import reference_forward
    from megatron_rlcorr.model.weights import init_full_weights
    from tests.dist import run_distributed

    cfg = dict(vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
               ffn_hidden_size=48, add_qkv_bias=True, make_vocab_size_divisible_by=1)
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    ranks = run_distributed(_device_init_worker, 2, cfg, tokens)
    reference = reference_forward(init_full_weights(ModelConfig(**cfg), 5), ModelConfig(**cfg), tokens)
    for host in (True, False):
        assert all(rank[host]["config"] is host for rank in ranks)
        logits = torch.cat([rank[host]["logits"] for rank in ranks], dim=-1)  # vocabulary-parallel shards
        torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
    for rank in ranks:
        assert rank[False]["marks"] == rank[True]["marks"]
        split = {name for name, (marked, _) in rank[False]["marks"].items() if marked}
        assert {"embedding.word_embeddings.weight", "output_layer.weight"} <= split
        assert any(name.endswith("linear_qkv.weight") for name in split)
        assert any(name.endswith("linear_fc2.weight") for name in split)
        assert rank[False]["marks"]["output_layer.weight"] == (True, 0)
