"""What the one-process benchmarks (bench_packing.py, bench_recompute.py) share: a world of one
process with Megatron-Core runnable on it, and their small GPT model."""
from __future__ import annotations

import os

import torch


def start_one_process_world(device: str, port: int) -> None:
    """torch.distributed with one rank (gloo on CPU with the GPUs hidden, NCCL on GPU 0) and the
    CPU patches for Megatron-Core (a no-op with CUDA). Call before anything touches CUDA."""
    import torch.distributed as dist

    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron

    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    enable_cpu_megatron()


def bench_model_config(*, hidden: int, layers: int, vocab: int, max_positions: int, device: str, **extra):
    """A GPT of head dim 64 (at least 2 heads, no GQA) and a 3x MLP; bf16 on GPU, fp32 on CPU."""
    from megatron_rlcorr.model.config import ModelConfig

    heads = max(2, hidden // 64)
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
                       num_query_groups=heads, ffn_hidden_size=hidden * 3, max_position_embeddings=max_positions,
                       bf16=device == "cuda", **extra)
