#!/usr/bin/env bash
# trace-jax on the GPUs of one machine: one process drives them all (no jax.distributed needed).
#
#   launch/gpu/single_host.sh [--gpus N] [--python PYTHON] [--dry-run] --run-dir DIR [--gin-file F ...]
#       [--gin-param 'X.y = z' ...]
#
# --gpus N uses GPUs 0..N-1 (CUDA_VISIBLE_DEVICES); default: every GPU `nvidia-smi -L` lists. Before anything runs,
# launch/check.py parses the gin config as `trace-jax train` does and checks that the MeshConfig axes multiply to N.
# Rerunning the same command resumes the run in DIR from its latest checkpoint. --python: the interpreter of the
# environment trace-jax is installed in (default: $PYTHON, else python3). --dry-run prints the command.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
  exit "${1:-0}"
}

GPUS="" RUN_DIR="" TRAIN_PYTHON=$PYTHON
GIN_FILES=() GIN_PARAMS=()
while (($#)); do
  case $1 in
    --gpus) has_value "$1" "$#"; GPUS=$2; shift 2 ;;
    --python) has_value "$1" "$#"; TRAIN_PYTHON=$2; shift 2 ;;
    *) common_arg "$@"; shift "$SHIFT" ;;
  esac
done

need "$RUN_DIR" --run-dir
if [[ -z $GPUS ]]; then
  command -v nvidia-smi >/dev/null || die "nvidia-smi not found: pass --gpus N"
  GPUS=$(nvidia-smi -L | grep -c '^GPU ') || true
  ((GPUS > 0)) || die "nvidia-smi lists no GPU on this machine; pass --gpus N"
fi
need_int "$GPUS" --gpus 1

check_args=(gpu --num-devices "$GPUS" --run-dir "$RUN_DIR")
train=("$TRAIN_PYTHON" -m trace_jax.cli train)
for f in "${GIN_FILES[@]}"; do check_args+=(--gin-file "$f"); train+=(--gin-file "$f"); done
for p in "${GIN_PARAMS[@]}"; do check_args+=(--gin-param "$p"); train+=(--gin-param "$p"); done
train+=(--run-dir "$RUN_DIR")
preflight "${check_args[@]}"
note "$GPUS GPUs; mesh $MESH"

run env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((GPUS - 1)))" "${train[@]}"
