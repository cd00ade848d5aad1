#!/usr/bin/env bash
# The tiny end-to-end demo: a 2-layer char-level model learns 1-digit addition by RL on 2 CPU
# processes, rollouts in bf16, training in fp32, DAPO-style rollout correction.
# Sets up the environment on a fresh machine first. Extra arguments are recipe overrides, e.g.
#   bash tools/demo.sh trainer.steps=50
cd "$(dirname "$0")/.."
source tools/_env.sh
ensure_env
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$(date +%s)
python -m torch.distributed.run --standalone --nproc_per_node=2 -m megatron_rlcorr.train \
  --config recipes/tiny_cpu.yaml trainer.resume=false "$@" | tee "$log"
metrics=$(sed -n 's/^metrics: //p' "$log" | tail -1)
echo
echo "wall time: $(( $(date +%s) - start )) s (including start-up)"
echo "metrics:   $metrics (one JSON record per step; TensorBoard events beside it when installed)"
echo "checkpoints: $(dirname "$metrics")/checkpoints"
python tools/summarize_run.py "$metrics"
