"""Benchmark: rollout.placement colocated vs separate, on the same number of processes.

Both runs train the tiny recipe (recipes/tiny_cpu.yaml) with the same seed, steps and overrides, on
`--nproc` processes launched by torchrun:
- colocated: every process generates its share of the batch, then trains (data parallel --nproc);
- separate: the last `--rollout-ranks` processes generate (rl/async_rollout.py) while the others
  train, on batches `--max-staleness` steps stale.
The default overrides (a larger model than the recipe's, responses up to 24 tokens) make generation
a real share of a step, as it is in RL on language models.

Per placement it reports, from each run's metrics.jsonl:
- steps/min: wall time, from the log time of step 1 to that of the last step (so the start-up,
  step 1 and, separate, the first batch that nothing overlaps are left out): 60 * (N - 1) / seconds.
  Not the sum of timing/step_s: with separate that leaves out the weight broadcast after each step,
  where the trainer waits for the batch being generated.
- the means of timing/gen_s (separate: the rollout ranks' seconds for the batch), timing/train_s and,
  separate, timing/wait_for_rollout_s (the seconds the trainer waited for the step's batch);
- separate: the share of generation hidden behind training, 1 - sum(wait_for_rollout_s) / sum(gen_s);
- reward_mean per step, side by side. The two curves differ (separate trains on stale batches, and
  on another data-parallel size): they show that both learn, not that they match.

    python tools/bench_async.py [--steps 8] [--nproc 3] [--rollout-ranks 1] [--max-staleness 1]
                                [--device cpu|cuda] [--json OUT.json] [KEY=VALUE ...]

Trailing KEY=VALUE overrides go to both runs, after the defaults. --device cuda needs one GPU per
process (NCCL): with fewer than --nproc GPUs it says so and exits 0 (the GPU check runs it on one).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"
# prompts_per_step 12: divisible by the 3 colocated ranks and by the 2 separate trainer ranks
DEFAULTS = ("data.prompts_per_step=12", "rollout.max_new_tokens=24", "model.hidden_size=128",
            "model.ffn_hidden_size=256", "model.num_layers=4", "trainer.save_every=0", "trainer.logger=[console]")
PLACEMENTS = ("colocated", "separate")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=3, help="processes of each run (both placements)")
    parser.add_argument("--rollout-ranks", type=int, default=1, help="separate: rollout.num_ranks")
    parser.add_argument("--max-staleness", type=int, default=1, help="separate: rollout.max_staleness")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--out", type=Path, help="the runs' directory (default: a temporary one)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE recipe overrides for both runs")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2: steps/min is measured from step 1 to the last step")
    if not 1 <= args.rollout_ranks < args.nproc:
        parser.error(f"--rollout-ranks={args.rollout_ranks} must leave a trainer rank of the --nproc={args.nproc}")
    if args.max_staleness < 1:
        parser.error("--max-staleness must be >= 1")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides must be KEY=VALUE, got {bad}")
    return args


def run_overrides(args: argparse.Namespace, placement: str, out_dir: Path) -> list[str]:
    """The recipe overrides of one placement's run."""
    extra = ([f"rollout.placement=separate", f"rollout.num_ranks={args.rollout_ranks}",
              f"rollout.max_staleness={args.max_staleness}"] if placement == "separate" else [])
    return [*DEFAULTS, f"trainer.steps={args.steps}", f"trainer.output_dir={out_dir / placement}",
            *extra, *args.overrides]


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


def summarize(records: list[dict]) -> dict:
    """One run's figures (module docstring) from its per-step records."""
    records = sorted(records, key=lambda r: r["step"])
    seconds = records[-1]["time"] - records[0]["time"]
    gen = [r["timing/gen_s"] for r in records]
    out = {"steps": len(records), "wall_s_after_step_1": seconds,
           "steps_per_min": 60.0 * (len(records) - 1) / seconds if seconds > 0 else float("nan"),
           "gen_s_mean": mean(gen), "train_s_mean": mean(r["timing/train_s"] for r in records),
           "reward_mean": [r["reward_mean"] for r in records]}
    if "timing/wait_for_rollout_s" in records[0]:
        wait = [r["timing/wait_for_rollout_s"] for r in records]
        out["wait_for_rollout_s_mean"] = mean(wait)
        out["gen_hidden_share"] = 1.0 - sum(wait) / sum(gen) if sum(gen) > 0 else float("nan")
        out["staleness_max"] = max(r.get("rollout/staleness_max", 0.0) for r in records)
    return out


def table(report: dict) -> str:
    runs = report["runs"]
    rows = [("steps/min (wall, steps 2..N)", "steps_per_min", "{:.2f}"), ("mean timing/gen_s", "gen_s_mean", "{:.3f}"),
            ("mean timing/train_s", "train_s_mean", "{:.3f}"),
            ("mean timing/wait_for_rollout_s", "wait_for_rollout_s_mean", "{:.3f}"),
            ("generation hidden behind training", "gen_hidden_share", "{:.0%}")]
    lines = [f"| {report['device']}, {report['nproc']} processes | colocated | separate |", "|---|---|---|"]
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
        runs = {p: summarize(launch(args, p, out_dir)) for p in PLACEMENTS}
    trainers = args.nproc - args.rollout_ranks
    report = {"device": args.device, "nproc": args.nproc, "steps": args.steps,
              "layout": {"colocated": f"dp{args.nproc}",
                         "separate": f"{trainers} trainer + {args.rollout_ranks} rollout ranks, "
                                     f"max_staleness {args.max_staleness}"},
              "overrides": [*DEFAULTS, *args.overrides], "runs": runs}
    print(f"colocated: dp{args.nproc}; separate: {report['layout']['separate']}; overrides: "
          f"{' '.join(report['overrides'])}")
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"[bench_async] wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
