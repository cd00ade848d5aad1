"""Architecture presets (model/presets.py): each is read like a checkpoint's config.json, builds a
DecoderShape, and has its model's published parameter count; unknown names are refused helpfully."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_rlcorr.model.architecture import DecoderShape, MoeShape
from megatron_rlcorr.model.hf_config import read_architecture
from megatron_rlcorr.model.presets import ARCHITECTURES, preset_architecture, preset_config

SHAPE_FIELDS = [f.name for f in dataclasses.fields(DecoderShape)]

# Total parameters as published: the safetensors total Hugging Face reports for the checkpoint
# (`safetensors.total` of https://huggingface.co/api/models/<repo>, the "Model size" on its page).
# Where a number was found only for the instruct twin, the twin has the same architecture.
PUBLISHED_PARAMETERS = {
    # Qwen/Qwen2.5-1.5B: 1,543,714,304, the HF API total for Qwen/Qwen2.5-1.5B-Instruct (same
    # architecture) as quoted by several repositories, and FAR.AI robust-llm's table of Qwen2.5
    # base-model sizes.
    "qwen2.5-1.5b": 1_543_714_304,
    # Qwen/Qwen2.5-7B at revision d149729398750b98c0af14eb82c78cfe92750796: 7,615,616,512; the same
    # total is the HF API's for Qwen/Qwen2.5-7B-Instruct.
    "qwen2.5-7b": 7_615_616_512,
    # Qwen/Qwen2.5-32B at revision 1818d35814b8319459f4bd55ed1ac8709630f003: 771 tensors,
    # 32,763,876,352 parameters (keras-hub's qwen2.5_instruct_32b_en preset has the same).
    "qwen2.5-32b": 32_763_876_352,
    # Qwen/Qwen2.5-72B at revision efba10c8e54e91e0d9570ab5f7b51a958474d4cb: 72,706,203,648
    # (keras-hub's qwen2.5_instruct_72b_en preset has the same).
    "qwen2.5-72b": 72_706_203_648,
    # Qwen/Qwen3-8B: 8,190,735,360, HF API safetensors total (keras-hub's qwen3_8b_en preset has
    # the same).
    "qwen3-8b": 8_190_735_360,
    # Qwen/Qwen3-32B: {"BF16": 32762123264}, HF API safetensors parameters (keras-hub's qwen3_32b_en).
    "qwen3-32b": 32_762_123_264,
    # meta-llama/Llama-3.1-8B: 8,030,261,248 (keras-hub's llama3.1_8b preset; HF API total of
    # meta-llama/Llama-3.1-8B-Instruct).
    "llama-3.1-8b": 8_030_261_248,
    # meta-llama/Llama-3.1-70B: 70,553,706,496, the HF API total of meta-llama/Llama-3.3-70B(-Instruct),
    # whose config has the same shapes as Llama-3.1-70B's (no total quoted for the 3.1 repo itself).
    "llama-3.1-70b": 70_553_706_496,
    # Qwen/Qwen3-30B-A3B: 30,532,122,624 (llama.cpp's general.parameter_count of its GGUF conversions,
    # which keep every tensor; the model card's "30.5B").
    "qwen3-30b-a3b": 30_532_122_624,
    # Qwen/Qwen3-235B-A22B: {"BF16": 235093634560}, HF API safetensors parameters (keras-hub's
    # qwen3_moe_235b_a22b_en preset has the same).
    "qwen3-235b-a22b": 235_093_634_560,
}
# Active parameters per token as the model cards round them ("A3B": 3.3B activated; "A22B": 22B).
PUBLISHED_ACTIVE = {"qwen3-30b-a3b": 3.3e9, "qwen3-235b-a22b": 22e9}
# The cards give one or two significant digits: 3.3B stands for 3.25..3.35B, so 2% either side.
ACTIVE_TOLERANCE = 0.02


def _shape(name: str) -> DecoderShape:
    arch = preset_architecture(name)
    moe = arch["moe"] and MoeShape(**arch["moe"])
    return DecoderShape(**{key: arch[key] for key in SHAPE_FIELDS if key != "moe"}, moe=moe)


def _count_from_config(config: dict) -> int:
    """Parameters counted tensor by tensor from config.json alone (the Hugging Face names), written
    independently of DecoderShape.parameter_count."""
    h, vocab, layers = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    heads, kv_heads, ffn = config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
    head_dim = config.get("head_dim") or h // heads
    qwen2, qwen3 = config["model_type"] == "qwen2", config["model_type"] in ("qwen3", "qwen3_moe")
    tensors = {
        "self_attn.q_proj.weight": heads * head_dim * h,
        "self_attn.k_proj.weight": kv_heads * head_dim * h,
        "self_attn.v_proj.weight": kv_heads * head_dim * h,
        "self_attn.o_proj.weight": h * heads * head_dim,
        "self_attn.q_proj.bias": heads * head_dim if qwen2 else 0,
        "self_attn.k_proj.bias": kv_heads * head_dim if qwen2 else 0,
        "self_attn.v_proj.bias": kv_heads * head_dim if qwen2 else 0,
        "self_attn.q_norm.weight": head_dim if qwen3 else 0,
        "self_attn.k_norm.weight": head_dim if qwen3 else 0,
        "mlp.gate_proj.weight": ffn * h,
        "mlp.up_proj.weight": ffn * h,
        "mlp.down_proj.weight": h * ffn,
        "input_layernorm.weight": h,
        "post_attention_layernorm.weight": h,
    }
    if config["model_type"] == "qwen3_moe":  # these presets: every layer sparse, no shared expert
        assert config["decoder_sparse_step"] == 1 and not config["mlp_only_layers"]
        experts, moe_ffn = config["num_experts"], config["moe_intermediate_size"]
        del tensors["mlp.gate_proj.weight"], tensors["mlp.up_proj.weight"], tensors["mlp.down_proj.weight"]
        tensors["mlp.gate.weight"] = experts * h
        tensors["mlp.experts.{e}.gate_proj|up_proj|down_proj.weight"] = experts * 3 * moe_ffn * h
    embed_tokens, norm = vocab * h, h
    lm_head = 0 if config["tie_word_embeddings"] else vocab * h
    return embed_tokens + layers * sum(tensors.values()) + norm + lm_head


# The Qwen2.5 Instruct presets: their base model's shapes and count, a 32k context and eps 1e-6.
PUBLISHED_PARAMETERS.update({f"{name}-instruct": PUBLISHED_PARAMETERS[name]
                             for name in ("qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b")})


def test_the_presets_asked_for_exist():
    assert set(PUBLISHED_PARAMETERS) == set(ARCHITECTURES)
    for name in ("qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b"):
        instruct = preset_architecture(f"{name}-instruct")
        assert (instruct["max_position_embeddings"], instruct["norm_epsilon"]) == (32768, 1e-6)
        assert {k: v for k, v in instruct.items() if k not in ("max_position_embeddings", "norm_epsilon")} == \
            {k: v for k, v in preset_architecture(name).items() if k not in ("max_position_embeddings", "norm_epsilon")}
    assert all(name == name.lower() for name in ARCHITECTURES)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_every_preset_reads_as_a_checkpoint_and_builds_a_decoder_shape(name):
    config = preset_config(name)
    arch = preset_architecture(name)
    assert arch == read_architecture(config, "x")
    assert set(SHAPE_FIELDS) <= set(arch)
    shape = _shape(name)
    assert (shape.vocab_size, shape.hidden_size, shape.num_layers) == (
        config["vocab_size"], config["hidden_size"], config["num_hidden_layers"])
    assert shape.head_dim == config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    assert shape.add_qkv_bias == name.startswith("qwen2.5")
    assert shape.qk_layernorm == name.startswith("qwen3")
    assert shape.rope_scaling == name.startswith("llama-3.1")
    assert arch["max_position_embeddings"] == config["max_position_embeddings"]
    assert (shape.moe is not None) == (config["model_type"] == "qwen3_moe")


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_parameter_count_is_the_published_one(name):
    assert _shape(name).parameter_count == PUBLISHED_PARAMETERS[name]
    assert _count_from_config(preset_config(name)) == PUBLISHED_PARAMETERS[name]


@pytest.mark.parametrize("name", list(PUBLISHED_ACTIVE))
def test_moe_presets_active_parameters_are_the_published_ones(name):
    shape, config = _shape(name), preset_config(name)
    active = shape.active_parameter_count
    assert abs(active / PUBLISHED_ACTIVE[name] - 1) < ACTIVE_TOLERANCE, (name, active)
    # every layer holds 8 of 128 experts' worth of active expert weights; the rest is shared by both counts
    inactive_experts = config["num_experts"] - config["num_experts_per_tok"]
    expert = 3 * config["hidden_size"] * config["moe_intermediate_size"]
    assert shape.parameter_count - active == config["num_hidden_layers"] * inactive_experts * expert
    assert shape.moe_layers == tuple(range(config["num_hidden_layers"]))
    moe = shape.moe
    assert (moe.num_experts, moe.router_topk, moe.pre_softmax) == (128, 8, False)
    assert moe.shared_expert_ffn_hidden_size is None
    assert shape.head_dim == 128 != shape.hidden_size // shape.num_attention_heads


def test_qwen25_32b_counted_by_hand():
    # Qwen2.5-32B: vocab 152064, hidden 5120, 64 layers, 40 query heads and 8 K/V heads of 128,
    # SwiGLU width 27648, q/k/v bias, untied output layer.
    embedding = 152064 * 5120                       # 778,567,680
    q = 5120 * 5120 + 5120                          # weight + bias: 26,219,520
    k = 5120 * 1024 + 1024                          # 8 heads * 128 = 1024 rows: 5,243,904
    v = 5120 * 1024 + 1024                          # 5,243,904
    o = 5120 * 5120                                 # 26,214,400
    mlp = 3 * 5120 * 27648                          # gate, up, down: 424,673,280
    norms = 2 * 5120                                # input and post-attention RMSNorm: 10,240
    layer = q + k + v + o + mlp + norms             # 487,605,248
    final_norm = 5120
    head = 152064 * 5120                            # untied lm_head: 778,567,680
    assert layer == 487_605_248
    total = embedding + 64 * layer + final_norm + head
    assert total == 32_763_876_352
    assert _shape("qwen2.5-32b").layer_parameters == layer
    assert _shape("qwen2.5-32b").parameter_count == total


def test_qwen25_32b_values():
    config = preset_config("qwen2.5-32b")
    assert {k: config[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "intermediate_size", "tie_word_embeddings",
                                   "rope_theta", "max_position_embeddings")} == {
        "vocab_size": 152064, "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 40,
        "num_key_value_heads": 8, "intermediate_size": 27648, "tie_word_embeddings": False,
        "rope_theta": 1e6, "max_position_embeddings": 131072}


def test_names_are_case_insensitive_and_configs_are_copies():
    assert preset_architecture("Qwen2.5-32B") == preset_architecture("qwen2.5-32b")
    assert preset_config("LLAMA-3.1-8B") == ARCHITECTURES["llama-3.1-8b"]
    config = preset_config("llama-3.1-8b")
    config["rope_scaling"]["factor"] = 32.0
    config["hidden_size"] = 1
    assert ARCHITECTURES["llama-3.1-8b"]["rope_scaling"]["factor"] == 8.0
    assert preset_config("llama-3.1-8b")["hidden_size"] == 4096


@pytest.mark.parametrize("name, closest", [("qwen2.5-32", "qwen2.5-32b"), ("Llama3.1-70B", "llama-3.1-70b"),
                                           ("qwen3_8b", "qwen3-8b")])
def test_unknown_name_suggests_the_closest_preset(name, closest):
    with pytest.raises(ValueError) as err:
        preset_architecture(name)
    message = str(err.value)
    assert message.startswith("model.architecture")
    assert repr(name) in message
    assert f'did you mean "{closest}"' in message
    assert all(preset in message for preset in ARCHITECTURES)


def test_unknown_name_with_nothing_close_lists_the_presets():
    with pytest.raises(ValueError, match=r"model\.architecture: unknown architecture 'mixtral-8x7b'; presets: "):
        preset_config("mixtral-8x7b")
