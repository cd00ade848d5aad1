"""tools/make_tiny_hf.py: the demo's Qwen2 checkpoint and DAPO parquet load, encode and score as the demo needs."""
import hashlib
import math
import importlib.util
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from megatron_rlcorr.data.rewards import dapo_math

_PATH = Path(__file__).resolve().parents[2] / "tools" / "make_tiny_hf.py"
_spec = importlib.util.spec_from_file_location("make_tiny_hf", _PATH)
mk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mk)

QUESTION = re.compile(r"What is (\d)\+(\d)\? Reply with Answer: <sum>")


@pytest.fixture(scope="module")
def out(tiny_hf):
    return tiny_hf  # conftest.py: the tool run once per session with --seed 0


@pytest.fixture(scope="module")
def tokenizer(out):
    return AutoTokenizer.from_pretrained(out / "model", local_files_only=True)


@pytest.fixture(scope="module")
def model(out):
    return AutoModelForCausalLM.from_pretrained(out / "model", local_files_only=True)


@pytest.fixture(scope="module")
def rows(out):
    return pq.read_table(out / "data" / "train.parquet").to_pylist()


@pytest.fixture(scope="module")
def val_rows(out):
    return pq.read_table(out / "data" / "val.parquet").to_pylist()


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_files(out):
    assert sorted(p.name for p in (out / "model").iterdir()) == sorted(mk.MODEL_FILES)
    assert (out / "data" / "train.parquet").is_file() and (out / "data" / "val.parquet").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["seed"] == 0 and manifest["rows"] == 80 and manifest["val_rows"] == 20
    assert manifest["parameters"] == 140_480


def test_config_is_a_small_qwen2(out, model, tokenizer):
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "max_position_embeddings")} == {
        "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128}
    assert config["vocab_size"] == len(tokenizer) == 133
    assert config["tie_word_embeddings"] is False and config["dtype"] == "float32"
    assert isinstance(model, Qwen2ForCausalLM) and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == 140_480


def test_weights_have_qwen2_biases_and_an_untied_head(out):
    with safe_open(out / "model" / "model.safetensors", "pt") as f:
        names = set(f.keys())
        head, embed = f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.1.self_attn.{proj}.bias" in names
    assert "model.layers.1.self_attn.o_proj.bias" not in names
    assert head.shape == embed.shape == (133, 64) and not torch.equal(head, embed)
    assert "model.layers.0.self_attn.k_proj.weight" in names


def test_tokenizer_special_tokens_and_digits(tokenizer):
    assert [tokenizer.convert_tokens_to_ids(t) for t in mk.SPECIAL_TOKENS] == [0, 1, 2]
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    ids = tokenizer.encode("Answer: 2048", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["Answer", ":", "Ġ", "2", "0", "4", "8"]
    text = "Answer: 12\nso 3 + 4 = 7!"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_loaded_tokenizer_equals_the_built_one(tokenizer, rows):
    built = mk.make_tokenizer()
    assert type(built) is type(tokenizer) and built.get_vocab() == tokenizer.get_vocab()
    for row in rows[:10]:
        assert mk.prompt_ids(built, row["prompt"]) == mk.prompt_ids(tokenizer, row["prompt"])


def test_chat_template_encodes_a_row(tokenizer, rows):
    row = rows[0]
    a, b = QUESTION.fullmatch(row["prompt"][0]["content"]).groups()
    ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=False)
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "<|im_start|>", "user", "Ċ", "What", "Ġis", "Ġ", a, "+", b, "?", "ĠReply", "Ġwith", "ĠAnswer", ":",
        "Ġ<", "sum", ">", "<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"]
    assert tokenizer.decode(ids) == (f"<|im_start|>user\nWhat is {a}+{b}? Reply with Answer: <sum><|im_end|>\n"
                                     "<|im_start|>assistant\n")
    without = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=False, return_dict=False)
    assert ids[:len(without)] == without and len(ids) == len(without) + 3


def test_generation_config(out, model):
    config = json.loads((out / "model" / "generation_config.json").read_text())
    assert config["eos_token_id"] == [2, 0] and config["pad_token_id"] == 0
    assert model.generation_config.eos_token_id == [2, 0]


