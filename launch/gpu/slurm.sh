#!/usr/bin/env bash
# trace-jax on a SLURM GPU cluster: writes a batch script that starts the trainer on every node with `srun` and
# jax.distributed, and submits it with `sbatch`.
#
#   launch/gpu/slurm.sh --nodes N --gpus-per-node G --run-dir DIR [--gin-file F ...] [--gin-param 'X.y = z' ...]
#       [--processes node|gpu] [--port P] [--partition P] [--account A] [--time T] [--job-name J] [--requeue]
#       [--signal-seconds S] [--sbatch-arg ARG ...] [--python PYTHON] [--dry-run]
#
# --processes node (default): one process per node (N tasks) driving all G GPUs of its node, its part of one global
#   mesh over the N x G GPUs (the host-driven work of rollouts and evaluation runs on each process's G GPUs); told
#   where the coordinator is by TRACE_JAX_COORDINATOR (the first node of the allocation, port --port, default
#   29500), TRACE_JAX_NUM_PROCESSES (N) and TRACE_JAX_PROCESS_ID (SLURM_PROCID), which select the explicit mode.
# --processes gpu: one process per GPU (N x G tasks, each with a mesh part of one GPU); JAX reads the SLURM
#   environment (coordinator = the first node, process id = SLURM_PROCID, local GPU = SLURM_LOCALID) with
#   DistributedConfig.mode = "auto". (--mode env and --mode auto, the older spellings, mean node and gpu.)
# Each task writes its own log, DIR/logs/slurm-<job>-<task>.log. The batch script is written to
# DIR/launch/slurm-<time>.sbatch. SLURM sends SIGTERM --signal-seconds (default 300) before the time limit, so the
# trainer writes a checkpoint and exits; resubmitting the same command (or --requeue after a preemption) resumes
# from it. DIR must be on a file system every node mounts. Before anything is submitted, launch/check.py checks the
# gin config and that the MeshConfig axes multiply to N x G. --python: the interpreter of the environment trace-jax
# is installed in, on every node (default: $PYTHON, else python3, as an absolute path). --dry-run prints the batch
# script and the sbatch command instead.
# Values written to #SBATCH lines are quoted for sbatch's own parser, with `%` doubled where sbatch expands filename
# patterns (DIR in --output), so any DIR, partition or account works; a value holding a newline is refused, and so
# is a `%` in the checkout's path (--chdir). --sbatch-arg values are written as given (quoted), `%` patterns included.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
  exit "${1:-0}"
}

NODES="" GPUS_PER_NODE="" RUN_DIR="" PROCESSES=node PORT=29500 PARTITION="" ACCOUNT="" TIME_LIMIT="" JOB_NAME=trace-jax
REQUEUE=0 SIGNAL_SECONDS=300 TRAIN_PYTHON=$PYTHON
GIN_FILES=() GIN_PARAMS=() SBATCH_ARGS=()
while (($#)); do
  case $1 in
    --nodes) has_value "$1" "$#"; NODES=$2; shift 2 ;;
    --gpus-per-node) has_value "$1" "$#"; GPUS_PER_NODE=$2; shift 2 ;;
    --processes) has_value "$1" "$#"; PROCESSES=$2; shift 2 ;;
    --mode)
      has_value "$1" "$#"
      case $2 in
        env) PROCESSES=node ;;
        auto) PROCESSES=gpu ;;
        *) die "--mode must be 'env' (one process per node) or 'auto' (one per GPU), got '$2'; or use --processes" ;;
      esac
      shift 2 ;;
    --port) has_value "$1" "$#"; PORT=$2; shift 2 ;;
    --partition) has_value "$1" "$#"; PARTITION=$2; shift 2 ;;
    --account) has_value "$1" "$#"; ACCOUNT=$2; shift 2 ;;
    --time) has_value "$1" "$#"; TIME_LIMIT=$2; shift 2 ;;
    --job-name) has_value "$1" "$#"; JOB_NAME=$2; shift 2 ;;
    --requeue) REQUEUE=1; shift ;;
    --signal-seconds) has_value "$1" "$#"; SIGNAL_SECONDS=$2; shift 2 ;;
    --sbatch-arg) has_value "$1" "$#"; SBATCH_ARGS+=("$2"); shift 2 ;;
    --python) has_value "$1" "$#"; TRAIN_PYTHON=$2; shift 2 ;;
    *) common_arg "$@"; shift "$SHIFT" ;;
  esac
done

need "$NODES" --nodes
need "$GPUS_PER_NODE" --gpus-per-node
need "$RUN_DIR" --run-dir
need_int "$NODES" --nodes 1
need_int "$GPUS_PER_NODE" --gpus-per-node 1
need_port "$PORT" --port
need_int "$SIGNAL_SECONDS" --signal-seconds
one_line "$RUN_DIR" --run-dir
one_line "$PARTITION" --partition
one_line "$ACCOUNT" --account
one_line "$PWD" "the current directory (--chdir of the batch script)"
[[ $PWD != *%* ]] || die "the current directory $(quote "$PWD") holds a '%', which sbatch may read as a filename" \
  "pattern in --chdir; run from a checkout whose path has none"
if [[ -n $TIME_LIMIT && ! $TIME_LIMIT =~ ^(([0-9]+-)?[0-9]+(:[0-9]+){0,2}|UNLIMITED|infinite)$ ]]; then
  die "--time '$TIME_LIMIT': write MINUTES, HH:MM:SS, D-HH, D-HH:MM:SS or UNLIMITED"
