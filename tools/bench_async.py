"""Benchmark: rollout.placement colocated vs separate, on the same number of processes.

Both runs train the tiny recipe (recipes/tiny_cpu.yaml) with the same seed, steps and overrides, on
`--nproc` processes launched by torchrun:
- colocated: every process generates its share of the batch, then trains (data parallel --nproc);
- separate: the last `--rollout-ranks` processes generate (rl/async_rollout.py) while the others
  train, on batches `--max-staleness` steps stale.
The default overrides (a larger model than the recipe's, responses up to 24 tokens) make generation
a real share of a step, as it is in RL on language models, and dynamic sampling is off, so that
every step generates one batch in both runs.

Per placement it reports, from each run's metrics.jsonl, over steps 2..N-S-1 (S: --max-staleness),
the same steps in both runs: step 1 has the start-up and, separate, a first batch that nothing
overlaps; after steps N-S..N the separate trainer has no batch left to ask for, so it sends no
weights and waits for nothing; and the separate run logs step N after its final checkpoint, the
colocated run before it:
- steps/min: wall time, from the log time of step 1 to that of step N-S-1: 60 * (N - S - 2) / seconds.
  Not the sum of timing/step_s: with separate that leaves out the weight broadcast after each step,
  where the trainer waits for the batch being generated.
- the means of timing/gen_s (separate: the rollout ranks' seconds for the batch), timing/train_s,
  timing/weight_sync_s and, separate, timing/wait_for_rollout_s (the seconds the trainer waited for
  the step's batch), and, separate, the share of generation hidden behind training, two ways:
  1 - sum(wait_for_rollout_s) / sum(gen_s), and 1 - sum(wait_for_rollout_s + weight_sync_s) /
  sum(gen_s). The second is the one to read: the weight broadcast after a step waits for the batch
  the rollout ranks are generating (rl/async_rollout.py), so with max_staleness 1 the trainer's
  waiting shows up there, and the next batch is then ready at once.
- reward_mean of every step, side by side. The curves part from step 2 on: separate trains on
  batches max_staleness steps stale (the same batches as colocated rollout.policy_lag would).

    python tools/bench_async.py [--steps 10] [--nproc 3] [--rollout-ranks 1] [--max-staleness 1]
                                [--device cpu|cuda] [--json OUT.json] [KEY=VALUE ...]

Trailing KEY=VALUE overrides go to both runs, after the defaults. --device cuda needs one GPU per
process (NCCL): with fewer than --nproc GPUs it says so and exits 0 (the GPU check's machine has one).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"
# micro-batches of 8 (the recipe's rollout.n) divide every rank's whole prompts' samples; resume off, so
# that an --out folder of an earlier run is trained afresh
DEFAULTS = ("trainer.micro_batch_size=8", "rollout.max_new_tokens=24",
            "model.hidden_size=128", "model.ffn_hidden_size=256", "model.num_layers=4", "trainer.save_every=0",
            "trainer.logger=[console]", "trainer.resume=false", "algorithm.dynamic_sampling.enabled=false")
PLACEMENTS = ("colocated", "separate")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=3, help="processes of each run (both placements)")
    parser.add_argument("--rollout-ranks", type=int, default=1, help="separate: rollout.num_ranks")
    parser.add_argument("--max-staleness", type=int, default=1, help="separate: rollout.max_staleness")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--out", type=Path, help="the runs' directory (default: a temporary one)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE recipe overrides for both runs")
    args = parser.parse_args(argv)
    if args.max_staleness < 1:
        parser.error("--max-staleness must be >= 1")
    if args.steps < args.max_staleness + 3:
        parser.error(f"--steps must be >= --max-staleness + 3 = {args.max_staleness + 3}: the figures are over "
                     "steps 2..N-S-1")
    if not 1 <= args.rollout_ranks < args.nproc:
        parser.error(f"--rollout-ranks={args.rollout_ranks} must leave a trainer rank of the --nproc={args.nproc}")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides must be KEY=VALUE, got {bad}")
    return args


def prompts_per_step(nproc: int, trainers: int, at_least: int = 12) -> int:
    """The smallest multiple of both data-parallel sizes (colocated nproc, separate trainers) that
    is at least `at_least`: both runs split the same prompts evenly."""
    both = math.lcm(nproc, trainers)
    return both * -(-at_least // both)


def run_overrides(args: argparse.Namespace, placement: str, out_dir: Path) -> list[str]:
    """The recipe overrides of one placement's run."""
    prompts = prompts_per_step(args.nproc, args.nproc - args.rollout_ranks)
    extra = (["rollout.placement=separate", f"rollout.num_ranks={args.rollout_ranks}",
              f"rollout.max_staleness={args.max_staleness}"] if placement == "separate" else [])
    return [*DEFAULTS, f"data.prompts_per_step={prompts}", f"trainer.steps={args.steps}",
            f"trainer.output_dir={out_dir / placement}", *extra, *args.overrides]


