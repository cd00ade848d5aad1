"""Tiny random Hugging Face checkpoints of the supported families, built in the tests (no download).

`make_checkpoint(directory, family)` builds a transformers model, gives every weight a random
value large enough that a wrong mapping shows in the logits (norm weights around 1, not 1), and
saves it with save_pretrained (one file, or sharded into several files with an index).
`hf_log_probs` is transformers' own float32 log-prob of each next token, the oracle.

Families (what each one exercises):
- qwen2: GQA, q/k/v bias, untied embeddings (Qwen2 / Qwen2.5);
- qwen3: per-head q/k RMSNorm, tied embeddings, head_dim 16 != hidden / heads;
- llama: tied embeddings, head_dim 16, LLaMA-3.1 rope scaling (base 5e5 and head_dim 16 give
  rotary wavelengths in all three regimes of the llama3 rule);
- qwen3_moe (MOE_FAMILIES): 4 experts of width 16, top 2, normalised top-k weights, a dense first
  layer (mlp_only_layers [0]), q/k norms, head_dim 16;
- qwen2_moe: 4 experts, top 2, weights not renormalised, every second layer sparse
  (decoder_sparse_step 2: layers 1 and 3), a shared expert of width 24 with its sigmoid gate, q/k/v bias.
Random router weights make ties between router logits essentially impossible, so transformers'
top-k (on float32 softmax probabilities) and the model's (on logits) pick the same experts.
"""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 100
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=16384)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
FAMILIES = ("qwen2", "qwen3", "llama")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")
MOE_COMMON = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, rope_theta=500.0,
                  tie_word_embeddings=False)


def hf_config(family: str):
    import transformers

    if family == "qwen2":
        return transformers.Qwen2Config(**COMMON, rope_theta=500.0, tie_word_embeddings=False)
    if family == "qwen3":
        return transformers.Qwen3Config(**COMMON, head_dim=16, rope_theta=500.0, tie_word_embeddings=True)
    if family == "llama":
        return transformers.LlamaConfig(**COMMON, head_dim=16, rope_theta=5e5, rope_scaling=dict(LLAMA3_ROPE),
                                        tie_word_embeddings=True)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**COMMON, **MOE_COMMON, head_dim=16, norm_topk_prob=True,
                                           mlp_only_layers=[0], decoder_sparse_step=1)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**COMMON, **MOE_COMMON, norm_topk_prob=False, decoder_sparse_step=2,
                                           shared_expert_intermediate_size=24)
    raise ValueError(family)


def make_checkpoint(directory: str | Path, family: str, *, seed: int = 0, sharded: bool = False,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Save a random tiny checkpoint of `family` in `directory` and return the directory."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    model = model.to(dtype)
    model.config.dtype = dtype  # what the checkpoint's config.json records
    directory = Path(directory)
    model.save_pretrained(directory, max_shard_size="40KB" if sharded else "5GB")
    return directory


def load_model(directory: str | Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def hf_logits(directory: str | Path, tokens_BT: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return load_model(directory)(tokens_BT).logits.float()


def hf_log_probs(directory: str | Path, tokens_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[B, T-1] float32 log pi(tokens[t+1] | tokens[:t+1]) at `temperature`, by transformers."""
    logits = hf_logits(directory, tokens_BT)[:, :-1] / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens_BT[:, 1:, None]).squeeze(-1)


def safetensors_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's safetensors files, by Hugging Face name."""
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors
