"""Published architectures by name, so a recipe can be planned before its checkpoint is on disk.

`model.architecture: qwen2.5-32b` in a recipe stands for the architecture fields of ModelConfig
that `model.hf_checkpoint` would otherwise read from the checkpoint's config.json (config.py
merges them; a checkpoint that is on disk must agree with the preset, hf_config.py checks it). Planning
(memory, parallel layout, parameter counts) then needs no download.

Each preset is the model's published Hugging Face config.json, cut down to the keys
`hf_config.read_architecture` reads or checks, with the published values unchanged (types included:
Qwen3 writes `rope_theta` as an integer), so the preset goes through exactly the path a real
checkpoint does. The comment above each names the repository it is from.

Conventions: names are lowercase `family-size` (`qwen2.5-7b`, `llama-3.1-70b`) and are matched
case-insensitively. A preset is the base (pretrained) model's config.json where the base and the
instruct configs differ (LLaMA-3.1's eos token list; Qwen2.5's context length, rms_norm_eps and
sliding-window fields); the tensor shapes, and so the parameter count, are the same for both.
"""
from __future__ import annotations

import copy
from typing import Any

from ..config import did_you_mean
from .hf_config import read_architecture

_LLAMA31_ROPE_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}

ARCHITECTURES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen2.5-1.5B (base), the only preset with tied embeddings. Qwen/Qwen2.5-1.5B-Instruct
    # has max_position_embeddings 32768.
    "qwen2.5-1.5b": {
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 8960,
        "max_position_embeddings": 131072, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "rms_norm_eps": 1e-06, "hidden_act": "silu", "use_sliding_window": False,
    },
    # Qwen/Qwen2.5-7B (base). Qwen/Qwen2.5-7B-Instruct has max_position_embeddings 32768.
    "qwen2.5-7b": {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
        "max_position_embeddings": 131072, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-06, "hidden_act": "silu", "use_sliding_window": False,
    },
    # Qwen/Qwen2.5-32B (base). Qwen/Qwen2.5-32B-Instruct has max_position_embeddings 32768 and
    # rms_norm_eps 1e-06.
    "qwen2.5-32b": {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "num_hidden_layers": 64,
        "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 27648,
        "max_position_embeddings": 131072, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-05, "hidden_act": "silu", "use_sliding_window": False,
    },
    # Qwen/Qwen2.5-72B (base). Qwen/Qwen2.5-72B-Instruct has max_position_embeddings 32768 and
    # rms_norm_eps 1e-06.
    "qwen2.5-72b": {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 8192, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 29568,
        "max_position_embeddings": 131072, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-05, "hidden_act": "silu", "use_sliding_window": False,
    },
    # Qwen/Qwen3-8B, the released post-trained checkpoint (the preset's namesake; Qwen/Qwen3-8B-Base
    # has the same layer shapes). head_dim is explicit in Qwen3 configs.
    "qwen3-8b": {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 12288, "head_dim": 128,
        "max_position_embeddings": 40960, "rope_theta": 1000000, "rope_scaling": None,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-06, "hidden_act": "silu", "attention_bias": False,
        "use_sliding_window": False,
    },
    # Qwen/Qwen3-32B (no base checkpoint of the 32B was published). head_dim 128 is not
    # hidden_size / num_attention_heads (80) here.
    "qwen3-32b": {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 5120, "num_hidden_layers": 64,
        "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 25600, "head_dim": 128,
        "max_position_embeddings": 40960, "rope_theta": 1000000, "rope_scaling": None,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-06, "hidden_act": "silu", "attention_bias": False,
        "use_sliding_window": False,
    },
    # Qwen/Qwen3-30B-A3B (mixture of experts: 128 experts of width 768, 8 per token, every layer sparse,
    # normalised top-k weights; intermediate_size is the dense MLP width, which no layer uses here).
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "intermediate_size": 6144, "head_dim": 128,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-06, "hidden_act": "silu", "attention_bias": False,
        "use_sliding_window": False, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
    },
    # Qwen/Qwen3-235B-A22B (128 experts of width 1536, 8 per token, every layer sparse).
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "intermediate_size": 12288, "head_dim": 128,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-06, "hidden_act": "silu", "attention_bias": False,
        "use_sliding_window": False, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
    },
    # meta-llama/Llama-3.1-8B (base; formerly Meta-Llama-3.1-8B). The instruct config has the same
    # values for every key here (it differs in eos_token_id, which is not read).
    "llama-3.1-8b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rope_scaling": _LLAMA31_ROPE_SCALING,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-05, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False,
    },
    # meta-llama/Llama-3.1-70B (base; formerly Meta-Llama-3.1-70B); as for the 8B, the instruct
    # config has the same values for every key here.
    "llama-3.1-70b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rope_scaling": _LLAMA31_ROPE_SCALING,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-05, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False,
    },
}
# The Qwen2.5 Instruct checkpoints (what most RL runs start from besides the base models): the
# same shapes, a 32768-token context and rms_norm_eps 1e-06 (as noted above each base preset).
ARCHITECTURES.update({
    f"{base}-instruct": {**ARCHITECTURES[base], "max_position_embeddings": 32768, "rms_norm_eps": 1e-06}
    for base in ("qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b")
})


def preset_config(name: str) -> dict[str, Any]:
    """A copy of the config.json mapping of preset `name` (any case); ValueError for an unknown
    name, with the closest preset and the list."""
    key = str(name).lower()
    if key not in ARCHITECTURES:
        raise ValueError(f"model.architecture: unknown architecture {name!r}{did_you_mean(key, list(ARCHITECTURES))}; "
                         f"presets: {', '.join(ARCHITECTURES)} (or set model.hf_checkpoint and leave "
                         "model.architecture out: the checkpoint's config.json then decides)")
    return copy.deepcopy(ARCHITECTURES[key])


def preset_architecture(name: str) -> dict[str, Any]:
    """ModelConfig's architecture fields of preset `name`, read as a checkpoint's config.json is."""
    return read_architecture(preset_config(name), f"model.architecture: {name}")
