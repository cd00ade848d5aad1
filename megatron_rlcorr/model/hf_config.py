"""Hugging Face config.json <-> the architecture (ModelConfig's architecture fields).

Supported families (transformers' `model_type`): `qwen2` (Qwen2, Qwen2.5: q/k/v bias), `qwen3`
(Qwen3 dense: RMSNorm of each query and key head, explicit head_dim), `llama` (LLaMA, LLaMA-3,
LLaMA-3.1 with its rope scaling), and the mixtures of experts `qwen3_moe` (Qwen3-30B-A3B,
Qwen3-235B-A22B: Qwen3's attention) and `qwen2_moe` (Qwen1.5-MoE, Qwen2-57B-A14B: Qwen2's q/k/v
bias, a shared expert with a sigmoid gate). Both config.json styles are read: transformers 4
(top-level `rope_theta`, `rope_scaling`, `torch_dtype`, `num_experts`) and transformers 5
(`rope_parameters`, `dtype`, and `num_local_experts` for qwen3_moe). Anything the Megatron model
cannot represent (MoE in another family, sliding-window attention, biases other than Qwen2's q/k/v,
other activations or rope types) is refused with the feature named.

MoE keys (architecture.MoeShape, the recipe's `model.moe`): `num_experts` / `num_local_experts`
(equal when both are given) -> num_experts; `num_experts_per_tok` -> router_topk;
`moe_intermediate_size` -> ffn_hidden_size; transformers' rule for which layers are sparse (layer
i is a MoE layer iff i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0) ->
dense_layers, the complement; `norm_topk_prob` -> pre_softmax = not norm_topk_prob (false when
absent, transformers' default for both families); qwen2_moe's `shared_expert_intermediate_size` ->
shared_expert_ffn_hidden_size (0 or null: none). `router_aux_loss_coef` is not read: it is a
pre-training setting, and RL runs with `model.moe.aux_loss_coeff` (default 0, config.py).
`output_router_logits` changes no weight or logit and is ignored.

Reading, merging with a recipe's keys or a preset (nested `moe` compared field by field), and
writing a config.json for an export (`config_for`). This module imports only architecture.py: it
is what config.py and presets.py read checkpoints' configs with, and it comes before the names and
loading (weights.py, hf.py), which import config.py.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .architecture import LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT, DecoderShape

SUPPORTED_MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                         "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
_SUPPORTED_TEXT = ("qwen2 (Qwen2, Qwen2.5), qwen3 (Qwen3 dense), llama (LLaMA, LLaMA-3, LLaMA-3.1), "
                   "qwen3_moe (Qwen3-30B-A3B, Qwen3-235B-A22B), qwen2_moe (Qwen1.5-MoE, Qwen2-57B-A14B)")

CONFIG_FILE = "config.json"

# Where each architecture field comes from in config.json (for messages).
_CONFIG_KEY = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads", "num_query_groups": "num_key_value_heads",
    "ffn_hidden_size": "intermediate_size", "kv_channels": "head_dim",
    "max_position_embeddings": "max_position_embeddings", "rotary_base": "rope_theta",
    "add_qkv_bias": "model_type", "qk_layernorm": "model_type", "tie_embeddings": "tie_word_embeddings",
    "norm_epsilon": "rms_norm_eps", "rope_scaling": "rope_scaling.rope_type",
    "rope_scaling_factor": "rope_scaling.factor", "moe": "model_type / num_experts",
}
_MOE_CONFIG_KEY = {
    "num_experts": "num_experts / num_local_experts", "router_topk": "num_experts_per_tok",
    "ffn_hidden_size": "moe_intermediate_size", "dense_layers": "mlp_only_layers / decoder_sparse_step",
    "pre_softmax": "norm_topk_prob", "shared_expert_ffn_hidden_size": "shared_expert_intermediate_size",
}
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")


# ---- reading -------------------------------------------------------------------------------------

def read_config(directory: str | Path) -> dict[str, Any]:
    """config.json of a Hugging Face checkpoint directory, with errors that name the path."""
    path = Path(directory) / CONFIG_FILE
    if not Path(directory).is_dir():
        raise ValueError(f"Hugging Face checkpoint {directory} is not a directory")
    if not path.is_file():
        raise ValueError(f"Hugging Face checkpoint {directory} has no {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def read_architecture(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig's architecture fields from a config.json mapping (`moe`: a mapping of MoeShape's
    fields, or None for a dense model); ValueError naming any model_type or feature the Megatron
    model cannot represent (`where` names the file)."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported; supported: {_SUPPORTED_TEXT}")
    _check_features(config, model_type, where)
    rope_theta, rope = _rope(config, where)
    heads = _required(config, "num_attention_heads", where)
    num_layers = _required(config, "num_hidden_layers", where)
    return {
        "vocab_size": _required(config, "vocab_size", where),
        "hidden_size": _required(config, "hidden_size", where),
        "num_layers": num_layers,
        "num_attention_heads": heads,
        "num_query_groups": config.get("num_key_value_heads") or heads,
        "ffn_hidden_size": _required(config, "intermediate_size", where),
        "kv_channels": config.get("head_dim"),
        "max_position_embeddings": config.get("max_position_embeddings", 4096),
        "rotary_base": float(rope_theta),
        # transformers 5's qwen2_moe has a qkv_bias switch (default true); transformers 4's always had the bias
        "add_qkv_bias": model_type == "qwen2" or (model_type == "qwen2_moe" and bool(config.get("qkv_bias", True))),
        "qk_layernorm": model_type in ("qwen3", "qwen3_moe"),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "norm_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        "rope_scaling": rope is not None,
        "rope_scaling_factor": float(rope["factor"]) if rope is not None else 8.0,
        "moe": _read_moe(config, model_type, num_layers, where) if model_type in MOE_MODEL_TYPES else None,
    }


def _required(config: Mapping[str, Any], key: str, where: str) -> Any:
    if config.get(key) is None:
        raise ValueError(f"{where}: config.json has no {key!r}")
    return config[key]


def _read_moe(config: Mapping[str, Any], model_type: str, num_layers: int, where: str) -> dict[str, Any]:
    """MoeShape's fields from a qwen3_moe / qwen2_moe config.json (module docstring)."""
    counts = {k: config[k] for k in _EXPERT_COUNT_KEYS if config.get(k) is not None}
    if not counts:
        raise ValueError(f"{where}: {model_type} config.json has neither 'num_experts' nor 'num_local_experts'")
    if len(set(counts.values())) > 1:
        raise ValueError(f"{where}: config.json gives num_experts={counts['num_experts']} and num_local_experts="
                         f"{counts['num_local_experts']}; they name the same count and must agree")
    num_experts = next(iter(counts.values()))
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{where}: {model_type} needs num_experts >= 1, got {num_experts!r} (a model without "
                         "experts is a dense one: use its dense model_type)")
    step = config.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{where}: decoder_sparse_step must be a positive integer, got {step!r}")
    mlp_only = config.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in mlp_only):
        raise ValueError(f"{where}: mlp_only_layers must be a list of layer indices, got {mlp_only!r}")
    # transformers: layer i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    dense = [i for i in range(num_layers) if i in mlp_only or (i + 1) % step]
    shared = config.get("shared_expert_intermediate_size") if model_type == "qwen2_moe" else None
    if model_type == "qwen2_moe" and "shared_expert_intermediate_size" not in config:
        raise ValueError(f"{where}: qwen2_moe config.json has no 'shared_expert_intermediate_size' (transformers "
                         "would give the shared expert its default width; write the checkpoint's width, or 0 for none)")
    return {
        "num_experts": num_experts,
        "router_topk": _required(config, "num_experts_per_tok", where),
        "ffn_hidden_size": _required(config, "moe_intermediate_size", where),
        "dense_layers": dense,
        "pre_softmax": not bool(config.get("norm_topk_prob", False)),
        "shared_expert_ffn_hidden_size": shared or None,
    }


