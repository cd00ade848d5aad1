"""The GPU tier of trainer offload (training/offload.py): on a GPU, offloading the weights,
gradients and optimizer state of a bf16 model with the distributed optimizer frees their CUDA
memory (torch.cuda.memory_allocated drops by what offload reports, which covers the states plan
counts: 2 + 4 + 12 bytes per parameter on one rank), the host copies are pinned, and after the
reload the next training step equals the step of a model that never left the GPU, bit for bit.
Local (Megatron-Core torch) layers: the mechanism does not depend on Transformer Engine.
Prints the freed memory (gpu_check.md quotes it).
"""
from __future__ import annotations

import pytest
import torch

from tests.dist import nccl_or_skip, run_distributed

pytestmark = pytest.mark.gpu

CFG = dict(vocab_size=4096, hidden_size=1024, num_layers=8, num_attention_heads=16, num_query_groups=4,
           ffn_hidden_size=4096, max_position_embeddings=256, bf16=True, transformer_impl="local")
BATCH, WIDTH = 4, 64


def _worker(rank, world):
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.weights import export_full_weights
    from megatron_rlcorr.parallel.groups import build_parallel_groups
    from megatron_rlcorr.training.offload import TrainerOffload
    from megatron_rlcorr.training.optimizer import OptimSettings, build_model_and_optimizer
    from megatron_rlcorr.training.step import StepBatch, compute_old_log_probs, train_minibatch
    from tests.distributed.test_step_parallel import _step_config

    groups = build_parallel_groups(1, 1, 1, None)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, CFG["vocab_size"], (BATCH, WIDTH), generator=gen)
    targets = torch.cat([tokens[:, 1:], torch.zeros(BATCH, 1, dtype=torch.long)], dim=1)
    mask = torch.zeros(BATCH, WIDTH)
    mask[:, 8:48] = 1
    advantages = torch.linspace(-1, 1, BATCH)[:, None].expand(BATCH, WIDTH).contiguous()
    cuda = torch.device("cuda", torch.cuda.current_device())
    out = {}
    for offload in (False, True):
        chunks, optimizer, _ = build_model_and_optimizer(ModelConfig(**CFG), OptimSettings(lr=1e-4), groups, seed=1,
                                                         total_steps=3)
        mover = TrainerOffload(chunks, optimizer, params=offload, grads=offload, optimizer_states=offload,
                               device=cuda)
        losses = []
        for step in range(2):
            probe = StepBatch(tokens.to(cuda), targets.to(cuda), mask.to(cuda), torch.zeros(BATCH, WIDTH, device=cuda),
                              advantages.to(cuda))
            old = compute_old_log_probs(chunks, probe, groups=groups, micro_batch_size=2, temperature=1.0)
            noise = 0.01 * torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(step)).to(cuda)
            batch = StepBatch(tokens.to(cuda), targets.to(cuda), mask.to(cuda), (old + noise).clamp(max=-1e-4),
                              advantages.to(cuda))
            if offload and step == 1:  # Adam's state exists after the first step
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                released = mover.offload()
                after = torch.cuda.memory_allocated()
                out["measure"] = {"released": released, "allocated_drop": before - after,
                                  "pinned": all(h.is_pinned() for h in mover._host.values()),
                                  "params": sum(p.numel() for c in chunks for p in c.parameters())}
                mover.reload()
            result = train_minibatch(chunks, optimizer, batch, groups=groups, cfg=_step_config("dec_pg_stm", 2),
                                     old_log_probs=old)
            losses.append(float(result.metrics["actor/pg_loss"]))
        out["offload" if offload else "plain"] = {
            "losses": losses, "weights": {k: v.float().cpu() for k, v in export_full_weights(chunks, groups).items()}}
    return out


def test_offload_frees_the_states_cuda_memory_and_changes_nothing():
    result = run_distributed(_worker, 1, backend=nccl_or_skip(1))[0]
    measure, params = result["measure"], result["measure"]["params"]
    # bf16 weights (2) + fp32 gradients (4) + fp32 master weights and Adam moments (12), per parameter.
    assert measure["released"] >= 18 * params
    # The allocator rounds each block up (512 bytes): the drop is what was released, to that rounding.
    assert 0 <= measure["allocated_drop"] - measure["released"] <= 0.01 * measure["released"]
    assert measure["pinned"]
    print(f"offload freed {measure['allocated_drop'] / 2**30:.3f} GiB of CUDA memory for {params:,} parameters "
          f"({measure['allocated_drop'] / params:.1f} bytes per parameter)")
    assert result["offload"]["losses"] == result["plain"]["losses"]
    for name, tensor in result["plain"]["weights"].items():
        assert torch.equal(tensor, result["offload"]["weights"][name]), name
