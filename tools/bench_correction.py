"""Benchmark: compute_rollout_correction vs a straightforward multi-pass implementation.

The baseline is written the way most frameworks write this math: one tensor op per formula, a
masked mean per metric and one `.item()` per metric (a host sync each on a GPU). Both run side by
side in one process on the same inputs, and the baseline's weights and masks are checked against
ours first so the comparison is fair. On a GPU the table also shows the memory-bandwidth floor:
one read of the inputs (two float32 log-prob tensors and a float32 mask) and one write of the
outputs (float32 weights and mask), at the bandwidth measured by a device-to-device copy.

The `kernels` column is the number of kernels one call launches, by the counting rule of
tools/op_count.py (torch.profiler on the CPU; the leaf ATen ops less views, allocations and no-op
casts), on a batch of 8 x 4096 tokens taken in one block as on a GPU, with every metric.
`--count-ops` prints only those counts, with the op types, for the correction's settings and for
one micro-batch's policy loss (PPO-clip + IS weights + entropy + KL to a reference policy; its
forward, and forward + backward).

`--compile` adds the compiled call (correction/compiled.py, `algorithm.correction_compile: torch`)
beside the eager one: `first call s`, the seconds of its first call at that size (the compilation,
for the first size; later sizes reuse it), `compiled ms`, and `vs ours`, eager ms / compiled ms (above
1x: the compiled call is faster). Its outputs are checked against the eager call's first (masks
equal, weights and metrics within compiled.RTOL). `--compile-backend` picks torch.compile's backend
(inductor; aot_eager traces without generating kernels, to check the tool cheaply on a CPU).

    python tools/bench_correction.py [--sizes 256K,1M,4M] [--device cuda] [--repeats 15] [--compile]
    python tools/bench_correction.py --count-ops
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import time
from pathlib import Path

import torch

from megatron_rlcorr.config import RolloutCorrectionConfig
from megatron_rlcorr.correction import compute_rollout_correction
from megatron_rlcorr.correction.compiled import DEFAULT_BACKEND, RTOL, compute_rollout_correction_compiled
from megatron_rlcorr.training.kl import KLLossSettings
from megatron_rlcorr.training.losses import LossConfig, global_loss_normalizers, policy_loss


def _tool(name: str):
    """A module of tools/ (a folder of scripts, not a package), loaded by its path."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


op_count = _tool("op_count")

SETTINGS = {
    "token_is": RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0),
    "dapo": RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
                                    rollout_rs="geometric", rollout_rs_threshold=1.01,
                                    rollout_rs_threshold_lower=0.99, rollout_token_veto_threshold=1e-4),
}
SEQ_LEN = 4096
COUNT_ROWS = 8  # the op-count batch: 8 x 4096 tokens, one block
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")


# ----------------------------------------------------------------------------------------------
# The multi-pass baseline (padded layout, one process).
def _masked_sum(x, mask, dim=None):
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def _masked_mean(x, mask, dim=None):
    return _masked_sum(x, mask, dim) / (mask.sum() if dim is None else mask.sum(dim)).clamp(min=1)


def _ratio_family(prefix, w, log_w, mask, hi, lo, token_level, seq_w_row=None):
    m = {}
    valid_rows = mask.sum(-1) > 0
    m[prefix + "mean"] = _masked_mean(w, mask).item()
    if token_level:
        m[prefix + "ratio_fraction_high"] = _masked_mean((w > hi).float(), mask).item()
        m[prefix + "ratio_fraction_low"] = _masked_mean((w < lo).float(), mask).item()
        m[prefix + "max"] = w.masked_fill(mask == 0, float("-inf")).max().item()
        m[prefix + "min"] = w.masked_fill(mask == 0, float("inf")).min().item()
    else:
        log_rows = log_w[valid_rows]
        m[prefix + "max"] = math.exp(min(log_rows.max().item(), 20.0))
        m[prefix + "min"] = math.exp(log_rows.min().item())
        m[prefix + "ratio_fraction_high"] = (log_rows > math.log(hi)).float().mean().item()
        m[prefix + "ratio_fraction_low"] = (log_rows < math.log(lo)).float().mean().item()
    clipped = w.clamp(lo, hi)
    mean_c = _masked_mean(clipped, mask)
    m[prefix + "std"] = torch.sqrt((_masked_mean(clipped.square(), mask) - mean_c.square()).clamp(min=0)).item()
    m[prefix + "eff_sample_size"] = (1.0 / _masked_mean((clipped / (mean_c + 1e-8)).square(), mask)).item()
    row_mean = (_masked_sum(w, mask, -1) / mask.sum(-1).clamp(min=1))[valid_rows]
    m[prefix + "seq_mean"] = row_mean.mean().item()
    m[prefix + "seq_std"] = row_mean.std().item() if row_mean.numel() > 1 else 0.0
    m[prefix + "seq_max"] = row_mean.max().item()
    m[prefix + "seq_min"] = row_mean.min().item()
    m[prefix + "seq_max_deviation"] = (row_mean - 1).abs().max().item()
    m[prefix + "seq_fraction_high"] = (row_mean > hi).float().mean().item()
    m[prefix + "seq_fraction_low"] = (row_mean < lo).float().mean().item()
    return m


def multipass_correction(old, rollout, mask, cfg: RolloutCorrectionConfig):
    mask = mask.float()
    lr = old.float() - rollout.float()
    metrics = {}
    valid_rows = mask.sum(-1) > 0
    # off-policy diagnostics
    metrics["kl"] = _masked_mean(rollout - old, mask).item()
    lr_c = lr.clamp(-20, 20)
    metrics["k3_kl"] = _masked_mean(torch.exp(lr_c) - lr_c - 1, mask).item()
    mean_old = _masked_sum(old, mask, -1) / mask.sum(-1).clamp(min=1)
    mean_rollout = _masked_sum(rollout, mask, -1) / mask.sum(-1).clamp(min=1)
    metrics["training_ppl"] = torch.exp(-mean_old)[valid_rows].mean().item()
    metrics["training_log_ppl"] = (-mean_old)[valid_rows].mean().item()
    metrics["rollout_ppl"] = torch.exp(-mean_rollout)[valid_rows].mean().item()
    metrics["rollout_log_ppl"] = (-mean_rollout)[valid_rows].mean().item()
    diff = (mean_rollout - mean_old)[valid_rows]
    metrics["log_ppl_diff"] = diff.mean().item()
    metrics["log_ppl_abs_diff"] = diff.abs().mean().item()
    metrics["log_ppl_diff_max"] = diff.max().item()
    metrics["log_ppl_diff_min"] = diff.min().item()
    metrics["ppl_ratio"] = torch.exp(diff).mean().item()
    metrics["chi2_token"] = (_masked_mean(torch.exp(2 * lr_c), mask) - 1).item()
    seq_lr = _masked_sum(lr, mask, -1)
    metrics["chi2_seq"] = (torch.exp(2 * seq_lr.clamp(-20, 20))[valid_rows].mean() - 1).item()

    weights = None
    if cfg.rollout_is is not None:
        C, c = cfg.rollout_is_threshold, cfg.is_threshold_low_mark
        if cfg.rollout_is == "token":
            w = torch.exp(lr_c) * mask
            metrics.update(_ratio_family("rollout_is_", w, lr, mask, C, c, True))
        else:
            w_row = torch.exp(seq_lr.clamp(-20, 20))
            w = w_row.unsqueeze(-1).expand_as(lr) * mask
            metrics.update(_ratio_family("rollout_is_", w, seq_lr, mask, C, c, False))
        weights = w.clamp(max=C) * mask
        if cfg.rollout_is_batch_normalize:
            if cfg.rollout_is == "token":
                mean = _masked_mean(weights, mask)
            else:
                mean = w_row.clamp(max=C)[valid_rows].mean()
            factor = mean if mean.item() > 1e-8 else torch.ones(())
            weights = weights / factor
            metrics["rollout_is_batch_norm_factor"] = factor.item()
    keep = mask.clone()
    rule = cfg.ratio_rejection
    if rule is not None:
        U, lo = rule.upper, rule.lower
        if rule.aggregate == "token":
            r = torch.exp(lr_c)
            keep_rs = ((r >= lo) & (r <= U)).float()
            metrics.update(_ratio_family("rollout_rs_", r * mask, lr, mask, U, lo, True))
        else:
            log_r = seq_lr if rule.aggregate == "seq_sum" else seq_lr / mask.sum(-1).clamp(min=1)
            r_row = torch.exp(log_r.clamp(-20, 20))
            keep_rs = ((r_row >= lo) & (r_row <= U)).float().unsqueeze(-1).expand_as(lr)
            metrics.update(_ratio_family("rollout_rs_", r_row.unsqueeze(-1).expand_as(lr) * mask, log_r, mask,
                                         U, lo, False))
        metrics["rollout_rs_masked_fraction"] = _masked_mean(1 - keep_rs, mask).item()
        lost_rows = (_masked_sum(1 - keep_rs, mask, -1) > 0)[valid_rows]
        metrics["rollout_rs_seq_masked_fraction"] = lost_rows.float().mean().item()
        keep = keep * keep_rs
    if cfg.rollout_token_veto_threshold is not None:
        catastrophic = (lr < math.log(cfg.rollout_token_veto_threshold)).float() * mask
        vetoed = catastrophic.sum(-1) > 0
        metrics["rollout_is_veto_fraction"] = vetoed[valid_rows].float().mean().item()
        metrics["rollout_is_catastrophic_token_fraction"] = _masked_mean(catastrophic, mask).item()
        keep = keep * (~vetoed).float().unsqueeze(-1)
    return weights, keep, metrics