def launch(args: argparse.Namespace, placement: str, out_dir: Path) -> list[dict]:
    """Run one placement; its metrics.jsonl records. The environment's PYTHONPATH is kept, after
    the repository root."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "-m", "megatron_rlcorr.train", "--config", str(RECIPE), *run_overrides(args, placement, out_dir)]
    print(f"[bench_async] {placement}: {' '.join(command[1:])}", flush=True)
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"bench_async: the {placement} run failed (exit {proc.returncode}), output above")
    (metrics,) = (out_dir / placement).glob("*/metrics.jsonl")
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def summarize(records: list[dict], max_staleness: int) -> dict:
    """One run's figures (module docstring) from its per-step records: over steps 2..N-S-1, but the
    reward curve, which has every step."""
    records = sorted(records, key=lambda r: r["step"])
    steady = records[1:len(records) - max_staleness - 1]
    seconds = steady[-1]["time"] - records[0]["time"]
    gen = [r["timing/gen_s"] for r in steady]
    out = {"steps": len(records), "window": [steady[0]["step"], steady[-1]["step"]], "wall_s": seconds,
           "steps_per_min": 60.0 * len(steady) / seconds if seconds > 0 else float("nan"),
           "gen_s_mean": mean(gen), "train_s_mean": mean(r["timing/train_s"] for r in steady),
           "weight_sync_s_mean": mean(r["timing/weight_sync_s"] for r in steady),
           "reward_mean": [r["reward_mean"] for r in records]}
    if "timing/wait_for_rollout_s" in records[0]:
        wait = [r["timing/wait_for_rollout_s"] for r in steady]
        idle = [w + r["timing/weight_sync_s"] for w, r in zip(wait, steady)]
        out["wait_for_rollout_s_mean"] = mean(wait)
        out["gen_hidden_share"] = 1.0 - sum(wait) / sum(gen) if sum(gen) > 0 else float("nan")
        out["gen_hidden_share_with_sync"] = 1.0 - sum(idle) / sum(gen) if sum(gen) > 0 else float("nan")
        out["staleness_max"] = max(r.get("rollout/staleness_max", 0.0) for r in records)
    return out


def table(report: dict) -> str:
    runs = report["runs"]
    rows = [("steps/min (wall)", "steps_per_min", "{:.2f}"), ("mean timing/gen_s", "gen_s_mean", "{:.3f}"),
            ("mean timing/train_s", "train_s_mean", "{:.3f}"),
            ("mean timing/weight_sync_s", "weight_sync_s_mean", "{:.3f}"),
            ("mean timing/wait_for_rollout_s", "wait_for_rollout_s_mean", "{:.3f}"),
            ("gen hidden: 1 - wait / gen", "gen_hidden_share", "{:.0%}"),
            ("gen hidden: 1 - (wait + weight_sync) / gen", "gen_hidden_share_with_sync", "{:.0%}")]
    first, last = report["runs"]["colocated"]["window"]
    lines = [f"| {report['device']}, {report['nproc']} processes, steps {first}-{last} | colocated | separate |",
             "|---|---|---|"]
    for label, key, fmt in rows:
        cells = [fmt.format(runs[p][key]) if key in runs[p] else "-" for p in PLACEMENTS]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    lines += ["", "| step | reward_mean colocated | reward_mean separate |", "|---|---|---|"]
    for step, (a, b) in enumerate(zip(runs["colocated"]["reward_mean"], runs["separate"]["reward_mean"]), start=1):
        lines.append(f"| {step} | {a:.3f} | {b:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus < args.nproc:
            print(f"bench_async: needs {args.nproc} GPUs (one per process for NCCL), {gpus} visible: skipped")
            return 0
    with tempfile.TemporaryDirectory(prefix="bench_async_") as scratch:
        out_dir = args.out or Path(scratch)
        runs = {p: summarize(launch(args, p, out_dir), args.max_staleness) for p in PLACEMENTS}
    trainers = args.nproc - args.rollout_ranks
    report = {"device": args.device, "nproc": args.nproc, "steps": args.steps,
              "layout": {"colocated": f"dp{args.nproc}",
                         "separate": f"{trainers} trainer + {args.rollout_ranks} rollout ranks, "
                                     f"max_staleness {args.max_staleness}"},
              "overrides": [*DEFAULTS, f"data.prompts_per_step={prompts_per_step(args.nproc, trainers)}",
                            *args.overrides], "runs": runs}
    print(f"colocated: dp{args.nproc}; separate: {report['layout']['separate']}; overrides: "
          f"{' '.join(report['overrides'])}")
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"[bench_async] wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
