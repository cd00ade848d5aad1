"""ModelConfig validation, seeded weights, and GPTModel (TP=1, CPU) against reference_forward.

The GPTModel checks run in one spawned process (a gloo world of 1), so Megatron-Core's globals
and the CPU patches never leak into this pytest process.
"""
import importlib.util

import pytest
import torch

from megatron_rlcorr.model.config import PADDED_VOCAB_LOGIT, Fp8Config, ModelConfig, pad_vocab_size
from megatron_rlcorr.model.reference import reference_forward
from megatron_rlcorr.model.weights import init_full_weights, neutral_weight_shapes
from tests.dist import hide_gpus, nccl_or_skip, run_distributed
from tests.gpu.te import require_transformer_engine

TINY = dict(vocab_size=100, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48)


# ---- config ------------------------------------------------------------------------------------

def test_from_dict_parses_nested_fp8_and_defaults():
    cfg = ModelConfig.from_dict({**TINY, "num_query_groups": 2, "bf16": True,
                                 "fp8": {"format": "hybrid", "recipe": "blockwise"}})
    assert cfg.fp8 == Fp8Config(format="hybrid", recipe="blockwise")
    assert cfg.params_dtype == "bfloat16" and cfg.torch_params_dtype == torch.bfloat16
    assert ModelConfig.from_dict(TINY).num_query_groups == 4  # no GQA by default
    assert ModelConfig.from_dict(TINY).head_dim == 8


@pytest.mark.parametrize("mapping, message", [
    ({**TINY, "ffn_hiden_size": 8}, 'did you mean "ffn_hidden_size"'),
    ({"vocab_size": 100}, "missing required setting(s): hidden_size, num_layers"),
    ({**TINY, "num_layers": "2"}, "model.num_layers must be an integer"),
    ({**TINY, "num_layers": 0}, "num_layers must be a positive integer"),
    ({**TINY, "num_query_groups": 3}, "num_query_groups (3) must divide num_attention_heads (4)"),
    ({**TINY, "hidden_size": 30}, "hidden_size (30) must be divisible by num_attention_heads"),
    ({**TINY, "kv_channels": 7}, "head dimension (7) must be even"),
    ({**TINY, "params_dtype": "float16"}, "params_dtype must be one of"),
    ({**TINY, "bf16": True, "params_dtype": "float32"}, "does not match bf16=True"),
    ({**TINY, "fp8": {"recipe": "tensorwize"}, "bf16": True}, 'did you mean "tensorwise"'),
    ({**TINY, "fp8": {"format": "e5m2"}, "bf16": True}, "model.fp8.format must be one of"),
    ({**TINY, "fp8": {}}, "fp8 needs bf16: true"),
    ({**TINY, "rotary_base": 0}, "rotary_base must be > 0"),
])
def test_invalid_configs_name_the_field(mapping, message):
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(mapping)
    assert message in str(err.value)


def test_pad_vocab_size():
    assert pad_vocab_size(100, 1) == 128
    assert pad_vocab_size(100, 2) == 256
    assert pad_vocab_size(151936, 8) == 152576
    assert pad_vocab_size(100, 4, divisible_by=1) == 100
    assert pad_vocab_size(101, 4, divisible_by=1) == 104


# ---- seeded weights and the reference -------------------------------------------------------------

def test_init_full_weights_is_per_name_and_layout_free():
    cfg = ModelConfig(**TINY, num_query_groups=2, add_qkv_bias=True)
    full = init_full_weights(cfg, seed=3)
    assert {k: tuple(v.shape) for k, v in full.items()} == neutral_weight_shapes(cfg)
    only_second = init_full_weights(cfg, seed=3, layers=[1])
    assert not any(k.startswith("layers.0.") for k in only_second)
    for name, tensor in only_second.items():
        assert torch.equal(tensor, full[name]), name
    assert not torch.equal(init_full_weights(cfg, seed=4)["layers.1.q.weight"], full["layers.1.q.weight"])
    assert torch.equal(full["layers.0.q.bias"], torch.zeros(32))
    assert torch.equal(full["final_norm.weight"], torch.ones(32))
    # Megatron's scaled init for the output projections: std / sqrt(2 * num_layers).
    assert full["layers.0.o.weight"].std() < 0.6 * full["layers.0.q.weight"].std()


def test_init_full_weights_ties_lm_head():
    weights = init_full_weights(ModelConfig(**TINY, tie_embeddings=True), seed=3)
    assert weights["lm_head.weight"] is weights["embed.weight"]