# ----------------------------------------------------------------------------------------------
def make_inputs(num_tokens: int, device: torch.device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = num_tokens // SEQ_LEN
    old = -torch.rand(rows, SEQ_LEN, generator=g) * 4
    rollout = (old + 0.02 * torch.randn(rows, SEQ_LEN, generator=g)).clamp(max=0)
    lengths = torch.randint(SEQ_LEN // 8, SEQ_LEN + 1, (rows,), generator=g)
    mask = (torch.arange(SEQ_LEN) < lengths[:, None]).float()
    return old.to(device), rollout.to(device), mask.to(device)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device, repeats: int) -> float:
    return time_side_by_side([fn], device, repeats)[0]


def time_side_by_side(fns, device, repeats: int) -> list[float]:
    """Median ms of each function, their runs interleaved so that both see the same machine
    (a shared CPU's speed drifts from one second to the next)."""
    for fn in fns:
        fn()
    _sync(device)
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            start = time.perf_counter()
            fn()
            _sync(device)
            out.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(s) for s in samples]


def copy_bandwidth_bytes_per_ms(device, numel: int = 1 << 26) -> float:
    src = torch.empty(numel, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, 10)
    return 2 * src.numel() * src.element_size() / ms  # read + write


def cuda_graph_replay(fn):
    """`fn` captured once in a CUDA graph; returns the replay. The eager call above is launch-bound
    on a GPU (a few hundred small kernels, each a few microseconds of host dispatch); the replay
    launches them all at once, which is what a trainer that captures its step pays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph, as capture requires
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def check_agreement(old, rollout, mask, cfg):
    ours = compute_rollout_correction(old, rollout, mask, cfg, check_inputs=False)
    w, keep, metrics = multipass_correction(old, rollout, mask, cfg)
    if w is not None:
        torch.testing.assert_close(ours.is_weights, w, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours.response_mask, keep), "baseline and library disagree on the mask"
    for name, value in metrics.items():
        got = ours.metrics["rollout_corr/" + name].item()
        if name.endswith("_std") and not name.endswith("seq_std"):
            # The baseline's one-pass float32 variance carries ~sqrt(8 eps32) noise (docs/correction.md).
            assert abs(got * got - value * value) <= 2e-4 * value * value + 1e-5, (name, got, value)
        else:
            assert math.isclose(got, value, rel_tol=1e-3, abs_tol=1e-4), (name, got, value)


def first_compiled_call_s(old, rollout, mask, cfg, backend: str) -> float:
    """Seconds of a first compiled call (it compiles the variant), after which its outputs are
    checked against the eager call's: masks equal, weights and metrics within compiled.RTOL."""
    _sync(old.device)
    start = time.perf_counter()
    got = compute_rollout_correction_compiled(old, rollout, mask, cfg, check_inputs=False, backend=backend)
    _sync(old.device)
    seconds = time.perf_counter() - start
    want = compute_rollout_correction(old, rollout, mask, cfg, check_inputs=False)
    assert torch.equal(got.response_mask, want.response_mask), "the compiled call's mask differs from eager's"
    if want.is_weights is not None:
        torch.testing.assert_close(got.is_weights, want.is_weights, rtol=RTOL, atol=1e-7)
    for name, value in want.metrics.items():
        torch.testing.assert_close(got.metrics[name], value, rtol=RTOL, atol=1e-7, msg=name)
    return seconds


