#!/usr/bin/env bash
# Multi-node launcher for a training recipe: one torchrun per node.
#
# Usage:
#   bash tools/launch.sh RECIPE [--dry-run] [section.key=value ...]
#
#   RECIPE      a recipe YAML (see recipes/); a relative path is taken from where you run this.
#   --dry-run   (anywhere among the arguments) print the settings and the command; start and
#               create nothing, exit 0.
#   overrides   passed on to megatron_rlcorr.train (e.g. trainer.steps=10 optim.lr=1e-4).
#
# The command runs from the repository root (relative paths in overrides, such as
# trainer.output_dir, and LOG_DIR are relative to it):
#   ${PYTHON:-python} -m torch.distributed.run --nnodes=$NNODES --node-rank=$NODE_RANK \
#       --nproc-per-node=$GPUS_PER_NODE --master-addr=$MASTER_ADDR --master-port=$MASTER_PORT \
#       -m megatron_rlcorr.train --config RECIPE [overrides ...]
# torchrun's default static rendezvous: node 0 serves it on MASTER_ADDR:MASTER_PORT, the other
# nodes join; with NNODES=1 it is a plain single-machine launch (MASTER_ADDR=127.0.0.1 works).
#
# Topology (environment; an unset or empty variable falls back to SLURM's, then to the default):
#   NNODES         nodes                 <- SLURM_JOB_NUM_NODES, SLURM_NNODES; default 1
#   NODE_RANK      this node, 0-based    <- SLURM_NODEID; default 0
#   MASTER_ADDR    node 0's address      <- first host of `scontrol show hostnames "$SLURM_JOB_NODELIST"`;
#                                           default 127.0.0.1
#   MASTER_PORT    rendezvous port       default 29500
#   GPUS_PER_NODE  processes per node    <- SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE ("h100:8" -> 8);
#                                           default: the GPUs `nvidia-smi -L` lists, else 1
# Other variables:
#   PYTHON         the interpreter (default: python)
#   LOG_DIR        where node<NODE_RANK>.log goes (default runs/logs); the node's torchrun output
#                  (stdout and stderr) goes to the terminal and is appended to that file.
# Bad values (not integers, NODE_RANK >= NNODES, ...) or an unreadable recipe: a message, exit 2.
#
# The recipe is checked for the launch of NNODES x GPUS_PER_NODE ranks as `megatron-rlcorr plan`
# checks it (layout, batch sizes, sequence lengths, rollout settings; the data files and the GPUs
# are checked by the ranks at start): a recipe that does not load or does not fit the launch exits
# 2 with the trainer's message. With rollout.placement: separate the last rollout.num_ranks ranks of the
# launch generate and the others train; the output says how many do which. When PYTHON cannot
# import megatron_rlcorr here, nothing is checked (the ranks check it at start) and it says so.
#
# On SLURM, one task per node, every node running this script:
#   srun --ntasks-per-node=1 bash tools/launch.sh recipes/tiny_cpu.yaml trainer.steps=100
#
# Environment for Megatron-Core and NCCL, each set only when you have not set it yourself (your
# value wins) and printed:
#   CUDA_DEVICE_MAX_CONNECTIONS=1      one hardware queue per device, so tensor/context-parallel
#                                      communication is issued in order and overlaps computation
#                                      (Hopper with TP or CP > 1; megatron-core warns without it).
#   TORCH_NCCL_AVOID_RECORD_STREAMS=1  NCCL work frees its tensors without record_stream, so
#                                      memory of async collectives is reused sooner.
#   NCCL_IB_TIMEOUT=19                 a longer InfiniBand timeout, fewer spurious failures on large
#                                      multi-node jobs.
#   NCCL_P2P_NET_CHUNKSIZE=2097152     2 MiB chunks for point-to-point over the network: pipeline
#                                      parallel stages on different nodes.
# OMP_NUM_THREADS is not set here: torchrun already sets it to 1 for its workers.
# PYTORCH_CUDA_ALLOC_CONF is left as you set it, but vLLM's sleep mode (rollout.engine: vllm with
# rollout.sleep_level > 0, the default level is 2) does not work with expandable segments: a
# PYTORCH_CUDA_ALLOC_CONF containing expandable_segments:True with such a recipe is refused (exit 2).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
EXIT_BAD_INPUT=2