def test_parquet_has_the_dapo_schema(out, rows, val_rows):
    for name in ("train.parquet", "val.parquet"):
        schema = pq.read_schema(out / "data" / name)
        assert schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
        assert schema.field("prompt").type == pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
        assert schema.field("reward_model").type == pa.struct([("ground_truth", pa.string()),
                                                               ("style", pa.string())])
        assert schema.field("extra_info").type == pa.struct([("index", pa.int64()), ("a", pa.int64()),
                                                             ("b", pa.int64())])
    pairs, indices = set(), set()
    for row in rows + val_rows:
        assert row["data_source"] == "math_dapo" and row["ability"] == "math"
        [message] = row["prompt"]
        assert message["role"] == "user"
        a, b = map(int, QUESTION.fullmatch(message["content"]).groups())
        assert row["reward_model"] == {"ground_truth": str(a + b), "style": "rule"}
        assert row["extra_info"]["a"] == a and row["extra_info"]["b"] == b
        pairs.add((a, b))
        indices.add(row["extra_info"]["index"])
    assert len(rows) + len(val_rows) == len(pairs) == len(indices) == 100


def test_validation_split_is_held_out_with_mirrors_in_training(rows, val_rows):
    """Every held-out sum a+b has a < b and its mirror b+a in the training split, never itself."""
    train = {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows}
    held_out = [(r["extra_info"]["a"], r["extra_info"]["b"]) for r in val_rows]
    assert len(held_out) == mk.VAL_ROWS == 20
    for a, b in held_out:
        assert a < b and (a, b) not in train and (b, a) in train


def test_seed_orders_the_rows():
    assert mk.dataset_rows(0) != mk.dataset_rows(1)
    assert sorted(r["prompt"][0]["content"] for r in mk.dataset_rows(0)) == sorted(
        r["prompt"][0]["content"] for r in mk.dataset_rows(1))


def test_warm_up_accuracy_at_temperature_1(out, model, tokenizer, rows):
    """transformers' own sampler, 4 samples of each of the 80 training prompts, scored by verl's DAPO verifier."""
    prompts = torch.tensor([mk.prompt_ids(tokenizer, row["prompt"]) for row in rows for _ in range(4)])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        generated = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                   temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=mk.MAX_NEW_TOKENS)
    texts = tokenizer.batch_decode(generated[:, prompts.shape[1]:], skip_special_tokens=True)
    truths = [row["reward_model"]["ground_truth"] for row in rows for _ in range(4)]
    accuracy = sum(dapo_math(t, g) > 0 for t, g in zip(texts, truths)) / len(texts)
    assert 0.2 <= accuracy <= 0.55, accuracy
    sampled = json.loads((out / "manifest.json").read_text())["sampled_accuracy"]
    assert sampled["samples"] == 200 and 0.2 <= sampled["accuracy"] <= 0.55


def test_second_run_does_nothing(out, capsys):
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert mk.main(["--out", str(out)]) == 0
    assert "already holds" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def test_another_seed_without_force_is_refused(out):
    with pytest.raises(SystemExit) as err:
        mk.main(["--out", str(out), "--seed", "1"])
    assert err.value.code == 2