def _check_features(config: Mapping[str, Any], model_type: str, where: str) -> None:
    unsupported = []
    if model_type not in MOE_MODEL_TYPES and any(
            config.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        unsupported.append("mixture of experts (num_experts; supported as qwen3_moe and qwen2_moe)")
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or []):
        unsupported.append("sliding-window attention (use_sliding_window / layer_types)")
    if config.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={config['hidden_act']!r} (only silu, SwiGLU)")
    # qwen2 and qwen2_moe take no attention_bias key (their q/k/v bias is built in / qkv_bias)
    if model_type not in ("qwen2", "qwen2_moe") and config.get("attention_bias"):
        unsupported.append("attention_bias=true (biases on every attention projection, o_proj included)")
    if config.get("mlp_bias"):
        unsupported.append("mlp_bias=true")
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        unsupported.append(f"partial_rotary_factor={config['partial_rotary_factor']}")
    if unsupported:
        raise ValueError(f"{where}: {model_type} with {'; '.join(unsupported)} is not supported by the Megatron "
                         f"model (supported: {_SUPPORTED_TEXT} decoders with RMSNorm, SwiGLU and RoPE)")


def _rope(config: Mapping[str, Any], where: str) -> tuple[float, dict | None]:
    """(rope_theta, LLaMA-3 scaling parameters or None) from either config.json style."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or params)
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"{where}: rope type {rope_type!r} is not supported (supported: default, llama3)")
    fixed = {"low_freq_factor": LLAMA3_LOW_FREQ_FACTOR, "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
             "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT}
    differ = {k: scaling.get(k) for k, v in fixed.items() if scaling.get(k, v) != v}
    if differ or "factor" not in scaling:
        raise ValueError(f"{where}: llama3 rope scaling needs a factor and Megatron-Core's fixed "
                         f"{fixed}; this checkpoint has {differ or 'no factor'}")
    return theta, scaling


# ---- agreement of a recipe, a preset and a checkpoint --------------------------------------------

def merge_architecture(mapping: Mapping[str, Any], directory: str) -> dict[str, Any]:
    """A recipe's `model:` mapping with the architecture of the checkpoint at `directory` filled
    in; a key given in both must agree (ValueError naming both values)."""
    arch = read_architecture(read_config(directory), f"model.hf_checkpoint={directory}")
    differing = _disagreements(mapping, arch)
    if differing:
        key, config_key, given, value = differing[0]
        raise ValueError(f"model.{key}={given!r} disagrees with {Path(directory) / CONFIG_FILE} ({config_key} gives "
                         f"{value!r}); remove model.{key} from the recipe (the checkpoint's config.json decides the "
                         "architecture) or use another checkpoint")
    return _merged(mapping, arch)


def checkpoint_agrees_with_preset(directory: str, preset: Mapping[str, Any], name: str) -> None:
    """ValueError naming every architecture field where the checkpoint's config.json differs from
    the preset `name` (`model.architecture`), with both values."""
    config_path = Path(directory) / CONFIG_FILE
    arch = read_architecture(read_config(directory), f"model.hf_checkpoint={directory}")
    differing = [f"{key} ({config_key}): checkpoint {found!r}, preset {value!r}"
                 for key, config_key, found, value in _disagreements(arch, preset, complete=True)]
    if differing:
        raise ValueError(f"model.architecture: {name} disagrees with {config_path} in {'; '.join(differing)}: "
                         "use the preset of this checkpoint (an Instruct checkpoint has its own: "
                         f"{name.lower().removesuffix('-instruct')}-instruct), or remove model.architecture (the "
                         "checkpoint's config.json then decides)")


def merge_preset(mapping: Mapping[str, Any], preset: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A recipe's `model:` mapping with the preset's architecture filled in; a key given in both
    must agree."""
    differing = _disagreements(mapping, preset)
    if differing:
        key, _, given, value = differing[0]
        raise ValueError(f"model.{key}={given!r} disagrees with model.architecture: {name} ({value!r}); "
                         f"remove model.{key} (the preset decides) or remove model.architecture")
    return _merged(mapping, preset)


