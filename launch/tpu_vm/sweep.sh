#!/usr/bin/env bash
# A gin sweep (configs/sweeps/*.gin) on Cloud TPU: one slice per run, each babysat (created, set up, run, recreated
# and resumed after preemption, deleted when done) by launch/tpu_vm/tpu.sh, at most --parallel at a time.
#
#   launch/tpu_vm/sweep.sh SWEEP.gin --name-prefix PREFIX --zone ZONE [--project PROJECT] --topology T
#       --runs-root /mnt/gcs/sweeps [--parallel N] [--log-dir DIR] [--dry-run] [tpu.sh options...]
#
# Run i of the sweep (in `trace-jax sweep SWEEP.gin --print` order) runs on slice PREFIX-i with run directory
# RUNS_ROOT/<sweep name>/<run name>; its babysitter's output goes to LOG_DIR/<sweep name>/<run name>.log (default
# LOG_DIR: logs/sweeps). Every run's config and mesh are checked before the first slice is created. Options not
# listed here (--queued, --spot, --mount, --runtime-version, ...) are passed to every `tpu.sh babysit`.
# --dry-run prints each babysitter's command line (as a comment) and the commands it would run.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
  exit "${1:-0}"
}

SWEEP_FILE="" PREFIX="" ZONE="" TOPOLOGY="" RUNS_ROOT="" PARALLEL=0 LOG_DIR=logs/sweeps
PASS=()
while (($#)); do
  case $1 in
    --name-prefix) has_value "$1" "$#"; PREFIX=$2; shift 2 ;;
    --zone) has_value "$1" "$#"; ZONE=$2; shift 2 ;;
    --topology) has_value "$1" "$#"; TOPOLOGY=$2; shift 2 ;;
    --runs-root) has_value "$1" "$#"; RUNS_ROOT=$2; shift 2 ;;
    --parallel) has_value "$1" "$#"; PARALLEL=$2; shift 2 ;;
    --log-dir) has_value "$1" "$#"; LOG_DIR=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage 0 ;;
    --queued | --spot) PASS+=("$1"); shift ;;
    --project | --runtime-version | --mount | --python | --create-attempts | --retry-wait | --poll-seconds | \
      --max-failures | --max-recreates)
      has_value "$1" "$#"; PASS+=("$1" "$2"); shift 2 ;;
    --gin-file | --gin_file | --gin-param | --gin_param | --run-dir | --run_dir | --name | --delete-when-done)
      die "$1 is set per run by the sweep file; edit it (sweep.base, sweep.params, sweep.axes) instead" ;;
    -*) die "unknown argument '$1' (see --help)" ;;
    *)
      [[ -z $SWEEP_FILE ]] || die "one sweep file, got '$SWEEP_FILE' and '$1'"
      SWEEP_FILE=$1; shift ;;
  esac
done

need "$SWEEP_FILE" "the sweep file (SWEEP.gin)"
need "$PREFIX" --name-prefix
need "$ZONE" --zone
need "$TOPOLOGY" --topology
need "$RUNS_ROOT" --runs-root
need_int "$PARALLEL" --parallel
[[ $PREFIX =~ ^[a-z]([-a-z0-9]{0,50}[a-z0-9])?$ ]] ||
  die "--name-prefix '$PREFIX': lowercase letters, digits and hyphens, starting with a letter (<= 52 chars)"

# set by check.py: each run's name, and its `trace-jax train` arguments (RUN_ARGC[i] of the flat RUN_ARGV for run i)
RUN_NAMES=() RUN_ARGC=() RUN_ARGV=() SWEEP_NAME=""
preflight sweep "$SWEEP_FILE" --topology "$TOPOLOGY" --runs-root "$RUNS_ROOT"
total=${#RUN_NAMES[@]}
((PARALLEL > 0)) || PARALLEL=$total
note "sweep $SWEEP_NAME: $total runs on $TOPOLOGY slices $PREFIX-0..$PREFIX-$((total - 1)), $PARALLEL at a time"

failed=0 pids=() run_args=() offset=0
for i in "${!RUN_NAMES[@]}"; do
  run_args=("${RUN_ARGV[@]:offset:RUN_ARGC[i]}")
  offset=$((offset + RUN_ARGC[i]))
  child=("$LAUNCH_DIR/tpu_vm/tpu.sh" babysit --name "$PREFIX-$i" --zone "$ZONE" --topology "$TOPOLOGY"
    --delete-when-done "${PASS[@]}" "${run_args[@]}")
  if ((DRY_RUN)); then
    echo "# run $((i + 1))/$total ${RUN_NAMES[$i]}: $(show "${child[@]}")"
    LAUNCH_CONFIG_CHECKED=1 "${child[@]}" --dry-run 2>/dev/null
    continue
  fi
  while (($(jobs -rp | wc -l) >= PARALLEL)); do
    sleep 5 # not `wait -n`: every run's status is collected by its pid below
  done
  log="$LOG_DIR/$SWEEP_NAME/${RUN_NAMES[$i]}.log"
  mkdir -p "$(dirname "$log")"
  note "run $((i + 1))/$total ${RUN_NAMES[$i]} on $PREFIX-$i (log $log)"
  LAUNCH_CONFIG_CHECKED=1 "${child[@]}" >"$log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do
  wait "$pid" || failed=$((failed + 1))
done
if ((failed)); then
  die "$failed of $total sweep runs failed; see $LOG_DIR/$SWEEP_NAME/"
fi
((DRY_RUN)) || note "sweep $SWEEP_NAME: all $total runs finished"
