"""Host memory of a checkpoint save, per rank: the DP-sharded optimizer format against the fully
reshardable one (training/checkpoint.py).

A dp2 run (gloo, CPU, fp32, distributed optimizer) of a model large enough for its optimizer state
to dominate trains one step (so Adam's moments exist) and saves; each rank records its peak
resident memory during the save above what it held before (Linux: the high-water mark VmHWM,
reset through /proc/self/clear_refs just before the save). Each format saves in its own
processes, so neither reuses memory the other freed. The fully reshardable format all-gathers
every data-parallel group's shards, so every rank holds its model-parallel slice's whole
optimizer state (fp32 master weights and both moments: 12 bytes per parameter) at once; the
DP-sharded one writes each rank's own shard.

Run as a script for the figures: `.venv/bin/python -m tests.distributed.test_checkpoint_memory`.
"""
from __future__ import annotations

import re
import sys

import pytest

from tests.dist import hide_gpus, run_distributed

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status"),
]

# ~8.4 M parameters: 12 bytes of optimizer state each is ~100 MB per model-parallel slice.
CFG = dict(vocab_size=1024, hidden_size=256, num_layers=8, num_attention_heads=8, num_query_groups=4,
           ffn_hidden_size=1024, tie_embeddings=True, max_position_embeddings=64)
MiB = 2**20


def _status_kib() -> dict[str, int]:
    with open("/proc/self/status") as status:
        return {k: int(v.split()[0]) for k, v in re.findall(r"(VmHWM|VmRSS):\s+(.*)", status.read())}


def _worker(rank, world, directory, optimizer_format):
    hide_gpus()
    import torch
    import torch.distributed as dist

    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups
    from megatron_rlcorr.training import checkpoint
    from megatron_rlcorr.training.optimizer import OptimSettings, build_model_and_optimizer, step_optimizer, zero_grads

    enable_cpu_megatron()
    groups = build_parallel_groups(1, 1, 1, None)
    chunks, optimizer, scheduler = build_model_and_optimizer(ModelConfig(**CFG), OptimSettings(lr=1e-3), groups,
                                                             seed=3, total_steps=2)
    zero_grads(chunks, optimizer)
    for chunk in chunks:  # a gradient, so that Adam's moments exist as in any trained run
        for param in chunk.parameters():
            param.main_grad.copy_(torch.randn_like(param.main_grad))
    assert step_optimizer(optimizer)[0]
    params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset the high-water mark to the current resident size
    before = _status_kib()["VmRSS"]
    checkpoint.CheckpointWriter(optimizer_format=optimizer_format).save(
        directory, 1, model_chunks=chunks, optimizer=optimizer, scheduler=scheduler, groups=groups, common={},
        layout={"world_size": world, "tp": 1, "pp": 1, "cp": 1, "vpp": None})
    peak = _status_kib()["VmHWM"]
    return {"params": params, "before_mib": before / 1024, "peak_mib": peak / 1024,
            "save_peak_mib": (peak - before) / 1024}


def measure(tmp_dir) -> dict[str, list[dict]]:
    from pathlib import Path

    return {fmt: run_distributed(_worker, 2, Path(tmp_dir) / fmt, fmt) for fmt in ("dp_reshardable", "fully_reshardable")}


def test_the_dp_sharded_save_does_not_hold_the_whole_optimizer_state(tmp_path):
    figures = measure(tmp_path)
    params = figures["dp_reshardable"][0]["params"]
    whole_state_mib = 12 * params / MiB  # fp32 master + exp_avg + exp_avg_sq of the rank's model-parallel slice
    for rank in range(2):
        sharded = figures["dp_reshardable"][rank]["save_peak_mib"]
        gathered = figures["fully_reshardable"][rank]["save_peak_mib"]
        # The gather holds the whole state on every rank; the DP-sharded save less than the whole state.
        assert gathered - sharded > 0.5 * whole_state_mib, (rank, sharded, gathered, whole_state_mib)
        assert sharded < whole_state_mib, (rank, sharded, whole_state_mib)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        results = measure(tmp)
    params = results["dp_reshardable"][0]["params"]
    print(f"dp2 save on CPU (gloo), {params:,} parameters per rank, fp32, distributed optimizer; "
          f"whole optimizer state of the slice: {12 * params / MiB:.0f} MiB")
    for fmt, ranks in results.items():
        for rank, r in enumerate(ranks):
            print(f"  {fmt:<18} rank {rank}: resident before {r['before_mib']:.0f} MiB, peak during save "
                  f"{r['peak_mib']:.0f} MiB (+{r['save_peak_mib']:.0f} MiB)")