def _merged(mapping: Mapping[str, Any], arch: Mapping[str, Any]) -> dict[str, Any]:
    """`mapping` with `arch`'s fields; the recipe's own `moe` keys (aux_loss_coeff, token_dispatcher)
    are kept beside the architecture's."""
    merged = {**mapping, **arch}
    if isinstance(mapping.get("moe"), Mapping) and arch.get("moe") is not None:
        merged["moe"] = {**mapping["moe"], **arch["moe"]}
    return merged


def _disagreements(given: Mapping[str, Any], arch: Mapping[str, Any], *,
                   complete: bool = False) -> list[tuple[str, str, Any, Any]]:
    """(field, its config.json key, given value, architecture's value) for every field of `arch` that
    `given` sets differently (`complete`: `given` sets all of them); `moe` field by field as `moe.<field>`."""
    out = []
    for key, value in arch.items():
        if key not in given and not complete:
            continue
        found = given.get(key)
        if key == "moe" and isinstance(found, Mapping) and isinstance(value, Mapping):
            out += [(f"moe.{k}", _MOE_CONFIG_KEY[k], found[k], v) for k, v in value.items()
                    if (k in found or complete) and not _moe_agrees(k, found.get(k), v)]
        elif not _agrees(key, found, value, arch):
            out.append((key, _CONFIG_KEY[key], found, value))
    return out


