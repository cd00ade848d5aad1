#!/usr/bin/env bash
# The tiny end-to-end demo of the real path, on 2 CPU processes: a Hugging Face checkpoint and a
# DAPO-format parquet in, RL with verl's DAPO math reward, bf16 rollouts against fp32 training and
# the DAPO rollout correction, a Hugging Face checkpoint out (recipes/tiny_hf_cpu.yaml).
# Sets up the environment on a fresh machine first, and makes the tiny checkpoint and dataset
# (tools/make_tiny_hf.py, no download) when they are missing. Extra arguments are recipe
# overrides, e.g.
#   bash tools/demo.sh trainer.steps=50
cd "$(dirname "$0")/.."
source tools/_env.sh
ensure_env
python tools/make_tiny_hf.py --out runs/tiny_hf_files
# One thread per process (2 processes on the 2-core machine): what torchrun would pick, without its banner.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$(date +%s)
python -m torch.distributed.run --standalone --nproc_per_node=2 -m megatron_rlcorr.train \
  --config recipes/tiny_hf_cpu.yaml trainer.resume=false "$@" | tee "$log"
metrics=$(sed -n 's/^metrics: //p' "$log" | tail -1)
exported=$(sed -n 's/^hugging face checkpoint: //p' "$log" | tail -1)
echo
echo "wall time:   $(( $(date +%s) - start )) s (including start-up)"
echo "metrics:     $metrics (one JSON record per step; TensorBoard events beside it when installed)"
echo "checkpoints: $(dirname "$metrics")/checkpoints"
if [ -n "$exported" ]; then
  echo "exported:    $exported (a Hugging Face checkpoint: AutoModelForCausalLM.from_pretrained(\"$exported\"))"
fi
python tools/summarize_run.py "$metrics"
