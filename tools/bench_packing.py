"""Benchmark: packed vs padded micro-batches of one training step, on long-tailed response lengths.

RL responses are long-tailed: most stop early, a few run to the limit. Padded micro-batches pad
every sequence to the longest of the mini-batch; packed ones (`trainer.max_tokens_per_micro_batch`)
concatenate the sequences, each trimmed to its length, into micro-batches of a token budget. Both
run side by side in one process on the same global batch and the same weights (the step of
training/step.py, decoupled PPO with token IS): the table gives the padding fraction
(tokens computed / tokens the sequences need - 1), the time per step and the real tokens per second,
and checks that both give the same gradient.

    python tools/bench_packing.py [--sequences 64] [--median 48] [--max-ratio 16] [--budget 2048]
        [--hidden 256] [--layers 4] [--steps 3] [--device cpu|cuda]

Response lengths are lognormal with the given median, clipped to max-ratio x median; prompts are 16
tokens. Runs as one process (gloo on CPU, NCCL with --device cuda and Transformer Engine layers).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from _bench_world import bench_model_config, start_one_process_world

PROMPT = 16


def response_lengths(n: int, median: int, max_ratio: float, seed: int = 0) -> torch.Tensor:
    """Lognormal lengths (sigma 1: a long tail) with the given median, within [1, max_ratio * median]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=gen) + torch.log(torch.tensor(float(median))))
    return lengths.round().clamp(1, int(max_ratio * median)).long()


def make_batch(lengths: torch.Tensor, vocab: int, seed: int = 1):
    from megatron_rlcorr.training.step import StepBatch

    gen = torch.Generator().manual_seed(seed)
    width = PROMPT + int(lengths.max()) + 1
    tokens = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths.tolist()):
        tokens[i, :PROMPT + n] = torch.randint(1, vocab, (PROMPT + n,), generator=gen)
        mask[i, PROMPT - 1:PROMPT - 1 + n] = 1
    targets = torch.cat([tokens[:, 1:], torch.zeros(len(lengths), 1, dtype=torch.long)], dim=1)
    rollout = torch.where(mask > 0, -torch.rand(mask.shape, generator=gen) * 3 - 0.1, 0.0)
    advantages = torch.randn(len(lengths), 1, generator=gen).expand_as(mask).contiguous()
    return StepBatch(tokens, targets, mask, rollout, advantages)


def _grad_vector(chunks) -> torch.Tensor:
    return torch.cat([p.main_grad.reshape(-1).float().cpu() for c in chunks for p in c.parameters()])


def run(args) -> dict:
    import torch.distributed as dist

    from megatron_rlcorr.config import RolloutCorrectionConfig
    from megatron_rlcorr.parallel.groups import build_parallel_groups
    from megatron_rlcorr.training.losses import LossConfig
    from megatron_rlcorr.training.optimizer import OptimSettings, build_model_and_optimizer
    from megatron_rlcorr.training.step import StepConfig, compute_old_log_probs, train_minibatch

    cuda = args.device == "cuda"
    start_one_process_world(args.device, port=29517)
    groups = build_parallel_groups(1, 1, 1)
    model_cfg = bench_model_config(hidden=args.hidden, layers=args.layers, vocab=1024, max_positions=8192,
                                   device=args.device)
    # lr 0: the weights stay put, so every timed step computes the same gradient
    chunks, optimizer, _ = build_model_and_optimizer(model_cfg, OptimSettings(lr=1e-9, clip_grad=0.0), groups,
                                                     seed=3, total_steps=10)
    lengths = response_lengths(args.sequences, args.median, args.max_ratio)
    batch = make_batch(lengths, model_cfg.vocab_size)
    # Random rollout log-probs are far from the model's: bounds as tight as DAPO's would reject
    # every sequence, so token IS with a threshold (and the veto) keeps the loss alive.
    correction = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_token_veto_threshold=1e-4)
    variants = {"padded": dict(micro_batch_size=args.micro_batch_size),
                "packed": dict(micro_batch_size=args.micro_batch_size, max_tokens_per_micro_batch=args.budget)}
    results = {name: {"times": []} for name in variants}
    for step in range(args.steps + 1):  # the first round warms up
        for name, sizes in variants.items():
            cfg = StepConfig(loss=LossConfig(), correction=correction, **sizes)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            old = compute_old_log_probs(chunks, batch, groups=groups, micro_batch_size=cfg.micro_batch_size,
                                        temperature=1.0, max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch)
            result = train_minibatch(chunks, optimizer, batch, groups=groups, cfg=cfg, old_log_probs=old)
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if step:
                results[name]["times"].append(elapsed)
            results[name]["padding"] = float(result.metrics["batch/padding_fraction"])
            results[name]["grad"] = _grad_vector(chunks)
            results[name]["loss"] = float(result.metrics["actor/pg_loss"])
    dist.destroy_process_group()
    results["lengths"] = lengths
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--median", type=int, default=48)
    parser.add_argument("--max-ratio", type=float, default=16.0)
    parser.add_argument("--budget", type=int, default=2048, help="packed: tokens per micro-batch")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="padded: sequences per micro-batch")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    results = run(args)
    lengths = results.pop("lengths")
    real = int(lengths.sum()) + len(lengths) * (PROMPT - 1)  # tokens the sequences need as input
    print(f"{len(lengths)} sequences: response median {int(lengths.median())}, max {int(lengths.max())} "
          f"(x{float(lengths.max() / lengths.median()):.1f}), {real} tokens; model hidden {args.hidden}, "
          f"{args.layers} layers; device {args.device}; decoupled PPO + token IS, old-log-prob pass + step")
    print(f"{'layout':<8}{'padding fraction':>18}{'s / step':>11}{'real tokens / s':>17}")
    for name in ("padded", "packed"):
        r = results[name]
        seconds = statistics.median(r["times"])
        print(f"{name:<8}{r['padding']:>18.3f}{seconds:>11.3f}{real / seconds:>17.0f}")
    speedup = statistics.median(results["padded"]["times"]) / statistics.median(results["packed"]["times"])
    diff = (results["packed"]["grad"] - results["padded"]["grad"]).abs().max()
    scale = results["padded"]["grad"].abs().max()
    print(f"packed / padded speed: {speedup:.2f}x; max |grad diff| {float(diff):.2e} (max |grad| {float(scale):.2e}); "
          f"loss {results['packed']['loss']:.6f} vs {results['padded']['loss']:.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
