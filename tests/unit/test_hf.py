"""Hugging Face checkpoints without Megatron: config.json, names, sliced reads, the streaming
writer, and the plain-torch reference and the embedded engine against transformers."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from megatron_rlcorr.model.config import ModelConfig
from megatron_rlcorr.model.hf import HF_TO_NEUTRAL, HFCheckpoint, ShardedWriter, hf_name, neutral_name, plan_shards
from megatron_rlcorr.model.hf_config import config_for, read_architecture
from megatron_rlcorr.model.reference import reference_forward
from megatron_rlcorr.model.weights import neutral_weight_shapes
from megatron_rlcorr.rollout import EmbeddedEngine
from tests.hf_models import FAMILIES, VOCAB, hf_config, hf_log_probs, hf_logits, make_checkpoint, safetensors_tensors

TOKENS = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {family: make_checkpoint(root / family, family, seed=i, sharded=family == "qwen2")
            for i, family in enumerate(FAMILIES)}


def _full_weights(directory):
    cfg = ModelConfig.from_dict({"hf_checkpoint": str(directory)})
    source = HFCheckpoint(directory)
    weights = {n: source.read(n) for n in neutral_weight_shapes(cfg) if not (cfg.tie_embeddings and n == "lm_head.weight")}
    if cfg.tie_embeddings:
        weights["lm_head.weight"] = weights["embed.weight"]
    return cfg, weights


# ---- config.json -------------------------------------------------------------------------------

def test_architecture_of_each_family(checkpoints):
    qwen2, qwen3, llama = (ModelConfig.from_dict({"hf_checkpoint": str(checkpoints[f])}) for f in FAMILIES)
    assert (qwen2.add_qkv_bias, qwen2.qk_layernorm, qwen2.tie_embeddings, qwen2.head_dim) == (True, False, False, 8)
    assert (qwen3.add_qkv_bias, qwen3.qk_layernorm, qwen3.tie_embeddings, qwen3.head_dim) == (False, True, True, 16)
    assert (llama.rope_scaling, llama.rope_scaling_factor, llama.rotary_base, llama.head_dim) == (True, 8.0, 5e5, 16)
    for cfg in (qwen2, qwen3, llama):
        assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_attention_heads, cfg.num_query_groups,
                cfg.ffn_hidden_size, cfg.norm_epsilon) == (VOCAB, 32, 4, 4, 2, 48, 1e-5)


# A Qwen2.5-32B config.json as transformers 4 wrote it (published checkpoints), and LLaMA-3.1's.
QWEN25_32B_V4 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120,
    "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 64,
    "hidden_act": "silu", "rope_scaling": None, "use_cache": True,
}
LLAMA31_8B_V4 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


def test_transformers_4_style_configs():
    qwen = read_architecture(QWEN25_32B_V4, "x")
    assert qwen["rotary_base"] == 1e6 and qwen["num_query_groups"] == 8 and qwen["kv_channels"] is None
    assert qwen["add_qkv_bias"] and not qwen["rope_scaling"] and qwen["ffn_hidden_size"] == 27648
    llama = read_architecture(LLAMA31_8B_V4, "x")
    assert llama["rope_scaling"] and llama["rope_scaling_factor"] == 8.0 and llama["rotary_base"] == 5e5
    # the old "type" key of rope_scaling is read like "rope_type"
    old = {**LLAMA31_8B_V4, "rope_scaling": {**LLAMA31_8B_V4["rope_scaling"], "type": "llama3"}}
    del old["rope_scaling"]["rope_type"]
    assert read_architecture(old, "x") == llama


def test_transformers_5_style_configs_read_the_same():
    for family in FAMILIES:
        config = hf_config(family).to_dict()
        assert "rope_parameters" in config and config.get("rope_theta") is None
        arch = read_architecture(config, "x")
        assert arch["rotary_base"] == (5e5 if family == "llama" else 500.0)
        assert arch["rope_scaling"] == (family == "llama")


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported; supported: qwen2 (Qwen2, Qwen2.5), qwen3"),
    ({"model_type": "mixtral"}, "model_type 'mixtral' is not supported"),
    ({"num_experts": 64}, "mixture of experts"),
    ({"use_sliding_window": True}, "sliding-window attention"),
    ({"layer_types": ["sliding_attention"] * 64}, "sliding-window attention"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' (only silu"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"vocab_size": None}, "config.json has no 'vocab_size'"),
])
def test_unsupported_qwen_configs_name_the_feature(change, message):
    with pytest.raises(ValueError) as err:
        read_architecture({**QWEN25_32B_V4, **change}, "model.hf_checkpoint=/ckpt")
    assert message in str(err.value) and "model.hf_checkpoint=/ckpt" in str(err.value)


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"rope_scaling": {**LLAMA31_8B_V4["rope_scaling"], "high_freq_factor": 2.0}},
     "llama3 rope scaling needs a factor and Megatron-Core's fixed"),
])
def test_unsupported_llama_configs_name_the_feature(change, message):
    with pytest.raises(ValueError, match=message):
        read_architecture({**LLAMA31_8B_V4, **change}, "x")


def test_recipe_keys_must_agree_with_config_json(checkpoints):
    directory = str(checkpoints["qwen3"])
    agreeing = {"hf_checkpoint": directory, "hidden_size": 32, "norm_epsilon": "1e-5", "kv_channels": 16,
                "bf16": True, "make_vocab_size_divisible_by": 1}
    cfg = ModelConfig.from_dict(agreeing)
    assert cfg.bf16 and cfg.make_vocab_size_divisible_by == 1 and cfg.hf_checkpoint == directory
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict({"hf_checkpoint": directory, "num_layers": 2})
    assert "model.num_layers=2 disagrees with" in str(err.value) and "num_hidden_layers gives 4" in str(err.value)
    with pytest.raises(ValueError, match="model.qk_layernorm=False disagrees"):
        ModelConfig.from_dict({"hf_checkpoint": directory, "qk_layernorm": False})
    # kv_channels: None stands for hidden / heads, which the Qwen2 checkpoint implies
    assert ModelConfig.from_dict({"hf_checkpoint": str(checkpoints["qwen2"]), "kv_channels": None}).head_dim == 8


def test_bad_checkpoint_directories(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        ModelConfig.from_dict({"hf_checkpoint": str(tmp_path / "nope")})
    with pytest.raises(ValueError, match="has no config.json"):
        ModelConfig.from_dict({"hf_checkpoint": str(tmp_path)})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        ModelConfig.from_dict({"hf_checkpoint": str(tmp_path)})
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_32B_V4))
    with pytest.raises(ValueError, match="neither model.safetensors nor model.safetensors.index.json"):
        HFCheckpoint(tmp_path)


# ---- names and reading -------------------------------------------------------------------------

def test_every_neutral_name_has_a_hugging_face_name_and_back():
    cfg = ModelConfig(vocab_size=10, hidden_size=8, num_layers=3, num_attention_heads=2, ffn_hidden_size=16,
                      add_qkv_bias=True, qk_layernorm=True)
    names = list(neutral_weight_shapes(cfg))
    assert len({hf_name(n) for n in names}) == len(names)
    assert all(neutral_name(hf_name(n)) == n for n in names)
    assert hf_name("layers.2.q_norm.weight") == "model.layers.2.self_attn.q_norm.weight"
    assert neutral_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    assert len(HF_TO_NEUTRAL) == 3 + 14 + 8  # + router, expert gate/up/down, shared gate/up/down and its gate


def test_sliced_reads_equal_slices_of_the_full_tensor(checkpoints):
    source = HFCheckpoint(checkpoints["qwen2"])  # sharded over several files
    full = safetensors_tensors(checkpoints["qwen2"])
    q = full["model.layers.3.self_attn.q_proj.weight"]
    assert torch.equal(source.read("layers.3.q.weight", 0, 8, 24), q[8:24])
    assert torch.equal(source.read("layers.3.o.weight", 1, 16, 32),
                       full["model.layers.3.self_attn.o_proj.weight"][:, 16:32])
    assert torch.equal(source.read("embed.weight"), full["model.embed_tokens.weight"])
    assert source.bytes_read == (16 * 32 + 32 * 16 + VOCAB * 32) * 4
    assert source.shape("layers.0.gate.weight") == (48, 32)


def test_checkpoint_inventory_errors_name_the_tensors(checkpoints, tmp_path):
    cfg = ModelConfig.from_dict({"hf_checkpoint": str(checkpoints["qwen3"])})
    source = HFCheckpoint(checkpoints["qwen3"])
    source.check(neutral_weight_shapes(cfg), tied=True)  # the tied lm_head is not expected
    with pytest.raises(ValueError, match=r"missing: lm_head.weight"):
        source.check(neutral_weight_shapes(cfg), tied=False)
    wrong = {**neutral_weight_shapes(cfg), "layers.1.up.weight": (40, 32)}
    with pytest.raises(ValueError, match=r"shape: model.layers.1.mlp.up_proj.weight \(48, 32\) \(the model needs "
                                         r"\(40, 32\)\)"):
        source.check(wrong, tied=True)
    fewer = {n: s for n, s in neutral_weight_shapes(cfg).items() if not n.startswith("layers.3.")}
    with pytest.raises(ValueError, match=r"unexpected: model.layers.3"):
        source.check(fewer, tied=True)
    with pytest.raises(ValueError, match="has no tensor model.layers.9.q_proj.weight|has no tensor"):
        source.read("layers.9.q.weight")


def test_index_naming_missing_shards(checkpoints, tmp_path):
    (tmp_path / "config.json").write_text((checkpoints["qwen2"] / "config.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(ValueError, match="names shard files that do not exist"):
        HFCheckpoint(tmp_path)


# ---- writing -----------------------------------------------------------------------------------

def test_sharded_writer_takes_tensors_in_any_order(tmp_path):
    tensors = {f"t{i}": torch.randn(3 + i, 5) for i in range(5)}
    shards = plan_shards([(n, tuple(t.shape)) for n, t in tensors.items()], torch.float32, max_shard_bytes=200)
    assert [len(s) for s in shards] == [2, 1, 1, 1]  # 60 + 80 bytes, then 100, 120, 140: one each
    writer = ShardedWriter(tmp_path, shards, torch.float32)
    for name in reversed(list(tensors)):
        writer.write(name, tensors[name])
    writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())
    assert sorted(index["weight_map"]) == sorted(tensors)
    for name, tensor in tensors.items():
        with safe_open(str(tmp_path / index["weight_map"][name]), framework="pt") as f:
            assert f.metadata() == {"format": "pt"} and torch.equal(f.get_tensor(name), tensor)


def test_sharded_writer_errors(tmp_path):
    writer = ShardedWriter(tmp_path, [[("a", (2, 2)), ("b", (3,))]], torch.bfloat16)
    assert (tmp_path / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="b has shape \\(2,\\), the plan says \\(3,\\)"):
        writer.write("b", torch.zeros(2))
    with pytest.raises(ValueError, match="c is not in the export plan"):
        writer.write("c", torch.zeros(1))
    writer.write("a", torch.ones(2, 2))
    with pytest.raises(ValueError, match="a was written twice"):
        writer.write("a", torch.ones(2, 2))
    with pytest.raises(ValueError, match="export incomplete: 1 tensors never arrived, e.g. \\['b'\\]"):
        writer.close()


def test_new_config_json_is_the_family_that_fits():
    base = ModelConfig(vocab_size=10, hidden_size=8, num_layers=1, num_attention_heads=2, ffn_hidden_size=16)
    assert config_for(base.decoder_shape, 64, torch.bfloat16)["model_type"] == "llama"
    import dataclasses
    qwen2 = dataclasses.replace(base.decoder_shape, add_qkv_bias=True)
    assert config_for(qwen2, 64, torch.float32)["model_type"] == "qwen2"
    qwen3 = dataclasses.replace(base.decoder_shape, qk_layernorm=True)
    config = config_for(qwen3, 64, torch.bfloat16)
    assert config["model_type"] == "qwen3" and config["dtype"] == "bfloat16" and config["head_dim"] == 4
    assert read_architecture(config, "x")["qk_layernorm"]
    with pytest.raises(ValueError, match="no Hugging Face family"):
        config_for(dataclasses.replace(qwen3, add_qkv_bias=True), 64, torch.float32)
    # a source's own config keeps its style: torch_dtype stays torch_dtype
    assert config_for(base.decoder_shape, 64, torch.float32, source=QWEN25_32B_V4)["torch_dtype"] == "float32"


# ---- the reference forward and the embedded engine against transformers -----------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_reference_forward_matches_transformers(checkpoints, family):
    cfg, weights = _full_weights(checkpoints[family])
    torch.testing.assert_close(reference_forward(weights, cfg, TOKENS), hf_logits(checkpoints[family], TOKENS),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_embedded_engine_log_probs_match_transformers(checkpoints, family):
    cfg, weights = _full_weights(checkpoints[family])
    engine = EmbeddedEngine(cfg.decoder_shape, precision="fp32")
    engine.load_weights(weights)
    prompts, responses = [t[:6].tolist() for t in TOKENS], [t[6:].tolist() for t in TOKENS]
    expected = hf_log_probs(checkpoints[family], TOKENS, 0.7)[:, 5:]
    for got, want in zip(engine.score(prompts, responses, temperature=0.7), expected):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # and generation reports the same log-probs for what it samples
    out = engine.generate(prompts, max_new_tokens=6, temperature=0.7, generator=torch.Generator().manual_seed(0))
    sampled = torch.tensor([p + r for p, r in zip(prompts, out.response_ids)])
    again = hf_log_probs(checkpoints[family], sampled, 0.7)[:, 5:]
    for got, want in zip(out.logprobs, again):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