die() {
  echo "launch.sh: error: $*" >&2
  exit "$EXIT_BAD_INPUT"
}

usage() {
  sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"
}

# --- arguments ---------------------------------------------------------------------------------
DRY_RUN=0
RECIPE=""
OVERRIDES=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h | --help) usage; exit 0 ;;
    *)
      if [[ -z "$RECIPE" ]]; then
        RECIPE=$arg
      else
        OVERRIDES+=("$arg")
      fi
      ;;
  esac
done
[[ -n "$RECIPE" ]] || die "no recipe given; usage: bash tools/launch.sh RECIPE [--dry-run] [key=value ...]"
[[ -f "$RECIPE" ]] || die "recipe file $RECIPE not found (from $PWD)"
[[ -r "$RECIPE" ]] || die "recipe file $RECIPE is not readable"
# The command runs from the repository root: keep the recipe's path valid from there.
if [[ "$RECIPE" != /* && "$PWD" != "$ROOT" ]]; then
  RECIPE="$PWD/$RECIPE"
fi

# --- topology ----------------------------------------------------------------------------------
# Each variable: the user's value, else SLURM's, else the default; *_FROM says where it came from
# (for error messages).
NNODES_FROM=NNODES NODE_RANK_FROM=NODE_RANK MASTER_ADDR_FROM=MASTER_ADDR
MASTER_PORT_FROM=MASTER_PORT GPUS_PER_NODE_FROM=GPUS_PER_NODE

if [[ -z "${NNODES:-}" ]]; then
  if [[ -n "${SLURM_JOB_NUM_NODES:-}" ]]; then
    NNODES=$SLURM_JOB_NUM_NODES NNODES_FROM="NNODES (from SLURM_JOB_NUM_NODES)"
  elif [[ -n "${SLURM_NNODES:-}" ]]; then
    NNODES=$SLURM_NNODES NNODES_FROM="NNODES (from SLURM_NNODES)"
  else
    NNODES=1
  fi
fi

if [[ -z "${NODE_RANK:-}" ]]; then
  if [[ -n "${SLURM_NODEID:-}" ]]; then
    NODE_RANK=$SLURM_NODEID NODE_RANK_FROM="NODE_RANK (from SLURM_NODEID)"
  else
    NODE_RANK=0
  fi
fi

if [[ -z "${MASTER_ADDR:-}" ]]; then
  if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
    hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST") \
      || die "MASTER_ADDR is unset and \`scontrol show hostnames \"$SLURM_JOB_NODELIST\"\` failed; set MASTER_ADDR"
    MASTER_ADDR=$(head -n 1 <<<"$hosts")
    MASTER_ADDR_FROM="MASTER_ADDR (from scontrol show hostnames \$SLURM_JOB_NODELIST)"
  else
    MASTER_ADDR=127.0.0.1
  fi
fi

MASTER_PORT=${MASTER_PORT:-29500}

if [[ -z "${GPUS_PER_NODE:-}" ]]; then
  if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
    GPUS_PER_NODE=$SLURM_GPUS_ON_NODE GPUS_PER_NODE_FROM="GPUS_PER_NODE (from SLURM_GPUS_ON_NODE)"
  elif [[ -n "${SLURM_GPUS_PER_NODE:-}" ]]; then
    GPUS_PER_NODE=${SLURM_GPUS_PER_NODE##*:}  # "h100:8" -> 8
    GPUS_PER_NODE_FROM="GPUS_PER_NODE (from SLURM_GPUS_PER_NODE=$SLURM_GPUS_PER_NODE)"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    GPUS_PER_NODE_FROM="GPUS_PER_NODE (from nvidia-smi -L)"
    [[ "$GPUS_PER_NODE" != 0 ]] || GPUS_PER_NODE=1
  else
    GPUS_PER_NODE=1
  fi
fi

# An integer >= $2 (leading zeros allowed), printed in canonical form; exit 2 naming $3 otherwise.
check_int() {
  local value=$1 min=$2 name=$3
  [[ "$value" =~ ^[0-9]{1,9}$ ]] || die "$name must be an integer >= $min, got '$value'"
  value=$((10#$value))
  ((value >= min)) || die "$name must be an integer >= $min, got '$value'"
  echo "$value"
}
NNODES=$(check_int "$NNODES" 1 "$NNODES_FROM")
NODE_RANK=$(check_int "$NODE_RANK" 0 "$NODE_RANK_FROM")
GPUS_PER_NODE=$(check_int "$GPUS_PER_NODE" 1 "$GPUS_PER_NODE_FROM")
MASTER_PORT=$(check_int "$MASTER_PORT" 1 "$MASTER_PORT_FROM")
((NODE_RANK < NNODES)) || die "$NODE_RANK_FROM must be < NNODES=$NNODES (0-based), got $NODE_RANK"
((MASTER_PORT <= 65535)) || die "$MASTER_PORT_FROM must be a port number <= 65535, got $MASTER_PORT"
[[ "$MASTER_ADDR" =~ ^[^[:space:]]+$ ]] || die "$MASTER_ADDR_FROM must be a host name or address, got '$MASTER_ADDR'"

cd "$ROOT"
PY=${PYTHON:-python}

# --- environment -------------------------------------------------------------------------------
ENV_NAMES=(CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_AVOID_RECORD_STREAMS NCCL_IB_TIMEOUT NCCL_P2P_NET_CHUNKSIZE)
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-19}
export NCCL_P2P_NET_CHUNKSIZE=${NCCL_P2P_NET_CHUNKSIZE:-2097152}
export NNODES NODE_RANK MASTER_ADDR MASTER_PORT GPUS_PER_NODE
TOPOLOGY_NAMES=(NNODES NODE_RANK MASTER_ADDR MASTER_PORT GPUS_PER_NODE)

# vLLM's sleep mode and expandable segments do not go together. Only when the allocator is set that
# way is the recipe read (its base chain and the overrides) to see whether it uses sleep mode; if
# it cannot be read here, the trainer reports the recipe (and checks this again).
EXPANDABLE=0
if [[ "${PYTORCH_CUDA_ALLOC_CONF:-}" == *expandable_segments:True* ]]; then
  EXPANDABLE=1
fi

# --- the recipe for this launch -----------------------------------------------------------------
# One interpreter (each start imports torch: seconds) checks both. The snippet's last line:
# "sleep_mode" (vLLM's sleep mode with expandable segments: refused), "roles TRAIN GENERATE" (the
# recipe validates for the launch), or "error MESSAGE"; anything else (no interpreter, no
# megatron_rlcorr) means it was not checked.
WORLD=$((NNODES * GPUS_PER_NODE))
check=$("$PY" - "$EXPANDABLE" "$WORLD" "$RECIPE" "${OVERRIDES[@]}" 2>/dev/null <<'EOF' || true
import sys
expandable, world, path, overrides = sys.argv[1] == "1", int(sys.argv[2]), sys.argv[3], sys.argv[4:]
if expandable:
    try:
        from pathlib import Path
        from megatron_rlcorr.recipe.tree import read_tree
        from megatron_rlcorr.rollout.base import RolloutConfig
        rollout = read_tree(Path(path), overrides).get("rollout") or {}
        engine = rollout.get("engine", RolloutConfig.engine)
        level = rollout.get("sleep_level", RolloutConfig.sleep_level)
    except Exception:  # not read here: the recipe check below (or the trainer) reports it
        pass
    else:
        if engine == "vllm" and level:
            print("sleep_mode")
            sys.exit()
from megatron_rlcorr.recipe import load_recipe
try:
    recipe = load_recipe(path, overrides)
    trainers = recipe.rollout.trainer_world(world)
except Exception as err:  # what the trainer would refuse at start too (a bad key, value, base file)
    print("error", " ".join(str(err).split()))
    sys.exit()
try:
    recipe.check_launch(world, here=False)
except ValueError as err:
    print("error", " ".join(str(err).split()))
else:
    print("roles", trainers, world - trainers)
EOF
)
check=$(tail -n 1 <<<"$check")
LAUNCH_SIZE="$WORLD ranks ($NNODES node(s) x $GPUS_PER_NODE)"
case "$check" in
  sleep_mode)
    die "PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF: vLLM's sleep mode (rollout.sleep_level > 0 with" \
      "rollout.engine: vllm, in $RECIPE) does not work with expandable_segments:True; unset it, or add" \
      "the override rollout.sleep_level=0"
    ;;
  "error "*) die "recipe $RECIPE for a launch of $LAUNCH_SIZE: ${check#error }" ;;
  "roles "*)
    read -r _ TRAIN_RANKS GENERATE_RANKS <<<"$check"
    if ((GENERATE_RANKS)); then
      ROLES="$LAUNCH_SIZE: $TRAIN_RANKS train (ranks 0..$((TRAIN_RANKS - 1))), $GENERATE_RANKS generate (ranks"
      ROLES+=" $TRAIN_RANKS..$((WORLD - 1)); rollout.placement: separate); the recipe validates for this launch"
    else
      ROLES="$LAUNCH_SIZE: all generate, then train (rollout.placement: colocated); the recipe validates for this"
      ROLES+=" launch"
    fi
    ;;
  *)
    ROLES="$LAUNCH_SIZE; the recipe was not checked here ($PY could not load megatron_rlcorr): the ranks check it"
    ROLES+=" at start"
    ;;
esac

# --- command -----------------------------------------------------------------------------------
CMD=("$PY" -m torch.distributed.run "--nnodes=$NNODES" "--node-rank=$NODE_RANK"
     "--nproc-per-node=$GPUS_PER_NODE" "--master-addr=$MASTER_ADDR" "--master-port=$MASTER_PORT"
     -m megatron_rlcorr.train --config "$RECIPE" "${OVERRIDES[@]}")

print_plan() {
  local name
  echo "# ranks: $ROLES"
  for name in "${TOPOLOGY_NAMES[@]}" "${ENV_NAMES[@]}"; do
    printf 'export %s=%q\n' "$name" "${!name}"
  done
  printf '+'
  printf ' %q' "${CMD[@]}"
  printf '\n'
}

LOG_DIR=${LOG_DIR:-runs/logs}
LOG_FILE="$LOG_DIR/node$NODE_RANK.log"

if ((DRY_RUN)); then
  echo "# dry run (nothing started or created): node $NODE_RANK of $NNODES would log to $LOG_FILE"
  print_plan
  exit 0
fi

echo "[launch] node $NODE_RANK of $NNODES: output also goes to $LOG_FILE (appended)"
mkdir -p "$LOG_DIR"
{
  echo "[launch] $(date '+%Y-%m-%d %H:%M:%S') ${HOSTNAME:-?}: node $NODE_RANK of $NNODES, from $ROOT"
  print_plan
} | tee -a "$LOG_FILE"
# torchrun's stdout and stderr to the terminal and the log. With pipefail the pipeline's status is
# torchrun's (tee's only if torchrun succeeded and tee failed); tee -i ignores Ctrl-C so that it
# still records what torchrun prints while it shuts its workers down.
status=0
"${CMD[@]}" 2>&1 | tee -a -i "$LOG_FILE" || status=$?
exit "$status"
