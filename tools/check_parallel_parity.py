#!/usr/bin/env python
"""Train a tiny fp32 model for N steps under several parallel layouts and compare each with one process.

    python tools/check_parallel_parity.py --layouts tp2,cp2,pp2,dp2,tp2cp2,tp2pp2,cp2pp2,tp2cp2pp2 --steps 3
        [--mode decoupled|bypass] [--loss ppo|pg] [--agg token-mean|seq-mean-token-sum|seq-mean-token-mean|seq-mean-token-sum-norm]
        [--packed] [--sequence-parallel]
    python tools/check_parallel_parity.py --layouts ep2,pp2ep2,tp2ep2 [--moe routed|shared] [--dispatcher alltoall]

A layout name is a sequence of <dim><size> tokens in any order, dim in tp, pp, cp, dp, vpp, ep,
etp (e.g. "tp2cp2", "pp2tp2dp2", "pp2vpp2", "pp2ep2"); a missing dim is 1 (vpp: none), except dp,
which without a token is the smallest that lets ep * etp divide tp * cp * dp ("ep2" runs on two
data-parallel ranks, "tp2ep2" on the two TP ranks). Each layout runs as
`torchrun --nproc_per_node=tp*pp*cp*dp` on the CPU (gloo), the reference as one process; both run
this script with --worker, train `--steps` optimizer steps of step.train_minibatch on fixed
synthetic data whose rollout log-probs are the initial model's plus noise (a real, growing
mismatch), and write per-step loss, grad norm and correction metrics and the final full weights.
The tiny model is fitted to every layout asked for (tiny_model: query groups and heads divisible
by each TP size, layers by each pp * vpp), so any parsed layout runs, tp4 and tp8 included. With
`--packed` the layouts train on packed micro-batches (THD, `max_tokens_per_micro_batch` about 2.5
sequences per rank, so several micro-batches of uneven sequences) against the same padded
single-process reference. One row per layout; the exit status is 1 if any row exceeds its tolerance. After the table, the
reference's veto and RS rejection fractions per step show what the correction rejected.

A layout with ep or etp > 1 trains a mixture-of-experts model (tiny_model; `--moe shared` adds a
shared expert; `--moe routed|shared` trains dense layouts on the MoE model too), with sequence
parallelism wherever tp > 1
(Megatron-Core's MoE layer requires it; `--sequence-parallel` turns it on for dense layouts), and
`--dispatcher` chooses the layouts' token dispatcher while the reference keeps allgather. The
result column names the sequence parallelism and dispatcher each layout ran with.

`--mode bypass --loss ppo` corrects pi_theta vs pi_rollout in the loss (RS and veto on the loss
mask, no IS weights: the PPO ratio is the weight). Its data add one sequence per step with a token
the engine gave probability ~1 while the model gives ~1/100, and its veto threshold is 0.05, so
the veto rejects that sequence (ratio ~0.01); the other modes keep their data and veto threshold
1e-4, so the tables measured for them in docs/parallel.md stay valid.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from megatron_rlcorr.training.losses import LOSS_AGG_MODES

ROOT = Path(__file__).resolve().parent.parent
LAYOUT_TOKEN = re.compile(r"(vpp|etp|ep|tp|pp|cp|dp)(\d+)")
SEED, BATCH, SEQ, TEMPERATURE = 11, 8, 13, 0.9
OPTIM = dict(lr=1e-2, clip_grad=1.0, adam_eps=1e-6, warmup_steps=1, decay_style="linear", min_lr=1e-3)
TOL = dict(loss=1e-5, grad_norm=1e-4, param=2e-4, metric=1e-4)  # metric: |diff| / max(|ref|, 1)


def parse_layout(name: str) -> dict[str, int | None]:
    """"tp2cp2" -> {"tp": 2, "pp": 1, "cp": 2, "dp": 1, "vpp": None, "ep": 1, "etp": 1}; ValueError if
    unparseable. Without a dp token, dp is the smallest that lets ep * etp divide a pipeline stage's
    tp * cp * dp ranks ("ep2" -> dp 2, "tp2ep2" -> dp 1)."""
    if not name or LAYOUT_TOKEN.sub("", name) != "":
        raise ValueError(f"cannot parse layout {name!r}: write <dim><size> tokens with dim in tp, pp, cp, dp, "
                         "vpp, ep, etp, e.g. tp2, cp2pp2, tp2cp2pp2, pp2vpp2, ep2, pp2ep2")
    layout: dict[str, int | None] = {"tp": 1, "pp": 1, "cp": 1, "dp": 1, "vpp": None, "ep": 1, "etp": 1}
    seen = set()
    for dim, size in LAYOUT_TOKEN.findall(name):
        if dim in seen:
            raise ValueError(f"layout {name!r} names {dim} twice")
        if int(size) < 1:
            raise ValueError(f"layout {name!r}: {dim} must be >= 1")
        seen.add(dim)
        layout[dim] = int(size)
    if layout["vpp"] is not None and layout["pp"] == 1:
        raise ValueError(f"layout {name!r}: vpp needs pp > 1")
    experts, stage = layout["ep"] * layout["etp"], layout["tp"] * layout["cp"]
    if "dp" not in seen:
        layout["dp"] = experts // math.gcd(experts, stage)
    elif (stage * layout["dp"]) % experts:
        raise ValueError(f"layout {name!r}: ep*etp = {experts} must divide tp*cp*dp = {stage * layout['dp']}")
    return layout


def world_size(layout: dict[str, int | None]) -> int:
    return layout["tp"] * layout["pp"] * layout["cp"] * layout["dp"]


def is_moe_layout(layout: dict[str, int | None]) -> bool:
    return layout["ep"] > 1 or layout["etp"] > 1


MOE_KINDS = ("routed", "shared")


def tiny_model(layouts: list[dict[str, int | None]], moe: str | None = None) -> dict:
    """The tiny model's settings, fitted to every layout of the run: query groups (and twice as
    many heads) divisible by each TP size, layers by each pp * vpp (at least 4), head dim 8. The
    reference and every layout use the same model, so a layout added to the list changes it for all.

    moe: None (dense), "routed" (layer 0 dense, the others mixtures of 4 experts, or as many as the
    largest ep, top-2, expert width divisible by each etp) or "shared" (the same plus a shared expert
    with its sigmoid gate, Qwen2-MoE style)."""
    tp = math.lcm(*(layout["tp"] for layout in layouts))
    stages = math.lcm(*(layout["pp"] * (layout["vpp"] or 1) for layout in layouts))
    groups = max(2, tp)
    heads = 2 * groups
    model = dict(vocab_size=100, hidden_size=8 * heads, num_layers=stages * -(-4 // stages),
                 num_attention_heads=heads, num_query_groups=groups, ffn_hidden_size=12 * heads,
                 tie_embeddings=True, add_qkv_bias=True, max_position_embeddings=64)
    if moe is not None:
        if moe not in MOE_KINDS:
            raise ValueError(f"moe must be one of {MOE_KINDS} or None, got {moe!r}")
        experts = math.lcm(4, *(layout["ep"] for layout in layouts))
        etp = math.lcm(*(layout["etp"] for layout in layouts))
        model["moe"] = dict(num_experts=experts, router_topk=2, ffn_hidden_size=4 * math.lcm(4, etp),
                            dense_layers=[0],
                            shared_expert_ffn_hidden_size=6 * heads if moe == "shared" else None)
    return model


def packed_budget(layout: dict[str, int | None]) -> int:
    """Tokens per rank per packed micro-batch: about 2.5 of the longest padded sequences, so a
    rank's 8 / dp sequences of 3 to 13 tokens make several micro-batches."""
    cp = layout["cp"]
    multiple = 2 * cp if cp > 1 else 1
    longest = -(-SEQ // multiple) * multiple
    return -(-longest * 5 // 2 // cp)


# ---- worker (one torchrun process) ----------------------------------------------------------------

def _bypass_ppo(args) -> bool:
    return args.mode == "bypass" and args.loss == "ppo"


def _synthetic_batch(step: int, model_cfg, init_weights, overconfident: bool = False) -> dict[str, torch.Tensor]:
    """Global batch of `step`: prompts + responses, rollout = initial model's log-probs + noise.

    Row `step % BATCH` gets a token 12 nats below the model (ratio e^12, RS rejects it). With
    `overconfident`, row `(step + 3) % BATCH` gets a token with rollout log-prob ~0 (ratio ~1/100:
    a veto threshold above ~0.01 rejects the sequence). Position 4 is in every row's response.
    """
    from megatron_rlcorr.model.reference import reference_forward

    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(1, model_cfg.vocab_size, (BATCH, SEQ), generator=gen)
    mask = torch.zeros(BATCH, SEQ)
    for i in range(BATCH):
        prompt, length = 2 + (i + step) % 3, 3 + (5 * i + step) % 8
        end = min(prompt + length, SEQ - 1)
        tokens[i, end + 1:] = 0
        mask[i, prompt:end] = 1
    targets = torch.cat([tokens[:, 1:], torch.zeros(BATCH, 1, dtype=torch.long)], dim=1)
    with torch.no_grad():
        logits = reference_forward(init_weights, model_cfg, tokens) / TEMPERATURE
        model_lp = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    rollout = model_lp + 0.2 * torch.randn(BATCH, SEQ, generator=gen)
    rollout[step % BATCH, 4] -= 12.0  # one sequence per step with a catastrophic (e^12) ratio
    if overconfident:
        rollout[(step + 3) % BATCH, 4] = 0.0  # the engine was sure, the model is not: vetoed
    rollout = rollout.clamp(max=-1e-3)
    advantages = torch.randn(BATCH, 1, generator=gen).expand(BATCH, SEQ).contiguous()
    return dict(tokens_BT=tokens, targets_BT=targets, response_mask_BT=mask, rollout_log_probs_BT=rollout,
                advantages_BT=advantages)


def micro_batch_sizes(layout: dict, args) -> tuple[int, int]:
    """(micro-batch size of the layout, of its reference run).

    The gradient does not depend on the micro-batch size. Bypass policy gradient corrects per
    micro-batch round (micro-batch j of every DP rank), so its metrics match one process only
    when the reference's micro-batches hold the same rows: one micro-batch per DP rank (or, with
    virtual pipelining, which needs >= pp micro-batches, pp of them and dp = 1).
    """
    per_rank = BATCH // layout["dp"]
    if not (args.loss == "pg" and args.mode == "bypass"):
        return 2, 2
    mbs = per_rank // layout["pp"] if layout["vpp"] else per_rank
    return mbs, mbs * layout["dp"]


def _step_config(args, mbs: int, max_tokens: int = 0):
    from megatron_rlcorr.config import RolloutCorrectionConfig
    from megatron_rlcorr.training.losses import LossConfig
    from megatron_rlcorr.training.step import StepConfig

    pg = args.loss == "pg"
    if args.mode == "decoupled":
        # The correction's use_policy_gradient requires bypass mode; decoupled policy gradient is
        # the loss's own loss_type below.
        correction = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0,
                                             rollout_is_batch_normalize=True, rollout_rs="geometric",
                                             rollout_rs_threshold=1.1, rollout_token_veto_threshold=1e-4)
    else:
        correction = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token",
                                             rollout_rs_threshold=3.0,
                                             rollout_token_veto_threshold=0.05 if _bypass_ppo(args) else 1e-4,
                                             bypass_mode=True, use_policy_gradient=pg)
    loss_type = "policy_gradient" if pg and args.mode == "decoupled" else "ppo_clip"
    return StepConfig(loss=LossConfig(loss_type=loss_type, loss_agg_mode=args.agg, entropy_coeff=0.01),
                      correction=correction, micro_batch_size=mbs, temperature=TEMPERATURE,
                      max_tokens_per_micro_batch=max_tokens)


