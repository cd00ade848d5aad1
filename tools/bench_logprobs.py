"""Benchmark: memory and time of the log-prob pass (training/logprobs.py), unchunked vs chunked,
and the log-prob error of a bf16 model's output layer with and without `model.fp32_lm_head`.

Log-prob pass (default section). One TP rank's logits [tokens, V_p] in bf16 (the trainer's), the
forward (log-prob, with and without entropy) and the backward, for the implementation before
chunking (kept below as the baseline) and the chunked one, side by side:

- extra memory: the peak of the bytes allocated during forward + backward above what existed
  before (the logits, the upstream gradients), less the gradient wrt the logits (its shape and
  dtype are the logits', and every implementation must return it). On CPU from the allocator's
  events recorded by torch.profiler (profile_memory: every allocation and free of the CPU
  allocator, summed in order); on CUDA from torch.cuda.max_memory_allocated. Printed as a fraction
  of one float32 [tokens x V_p] copy;
- the median time of forward + backward, and the largest difference of the log-probs, entropies
  and gradients between the two implementations.

The default shape is the 32B recipe's per rank scaled down for a CPU: 22,528 / 8 tokens and
Qwen2.5's 152,064 vocabulary rows over TP 8 (one float32 copy: 214 MB; at full size 1.7 GB).

`--lm-head`: a seeded bf16 GPT (Megatron-Core, one process) and the same weights in float32; the
log-probs of a batch through the bf16 model with the bf16 output layer and with `fp32_lm_head`:
mean and max |d log p| over tokens against the float32 model holding the same (bf16) weights, and
against float64 logits of the same bf16 hidden states (the head's own rounding, which the lever
removes); and the peak memory of forward + backward with each head (on CPU from the allocator's
events, as above; on CUDA max_memory_allocated).

    python tools/bench_logprobs.py [--device cpu|cuda] [--tokens 2816] [--vocab-shard 19008] [--repeats 3]
    python tools/bench_logprobs.py --lm-head [--device cpu|cuda] [--vocab 32000] [--hidden 512]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rlcorr.training.logprobs import token_logprobs_and_entropy


# ---- the baseline: the implementation before chunking ------------------------------------------

class _UnchunkedLogProb(torch.autograd.Function):
    """One float32 copy of all the logits, turned in place into what backward keeps (the softmax,
    or with entropy the log-softmax); backward builds the whole float32 gradient."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, compute_entropy):
        z = logits.to(torch.float32, copy=True)
        if temperature != 1.0:
            z.div_(temperature)
        z.sub_(z.amax(dim=-1, keepdim=True))
        target_z = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        if compute_entropy:
            exp_z = z.exp()
            sums = torch.stack([exp_z.sum(dim=-1), exp_z.mul_(z).sum(dim=-1)])
            del exp_z
        else:
            exp_z = z.exp_()
            sums = exp_z.sum(dim=-1)[None]
        log_sum_exp = sums[0].log()
        ctx.temperature, ctx.dtype, ctx.compute_entropy = temperature, logits.dtype, compute_entropy
        if not compute_entropy:
            ctx.save_for_backward(exp_z.div_(sums[0].unsqueeze(-1)), targets)
            return target_z - log_sum_exp
        entropy = log_sum_exp - sums[1] / sums[0]
        ctx.save_for_backward(z.sub_(log_sum_exp.unsqueeze(-1)), targets, entropy)
        return target_z - log_sum_exp, entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_h=None):
        if ctx.compute_entropy:
            log_p, targets, entropy = ctx.saved_tensors
            scale = torch.addcmul((grad_lp + grad_h * entropy).unsqueeze(-1), log_p, grad_h.unsqueeze(-1))
            grad = log_p.exp().mul_(scale).neg_()
        else:
            softmax, targets = ctx.saved_tensors
            grad = softmax * -grad_lp.unsqueeze(-1)
        grad.scatter_add_(-1, targets.unsqueeze(-1), grad_lp.unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(ctx.dtype), None, None, None


def unchunked(logits, targets, temperature, compute_entropy):
    out = _UnchunkedLogProb.apply(logits, targets, temperature, compute_entropy)
    return out if compute_entropy else (out, None)


def chunked(logits, targets, temperature, compute_entropy):
    return token_logprobs_and_entropy(logits, targets, temperature=temperature, compute_entropy=compute_entropy)


IMPLEMENTATIONS = {"unchunked (before)": unchunked, "chunked": chunked}


# ---- measuring ---------------------------------------------------------------------------------

def cpu_peak_bytes(fn) -> int:
    """Peak of the CPU allocator's net allocations while fn runs (torch.profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for event in events:
        if event.device_type() == torch.autograd.DeviceType.CPU:
            current += event.nbytes()
            peak = max(peak, current)
    return peak


def cuda_peak_bytes(fn) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def problem(tokens: int, vocab: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(tokens, vocab, generator=gen)).to(device, torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    g_lp, g_h = torch.randn(tokens, generator=gen).to(device), torch.randn(tokens, generator=gen).to(device)
    return logits, targets, g_lp, g_h


def forward_backward(impl, logits, targets, g_lp, g_h, temperature, entropy):
    leaf = logits.detach().requires_grad_()
    lp, h = impl(leaf, targets, temperature, entropy)
    objective = (lp * g_lp).sum() + ((h * g_h).sum() if entropy else 0.0)
    objective.backward()
    return lp.detach(), None if h is None else h.detach(), leaf.grad


def log_prob_section(args) -> None:
    device = args.device
    logits, targets, g_lp, g_h = problem(args.tokens, args.vocab_shard, device)
    copy_bytes = 4 * args.tokens * args.vocab_shard
    grad_bytes = logits.numel() * logits.element_size()
    peak = cuda_peak_bytes if device == "cuda" else cpu_peak_bytes
    print(f"log-prob pass, one TP rank: {args.tokens} tokens x {args.vocab_shard} vocabulary rows, bf16 logits, "
          f"temperature {args.temperature}, device {_device_name(device)}")
    print(f"one float32 copy of the logits: {copy_bytes / 2**20:.0f} MiB; extra memory = peak allocated during "
          "forward + backward, less the returned bf16 gradient")
    print(f"{'':10} {'implementation':20} {'extra memory / fp32 copy':>25} {'time (s)':>9}")
    for entropy in (False, True):
        results = {}
        for name, impl in IMPLEMENTATIONS.items():
            run = lambda: forward_backward(impl, logits, targets, g_lp, g_h, args.temperature, entropy)  # noqa: E731
            extra = peak(run) - grad_bytes
            times = []
            for _ in range(args.repeats):
                _sync(device)
                start = time.perf_counter()
                results[name] = run()
                _sync(device)
                times.append(time.perf_counter() - start)
            label = "+ entropy" if entropy else "log-prob"
            print(f"{label:10} {name:20} {extra / copy_bytes:>25.3f} {statistics.median(times):>9.3f}")
        (lp0, h0, g0), (lp1, h1, g1) = results.values()
        diffs = [f"log-prob {(lp0 - lp1).abs().max().item():.1e}",
                 f"gradient {(g0.float() - g1.float()).abs().max().item():.1e} (bf16)"]
        if entropy:
            diffs.insert(1, f"entropy {(h0 - h1).abs().max().item():.1e}")
        print(f"{'':10} max |before - chunked|: {', '.join(diffs)}")


# ---- fp32_lm_head ------------------------------------------------------------------------------

def lm_head_section(args) -> None:
    import dataclasses

    from _bench_world import bench_model_config, start_one_process_world

    from megatron_rlcorr.model.build import build_model_chunks
    from megatron_rlcorr.parallel.groups import build_parallel_groups

    start_one_process_world(args.device, 29517)
    groups = build_parallel_groups(1, 1, 1)
    base = bench_model_config(hidden=args.hidden, layers=args.layers, vocab=args.vocab, max_positions=args.seq,
                              device=args.device)
    device = "cuda" if args.device == "cuda" else "cpu"
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(3))
    tokens = tokens.to(device)
    targets = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(args.seq, device=device)[None].expand(args.batch, -1)

    def build(bf16: bool, fp32_head: bool):
        (model,) = build_model_chunks(dataclasses.replace(base, bf16=bf16, params_dtype=None, fp32_lm_head=fp32_head),
                                      groups, seed=11)
        return model

    models = {flag: build(True, flag) for flag in (False, True)}
    reference = build(False, False)
    with torch.no_grad():
        for model in models.values():  # a power of two: exact in bf16
            model.output_layer.weight.mul_(args.head_scale)
        # The float32 reference holds the bf16 model's weights exactly: only the arithmetic differs.
        for (name, p32), (name16, p16) in zip(reference.named_parameters(), models[False].named_parameters()):
            assert name == name16, (name, name16)
            p32.copy_(p16.float())

    def run(model, backward: bool = False):
        seen = {}
        hook = model.output_layer.register_forward_pre_hook(lambda m, a: seen.update(hidden=a[0].detach()))
        with torch.set_grad_enabled(backward):
            logits = model(tokens, positions, None)
            lp, _ = token_logprobs_and_entropy(logits, targets, temperature=args.temperature)
            if backward:
                lp.sum().backward()
        hook.remove()
        return lp.detach().double(), logits.detach(), seen["hidden"]

    fp32_lp, _, _ = run(reference)
    print(f"fp32_lm_head: a seeded GPT (hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}, output "
          f"weight x{args.head_scale:g}), {args.batch} x {args.seq} tokens, temperature {args.temperature}, "
          f"device {_device_name(args.device)}")
    print("  |d log p| over the tokens:  whole model vs the same weights in float32  |  head only: vs float64 "
          "logits of the same bf16 hidden states")
    for fp32_head, model in models.items():
        lp, logits, hidden = run(model)
        exact = F.linear(hidden.double(), model.output_layer.weight.double()).transpose(0, 1)
        exact_lp, _ = token_logprobs_and_entropy(exact, targets, temperature=args.temperature)
        d_model, d_head = (lp - fp32_lp).abs(), (lp - exact_lp.double()).abs()
        print(f"  fp32_lm_head={str(fp32_head).lower():5}  mean {d_model.mean().item():.2e}  max "
              f"{d_model.max().item():.2e}  |  mean {d_head.mean().item():.2e}  max {d_head.max().item():.2e}  "
              f"(logits {str(logits.dtype).replace('torch.', '')}, |logit| up to {logits.float().abs().max().item():.1f})")
    peak = cuda_peak_bytes if device == "cuda" else cpu_peak_bytes
    peaks = {flag: peak(lambda m=model: run(m, backward=True)) for flag, model in models.items()}
    tokens_n, vocab = args.batch * args.seq, models[False].output_layer.weight.shape[0]
    # float32 copies: the weight shard and its gradient before the cast back (2 x 4 V_p H), the logits
    # twice over (GPTModel returns a [b, s] copy of the [s, b] output: 2 x 2 T V_p more than bf16),
    # the hidden states and their gradient (2 x 4 T H)
    formula = 8 * vocab * args.hidden + 4 * tokens_n * vocab + 8 * tokens_n * args.hidden
    print(f"  peak memory of forward + log-probs + backward: {peaks[False] / 2**20:.1f} MiB (bf16 head), "
          f"{peaks[True] / 2**20:.1f} MiB (fp32 head): +{(peaks[True] - peaks[False]) / 2**20:.1f} MiB; expected "
          f"8 V_p H + 4 T V_p + 8 T H bytes = {formula / 2**20:.1f} MiB (T tokens, V_p {vocab} rows, H {args.hidden})")
    dist.destroy_process_group()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({torch.get_num_threads()} threads)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tokens", type=int, default=22528 // 8, help="tokens of one micro-batch on one rank")
    parser.add_argument("--vocab-shard", type=int, default=152064 // 8, help="vocabulary rows per TP rank")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lm-head", action="store_true", help="the fp32_lm_head section instead")
    parser.add_argument("--vocab", type=int, default=32000, help="--lm-head: vocabulary size")
    parser.add_argument("--hidden", type=int, default=512, help="--lm-head: hidden size")
    parser.add_argument("--layers", type=int, default=2, help="--lm-head: layers")
    parser.add_argument("--seq", type=int, default=256, help="--lm-head: tokens per sequence")
    parser.add_argument("--batch", type=int, default=2, help="--lm-head: sequences")
    parser.add_argument("--head-scale", type=float, default=8.0,
                        help="--lm-head: the output weight times this (a power of two), for logits of a trained "
                             "model's size (|z| ~ 10-30)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA machine")
    if args.lm_head:
        lm_head_section(args)
    else:
        log_prob_section(args)


if __name__ == "__main__":
    main()