def test_force_rewrites_the_same_bytes(out, capsys):
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "manifest.json")
    before = {p: (_sha(p), p.stat().st_mtime_ns) for p in files}
    manifest = json.loads((out / "manifest.json").read_text())
    assert mk.main(["--out", str(out), "--force"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert sorted(p for p in out.rglob("*") if p.is_file() and p.name != "manifest.json") == files
    for p in files:
        assert _sha(p) == before[p][0], p
    assert (out / "model" / "model.safetensors").stat().st_mtime_ns != before[out / "model" / "model.safetensors"][1]
    again = json.loads((out / "manifest.json").read_text())
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in manifest.items() if k != "seconds"}


# ---- --moe: the Qwen3-MoE checkpoint ----------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_out(tiny_hf_moe):
    return tiny_hf_moe  # conftest.py: the tool run once per session with --seed 0 --moe


def test_moe_config_and_weights(moe_out, tokenizer):
    from transformers import Qwen3MoeForCausalLM

    config = json.loads((moe_out / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == ["Qwen3MoeForCausalLM"]
    # transformers 5 writes the expert count as num_local_experts
    assert config.get("num_experts", config.get("num_local_experts")) == mk.MOE_SIZES["num_experts"] == 8
    assert {k: config[k] for k in ("num_experts_per_tok", "moe_intermediate_size", "mlp_only_layers",
                                   "norm_topk_prob", "num_hidden_layers", "head_dim", "intermediate_size")} == {
        "num_experts_per_tok": 2, "moe_intermediate_size": 64, "mlp_only_layers": [0], "norm_topk_prob": True,
        "num_hidden_layers": 3, "head_dim": 16, "intermediate_size": 256}
    assert config["vocab_size"] == len(tokenizer) and config["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(moe_out / "model", local_files_only=True)
    assert isinstance(model, Qwen3MoeForCausalLM)
    parameters = sum(p.numel() for p in model.parameters())
    assert json.loads((moe_out / "manifest.json").read_text())["parameters"] == parameters
    # the dense first layer, then the routers and experts; Qwen3's q/k norms and no q/k/v bias
    h, f, e, k = 64, 64, 8, 2
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert "model.layers.0.mlp.gate_proj.weight" in shapes and "model.layers.0.mlp.gate.weight" not in shapes
    for layer in (1, 2):
        assert shapes[f"model.layers.{layer}.mlp.gate.weight"] == (e, h)
        assert sum(math.prod(s) for n, s in shapes.items() if n.startswith(f"model.layers.{layer}.mlp.experts.")) \
            == e * 3 * h * f
    assert "model.layers.1.self_attn.q_norm.weight" in shapes and "model.layers.1.self_attn.q_proj.bias" not in shapes
    # the routing the model does: every token's top-2 of 8 experts, so the two MoE layers route (not dense)
    with torch.no_grad():
        out = model(input_ids=torch.arange(20)[None], output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape[-1] == e
    assert k == config["num_experts_per_tok"]


def test_moe_shares_the_tokenizer_data_and_warm_up(out, moe_out):
    """Byte-identical tokenizer files and parquets to the dense tool's, and a warm-up to the same target."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert _sha(moe_out / "model" / name) == _sha(out / "model" / name), name
    for name in ("data/train.parquet", "data/val.parquet"):
        assert _sha(moe_out / name) == _sha(out / name), name
    manifest = json.loads((moe_out / "manifest.json").read_text())
    assert manifest["model_type"] == "qwen3_moe" and manifest["seed"] == 0
    assert manifest["warmup"]["expected_accuracy"] >= mk.WARMUP_TARGET
    assert 0.2 <= manifest["sampled_accuracy"]["accuracy"] <= 0.55


def test_moe_checkpoint_reads_as_our_model_config(moe_out):
    from megatron_rlcorr.model.config import ModelConfig

    cfg = ModelConfig.from_dict({"hf_checkpoint": str(moe_out / "model")})
    moe = cfg.moe
    assert (moe.num_experts, moe.router_topk, moe.ffn_hidden_size, moe.dense_layers, moe.pre_softmax) == (
        8, 2, 64, (0,), False)                                 # norm_topk_prob true <-> not pre-softmax
    assert moe.shared_expert_ffn_hidden_size is None and cfg.qk_layernorm and not cfg.add_qkv_bias
    assert cfg.decoder_shape.moe_layers == (1, 2)
    assert cfg.decoder_shape.parameter_count == json.loads((moe_out / "manifest.json").read_text())["parameters"]


def test_moe_and_dense_directories_are_not_mixed_up(out, moe_out):
    for directory, flags in ((moe_out, []), (out, ["--moe"])):
        with pytest.raises(SystemExit) as err:
            mk.main(["--out", str(directory), *flags])
        assert err.value.code == 2


def test_moe_recipe_loads_with_the_files(moe_out, tmp_path, monkeypatch):
    """recipes/tiny_hf_moe_cpu.yaml, run where `runs/tiny_hf_moe_files` holds the tool's output (as demo.sh
    makes it), validates for 2 processes, with EP 2 too: routing replay, the checkpoint's experts."""
    from megatron_rlcorr.recipe import load_recipe

    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "tiny_hf_moe_files").symlink_to(moe_out)
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(_PATH.parents[1] / "recipes" / "tiny_hf_moe_cpu.yaml")
    assert recipe.check_layout(2) == 2
    assert recipe.rollout.routing_replay and recipe.model.moe.num_experts == 8
    assert load_recipe(_PATH.parents[1] / "recipes" / "tiny_hf_moe_cpu.yaml", ["parallel.ep=2"]).check_layout(2) == 2
    assert recipe.data.train_files == ["runs/tiny_hf_moe_files/data/train.parquet"]
