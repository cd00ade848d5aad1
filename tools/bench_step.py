"""Benchmark: one whole RL training step of a Qwen2.5-1.5B-shaped model on one GPU.

What: the trainer's decoupled step (rl/trainer.py `_before_updates` and `_update`, no reference
policy): the forward-only pi_old pass (`compute_old_log_probs_and_entropy`), the rollout correction
over the step batch (`step_correction`) and the update (`train_minibatch`: forward/backward over
packed micro-batches, the optimizer step), of a seeded random initialisation (no download) of
`model.architecture: qwen2.5-1.5b` (28 layers, hidden 1536, SwiGLU 8960, 12 heads / 2 K/V groups,
q/k/v bias, RoPE, tied embeddings, vocabulary 151,936) in BF16 with Transformer Engine's layers
(`--layers` lowers the depth where 28 do not fit or take too long), under DAPO's algorithm (PPO
clip-higher, sequence IS, geometric RS, veto) and the distributed optimizer (`bench_recipe`).
Why: the trainer's throughput and MFU, the correction's and the loss's share of a step at full
size, and `plan`'s memory model (recipe/memory.py) against what the GPU allocates.

How measured: `--warmup` untimed steps, then `--steps` timed ones back to back between two
torch.cuda.synchronize() (perf_counter). Inside them the `step_correction` call and every
`policy_loss` call (training/losses.py, once per micro-batch: the loss's forward; its backward runs
inside the model's) are timed with CUDA events on the GPU, perf_counter on the CPU; a share is
their time over the steps'. tokens/s: the tokens the model computes (each sequence through its last
response token) per second. peak: torch.cuda.max_memory_allocated over the timed steps; plan:
`estimate_memory` of the same recipe on 1 GPU, its training phase without a rollout engine
(weights + gradients + optimizer + activations + logits: the bench holds no engine).
The batch: `--sequences` sequences of seeded random tokens, lengths uniform in [seq_len / 2,
seq_len], a quarter prompt, packed (THD, cu_seqlens) into micro-batches of at most
`--micro-batch-tokens` tokens; rollout log-probs: the initial model's + N(0, ROLLOUT_NOISE) per
token (a real, small mismatch); advantages +-1 per sequence.

FLOPs (MFU): per token 2 N for the pi_old forward and 6 N for the update's forward and backward
(6 x params), N = the decoder layers' parameters + the output layer's V x h (the embedding lookup
is no matmul), plus causal attention: 2 s q_dim FLOPs per token per layer in a forward over a
sequence of s tokens (QK^T and AV over s / 2 earlier positions on average), once for pi_old and 3
times for the update. Model FLOPs: padding and recomputation are not counted. MFU = FLOPs per second
/ the dense BF16 peak (PEAK_BF16_FLOPS by device name, or `--peak-tflops`); omitted with a note
where neither is known (the CPU).

`--device cpu` (the default without CUDA): a tiny model of the same kind (2 layers, hidden 64,
Megatron-Core's local layers, float32) on short sequences, for the unit test; no GPU figure.

    python tools/bench_step.py [--device cuda|cpu] [--layers 28] [--seq-len 4096] [--sequences 8]
        [--micro-batch-tokens 8192] [--warmup 1] [--steps 3] [--peak-tflops T]

Conventions: seconds, bytes (printed in MiB = 2**20), FLOPs; names carry their unit.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time

import torch

# Dense (no sparsity) BF16 tensor-core peaks, NVIDIA's data sheets; the first entry in the device's name wins.
PEAK_BF16_FLOPS = (("H200 NVL", 835e12), ("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12),
                   ("H100", 989e12), ("A100", 312e12))
DEFAULTS = {"cuda": dict(layers=28, seq_len=4096, sequences=8, micro_batch_tokens=8192),
            "cpu": dict(layers=2, seq_len=32, sequences=4, micro_batch_tokens=64)}
TINY_MODEL = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                  add_qkv_bias=True, tie_embeddings=True, rotary_base=1e6, max_position_embeddings=4096)
# The recipe tree's model, replaced by the bench's (a preset's depth cannot be overridden in a tree)
PLACEHOLDER_MODEL = dict(vocab_size=16, hidden_size=8, num_layers=1, num_attention_heads=1, ffn_hidden_size=8)
ROLLOUT_NOISE = 0.02   # standard deviation (nats per token) of the rollout log-probs from the model's
SEED = 1234


def parse_args(argv=None) -> argparse.Namespace:
    """The options with the device's defaults; ValueError for options that cannot run here."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda where available, else cpu")
    parser.add_argument("--layers", type=int, help="decoder layers (default: 28 on cuda, Qwen2.5-1.5B's; 2 on cpu)")
    parser.add_argument("--seq-len", type=int, help="longest sequence, tokens (default: 4096 on cuda, 32 on cpu)")
    parser.add_argument("--sequences", type=int, help="sequences per step (default: 8 on cuda, 4 on cpu)")
    parser.add_argument("--micro-batch-tokens", type=int, help="packing budget (default: 8192 on cuda, 64 on cpu)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense BF16 peak, for MFU")
    args = parser.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    from megatron_rlcorr.model.implementation import resolve_transformer_impl

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA GPU (torch.cuda.is_available() is False): run it on "
                         "a GPU machine, or use --device cpu (a tiny model, for testing the tool)")
    for name, least in (("layers", 1), ("sequences", 1), ("steps", 1), ("warmup", 0), ("seq_len", 8)):
        if getattr(args, name) < least:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(args, name)}")
    if args.micro_batch_tokens < args.seq_len:
        raise ValueError(f"--micro-batch-tokens ({args.micro_batch_tokens}) must hold the longest sequence: "
                         f"use at least --seq-len ({args.seq_len})")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise ValueError(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    # Transformer Engine on the GPU, as the trainer builds it there (a ValueError naming the fix without it)
    args.transformer_impl = resolve_transformer_impl("transformer_engine" if args.device == "cuda" else "local")


# ---- the recipe, the model, the batch -----------------------------------------------------------

def bench_recipe(args):
    """The step's recipe (module docstring) with the model of `args.device`."""
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.recipe import parse_recipe

    model = (ModelConfig.from_dict({"architecture": "qwen2.5-1.5b", "bf16": True}) if args.device == "cuda"
             else ModelConfig(**TINY_MODEL, num_layers=args.layers))
    model = dataclasses.replace(model, num_layers=args.layers, transformer_impl=args.transformer_impl)
    tree = {"name": "bench_step", "model": PLACEHOLDER_MODEL, "parallel": {"tp": 1, "pp": 1, "cp": 1},
            "rollout": {"max_new_tokens": args.seq_len, "temperature": 1.0},
            "algorithm": {"loss": {"loss_type": "ppo_clip", "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                                   "clip_ratio_c": 10.0, "loss_agg_mode": "token-mean"},
                          "rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 2.0,
                                                 "rollout_is_batch_normalize": True, "rollout_rs": "geometric",
                                                 "rollout_rs_threshold": 1.01, "rollout_rs_threshold_lower": 0.99,
                                                 "rollout_token_veto_threshold": 1e-4}},
            "optim": {"lr": 1e-6, "weight_decay": 0.1, "clip_grad": 1.0, "use_distributed_optimizer": True},
            "trainer": {"micro_batch_size": 1, "max_tokens_per_micro_batch": args.micro_batch_tokens, "seed": SEED}}
    return dataclasses.replace(parse_recipe(tree), model=model)


def step_config(recipe):
    """The StepConfig the trainer makes of a recipe (rl/trainer.py)."""
    from megatron_rlcorr.training.step import StepConfig

    algo, trainer = recipe.algorithm, recipe.trainer
    return StepConfig(loss=algo.loss, correction=algo.rollout_correction, micro_batch_size=trainer.micro_batch_size,
                      max_tokens_per_micro_batch=trainer.max_tokens_per_micro_batch,
                      temperature=recipe.rollout.temperature, kl_loss=algo.kl_loss,
                      response_limit=recipe.rollout.max_new_tokens)


def build_trainer(recipe, groups, total_steps: int):
    """(model chunks, optimizer) as the trainer builds them."""
    from megatron_rlcorr.training.optimizer import build_model_and_optimizer

    chunks, optimizer, _ = build_model_and_optimizer(recipe.model, recipe.optim, groups, seed=recipe.trainer.seed,
                                                     total_steps=total_steps)
    return chunks, optimizer


def make_batch(args, vocab_size: int, device: torch.device):
    """The step batch (module docstring); rollout log-probs 0 until `with_rollout_log_probs`."""
    from megatron_rlcorr.rl.batch import batch_to
    from megatron_rlcorr.training.step import StepBatch

    gen = torch.Generator().manual_seed(SEED)
    lengths = torch.randint(args.seq_len // 2, args.seq_len + 1, (args.sequences,), generator=gen)
    tokens = torch.zeros(args.sequences, args.seq_len, dtype=torch.long)
    mask = torch.zeros(args.sequences, args.seq_len)
    for row, length in enumerate(lengths.tolist()):
        tokens[row, :length] = torch.randint(1, vocab_size, (length,), generator=gen)
        mask[row, length // 4 - 1:length - 1] = 1   # the response tokens, at their targets' positions
    targets = torch.cat([tokens[:, 1:], torch.zeros(args.sequences, 1, dtype=torch.long)], dim=1)
    advantages = (torch.randint(0, 2, (args.sequences, 1), generator=gen) * 2 - 1).float().expand_as(mask)
    return batch_to(StepBatch(tokens, targets, mask, torch.zeros_like(mask), advantages.contiguous()), device)


def with_rollout_log_probs(chunks, batch, cfg, groups):
    """`batch` with rollout log-probs = the model's + N(0, ROLLOUT_NOISE), 0 off the response."""
    from megatron_rlcorr.training.step import compute_old_log_probs

    model_lp = compute_old_log_probs(chunks, batch, groups=groups, micro_batch_size=cfg.micro_batch_size,
                                     temperature=cfg.temperature,
                                     max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch)
    noise = torch.randn(model_lp.shape, generator=torch.Generator().manual_seed(SEED + 1)).to(model_lp.device)
    rollout = torch.where(batch.response_mask_BT > 0, (model_lp + ROLLOUT_NOISE * noise).clamp(max=-1e-4), 0.0)
    return dataclasses.replace(batch, rollout_log_probs_BT=rollout)


# ---- timing -------------------------------------------------------------------------------------

class SpanTimer:
    """Time inside the timed calls: CUDA events on the GPU (read after a synchronize), perf_counter on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.spans = cuda, []

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def span(self):
        start = self._mark()
        yield
        self.spans.append((start, self._mark()))

    def pop_seconds(self) -> float:
        """The spans' total since the last call (on the GPU: call after a synchronize)."""
        seconds = sum(start.elapsed_time(end) / 1e3 if self.cuda else end - start for start, end in self.spans)
        self.spans.clear()
        return seconds


@contextlib.contextmanager
def timed_loss(timer: SpanTimer):
    """While active, train_minibatch's policy_loss calls are timed."""
    from megatron_rlcorr.training import step as step_module

    original = step_module.policy_loss

    def timed(*args, **kwargs):
        with timer.span():
            return original(*args, **kwargs)

    step_module.policy_loss = timed
    try:
        yield
    finally:
        step_module.policy_loss = original


def run_step(chunks, optimizer, batch, cfg, groups, timers: dict[str, SpanTimer]):
    """The trainer's decoupled step: pi_old pass, correction, update."""
    from megatron_rlcorr.training.step import compute_old_log_probs_and_entropy, step_correction, train_minibatch

    old, _entropy = compute_old_log_probs_and_entropy(
        chunks, batch, groups=groups, micro_batch_size=cfg.micro_batch_size, temperature=cfg.temperature,
        max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch)
    with timers["correction"].span():
        correction, _metrics = step_correction(old, batch, cfg.correction, groups)
    with timed_loss(timers["loss"]):
        return train_minibatch(chunks, optimizer, batch, groups=groups, cfg=cfg, old_log_probs=old,
                               correction=correction)


# ---- the figures --------------------------------------------------------------------------------

def step_flops(model, lengths: torch.Tensor) -> float:
    """Model FLOPs of one step (module docstring): 8 N per token + causal attention x (1 + 3)."""
    shape = model.decoder_shape
    matmul_params = shape.num_layers * shape.layer_parameters + shape.vocab_size * shape.hidden_size
    q_dim = shape.num_attention_heads * shape.head_dim
    attention_forward = 2.0 * shape.num_layers * q_dim * float((lengths.double() ** 2).sum())
    return 8.0 * matmul_params * float(lengths.sum()) + 4.0 * attention_forward


def peak_flops(device_name: str, peak_tflops: float | None) -> tuple[float | None, str]:
    """The dense BF16 peak for MFU, and where it comes from (or why MFU is omitted)."""
    if peak_tflops is not None:
        return peak_tflops * 1e12, f"MFU against {peak_tflops:g} TFLOP/s (--peak-tflops)"
    for name, flops in PEAK_BF16_FLOPS:
        if name in device_name:
            return flops, f"MFU against {flops / 1e12:g} TFLOP/s, the {name}'s dense BF16 peak"
    return None, f"MFU omitted: no dense BF16 peak is known for {device_name!r}; pass --peak-tflops"


def run_bench(args) -> dict:
    """The figures, in a world of one process that exists already (main makes it)."""
    from megatron_rlcorr.parallel.groups import build_parallel_groups, destroy_parallel_groups

    groups = build_parallel_groups(1, 1, 1)
    try:
        device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
        recipe = bench_recipe(args)
        cfg = step_config(recipe)
        chunks, optimizer = build_trainer(recipe, groups, total_steps=args.warmup + args.steps)
        batch = with_rollout_log_probs(chunks, make_batch(args, recipe.model.vocab_size, device), cfg, groups)
        timed = time_steps(args, lambda timers: run_step(chunks, optimizer, batch, cfg, groups, timers), device)
        return figures(args, recipe, batch, timed, device)
    finally:
        destroy_parallel_groups()


def time_steps(args, step, device: torch.device) -> dict:
    """`--warmup` steps, then `--steps` timed back to back: their seconds, the correction's and the
    loss's, the last step's result and the peak CUDA memory (None off CUDA)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    timers = {"correction": SpanTimer(cuda), "loss": SpanTimer(cuda)}
    for _ in range(args.warmup):
        step(timers)
    sync()
    for timer in timers.values():
        timer.pop_seconds()   # the warm-up's
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        result = step(timers)
    sync()
    return dict(total_s=time.perf_counter() - start, correction_s=timers["correction"].pop_seconds(),
                loss_s=timers["loss"].pop_seconds(), result=result,
                peak_bytes=torch.cuda.max_memory_allocated(device) if cuda else None)


def figures(args, recipe, batch, timed: dict, device: torch.device) -> dict:
    """What the table prints, from the timed steps (module docstring for each)."""
    from megatron_rlcorr.recipe.memory import estimate_memory
    from megatron_rlcorr.training.microbatches import sequence_lengths

    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else f"cpu ({torch.get_num_threads()} threads)"
    lengths = sequence_lengths(batch.response_mask_BT).cpu()
    flops_per_step, total_s = step_flops(recipe.model, lengths), timed["total_s"]
    flops_per_s = flops_per_step * args.steps / total_s
    peak, note = peak_flops(name, args.peak_tflops)
    plan = estimate_memory(recipe, 1, torch.cuda.get_device_properties(device).total_memory if cuda else 80 * 2**30)
    return dict(device=name, model=recipe.model, lengths=lengths, step_s=total_s / args.steps,
                tokens_per_s=float(lengths.sum()) * args.steps / total_s,
                correction_share=timed["correction_s"] / total_s, loss_share=timed["loss_s"] / total_s,
                flops_per_step=flops_per_step, mfu=None if peak is None else flops_per_s / peak,
                mfu_note=note, peak_bytes=timed["peak_bytes"],
                plan_bytes=plan.training_phase - plan.rollout_resident,   # no rollout engine here
                padding_fraction=float(timed["result"].metrics["batch/padding_fraction"]))


# ---- the report ---------------------------------------------------------------------------------

COLUMNS = ("device", "layers", "tokens/step", "s/step", "tokens/s", "MFU", "correction share", "loss share",
           "peak MiB", "plan MiB", "peak/plan")


def format_table(r: dict, args) -> str:
    m, mib, peak = r["model"], 2**20, r["peak_bytes"]
    cells = (r["device"], str(m.num_layers), str(int(r["lengths"].sum())), f"{r['step_s']:.3f}",
             f"{r['tokens_per_s']:.0f}", "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
             f"{100 * r['correction_share']:.2f}%", f"{100 * r['loss_share']:.2f}%",
             "-" if peak is None else f"{peak / mib:.0f}", f"{r['plan_bytes'] / mib:.1f}",
             "-" if peak is None else f"{peak / r['plan_bytes']:.2f}")
    return "\n".join([
        f"One RL step (pi_old forward, rollout correction, update) on {r['device']}: {m.num_layers} layers, hidden "
        f"{m.hidden_size}, ffn {m.ffn_hidden_size}, {m.num_attention_heads} heads / {m.num_query_groups} K/V groups, "
        f"vocabulary {m.vocab_size}, {m.transformer_impl} {'BF16' if m.bf16 else 'float32'}",
        f"{len(r['lengths'])} sequences of {int(r['lengths'].min())}-{int(r['lengths'].max())} tokens packed into "
        f"micro-batches of <= {args.micro_batch_tokens} tokens (padding fraction {r['padding_fraction']:.3f}); "
        f"{args.warmup} warm-up + {args.steps} timed step(s)",
        "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS), "| " + " | ".join(cells) + " |", "",
        f"{r['mfu_note']}; model FLOPs per step {r['flops_per_step']:.3e}",
        "plan MiB: recipe/memory.py's training phase on 1 GPU (weights + gradients + optimizer + activations + "
        "logits; no rollout engine)" + ("" if peak is not None else "; peak MiB: CUDA only (max_memory_allocated)"),
    ])


def main(argv=None) -> int:
    import torch.distributed as dist

    try:
        args = parse_args(argv)
    except ValueError as err:
        print(f"error: bench_step: {err}", file=sys.stderr)
        return 2
    from _bench_world import start_one_process_world

    start_one_process_world(args.device, port=29523)
    try:
        print(format_table(run_bench(args), args))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