def run_worker(args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = train_layout(args, args.layout, json.loads(args.model), optim=json.loads(args.optim), mbs=args.mbs,
                          max_tokens=args.max_tokens, sequence_parallel=args.sequence_parallel,
                          dispatcher=args.dispatcher)
    if dist.get_rank() == 0:
        torch.save(result, args.out)
    dist.destroy_process_group()


def train_layout(args, name: str, model: dict, *, optim: dict | None = None, mbs: int = 2, max_tokens: int = 0,
                 sequence_parallel: bool = False, dispatcher: str | None = None) -> dict:
    """Train `args.steps` steps of `model` (tiny_model's settings) under layout `name` in this
    process group (the whole world: tp * pp * cp * dp ranks) and return, on every rank, the per-step
    metrics, the final full weights (export_full_weights, experts included), how far they moved from
    the initial ones, and what the model ran with (sequence_parallel, dispatcher). The process groups are built here and
    destroyed at the end, so one process group can train several layouts in turn (the tests)."""
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.weights import export_full_weights, init_full_weights
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups, destroy_parallel_groups
    from megatron_rlcorr.training.optimizer import OptimSettings, build_model_and_optimizer, sync_params
    from megatron_rlcorr.training.step import StepBatch, compute_old_log_probs, train_minibatch

    enable_cpu_megatron()
    layout = parse_layout(name)
    groups = build_parallel_groups(layout["tp"], layout["pp"], layout["cp"], layout["vpp"], ep=layout["ep"],
                                   etp=layout["etp"], sequence_parallel=sequence_parallel)
    try:
        if dispatcher:
            model = {**model, "moe": {**model["moe"], "token_dispatcher": dispatcher}}
        model_cfg = ModelConfig(**model)
        chunks, optimizer, scheduler = build_model_and_optimizer(model_cfg, OptimSettings(**OPTIM, **(optim or {})),
                                                                 groups, seed=SEED, total_steps=args.steps)
        init_weights = init_full_weights(model_cfg, SEED)
        per_rank = BATCH // groups.dp_size
        rows = slice(groups.dp_rank * per_rank, (groups.dp_rank + 1) * per_rank)
        cfg = _step_config(args, mbs, max_tokens)
        history = []
        for step in range(args.steps):
            data = _synthetic_batch(step, model_cfg, init_weights, overconfident=_bypass_ppo(args))
            batch = StepBatch(**{k: v[rows] for k, v in data.items()})
            old = None
            if not cfg.correction.bypass_mode:
                old = compute_old_log_probs(chunks, batch, groups=groups, micro_batch_size=cfg.micro_batch_size,
                                            temperature=cfg.temperature,
                                            max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch)
            result = train_minibatch(chunks, optimizer, batch, groups=groups, cfg=cfg, old_log_probs=old)
            scheduler.step(1)  # the caller's, once per RL step (as the trainer does)
            history.append({k: float(v) for k, v in result.metrics.items()})
        sync_params(chunks)
        weights = export_full_weights(chunks, groups)
        config = chunks[0].config
        return dict(history=history, weights=weights,
                    moved=max(float((weights[k] - init_weights[k]).abs().max()) for k in weights),
                    sequence_parallel=bool(config.sequence_parallel),
                    dispatcher=config.moe_token_dispatcher_type if model_cfg.moe is not None else None)
    finally:
        destroy_parallel_groups()


# ---- driver ---------------------------------------------------------------------------------------

def launch(name: str, layout: dict, args, out: Path, mbs: int, max_tokens: int = 0, optim: str = "{}",
           reference: bool = False) -> str | None:
    """Run the worker for one layout; None on success, else the tail of its output. The reference
    (one process) keeps the default dispatcher (allgather on the CPU) and no sequence parallelism."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size(layout)}",
           str(Path(__file__).resolve()), "--worker", "--layout", name, "--out", str(out), "--steps", str(args.steps),
           "--mode", args.mode, "--loss", args.loss, "--agg", args.agg, "--mbs", str(mbs),
           "--max-tokens", str(max_tokens), "--model", args.model, "--optim", optim]
    if not reference:
        if sequence_parallel(layout, args):
            cmd.append("--sequence-parallel")
        if args.dispatcher:
            cmd += ["--dispatcher", args.dispatcher]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not out.exists():
        return (proc.stdout + proc.stderr)[-3000:]
    return None


def sequence_parallel(layout: dict, args) -> bool:
    """Sequence parallelism for a layout: with --sequence-parallel wherever tp > 1, and always for a
    mixture-of-experts model with tp > 1 (Megatron-Core's MoE layer requires it there)."""
    return layout["tp"] > 1 and (args.sequence_parallel or args.moe is not None)


def compare(result: dict, ref: dict) -> dict[str, float]:
    hist, ref_hist = result["history"], ref["history"]
    loss = max(abs(h["actor/pg_loss"] - r["actor/pg_loss"]) for h, r in zip(hist, ref_hist))
    grad_norm = max(abs(h["actor/grad_norm"] - r["actor/grad_norm"]) / max(abs(r["actor/grad_norm"]), 1e-6)
                    for h, r in zip(hist, ref_hist))
    param = max(float((result["weights"][k] - v).abs().max()) for k, v in ref["weights"].items())
    metric = 0.0
    for h, r in zip(hist, ref_hist):
        for key, value in r.items():
            if key.startswith("rollout_corr/"):
                metric = max(metric, abs(h[key] - value) / max(abs(value), 1.0))
    return dict(loss=loss, grad_norm=grad_norm, param=param, metric=metric)


def _moe_note(model: dict, args) -> str:
    moe = model.get("moe")
    if moe is None:
        return ""
    shared = f", shared expert {moe['shared_expert_ffn_hidden_size']}" if moe["shared_expert_ffn_hidden_size"] else ""
    return (f"; MoE: {moe['num_experts']} experts top-{moe['router_topk']} of width {moe['ffn_hidden_size']}, dense "
            f"layers {moe['dense_layers']}{shared}; dispatcher {args.dispatcher or 'allgather'} (reference allgather)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="tp2,cp2,pp2,dp2,tp2cp2,tp2pp2,cp2pp2,tp2cp2pp2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mode", choices=["decoupled", "bypass"], default="decoupled")
    parser.add_argument("--loss", choices=["ppo", "pg"], default="ppo")
    parser.add_argument("--agg", choices=list(LOSS_AGG_MODES),
                        default="token-mean")
    parser.add_argument("--packed", action="store_true",
                        help="layouts train on packed micro-batches (THD) of ~2.5 sequences' tokens per rank; the "
                             "reference stays padded")
    parser.add_argument("--overlap", action="store_true",
                        help="layouts overlap the gradient reduce-scatter and the weight all-gather of the "
                             "distributed optimizer (optim.overlap_grad_reduce / overlap_param_gather)")
    parser.add_argument("--no-distributed-optimizer", action="store_true",
                        help="layouts use Megatron's plain (replicated) Adam instead of the distributed optimizer")
    parser.add_argument("--moe", choices=MOE_KINDS, default=None,
                        help="a mixture-of-experts model (tiny_model): routed experts, or with a shared expert too; "
                             "default routed when a layout has ep or etp > 1, else dense")
    parser.add_argument("--dispatcher", choices=["allgather", "alltoall"], default=None,
                        help="the layouts' token dispatcher (model.moe.token_dispatcher); the reference keeps the "
                             "default (allgather on the CPU)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="sequence parallelism for every layout with tp > 1 (always on for MoE with tp > 1)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per layout")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--mbs", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--max-tokens", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--optim", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.worker:
        run_worker(args)
        return 0

    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    try:
        layouts = {name: parse_layout(name) for name in names}
    except ValueError as err:
        parser.error(str(err))
    for name, layout in layouts.items():
        if BATCH % (layout["dp"] * 2):
            parser.error(f"layout {name}: dp={layout['dp']} must divide the batch of {BATCH} into micro-batches of 2")
    if args.packed and args.mode == "bypass" and args.loss == "pg":
        parser.error("--packed with --mode bypass --loss pg: bypass policy gradient corrects per micro-batch, so its "
                     "metrics follow the packing; compare it padded")
    if args.overlap and args.no_distributed_optimizer:
        parser.error("--overlap overlaps the distributed optimizer's gathers: drop --no-distributed-optimizer")
    optim = (dict(overlap_grad_reduce=True, overlap_param_gather=True) if args.overlap else
             dict(use_distributed_optimizer=False) if args.no_distributed_optimizer else {})
    if args.moe is None and any(is_moe_layout(layout) for layout in layouts.values()):
        args.moe = "routed"
    if args.dispatcher and args.moe is None:
        parser.error("--dispatcher chooses the MoE token dispatcher: add --moe (or a layout with ep > 1)")
    model = tiny_model([*layouts.values(), parse_layout("tp1")], args.moe)
    args.model = json.dumps(model)
    print(f"mode={args.mode} loss={args.loss} agg={args.agg} steps={args.steps}{' packed' if args.packed else ''} "
          f"optimizer: {optim or 'distributed'} "
          f"(fp32, CPU/gloo); model: {model['num_layers']} layers, {model['num_attention_heads']} heads, "
          f"{model['num_query_groups']} query groups, hidden {model['hidden_size']}{_moe_note(model, args)}")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        refs: dict[int, dict] = {}
        header = f"{'layout':<12}{'procs':>6}{'max|loss-ref|':>15}{'grad-norm rel':>15}{'max|param-ref|':>16}" \
                 f"{'corr-metric diff':>17}  result"
        print(header)
        print("-" * len(header))
        for name, layout in layouts.items():
            out = Path(tmp) / f"{name}.pt"
            mbs, ref_mbs = micro_batch_sizes(layout, args)
            if ref_mbs not in refs:
                ref_out = Path(tmp) / f"ref_mbs{ref_mbs}.pt"
                error = launch("tp1", parse_layout("tp1"), args, ref_out, ref_mbs, reference=True)
                if error:
                    print(f"reference run (one process, micro-batch size {ref_mbs}) failed:\n{error}")
                    return 1
                refs[ref_mbs] = torch.load(ref_out, weights_only=False)
                if refs[ref_mbs]["moved"] < 1e-4:  # else the parameter column compares untrained weights
                    print(f"reference run (micro-batch size {ref_mbs}): the weights moved only "
                          f"{refs[ref_mbs]['moved']:.1e} from the initial ones in {args.steps} steps; use more steps")
                    return 1
            ref = refs[ref_mbs]
            error = launch(name, layout, args, out, mbs, packed_budget(layout) if args.packed else 0, json.dumps(optim))
            if error:
                failed = True
                print(f"{name:<12}{world_size(layout):>6}  ERROR\n{error}")
                continue
            result = torch.load(out, weights_only=False)
            diff = compare(result, ref)
            ok = all(diff[key] <= TOL[key] for key in TOL)
            failed |= not ok
            ran = [word for word, on in (("sequence parallel", result["sequence_parallel"]),
                                         (result["dispatcher"], result["dispatcher"])) if on]
            print(f"{name:<12}{world_size(layout):>6}{diff['loss']:>15.2e}{diff['grad_norm']:>15.2e}"
                  f"{diff['param']:>16.2e}{diff['metric']:>17.2e}  {'PASS' if ok else 'FAIL'}"
                  f"{' (' + ', '.join(ran) + ')' if ran else ''}", flush=True)
    for ref_mbs, ref in sorted(refs.items()):
        fractions = {name: " ".join(f"{h.get(f'rollout_corr/{name}', float('nan')):.3f}" for h in ref["history"])
                     for name in ("rollout_is_veto_fraction", "rollout_rs_seq_masked_fraction",
                                  "rollout_rs_masked_fraction")}
        print(f"reference (1 process, micro-batch size {ref_mbs}): max |param - initial| {ref['moved']:.2e}; "
              f"per step: veto fraction (sequences) "
              f"{fractions['rollout_is_veto_fraction']}; RS rejected sequences "
              f"{fractions['rollout_rs_seq_masked_fraction']}, tokens {fractions['rollout_rs_masked_fraction']}")
    print(f"tolerances: loss {TOL['loss']:g} abs, grad norm {TOL['grad_norm']:g} rel, params {TOL['param']:g} abs, "
          f"correction metrics {TOL['metric']:g} rel (|diff| / max(|ref|, 1))")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
