"""Mixture-of-experts Hugging Face checkpoints without Megatron (model/hf_config.py, model/hf.py):
Qwen3-MoE and Qwen2-MoE config.json -> model.moe (both expert-count spellings, transformers' rule
for the dense layers, router softmax, shared expert, refusals), agreement with a recipe and a
preset field by field, expert tensor names, and the plain-torch reference forward on the
checkpoint's weights against transformers' logits and per-layer expert choices."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rlcorr.model.config import ModelConfig
from megatron_rlcorr.model.hf import HFCheckpoint, ShardedWriter, hf_name, neutral_name, plan_shards
from megatron_rlcorr.model.hf_config import config_for, read_architecture, write_config
from megatron_rlcorr.model.presets import preset_config
from megatron_rlcorr.model.reference import reference_forward
from megatron_rlcorr.model.weights import neutral_weight_shapes
from tests.hf_models import COMMON, MOE_COMMON, MOE_FAMILIES, VOCAB, hf_config, load_model, make_checkpoint

TOKENS = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_moe")
    return {family: make_checkpoint(root / family, family, seed=10 + i) for i, family in enumerate(MOE_FAMILIES)}


def _full_weights(directory):
    cfg = ModelConfig.from_dict({"hf_checkpoint": str(directory)})
    source = HFCheckpoint(directory)
    return cfg, {n: source.read(n) for n in neutral_weight_shapes(cfg)}


# ---- config.json -------------------------------------------------------------------------------

def test_moe_settings_of_each_family(checkpoints):
    qwen3 = ModelConfig.from_dict({"hf_checkpoint": str(checkpoints["qwen3_moe"])})
    qwen2 = ModelConfig.from_dict({"hf_checkpoint": str(checkpoints["qwen2_moe"])})
    assert (qwen3.qk_layernorm, qwen3.add_qkv_bias, qwen3.head_dim) == (True, False, 16)
    assert (qwen2.qk_layernorm, qwen2.add_qkv_bias, qwen2.head_dim) == (False, True, 8)
    assert (qwen3.moe.num_experts, qwen3.moe.router_topk, qwen3.moe.ffn_hidden_size) == (4, 2, 16)
    assert (qwen3.moe.dense_layers, qwen3.moe.pre_softmax, qwen3.moe.shared_expert_ffn_hidden_size) == ((0,), False, None)
    assert (qwen2.moe.dense_layers, qwen2.moe.pre_softmax, qwen2.moe.shared_expert_ffn_hidden_size) == ((0, 2), True, 24)
    assert qwen3.decoder_shape.moe_layers == (1, 2, 3) and qwen2.decoder_shape.moe_layers == (1, 3)
    assert qwen3.ffn_hidden_size == qwen2.ffn_hidden_size == 48  # the dense layers' MLP
    # RL defaults: router_aux_loss_coef is not read
    assert qwen3.moe.aux_loss_coeff == 0.0 and qwen2.moe.aux_loss_coeff == 0.0


def test_both_expert_count_spellings():
    config = hf_config("qwen3_moe").to_dict()
    assert config.get("num_local_experts") == 4 and "num_experts" not in config  # how transformers 5 writes it
    v5 = read_architecture(config, "x")["moe"]
    v4 = {k: v for k, v in config.items() if k != "num_local_experts"}
    assert read_architecture({**v4, "num_experts": 4}, "x")["moe"] == v5
    assert read_architecture({**config, "num_experts": 4}, "x")["moe"] == v5  # both, agreeing
    with pytest.raises(ValueError, match="num_experts=8 and num_local_experts=4; they name the same count"):
        read_architecture({**config, "num_experts": 8}, "x")
    with pytest.raises(ValueError, match="neither 'num_experts' nor 'num_local_experts'"):
        read_architecture(v4, "x")
    with pytest.raises(ValueError, match="needs num_experts >= 1, got 0"):
        read_architecture({**v4, "num_experts": 0}, "x")


@pytest.mark.parametrize("mlp_only_layers, step", [([], 1), ([0], 1), ([], 2), ([1, 4], 3), ([5, 40], 2)])
def test_dense_layers_follow_transformers(mlp_only_layers, step):
    """Which layers transformers builds with experts, read off its model, against dense_layers."""
    import transformers

    config = transformers.Qwen2MoeConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=6,
                                         num_attention_heads=2, num_key_value_heads=1, num_experts=2,
                                         num_experts_per_tok=1, moe_intermediate_size=4,
                                         shared_expert_intermediate_size=4, mlp_only_layers=mlp_only_layers,
                                         decoder_sparse_step=step)
    model = transformers.AutoModelForCausalLM.from_config(config)
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    moe = read_architecture(config.to_dict(), "x")["moe"]
    assert [i for i in range(6) if i not in moe["dense_layers"]] == sparse


def test_router_softmax_and_shared_expert_keys():
    import transformers

    qwen3, qwen2 = hf_config("qwen3_moe").to_dict(), hf_config("qwen2_moe").to_dict()
    assert read_architecture({**qwen3, "norm_topk_prob": True}, "x")["moe"]["pre_softmax"] is False
    assert read_architecture({**qwen3, "norm_topk_prob": False}, "x")["moe"]["pre_softmax"] is True
    # absent: transformers' default for each family
    for family, config in (("qwen3_moe", qwen3), ("qwen2_moe", qwen2)):
        default = transformers.AutoConfig.for_model(family).norm_topk_prob
        absent = {k: v for k, v in config.items() if k != "norm_topk_prob"}
        assert read_architecture(absent, "x")["moe"]["pre_softmax"] is (not default)
    for width in (0, None):
        assert read_architecture({**qwen2, "shared_expert_intermediate_size": width}, "x")["moe"][
            "shared_expert_ffn_hidden_size"] is None
    # transformers 5's qkv_bias switch of qwen2_moe
    assert read_architecture(qwen2, "x")["add_qkv_bias"] is True
    assert read_architecture({**qwen2, "qkv_bias": False}, "x")["add_qkv_bias"] is False
    # qwen3_moe ignores a shared expert width (it has none)
    assert read_architecture({**qwen3, "shared_expert_intermediate_size": 64}, "x")["moe"][
        "shared_expert_ffn_hidden_size"] is None


@pytest.mark.parametrize("family, change, message", [
    ("qwen2_moe", {"shared_expert_intermediate_size": "drop"}, "no 'shared_expert_intermediate_size'"),
    ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer, got 0"),
    ("qwen2_moe", {"mlp_only_layers": "0"}, "mlp_only_layers must be a list of layer indices"),
    ("qwen2_moe", {"use_sliding_window": True}, "sliding-window attention"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias=true"),
    ("qwen3_moe", {"num_experts_per_tok": None}, "config.json has no 'num_experts_per_tok'"),
    ("qwen3_moe", {"moe_intermediate_size": None}, "config.json has no 'moe_intermediate_size'"),
    ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("qwen3_moe", {"model_type": "mixtral"}, "model_type 'mixtral' is not supported"),
    ("qwen3_moe", {"model_type": "qwen3"}, "qwen3 with mixture of experts (num_experts; supported as qwen3_moe"),
])
def test_unrepresentable_moe_configs_name_the_feature(family, change, message):
    config = hf_config(family).to_dict()
    config.update({k: v for k, v in change.items() if v != "drop"})
    for key in (k for k, v in change.items() if v == "drop"):
        del config[key]
    with pytest.raises(ValueError) as err:
        read_architecture(config, "model.hf_checkpoint=/ckpt")
    assert message in str(err.value) and "model.hf_checkpoint=/ckpt" in str(err.value)


def test_recipe_moe_keys_agree_field_by_field(checkpoints):
    directory = str(checkpoints["qwen3_moe"])
    cfg = ModelConfig.from_dict({"hf_checkpoint": directory,
                                 "moe": {"router_topk": 2, "dense_layers": [0], "aux_loss_coeff": 0.01,
                                         "token_dispatcher": "allgather"}})
    assert (cfg.moe.router_topk, cfg.moe.num_experts, cfg.moe.aux_loss_coeff, cfg.moe.token_dispatcher) == (
        2, 4, 0.01, "allgather")
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict({"hf_checkpoint": directory, "moe": {"router_topk": 3}})
    assert "model.moe.router_topk=3 disagrees with" in str(err.value) and "num_experts_per_tok gives 2" in str(err.value)
    with pytest.raises(ValueError, match=r"model.moe.dense_layers=\[1\] disagrees .*mlp_only_layers / decoder_sparse"):
        ModelConfig.from_dict({"hf_checkpoint": directory, "moe": {"dense_layers": [1]}})
    with pytest.raises(ValueError, match="model.moe=None disagrees"):
        ModelConfig.from_dict({"hf_checkpoint": directory, "moe": None})


def test_moe_settings_on_a_dense_checkpoint_are_refused(tmp_path):
    dense = make_checkpoint(tmp_path / "qwen3", "qwen3")
    assert ModelConfig.from_dict({"hf_checkpoint": str(dense)}).moe is None
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict({"hf_checkpoint": str(dense), "moe": {"aux_loss_coeff": 0.01}})
    assert "model.moe={'aux_loss_coeff': 0.01} disagrees with" in str(err.value)
    assert "(model_type / num_experts gives None)" in str(err.value)


def test_preset_agreement_names_moe_fields(tmp_path):
    import json

    config = preset_config("qwen3-30b-a3b")
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_experts": 64, "norm_topk_prob": False}))
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict({"hf_checkpoint": str(tmp_path), "architecture": "qwen3-30b-a3b"})
    message = str(err.value)
    assert "moe.num_experts (num_experts / num_local_experts): checkpoint 64, preset 128" in message
    assert "moe.pre_softmax (norm_topk_prob): checkpoint True, preset False" in message
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_dict({"hf_checkpoint": str(tmp_path), "architecture": "qwen3-30b-a3b",
                                 "moe": {"aux_loss_coeff": 0.001}})
    assert (cfg.moe.num_experts, cfg.moe.router_topk, cfg.moe.aux_loss_coeff) == (128, 8, 0.001)
    with pytest.raises(ValueError, match=r"model.moe.num_experts=64 disagrees with model.architecture: qwen3-30b-a3b"):
        ModelConfig.from_dict({"architecture": "qwen3-30b-a3b", "moe": {"num_experts": 64}})


# ---- names and reading -------------------------------------------------------------------------

@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_names_are_the_checkpoints(checkpoints, family):
    cfg = ModelConfig.from_dict({"hf_checkpoint": str(checkpoints[family])})
    source = HFCheckpoint(checkpoints[family])
    names = list(neutral_weight_shapes(cfg))
    assert {hf_name(n) for n in names} == set(source.shapes())
    assert all(neutral_name(hf_name(n)) == n for n in names)
    source.check(neutral_weight_shapes(cfg), tied=False)
    assert hf_name("layers.3.experts.2.down.weight") == "model.layers.3.mlp.experts.2.down_proj.weight"
    assert hf_name("layers.1.router.weight") == "model.layers.1.mlp.gate.weight"
    assert neutral_name("model.layers.1.mlp.experts.3.gate_proj.weight") == "layers.1.experts.3.gate.weight"
    assert neutral_name("model.layers.1.mlp.experts.3.bias") is None
    if family == "qwen2_moe":
        assert neutral_name("model.layers.3.mlp.shared_expert_gate.weight") == "layers.3.shared_gate.weight"
        assert hf_name("layers.1.shared.up.weight") == "model.layers.1.mlp.shared_expert.up_proj.weight"
    # an expert slice (one expert-parallel rank's expert, one ETP rank's rows) reads only those bytes
    before = source.bytes_read
    rows = source.read("layers.3.experts.1.up.weight", 0, 8, 16)
    assert torch.equal(rows, source.read("layers.3.experts.1.up.weight")[8:16])
    assert source.bytes_read - before == (8 * 32 + 16 * 32) * 4


def test_zero_width_shared_expert_is_no_shared_expert(tmp_path):
    """qwen2_moe with shared_expert_intermediate_size 0: transformers keeps zero-width shared experts
    and their gates, which add nothing; the model has none, and the logits agree."""
    import transformers

    config = transformers.Qwen2MoeConfig(**COMMON, **MOE_COMMON, shared_expert_intermediate_size=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(0.2 * torch.randn(param.shape) + (1.0 if name.endswith("norm.weight") else 0.0))
    model.save_pretrained(tmp_path)
    cfg, weights = _full_weights(tmp_path)
    assert cfg.moe.shared_expert_ffn_hidden_size is None and not any("shared" in n for n in weights)
    HFCheckpoint(tmp_path).check(neutral_weight_shapes(cfg), tied=False)
    with torch.no_grad():
        expected = model.eval()(TOKENS).logits
    torch.testing.assert_close(reference_forward(weights, cfg, TOKENS), expected, atol=1e-5, rtol=0)


# ---- export config.json ------------------------------------------------------------------------

@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_new_moe_config_json_loads_in_transformers(checkpoints, family, tmp_path):
    """config_for's config.json and the checkpoint's tensors under hf_name, written by ShardedWriter:
    transformers loads them with no missing or unexpected key and gives the source's logits."""
    cfg, weights = _full_weights(checkpoints[family])
    config = config_for(cfg.decoder_shape, cfg.max_position_embeddings, torch.float32)
    assert config["model_type"] == family and config["architectures"] == [type(load_model(checkpoints[family])).__name__]
    assert read_architecture(config, "x")["moe"] == read_architecture(hf_config(family).to_dict(), "x")["moe"]
    entries = [(hf_name(n), tuple(t.shape)) for n, t in weights.items()]
    writer = ShardedWriter(tmp_path, plan_shards(entries, torch.float32, max_shard_bytes=64 * 1024), torch.float32)
    for name, tensor in weights.items():
        writer.write(hf_name(name), tensor)
    writer.close()
    write_config(tmp_path, config)
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                     output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(TOKENS).logits, load_model(checkpoints[family])(TOKENS).logits,
                                   atol=0, rtol=0)