def _agrees(key: str, given: Any, expected: Any, arch: Mapping[str, Any]) -> bool:
    if key == "kv_channels":  # None means hidden_size / heads
        default = arch["hidden_size"] // arch["num_attention_heads"]
        return (given or default) == (expected or default)
    if isinstance(expected, float) and not isinstance(given, bool):
        try:
            return math.isclose(float(given), expected, rel_tol=1e-9)
        except (TypeError, ValueError):
            return False
    return given == expected


def _moe_agrees(key: str, given: Any, expected: Any) -> bool:
    if key == "dense_layers":  # any order, as MoeShape sorts them
        try:
            return sorted(set(given)) == sorted(set(expected))
        except TypeError:
            return False
    return given == expected


# ---- writing -------------------------------------------------------------------------------------

def export_config(cfg, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for exporting a model of ModelConfig `cfg`: its Hugging Face source's own (the
    architecture came from it) or a new one (config_for)."""
    source = read_config(cfg.hf_checkpoint) if cfg.hf_checkpoint else None
    return config_for(cfg.decoder_shape, cfg.max_position_embeddings, dtype, source)


def config_for(shape: DecoderShape, max_position_embeddings: int, dtype: torch.dtype,
               source: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """config.json for an export: the source checkpoint's own with its dtype updated, or a new one
    of the family that represents `shape` (model_type_for)."""
    dtype_name = str(dtype).removeprefix("torch.")
    if source is not None:
        config = dict(source)
        config["torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"] = dtype_name
        return config
    model_type = model_type_for(shape)
    config = {
        "architectures": [SUPPORTED_MODEL_TYPES[model_type]], "model_type": model_type,
        "vocab_size": shape.vocab_size, "hidden_size": shape.hidden_size, "intermediate_size": shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_query_groups, "head_dim": shape.head_dim, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": shape.norm_epsilon,
        "tie_word_embeddings": shape.tie_embeddings, "rope_theta": shape.rotary_base, "dtype": dtype_name,
    }
    if model_type in ("llama", "qwen3"):
        config.update(attention_bias=False, mlp_bias=False)
    if shape.moe is not None:
        config.update(_moe_config(shape, model_type))
    if shape.rope_scaling:
        config["rope_scaling"] = {"rope_type": "llama3", "factor": shape.rope_scaling_factor,
                                  "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
                                  "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
                                  "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT}
    return config


def model_type_for(shape: DecoderShape) -> str:
    """The Hugging Face family that represents `shape`: qwen3 with q/k norms, qwen2 with q/k/v bias,
    else llama; with experts qwen3_moe (q/k norms, no shared expert) or qwen2_moe (a shared expert,
    q/k/v bias or not). ValueError for a shape no family has."""
    if shape.qk_layernorm and shape.add_qkv_bias:
        raise ValueError("a model with both q/k norms and q/k/v biases has no Hugging Face family to export to")
    if shape.moe is None:
        return "qwen3" if shape.qk_layernorm else "qwen2" if shape.add_qkv_bias else "llama"
    shared = shape.moe.shared_expert_ffn_hidden_size is not None
    if shape.qk_layernorm and not shared:
        return "qwen3_moe"
    if shared and not shape.qk_layernorm:
        return "qwen2_moe"
    raise ValueError("a mixture of experts exports as qwen3_moe (q/k norms, no shared expert) or qwen2_moe (a shared "
                     f"expert, no q/k norms); this one has q/k norms {shape.qk_layernorm} and a shared expert "
                     f"{shared}: no Hugging Face family to export to")


def _moe_config(shape: DecoderShape, model_type: str) -> dict[str, Any]:
    moe = shape.moe
    config = {"num_experts": moe.num_experts, "num_experts_per_tok": moe.router_topk,
              "moe_intermediate_size": moe.ffn_hidden_size, "mlp_only_layers": list(moe.dense_layers),
              "decoder_sparse_step": 1, "norm_topk_prob": not moe.pre_softmax, "use_sliding_window": False,
              "output_router_logits": False}
    if model_type == "qwen2_moe":
        config.update(shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size, qkv_bias=shape.add_qkv_bias)
    else:
        config.update(attention_bias=False)
    return config


def write_config(directory: Path, config: Mapping[str, Any]) -> None:
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