# ----------------------------------------------------------------------------------------------
# Kernel counts (tools/op_count.py)
def count_correction_ops(cfg: RolloutCorrectionConfig):
    """Counter of the kernels one call launches on the count batch (every metric)."""
    old, rollout, mask = make_inputs(COUNT_ROWS * SEQ_LEN, torch.device("cpu"))
    return op_count.count_ops(lambda: compute_rollout_correction(old, rollout, mask, cfg, check_inputs=False))


def loss_inputs(rows: int = COUNT_ROWS, seq_len: int = 512, seed: int = 0) -> dict:
    """One micro-batch of the policy loss: pi_theta log-probs and entropy (differentiable), pi_old,
    the reference policy, advantages, the correction's mask and IS weights."""
    g = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(rows, seq_len, generator=g) * 3
    mask = (torch.arange(seq_len) < torch.randint(seq_len // 4, seq_len + 1, (rows, 1), generator=g)).float()
    return dict(log_prob=log_prob.requires_grad_(True),
                old_log_prob=log_prob.detach() + 0.05 * torch.randn(rows, seq_len, generator=g),
                advantages=torch.randn(rows, 1, generator=g).expand(rows, seq_len).contiguous(),
                loss_mask=mask, is_weights=torch.rand(rows, seq_len, generator=g) * mask,
                entropy=(torch.rand(rows, seq_len, generator=g) * 2).requires_grad_(True),
                ref_log_prob=log_prob.detach() + 0.05 * torch.randn(rows, seq_len, generator=g))


def count_loss_ops(agg_mode: str = "token-mean", backward: bool = False):
    """Counter of the kernels of one micro-batch's policy loss: PPO-clip (clip-higher, dual clip)
    with token IS weights, an entropy bonus and the low_var_kl loss to a reference policy."""
    x = loss_inputs()
    cfg = LossConfig(clip_ratio_high=0.28, entropy_coeff=0.001, loss_agg_mode=agg_mode)
    (normalizer,) = global_loss_normalizers([x["loss_mask"]], agg_mode)
    kl = KLLossSettings(enabled=True, coef=0.001, type="low_var_kl")

    def step():
        out = policy_loss(x["log_prob"], x["old_log_prob"], x["advantages"], x["loss_mask"], cfg,
                          normalizer=normalizer, is_weights=x["is_weights"], entropy=x["entropy"],
                          ref_log_prob=x["ref_log_prob"], kl=kl)
        if backward:
            out.loss.backward()

    return op_count.count_ops(step)


def print_op_counts() -> None:
    rows = [(f"correction {name}", count_correction_ops(cfg)) for name, cfg in SETTINGS.items()]
    for mode in LOSS_AGG_MODES:
        rows.append((f"loss {mode}", count_loss_ops(mode)))
        rows.append((f"loss {mode} +backward", count_loss_ops(mode, backward=True)))
    print(f"torch={torch.__version__}; kernels per call, counted by tools/op_count.py")
    print(f"{'call':<36} {'kernels':>7}  op types")
    for name, counts in rows:
        kinds = ", ".join(f"{op.removeprefix('aten::')} {n}" for op, n in counts.most_common())
        print(f"{name:<36} {sum(counts.values()):>7}  {kinds}")


def _parse_size(text: str) -> int:
    """'262144', '256K', '1M', '4M' -> tokens (K = 2^10, M = 2^20)."""
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text.strip()[-1:].upper(), 1)
    digits = text.strip()[:-1] if scale > 1 else text.strip()
    try:
        return int(float(digits) * scale)
    except ValueError:
        raise SystemExit(f"--sizes: cannot read {text!r}; use token counts like 262144 or 256K,1M,4M") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="256K,1M,4M", help="token counts, comma-separated (K = 2^10, M = 2^20)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--floor", action=argparse.BooleanOptionalAction, default=None,
                        help="print the memory-bandwidth floor columns (default: on a GPU only)")
    parser.add_argument("--count-ops", action="store_true",
                        help="print the kernels per call of each setting and of the policy loss, and exit")
    parser.add_argument("--compile", action="store_true",
                        help="also time the torch.compile'd call (algorithm.correction_compile: torch) beside eager")
    parser.add_argument("--compile-backend", default=DEFAULT_BACKEND,
                        help=f"torch.compile backend for --compile (default {DEFAULT_BACKEND})")
    args = parser.parse_args(argv)
    if args.count_ops:
        print_op_counts()
        return
    device = torch.device(args.device)
    show_floor = device.type == "cuda" if args.floor is None else args.floor
    bandwidth = copy_bandwidth_bytes_per_ms(device) if show_floor else None
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()}")
    kernels = {name: sum(count_correction_ops(cfg).values()) for name, cfg in SETTINGS.items()}
    header = f"{'setting':<9} {'tokens':>9} {'kernels':>7} {'multi-pass ms':>14} {'ours ms':>9} {'speed-up':>9}"
    graphed = device.type == "cuda"
    if graphed:
        header += f" {'graphed ms':>11} {'speed-up':>9}"
    if bandwidth:
        header += f" {'floor ms':>9} {'ours/floor':>10}"
    if args.compile:
        header += f" {'first call s':>12} {'compiled ms':>11} {'vs ours':>8}"
    print(header)
    for num_tokens in (_parse_size(s) for s in args.sizes.split(",")):
        old, rollout, mask = make_inputs(num_tokens, device)
        for name, cfg in SETTINGS.items():
            check_agreement(old, rollout, mask, cfg)
            base, ours = time_side_by_side(
                [lambda: multipass_correction(old, rollout, mask, cfg),
                 lambda: compute_rollout_correction(old, rollout, mask, cfg, check_inputs=False)],
                device, args.repeats)
            row = f"{name:<9} {old.numel():>9} {kernels[name]:>7} {base:>14.2f} {ours:>9.2f} {base / ours:>8.1f}x"
            if graphed:
                replay = cuda_graph_replay(
                    lambda: compute_rollout_correction(old, rollout, mask, cfg, check_inputs=False))
                ours = time_ms(replay, device, args.repeats)
                row += f" {ours:>11.3f} {base / ours:>8.1f}x"
            if bandwidth:
                floor = (3 * 4 + 2 * 4) * old.numel() / bandwidth
                row += f" {floor:>9.3f} {ours / floor:>9.0f}x"
            if args.compile:
                row += _compiled_columns(old, rollout, mask, cfg, device, args)
            print(row, flush=True)


def _compiled_columns(old, rollout, mask, cfg, device, args) -> str:
    """The --compile columns: first call s, compiled ms, eager ms / compiled ms (timed side by side)."""
    first = first_compiled_call_s(old, rollout, mask, cfg, args.compile_backend)
    eager, compiled = time_side_by_side(
        [lambda: compute_rollout_correction(old, rollout, mask, cfg, check_inputs=False),
         lambda: compute_rollout_correction_compiled(old, rollout, mask, cfg, check_inputs=False,
                                                     backend=args.compile_backend)],
        device, args.repeats)
    return f" {first:>12.1f} {compiled:>11.3f} {eager / compiled:>7.2f}x"


if __name__ == "__main__":
    main()