def test_reference_forward_is_causal():
    cfg = ModelConfig(**TINY, num_query_groups=2)
    weights = init_full_weights(cfg, seed=0)
    tokens = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 100
    logits, logits_changed = reference_forward(weights, cfg, tokens), reference_forward(weights, cfg, changed)
    assert logits.shape == (2, 10, 100) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[:, :6], logits_changed[:, :6], atol=0, rtol=0)
    assert not torch.allclose(logits[:, 6:], logits_changed[:, 6:])


# ---- GPTModel (TP=1) in a spawned process -----------------------------------------------------

CASES = {
    "gqa_bias_untied": dict(TINY, num_query_groups=2, add_qkv_bias=True, rotary_base=1000.0),
    "mha_tied_wide_heads": dict(TINY, kv_channels=16, tie_embeddings=True, norm_epsilon=1e-5),
}


def _random_weights(cfg, seed):
    gen = torch.Generator().manual_seed(seed)
    return {name: (1.0 if name.endswith("norm.weight") else 0.0) + 0.1 * torch.randn(shape, generator=gen)
            for name, shape in neutral_weight_shapes(cfg).items()}


def _single_process_worker(rank, world, cases, tokens):
    hide_gpus()
    from megatron_rlcorr.model.build import build_gpt_model
    from megatron_rlcorr.model.weights import export_full_weights, load_full_weights
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups, destroy_parallel_groups

    assert enable_cpu_megatron() and enable_cpu_megatron()  # idempotent
    assert torch.cuda.current_device() == "cpu"
    out = {}
    try:
        build_parallel_groups(2, 1, 1)
    except ValueError as err:
        out["bad_world"] = str(err)
    groups = build_parallel_groups(1, 1, 1)
    out["sizes"] = (groups.tp_size, groups.pp_size, groups.cp_size, groups.dp_size, groups.dp_cp_size,
                    groups.is_pipeline_first_stage(), groups.is_pipeline_last_stage())
    for name, (cfg_dict, weights) in cases.items():
        cfg = ModelConfig(**cfg_dict)
        model = build_gpt_model(cfg, groups, seed=5)
        seeded = export_full_weights([model], groups)
        load_full_weights([model], weights, groups)
        with torch.no_grad():
            logits = model(tokens, None, None)
        out[name] = dict(seeded=seeded, logits=logits, exported=export_full_weights([model], groups))
    bf16 = ModelConfig(**CASES["gqa_bias_untied"], bf16=True)
    model = build_gpt_model(bf16, groups, seed=5)
    load_full_weights([model], cases["gqa_bias_untied"][1], groups)
    with torch.no_grad():
        out["bf16_logits"] = model(tokens, None, None)
    out["bf16_param_dtypes"] = {p.dtype for p in model.parameters()}
    destroy_parallel_groups()
    out["rebuilt_tp"] = build_parallel_groups(1, 1, 1).tp_size
    return out


@pytest.fixture(scope="module")
def single_process():
    if importlib.util.find_spec("transformer_engine") is not None:
        # Megatron-Core then builds TE norms even in the local spec, and those need CUDA.
        pytest.skip("CPU-path test; Transformer Engine is installed")
    cases = {name: (cfg, _random_weights(ModelConfig(**cfg), seed=i)) for i, (name, cfg) in enumerate(CASES.items())}
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    return cases, tokens, run_distributed(_single_process_worker, 1, cases, tokens)[0]


@pytest.mark.parametrize("name", list(CASES))
def test_gpt_model_matches_reference_forward(single_process, name):
    cases, tokens, out = single_process
    cfg_dict, weights = cases[name]
    cfg = ModelConfig(**cfg_dict)
    logits = out[name]["logits"]
    assert logits.shape == (2, 12, 128)  # vocabulary padded to a multiple of 128
    torch.testing.assert_close(logits[..., :100], reference_forward(weights, cfg, tokens), atol=1e-5, rtol=0)
    assert torch.all(logits[..., 100:] == PADDED_VOCAB_LOGIT)


@pytest.mark.parametrize("name", list(CASES))
def test_export_returns_loaded_and_seeded_weights(single_process, name):
    cases, _, out = single_process
    cfg_dict, weights = cases[name]
    cfg = ModelConfig(**cfg_dict)
    expected = dict(weights)
    if cfg.tie_embeddings:
        expected["lm_head.weight"] = expected["embed.weight"]
    for exported, reference in ((out[name]["exported"], expected), (out[name]["seeded"], init_full_weights(cfg, 5))):
        assert list(exported) == list(neutral_weight_shapes(cfg))
        for key in reference:
            assert torch.equal(exported[key], reference[key]), key


def test_bf16_model_runs_close_to_the_float32_reference(single_process):
    cases, tokens, out = single_process
    cfg_dict, weights = cases["gqa_bias_untied"]
    reference = reference_forward(weights, ModelConfig(**cfg_dict), tokens)
    assert out["bf16_param_dtypes"] == {torch.bfloat16}
    assert out["bf16_logits"].dtype == torch.bfloat16
    torch.testing.assert_close(out["bf16_logits"][..., :100].float(), reference, atol=0.05, rtol=0.02)


