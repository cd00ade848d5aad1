"""Benchmark: activation memory and time of a forward + backward with and without recomputation.

`model.recompute` trades compute for memory. For each setting this builds the same seeded model
(Megatron-Core GPTModel, one process) and runs forward + backward on the same batch, side by side:

- activation memory: the bytes autograd keeps for the backward at the end of the forward
  (every tensor saved for backward, counted once per storage, through
  `torch.autograd.graph.saved_tensors_hooks`), which is what recomputation removes. Measured on
  any device;
- on CUDA also the peak allocated memory of the forward + backward above the weights
  (`torch.cuda.max_memory_allocated`);
- the median time of the forward + backward, and the largest gradient difference to the run
  without recomputation (recomputation must not change the gradient).

    python tools/bench_recompute.py [--hidden 512] [--layers 4] [--seq 1024] [--batch 2] [--repeats 3]
        [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from _bench_world import bench_model_config, start_one_process_world

SETTINGS = {
    "none": None,
    "full uniform 1": dict(granularity="full", method="uniform", num_layers=1),
    "full block 2": dict(granularity="full", method="block", num_layers=2),
    "selective core_attn": dict(granularity="selective", modules=("core_attn",)),
    "selective core_attn mlp layernorm": dict(granularity="selective", modules=("core_attn", "mlp", "layernorm")),
}


class SavedBytes:
    """Bytes of the distinct storages autograd saves for the backward while active."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def run_setting(recompute, args, tokens):
    from megatron_rlcorr.model.build import build_model_chunks
    from megatron_rlcorr.parallel.groups import build_parallel_groups, destroy_parallel_groups

    cuda = args.device == "cuda"
    groups = build_parallel_groups(1, 1, 1)
    cfg = bench_model_config(hidden=args.hidden, layers=args.layers, vocab=2048, max_positions=args.seq,
                             device=args.device, recompute=recompute)
    (model,) = build_model_chunks(cfg, groups, seed=5)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    times, saved, peak = [], 0, 0
    for repeat in range(args.repeats + 1):  # the first warms up
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        counter = SavedBytes()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            logits = model(tokens, positions, attention_mask=None)
        saved = counter.total  # before the backward, whose recomputation saves more, briefly
        logits.float().logsumexp(-1).mean().backward()
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        if repeat:
            times.append(time.perf_counter() - start)
    grads = torch.cat([p.grad.reshape(-1).float().cpu() for p in model.parameters() if p.grad is not None])
    destroy_parallel_groups()
    return dict(saved=saved, peak=peak, seconds=statistics.median(times), grads=grads)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    import torch.distributed as dist

    cuda = args.device == "cuda"
    start_one_process_world(args.device, port=29519)
    tokens = torch.randint(1, 2048, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(args.device)
    results = {name: run_setting(setting, args, tokens) for name, setting in SETTINGS.items()}
    dist.destroy_process_group()
    base = results["none"]
    print(f"GPTModel hidden {args.hidden}, {args.layers} layers, batch {args.batch} x {args.seq} tokens, "
          f"device {args.device}; forward + backward, median of {args.repeats}")
    header = f"{'recompute':<36}{'saved MiB':>11}{'vs none':>9}{'peak MiB':>10}{'s':>8}{'vs none':>9}{'max |dgrad|':>13}"
    print(header)
    for name, r in results.items():
        peak = f"{r['peak'] / 2**20:>10.1f}" if cuda else f"{'-':>10}"
        print(f"{name:<36}{r['saved'] / 2**20:>11.1f}{r['saved'] / base['saved']:>9.2f}{peak}"
              f"{r['seconds']:>8.3f}{r['seconds'] / base['seconds']:>9.2f}"
              f"{float((r['grads'] - base['grads']).abs().max()):>13.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