fi
[[ $PROCESSES == node || $PROCESSES == gpu ]] ||
  die "--processes must be 'node' (one process per node, all its GPUs) or 'gpu' (one per GPU), got '$PROCESSES'"
[[ $JOB_NAME =~ ^[A-Za-z0-9_.-]+$ ]] || die "--job-name '$JOB_NAME': letters, digits, _ . - only"
for arg in "${SBATCH_ARGS[@]}"; do
  one_line "$arg" --sbatch-arg
  [[ $arg =~ ^--[A-Za-z][A-Za-z0-9-]*(=|$) ]] ||
    die "--sbatch-arg $(quote "$arg"): give a long sbatch option, e.g. --sbatch-arg=--qos=high"
done
if [[ $TRAIN_PYTHON != /* ]]; then
  resolved=$(command -v "$TRAIN_PYTHON") ||
    die "--python '$TRAIN_PYTHON' not found; give the absolute path of the environment's python"
  TRAIN_PYTHON=$resolved
fi

DEVICES=$((NODES * GPUS_PER_NODE))
check_args=(gpu --num-devices "$DEVICES" --run-dir "$RUN_DIR")
for f in "${GIN_FILES[@]}"; do check_args+=(--gin-file "$f"); done
for p in "${GIN_PARAMS[@]}"; do check_args+=(--gin-param "$p"); done
preflight "${check_args[@]}"
note "$NODES nodes x $GPUS_PER_NODE GPUs = $DEVICES devices, one process per $PROCESSES; mesh $MESH"

[[ $RUN_DIR == /* ]] || RUN_DIR="$PWD/$RUN_DIR"
train=("$TRAIN_PYTHON" -m trace_jax.cli train)
for f in "${GIN_FILES[@]}"; do train+=(--gin-file "$f"); done
for p in "${GIN_PARAMS[@]}"; do train+=(--gin-param "$p"); done
if [[ $PROCESSES == gpu ]]; then
  train+=(--gin-param 'DistributedConfig.mode = "auto"')
  tasks_per_node=$GPUS_PER_NODE
else
  tasks_per_node=1
fi
train+=(--run-dir "$RUN_DIR" --no-progress)

# sbatch_word VALUE: VALUE as one word of an #SBATCH line. sbatch, not the shell, reads those lines: double quotes
# group (so spaces and '#' stay in the value) and a backslash escapes the next character. Bare when nothing needs it.
sbatch_word() {
  if [[ $1 =~ ^[A-Za-z0-9_./:=@,+%~-]+$ ]]; then
    printf '%s' "$1"
    return
  fi
  local value=${1//\\/\\\\}
  value=${value//\"/\\\"}
  printf '"%s"' "$value"
}

# literal_pattern VALUE: VALUE inside a filename pattern (--output): '%' doubled, so sbatch and srun keep it as is.
literal_pattern() {
  printf '%s' "${1//%/%%}"
}

batch_script() {
  local log_dir
  log_dir=$(literal_pattern "$RUN_DIR/logs")
  echo '#!/bin/bash'
  echo "#SBATCH --job-name=$JOB_NAME"
  echo "#SBATCH --nodes=$NODES"
  echo "#SBATCH --ntasks-per-node=$tasks_per_node"
  echo "#SBATCH --gpus-per-node=$GPUS_PER_NODE"
  echo "#SBATCH --chdir=$(sbatch_word "$PWD")"
  echo "#SBATCH --output=$(sbatch_word "$log_dir/slurm-%j.out")"
  echo "#SBATCH --signal=TERM@$SIGNAL_SECONDS"
  [[ -z $PARTITION ]] || echo "#SBATCH --partition=$(sbatch_word "$PARTITION")"
  [[ -z $ACCOUNT ]] || echo "#SBATCH --account=$(sbatch_word "$ACCOUNT")"
  [[ -z $TIME_LIMIT ]] || echo "#SBATCH --time=$TIME_LIMIT"
  if ((REQUEUE)); then echo "#SBATCH --requeue"; fi
  for arg in "${SBATCH_ARGS[@]}"; do
    if [[ $arg == *=* ]]; then
      echo "#SBATCH ${arg%%=*}=$(sbatch_word "${arg#*=}")"
    else
      echo "#SBATCH $arg"
    fi
  done
  echo 'set -euo pipefail'
  echo "mkdir -p $(quote "$RUN_DIR/logs")"
  local srun=(srun --kill-on-bad-exit=1 "--output=$log_dir/slurm-%j-%t.log")
  if [[ $PROCESSES == gpu ]]; then
    show "${srun[@]}" "${train[@]}"
  else
    # sed, not head: head's early exit would SIGPIPE scontrol and fail the script under pipefail.
    # shellcheck disable=SC2016  # expanded when the batch script runs
    echo 'TRACE_JAX_COORDINATOR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p):'"$PORT"'"'
    echo "export TRACE_JAX_COORDINATOR TRACE_JAX_NUM_PROCESSES=$NODES"
    # shellcheck disable=SC2016  # expanded in each task
    show "${srun[@]}" bash -c 'TRACE_JAX_PROCESS_ID=$SLURM_PROCID exec "$@"' trace-jax "${train[@]}"
  fi
}

script="$RUN_DIR/launch/slurm-$(date -u +%Y%m%d-%H%M%S).sbatch"
if ((DRY_RUN)); then
  echo "# the batch script ($script):"
  batch_script
  echo "# submitted with:"
  show sbatch "$script"
else
  mkdir -p "$(dirname "$script")" "$RUN_DIR/logs"
  batch_script >"$script"
  note "batch script: $script"
  run sbatch "$script"
fi