def test_parallel_groups_single_process(single_process):
    out = single_process[2]
    assert "world size 1 is not divisible by tp*pp*cp = 2*1*1 = 2" in out["bad_world"]
    assert out["sizes"] == (1, 1, 1, 1, 1, True, True)
    assert out["rebuilt_tp"] == 1


# ---- Transformer Engine layers on a GPU ---------------------------------------------------------

TE_CFG = dict(vocab_size=1000, hidden_size=128, num_layers=2, num_attention_heads=8, num_query_groups=2,
              ffn_hidden_size=256, add_qkv_bias=True, rotary_base=1e6)


def _transformer_engine_worker(rank, world, weights, tokens):
    from megatron_rlcorr.model.build import build_gpt_model
    from megatron_rlcorr.model.implementation import fp8_recipe_unsupported_here, resolve_transformer_impl
    from megatron_rlcorr.model.weights import export_full_weights, load_full_weights
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups

    assert not enable_cpu_megatron() and resolve_transformer_impl(None) == "transformer_engine"
    groups = build_parallel_groups(1, 1, 1)
    tokens = tokens.cuda()
    # The recipes this GPU runs, as Transformer Engine reports them (blockwise: CUDA >= 12.9; mxfp8: Blackwell)
    recipes = [r for r in ("delayed", "tensorwise", "blockwise", "mxfp8") if fp8_recipe_unsupported_here(r) is None]
    variants = [("fp32", {}), ("bf16", {"bf16": True})] + [(r, {"bf16": True, "fp8": {"recipe": r}}) for r in recipes]
    out = {"recipes": recipes}
    for name, extra in variants:
        model = build_gpt_model(ModelConfig(**TE_CFG, **extra), groups, seed=5)
        load_full_weights([model], weights, groups)
        logits = model(tokens, None, None)[..., :TE_CFG["vocab_size"]].float()
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        out[name] = dict(logits=logits.detach().cpu(), exported=export_full_weights([model], groups),
                         finite_grads=all(p.grad is not None and torch.isfinite(p.grad).all().item()
                                          for p in model.parameters()),
                         param_names=[n for n, _ in model.named_parameters()])
    return out


@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_transformer_engine_model_matches_reference_on_gpu():
    require_transformer_engine()
    cfg = ModelConfig(**TE_CFG)
    weights = _random_weights(cfg, seed=0)
    tokens = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(1))
    out = run_distributed(_transformer_engine_worker, 1, weights, tokens, backend=nccl_or_skip(1))[0]
    assert {"delayed", "tensorwise"} <= set(out["recipes"])  # every FP8 GPU (compute capability 8.9+)
    reference = reference_forward(weights, cfg, tokens)
    assert any("layer_norm_weight" in n for n in out["fp32"]["param_names"])  # TE's fused norm + linear
    for name, tensor in out["fp32"]["exported"].items():
        assert torch.equal(tensor.cpu(), weights[name]), name
    # Transformer Engine runs float32 GEMMs in TF32 (measured 0.009 on logits of scale 5 on an H100).
    torch.testing.assert_close(out["fp32"]["logits"], reference, atol=3e-2, rtol=0)
    torch.testing.assert_close(out["bf16"]["logits"], reference, atol=0.3, rtol=0)
    for recipe in out["recipes"]:
        fp8 = out[recipe]
        assert fp8["finite_grads"], recipe
        # FP8 GEMMs move these logits by ~0.14 on average (measured, H100, random weights).
        assert (fp8["logits"] - out["bf16"]["logits"]).abs().mean() < 0.5, recipe


def test_only_the_gptmodel_deprecation_notice_is_filtered():
    """megatron-core 0.19 logs "GPTModel IS DEPRECATED" on every build (model/build.py keeps
    GPTModel knowingly): that notice is dropped, anything else its logger says is not."""
    import importlib.util
    import logging
    from pathlib import Path

    from megatron_rlcorr.model.build import _drop_gptmodel_deprecation

    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        _drop_gptmodel_deprecation()
        _drop_gptmodel_deprecation()  # once per process
        logger.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes")
        logger.warning("something else")
    finally:
        logger.removeHandler(handler)
    assert seen == ["something else"]
    assert len(logger.filters) == 1
    # The installed version's notice, where it has one, is the text the filter looks for.
    source = Path(importlib.util.find_spec("megatron.core").origin).parent / "models" / "gpt" / "gpt_model.py"
    text = source.read_text()
    assert "DEPRECATED" not in text or "GPTModel IS DEPRECATED" in text
