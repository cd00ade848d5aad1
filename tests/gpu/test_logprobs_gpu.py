"""The GPU tier for the log-prob pass: the chunked log-prob / entropy memory on CUDA (allocated
bytes, not the CPU allocator's events), and `model.fp32_lm_head` with Transformer Engine layers
and Megatron's DDP (whose fused weight-gradient accumulation, on where apex's kernel is installed,
must not touch the output layer's float32 weight copy): a pi_old pass and one training step."""
from __future__ import annotations

import math

import pytest
import torch

from tests.dist import nccl_or_skip, run_distributed
from tests.gpu.te import require_transformer_engine

pytestmark = pytest.mark.gpu

CFG = dict(vocab_size=1000, hidden_size=128, num_layers=2, num_attention_heads=8, num_query_groups=2,
           ffn_hidden_size=256, add_qkv_bias=True, rotary_base=1e6, max_position_embeddings=64, bf16=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compute_entropy", [False, True])
def test_chunked_log_probs_extra_cuda_memory_is_under_a_quarter_of_one_fp32_copy(compute_entropy):
    from megatron_rlcorr.training.logprobs import token_logprobs_and_entropy

    tokens, vocab = 4096, 8192
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(tokens, vocab, generator=gen)).cuda().bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen).cuda()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logprob, entropy = token_logprobs_and_entropy(logits, targets, compute_entropy=compute_entropy)
    (logprob.sum() + (entropy.sum() if compute_entropy else 0.0)).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - logits.grad.numel() * logits.grad.element_size()
    assert extra <= 0.25 * 4 * tokens * vocab, extra / (4 * tokens * vocab)


def _fp32_head_worker(rank, world):
    from megatron_rlcorr.config import RolloutCorrectionConfig
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.parallel.groups import build_parallel_groups
    from megatron_rlcorr.training.losses import LossConfig
    from megatron_rlcorr.training.optimizer import OptimSettings, build_model_and_optimizer
    from megatron_rlcorr.training.step import StepBatch, StepConfig, compute_old_log_probs, train_minibatch

    groups = build_parallel_groups(1, 1, 1)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, CFG["vocab_size"], (4, 33), generator=gen)
    targets = torch.cat([tokens[:, 1:], torch.zeros(4, 1, dtype=torch.long)], dim=1)
    mask = torch.zeros(4, 33)
    mask[:, 5:30] = 1
    out = {}
    for fp32_head in (False, True):
        chunks, optimizer, _ = build_model_and_optimizer(ModelConfig(**CFG, fp32_lm_head=fp32_head),
                                                         OptimSettings(lr=1e-3), groups, seed=5, total_steps=2)
        batch = StepBatch(tokens, targets, mask, torch.full((4, 33), -3.0), torch.randn(4, 33, generator=gen))
        cfg = StepConfig(loss=LossConfig(entropy_coeff=0.01), correction=RolloutCorrectionConfig(rollout_is="token"),
                         micro_batch_size=2)
        old = compute_old_log_probs(chunks, batch, groups=groups, micro_batch_size=2, temperature=1.0)
        head = chunks[0].module.output_layer.weight
        before = head.detach().float().clone()
        result = train_minibatch(chunks, optimizer, batch, groups=groups, cfg=cfg, old_log_probs=old)
        out[fp32_head] = dict(old=old.float().cpu(), metrics={k: float(v) for k, v in result.metrics.items()},
                              head_moved=float((head.detach().float() - before).abs().max()))
    return out


@pytest.mark.timeout(300)
def test_fp32_lm_head_trains_with_transformer_engine_and_ddp():
    require_transformer_engine()
    out = run_distributed(_fp32_head_worker, 1, backend=nccl_or_skip(1))[0]
    mask = torch.zeros(4, 33, dtype=torch.bool)
    mask[:, 5:30] = True
    for fp32_head, result in out.items():
        assert all(math.isfinite(v) for v in result["metrics"].values()), fp32_head
        assert result["head_moved"] > 0, fp32_head  # its gradient reached the optimizer
    # Same bf16 body, the head's rounding apart: close, and not identical.
    diff = (out[True]["old"] - out[False]["old"])[mask].abs()
    assert 0 < float(diff.max()) < 0.1