def test_moe_shapes_without_a_family_are_refused():
    qwen3 = ModelConfig.from_dict({"architecture": "qwen3-30b-a3b"}).decoder_shape
    assert config_for(qwen3, 64, torch.bfloat16)["num_experts"] == 128
    shared = dataclasses.replace(qwen3.moe, shared_expert_ffn_hidden_size=64)
    with pytest.raises(ValueError, match="q/k norms True and a shared expert True: no Hugging Face family"):
        config_for(dataclasses.replace(qwen3, moe=shared), 64, torch.float32)
    with pytest.raises(ValueError, match="q/k norms False and a shared expert False: no Hugging Face family"):
        config_for(dataclasses.replace(qwen3, qk_layernorm=False), 64, torch.float32)


# ---- the reference forward against transformers ------------------------------------------------

@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_reference_forward_matches_transformers_with_the_same_experts(checkpoints, family):
    cfg, weights = _full_weights(checkpoints[family])
    routing: list[torch.Tensor] = []
    logits = reference_forward(weights, cfg, TOKENS, routing=routing)
    with torch.no_grad():
        out = load_model(checkpoints[family])(TOKENS, output_router_logits=True)
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=0)
    # transformers records the router logits of its MoE layers, in order
    assert len(out.router_logits) == len(routing) == len(cfg.decoder_shape.moe_layers)
    for router_logits, chosen_BTK in zip(out.router_logits, routing):
        hf_BTK = router_logits.float().softmax(-1).topk(cfg.moe.router_topk, dim=-1).indices.view(chosen_BTK.shape)
        assert torch.equal(hf_BTK.sort(-1).values, chosen_BTK.sort(-1).values)
