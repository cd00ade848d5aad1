"""The vLLM end-to-end check: a tiny RL run with the real vLLM engine in eager mode, in bf16 and then in
fp8 rollout precision, on one GPU, and the training-rollout mismatch the rollout correction measured.

    python tools/vllm_e2e.py [--out DIR] [--steps 2] [--precision bf16 fp8] [--json OUT.json] [KEY=VALUE ...]

Each precision is one torchrun launch of one process that trains recipes/tiny_hf_cpu.yaml for
--steps steps with `rollout.engine: vllm`, `rollout.enforce_eager: true` and `rollout.precision`
set, the vLLM engine colocated with the trainer on the GPU. The model and data are
tools/make_tiny_hf.py's tiny Qwen2 checkpoint (the one tests/gpu/test_vllm_engine.py gives vLLM)
and additions, made in DIR/tiny_hf_files when that folder does not hold them yet. Each run writes
DIR/runs/vllm_e2e_<precision>/metrics.jsonl and its output to DIR/vllm_e2e_<precision>.log; from
the metrics the report takes the mean over the training steps of
- `rollout_corr/k3_kl`: the k3 estimate of KL(rollout || trainer), a mean over tokens;
- `rollout_corr/log_ppl_abs_diff`: |training log perplexity - rollout log perplexity|, a mean over
  sequences;
- `rollout_corr/rollout_rs_masked_fraction`: the share of response tokens rejection sampling masked
  (the recipe's geometric rule),
printed as a markdown table that names the device. Trailing KEY=VALUE overrides go to every run,
after the defaults.

Needs vLLM (the "vllm" extra) and a CUDA GPU: without either it says which is missing and exits 2.
When making the checkpoint or a run fails, it prints the end of that log and exits 1.
`bash tools/gpu_check.sh --vllm` runs it.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: megatron_rlcorr from this checkout
    sys.path.insert(0, str(ROOT))
RECIPE = ROOT / "recipes" / "tiny_hf_cpu.yaml"
PRECISIONS = ("bf16", "fp8")
# validation, checkpoints and dynamic sampling's extra generation rounds off: each step is one batch
DEFAULTS = ("rollout.engine=vllm", "rollout.enforce_eager=true", "data.val_files=[]", "trainer.test_freq=0",
            "trainer.save_every=0", "trainer.save_hf=false", "trainer.resume=false", "trainer.logger=[console]",
            "algorithm.dynamic_sampling.enabled=false")
# (metrics.jsonl key, column heading); a pipe inside a markdown cell is escaped
METRICS = (("rollout_corr/k3_kl", "k3 KL(rollout \\|\\| trainer)"),
           ("rollout_corr/log_ppl_abs_diff", "\\|log ppl diff\\|"),
           ("rollout_corr/rollout_rs_masked_fraction", "RS-masked tokens"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--out", type=Path, default=ROOT / "gpu_check" / "vllm_e2e",
                        help="the runs, their logs and the tiny checkpoint go here")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--precision", nargs="+", choices=PRECISIONS, default=list(PRECISIONS),
                        help="rollout precisions to run, in this order")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE recipe overrides for every run")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides must be KEY=VALUE, got {bad}")
    return args


def missing_requirements() -> list[str]:
    """What this machine lacks for the check: vLLM, a CUDA GPU (empty: nothing)."""
    from megatron_rlcorr.rollout.vllm_engine import VLLM_VERSION

    missing = []
    if importlib.util.find_spec("vllm") is None:
        missing.append(f"vLLM is not installed (pip install -e '.[vllm]': vllm=={VLLM_VERSION})")
    import torch

    if not torch.cuda.is_available():
        missing.append("no CUDA GPU is visible (torch.cuda.is_available() is False)")
    return missing


def files_dir(out: Path) -> Path:
    return out / "tiny_hf_files"


def run_name(precision: str) -> str:
    return f"vllm_e2e_{precision}"


def run_overrides(args: argparse.Namespace, precision: str) -> list[str]:
    """The recipe overrides of one precision's run."""
    files = files_dir(args.out)
    return [*DEFAULTS, f"name={run_name(precision)}", f"rollout.precision={precision}",
            f"model.hf_checkpoint={files / 'model'}", f"data.train_files=[{files / 'data' / 'train.parquet'}]",
            f"trainer.steps={args.steps}", f"trainer.output_dir={args.out / 'runs'}", *args.overrides]


def figures(records: list[dict]) -> dict:
    """The means over the training steps (step > 0) of METRICS; NaN for a metric no step has."""
    steps = [r for r in records if r.get("step", 0) > 0]
    if not steps:
        raise ValueError("no training step in the metrics")
    out = {"steps": len(steps)}
    for key, _ in METRICS:
        values = [r[key] for r in steps if key in r]
        out[key] = sum(values) / len(values) if values else math.nan
    return out


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table(device: str, runs: dict[str, dict]) -> str:
    """One row per precision: the device, the rollout precision, the steps averaged, METRICS."""
    lines = ["| device | rollout precision | steps | " + " | ".join(label for _, label in METRICS) + " |",
             "|---|---|---|" + "---|" * len(METRICS)]
    for precision, figs in runs.items():
        cells = ["-" if math.isnan(figs[key]) else f"{figs[key]:.4g}" for key, _ in METRICS]
        lines.append(f"| {device} | {precision} | {figs['steps']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _run(command: list[str], log: Path, what: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    print(f"[vllm_e2e] {what}: {' '.join(command[1:])}", flush=True)
    with log.open("w") as out:
        status = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if status != 0:
        tail = log.read_text(errors="replace").splitlines()[-60:]
        sys.stderr.write("\n".join(tail) + "\n")
        raise SystemExit(f"vllm_e2e: {what} failed (exit {status}); the end of {log} is above")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = missing_requirements()
    if missing:
        print("vllm_e2e: needs vLLM and a CUDA GPU: " + "; ".join(missing), file=sys.stderr)
        return 2
    import torch

    device = torch.cuda.get_device_name(0)
    args.out.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, str(ROOT / "tools" / "make_tiny_hf.py"), "--out", str(files_dir(args.out))],
         args.out / "make_tiny_hf.log", "the tiny checkpoint")
    runs = {}
    for precision in args.precision:
        name = run_name(precision)
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
              "-m", "megatron_rlcorr.train", "--config", str(RECIPE), *run_overrides(args, precision)],
             args.out / f"{name}.log", f"the {precision} run")
        runs[precision] = figures(read_metrics(args.out / "runs" / name / "metrics.jsonl"))
    print(f"vLLM end to end on {device}: recipes/tiny_hf_cpu.yaml, rollout.engine vllm, enforce_eager true; "
          f"means over the training steps")
    print(table(device, runs))
    if args.json:
        plain = {p: {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in figs.items()}
                 for p, figs in runs.items()}  # JSON has no NaN
        args.json.write_text(json.dumps({"device": device, "overrides": run_overrides(args, "<precision>"),
                                         "runs": plain}, indent=2) + "\n")
        print(f"[vllm_e2e] wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
