#!/usr/bin/env bash
# The GPU check, on a machine with one GPU, in two parts that each fit one call of about 9 minutes
# (the steps' time limits add up to 552 s and 270 s; on an H100 the first part's steps took 289 s,
# docs/gpu-check.md, before bench_async, bench_step and the vLLM part were added):
#
#     bash tools/gpu_check.sh [OUT_DIR]          # default OUT_DIR: gpu_check
#     bash tools/gpu_check.sh --vllm [OUT_DIR]   # default OUT_DIR: gpu_check_vllm
#
# The first runs the GPU tier of the suite (pytest -m 'gpu and not vllm'; it prints the memory
# trainer offload frees) and the GPU benchmarks, tools/bench_step.py (one whole RL step of a
# Qwen2.5-1.5B shape) among them. `--vllm`, on a machine where vLLM is installed (staged offline:
# ../shared/gpu/prepare.sh --vllm-only), runs the real-vLLM tests (pytest -m vllm
# tests/gpu/test_vllm_engine.py) and tools/vllm_e2e.py (a tiny RL run with rollout.engine: vllm and
# rollout.enforce_eager: true, in bf16 then fp8 rollout precision: its k3 KL, |log ppl diff| and
# RS-masked token share); it exits 2 where `$PYTHON -c "import vllm"` fails. Each step runs under its
# own time limit, carrying on past a failure, and writes OUT_DIR/gpu_check.md: the device, the
# versions, each step's status and time, and each benchmark's figures (every table names its device),
# with every step's full output beside it in OUT_DIR/<step>.log. Exits 1 when any step failed.
#
# It runs in the Python environment the project is installed in: .venv when there is one (`bash
# tools/test.sh` builds it), else python3 on PATH (e.g. a GPU machine where Megatron-Core and
# Transformer Engine were staged offline and the project installed with `pip install --no-deps -e .`).
# PYTHON=... overrides. Transformer Engine must be importable: without it the TE tests fail, naming
# the fix.
set -uo pipefail
cd "$(dirname "$0")/.."
part=main
if [ "${1:-}" = "--vllm" ]; then
  part=vllm
  shift
fi
OUT=${1:-$([ "$part" = vllm ] && echo gpu_check_vllm || echo gpu_check)}
mkdir -p "$OUT"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$OUT/gpu_check.md"

# name | time limit (s) | command. The limits add up to 552 s: about 9 minutes with the start-up.
# Each benchmark is a small model or a few tensors: its time is mostly imports and CUDA/NCCL start-up
# (bench_correction --compile also compiles the correction with Inductor, the first call per setting).
# bench_async needs 3 GPUs (one per process): on one it prints that it was skipped and exits 0, so
# its limit is the time to import torch; on a machine of 3 or more GPUs raise it (two short trainings).
# The real-vLLM tests run in the --vllm part, so the tier leaves them out.
STEPS=(
  "gpu_tier|260|$PYTHON -m pytest -m 'gpu and not vllm' tests -q -raP"
  "bench_correction|70|$PYTHON tools/bench_correction.py --floor --device cuda --compile"
  "bench_packing|34|$PYTHON tools/bench_packing.py --device cuda"
  "bench_recompute|34|$PYTHON tools/bench_recompute.py --device cuda"
  "bench_logprobs|20|$PYTHON tools/bench_logprobs.py --device cuda"
  "bench_logprobs_fp32_lm_head|34|$PYTHON tools/bench_logprobs.py --lm-head --device cuda"
  "bench_async|20|$PYTHON tools/bench_async.py --device cuda"
  "bench_step|80|$PYTHON tools/bench_step.py --device cuda --warmup 1 --steps 3"
)
# --vllm: its GPU tests (two engines, bf16 and fp8, each in its own process), then the tiny end-to-end
# run in each precision (vllm_e2e.py: the checkpoint, then one torchrun launch per precision): 270 s.
VLLM_STEPS=(
  "vllm_engine|120|$PYTHON -m pytest -m vllm tests/gpu/test_vllm_engine.py -q -raP"
  "vllm_e2e|150|$PYTHON tools/vllm_e2e.py --out $OUT/vllm_e2e"
)

device=$("$PYTHON" -c "import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name(0))" 2>/dev/null)
if [ -z "$device" ]; then
  echo "gpu_check: $PYTHON sees no CUDA GPU (torch.cuda.is_available() is False); run it on a GPU machine" >&2
  exit 2
fi
if [ "$part" = vllm ]; then
  if ! "$PYTHON" -c "import vllm" > /dev/null 2>&1; then
    echo "gpu_check --vllm: \`$PYTHON -c \"import vllm\"\` fails; install vLLM on this machine (pip install -e '.[vllm]', or offline: ../shared/gpu/prepare.sh --vllm-only)" >&2
    exit 2
  fi
  STEPS=("${VLLM_STEPS[@]}")
fi
versions=$("$PYTHON" - <<'EOF'
import platform
from importlib import metadata

import torch

def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"

print(f"Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"megatron-core {version('megatron-core')}, transformer-engine {version('transformer-engine')}, "
      f"vllm {version('vllm')}, {torch.cuda.device_count()} GPU(s) visible")
EOF
)

{
  echo "# GPU check"
  echo
  echo "- device: $device (GPU 0; every figure below was measured on it)"
  echo "- $versions"
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); command: \`bash tools/gpu_check.sh$([ "$part" = vllm ] && echo " --vllm")\`"
  echo
  echo "| step | status | seconds | limit |"
  echo "|---|---|---|---|"
} > "$SUMMARY.head"
: > "$SUMMARY.body"

failed=0
for step in "${STEPS[@]}"; do
  IFS='|' read -r name limit command <<< "$step"
  log="$OUT/$name.log"
  echo "[gpu_check] $name (limit ${limit} s): $command"
  start=$SECONDS
  # timeout signals the step's whole process group (pytest's and torchrun's workers included)
  timeout --kill-after=10 "$limit" bash -c "$command" > "$log" 2>&1
  rc=$?
  took=$((SECONDS - start))
  case $rc in
    0) status="ok" ;;
    124|137) status="TIMED OUT"; failed=1 ;;
    *) status="FAILED (exit $rc)"; failed=1 ;;
  esac
  echo "[gpu_check] $name: $status in ${took} s"
  echo "| $name | $status | $took | $limit |" >> "$SUMMARY.head"
  {
    echo
    echo "## $name: $status"
    echo
    echo "\`$command\` (full output: $name.log)"
    echo
    echo '```'
    if [ "$name" = gpu_tier ]; then  # the figures its tests print, every test that did not pass, the counts
      grep -h "^offload freed" "$log" || echo "(no offload figure: tests/gpu/test_offload_gpu.py did not pass)"
      sed -n '/short test summary info/,$p' "$log" | tail -n 60
      grep -q 'short test summary info' "$log" || tail -n 40 "$log"
    else
      tail -n 40 "$log"
    fi
    echo '```'
  } >> "$SUMMARY.body"
done
cat "$SUMMARY.head" "$SUMMARY.body" > "$SUMMARY"
rm -f "$SUMMARY.head" "$SUMMARY.body"
echo "[gpu_check] wrote $SUMMARY"
exit $failed
