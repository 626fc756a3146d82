#!/usr/bin/env bash
# trace-jax on a Cloud TPU VM slice: create, set up, run, babysit, stop, delete. docs/launch.md walks through it.
#
#   launch/tpu_vm/tpu.sh COMMAND --name NAME --zone ZONE [--project PROJECT] [options] [--dry-run]
#
# Commands:
#   create   create the slice (a TPU VM, or with --queued a queued resource), retrying on capacity errors
#   setup    ship this checkout to every worker and install it with the pinned dependencies (launch/constraints.txt)
#            into ~/trace-jax-venv; with --mount BUCKET:DIR, mount a GCS bucket with gcsfuse on every worker
#   run      run `trace-jax train` on every worker at once (JAX finds the pod: DistributedConfig.mode = "auto"), each
#            host appending to its own log RUN_DIR/logs/<hostname>.log; resumes when RUN_DIR already holds the run
#   babysit  create if absent, set up, run; on preemption delete, recreate, set up and run again (which resumes from
#            the latest checkpoint in RUN_DIR) until the run finishes
#   stop     SIGTERM the trainer on every worker (it writes a checkpoint and exits)
#   delete   delete the slice (and its queued resource)
#   status   print the slice's state
#
# Options:
#   --topology T          the slice: v5e:4x4, v5p:2x2x2, v6e:2x4, v4:2x2x1, or an accelerator type (v5litepod-16)
#   --runtime-version V   TPU software image (default: the generation's, e.g. v2-alpha-tpuv5-lite for v5e)
#   --queued              use a queued resource (waits in Google's queue instead of failing on no capacity)
#   --spot                spot capacity (cheaper, preemptible)
#   --create-attempts N   capacity retries of create (default 20)    --retry-wait S  seconds between them (default 120)
#   --poll-seconds S      babysit's state poll interval (default 60)
#   --max-failures N      babysit: reruns after a failure on a healthy slice (leftover trainers killed first)
#                         before giving up (default 3)
#   --max-recreates N     babysit: recreations after preemption before giving up (default 20)
#   --delete-when-done    babysit: delete the slice when the run finishes
#   --mount BUCKET:DIR    setup: mount gs://BUCKET at DIR on every worker (gcsfuse), for a durable RUN_DIR
#   --python VERSION      setup: the workers' Python (default 3.11; uv installs it)
#   --log-dir DIR         run/babysit: also keep each worker's output here, DIR/<worker id>.log (gcloud's
#                         --output-directory); the terminal then shows only gcloud's own messages
#   --plan                run/babysit: first run `trace-jax plan` here (AOT compile for the topology, HBM fit;
#                         needs the `tpu` extra locally) and stop unless it succeeds; --topology must be a shape
#   --gin-file F, --gin-param B, --run-dir D   as for `trace-jax train`; RUN_DIR must be an absolute path on storage
#                         every worker mounts (a preemption wipes the VMs' disks)
#   --dry-run             print the commands (gcloud, git) instead of running them; the checks still run
#
# Before create, run and babysit spend anything, launch/check.py parses the gin config as the trainer does and checks
# that the MeshConfig axes multiply to the slice's chip count, that RUN_DIR is durable and that a pretrained
# checkpoint path is absolute.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
  exit "${1:-0}"
}

COMMAND=${1:-}
[[ -n $COMMAND ]] || usage 2
shift
case $COMMAND in
  create | setup | run | babysit | stop | delete | status) ;;
  -h | --help) usage 0 ;;
  *) die "unknown command '$COMMAND'; one of: create setup run babysit stop delete status (see --help)" ;;
esac

NAME="" ZONE="" PROJECT="" TOPOLOGY="" RUNTIME_VERSION_FLAG="" QUEUED=0 SPOT=0
CREATE_ATTEMPTS=20 RETRY_WAIT=120 POLL_SECONDS=60 MAX_FAILURES=3 MAX_RECREATES=20 DELETE_WHEN_DONE=0
MOUNT="" WORKER_PYTHON=3.11 RUN_DIR="" PLAN=0 LOG_DIR=""
GIN_FILES=() GIN_PARAMS=()
while (($#)); do
  case $1 in
    --name) has_value "$1" "$#"; NAME=$2; shift 2 ;;
    --zone) has_value "$1" "$#"; ZONE=$2; shift 2 ;;
    --project) has_value "$1" "$#"; PROJECT=$2; shift 2 ;;
    --topology) has_value "$1" "$#"; TOPOLOGY=$2; shift 2 ;;
    --runtime-version) has_value "$1" "$#"; RUNTIME_VERSION_FLAG=$2; shift 2 ;;
    --queued) QUEUED=1; shift ;;
    --spot) SPOT=1; shift ;;
    --create-attempts) has_value "$1" "$#"; CREATE_ATTEMPTS=$2; shift 2 ;;
    --retry-wait) has_value "$1" "$#"; RETRY_WAIT=$2; shift 2 ;;
    --poll-seconds) has_value "$1" "$#"; POLL_SECONDS=$2; shift 2 ;;
    --max-failures) has_value "$1" "$#"; MAX_FAILURES=$2; shift 2 ;;
    --max-recreates) has_value "$1" "$#"; MAX_RECREATES=$2; shift 2 ;;
    --delete-when-done) DELETE_WHEN_DONE=1; shift ;;
    --mount) has_value "$1" "$#"; MOUNT=$2; shift 2 ;;
    --python) has_value "$1" "$#"; WORKER_PYTHON=$2; shift 2 ;;
    --plan) PLAN=1; shift ;;
    --log-dir) has_value "$1" "$#"; LOG_DIR=$2; shift 2 ;;
    *) common_arg "$@"; shift "$SHIFT" ;;
  esac
done

# -- argument checks: all before anything is spent
need "$NAME" --name
need "$ZONE" --zone
[[ $NAME =~ ^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$ ]] ||
  die "--name '$NAME': a TPU name is lowercase letters, digits and hyphens, starting with a letter (<= 63 chars)"
need_int "$CREATE_ATTEMPTS" --create-attempts 1
need_int "$RETRY_WAIT" --retry-wait
need_int "$POLL_SECONDS" --poll-seconds
need_int "$MAX_FAILURES" --max-failures
need_int "$MAX_RECREATES" --max-recreates
if [[ -n $MOUNT && ! $MOUNT =~ ^[a-z0-9][-a-z0-9_.]*:/[^:]*$ ]]; then
  die "--mount '$MOUNT': write BUCKET:/ABSOLUTE/DIR, e.g. my-bucket:/mnt/gcs"
fi
if [[ $COMMAND == setup || $COMMAND == run || $COMMAND == babysit ]]; then
  git -C "$REPO_ROOT" rev-parse --git-dir >/dev/null 2>&1 ||
    die "$REPO_ROOT is not a git checkout; the launchers ship the checkout's tree to the workers"
  for f in "${GIN_FILES[@]}"; do
    [[ $f != /* ]] || die "--gin-file '$f' is absolute; give a path inside the checkout (e.g." \
      "configs/qwen3_4b.gin): the workers run from their copy of it"
    git -C "$REPO_ROOT" ls-files --error-unmatch -- "$f" >/dev/null 2>&1 ||
      die "--gin-file '$f' is not in the checkout's git index; git add it (the workers get the tracked files)"
  done
fi

case $COMMAND in
  create | run | babysit)
    need "$TOPOLOGY" --topology
    [[ $COMMAND == create ]] || need "$RUN_DIR" --run-dir
    check_args=(tpu --topology "$TOPOLOGY")
    # sweep.sh checked every run's config already; the slice name is all that is left to resolve
    if [[ $COMMAND != create && ${LAUNCH_CONFIG_CHECKED:-0} != 1 ]]; then
      check_args+=(--run-dir "$RUN_DIR")
      for f in "${GIN_FILES[@]}"; do check_args+=(--gin-file "$f"); done
      for p in "${GIN_PARAMS[@]}"; do check_args+=(--gin-param "$p"); done
    else
      check_args[0]=slice
    fi
    preflight "${check_args[@]}"
    RUNTIME_VERSION=${RUNTIME_VERSION_FLAG:-$RUNTIME_VERSION}
    if ((PLAN)) && [[ $COMMAND != create ]]; then
      [[ $TOPOLOGY == *:* ]] || die "--plan needs --topology as a shape (e.g. v5e:4x4), not '$TOPOLOGY'"
      plan=("$PYTHON" -m trace_jax.cli plan --topology "$TOPOLOGY")
      for f in "${GIN_FILES[@]}"; do plan+=(--gin-file "$f"); done
      for p in "${GIN_PARAMS[@]}"; do plan+=(--gin-param "$p"); done
      run "${plan[@]}" || die "trace-jax plan did not pass for $TOPOLOGY (see above); nothing was created"
    fi
    note "slice $TOPOLOGY = $ACCELERATOR_TYPE ($CHIPS chips, runtime $RUNTIME_VERSION); mesh ${MESH:-(not checked here)}"
    ;;
esac
LOCATION=(--zone "$ZONE")
[[ -z $PROJECT ]] || LOCATION+=(--project "$PROJECT")
WORKERS=(--worker=all)

# -- the slice
slice_state() { # READY/ACTIVE, CREATING, PREEMPTED, ..., MISSING (gcloud: not found) or UNREACHABLE (other errors)
  local state err query
  if ((QUEUED)); then
    query=(gcloud compute tpus queued-resources describe "$NAME" "${LOCATION[@]}" --format='value(state.state)')
  else
    query=(gcloud compute tpus tpu-vm describe "$NAME" "${LOCATION[@]}" --format='value(state)')
  fi
  err=$(mktemp)
  if state=$(DRY_ANSWER=${DRY_STATE:-MISSING} capture "${query[@]}" 2>"$err"); then
    state=${state:-MISSING}
  elif grep -qiE 'NOT_FOUND|not found' "$err"; then
    state=MISSING
  else # a network or auth hiccup must not make the babysitter recreate a healthy slice: wait and ask again
    state=UNREACHABLE
    sed 's/^/  gcloud: /' "$err" >&2
  fi
  rm -f "$err"
  printf '%s\n' "$state"
}

state_class() { # up | gone | deleting | pending
  case $1 in
    READY | ACTIVE) echo up ;;
    PREEMPTED | TERMINATED | STOPPED | SUSPENDED | SUSPENDING | FAILED | MISSING) echo gone ;;
    DELETING) echo deleting ;;
    # CREATING, STARTING, REPAIRING, WAITING_FOR_RESOURCES, PROVISIONING, ... and any state not known here: wait
    # rather than delete a slice that may be coming up
    *) echo pending ;;
  esac
}

CAPACITY_ERRORS='RESOURCE_EXHAUSTED|[Nn]o more capacity|[Ii]nsufficient capacity|ZONE_RESOURCE_POOL_EXHAUSTED'
CAPACITY_ERRORS+='|[Ss]tockout|resources are not available'

create_slice() {
  local cmd attempt=1 err
  if ((QUEUED)); then
    cmd=(gcloud compute tpus queued-resources create "$NAME" --node-id "$NAME" "${LOCATION[@]}"
      --accelerator-type "$ACCELERATOR_TYPE" --runtime-version "$RUNTIME_VERSION")
  else
    cmd=(gcloud compute tpus tpu-vm create "$NAME" "${LOCATION[@]}"
      --accelerator-type "$ACCELERATOR_TYPE" --version "$RUNTIME_VERSION")
  fi
  if ((SPOT)); then cmd+=(--spot); fi
  if ((DRY_RUN)); then
    run "${cmd[@]}"
  else
    err=$(mktemp)
    # gcloud's stderr goes to a file first (then to the terminal): the capacity test must read all of it
    until run "${cmd[@]}" 2>"$err"; do
      cat "$err" >&2
      if ! grep -Eq "$CAPACITY_ERRORS" "$err"; then
        rm -f "$err"
        die "creating $NAME failed (not a capacity error, so not retried); see gcloud's message above"
      fi
      if ((attempt >= CREATE_ATTEMPTS)); then
        rm -f "$err"
        die "no capacity for $ACCELERATOR_TYPE in $ZONE after $attempt attempts; try --queued, another zone or later"
      fi
      attempt=$((attempt + 1))
      note "no capacity for $ACCELERATOR_TYPE in $ZONE; attempt $attempt/$CREATE_ATTEMPTS in ${RETRY_WAIT}s"
      sleep "$RETRY_WAIT"
    done
    cat "$err" >&2
    rm -f "$err"
  fi
  wait_until_up
}

wait_until_up() {
  if ((DRY_RUN)); then return 0; fi
  local state
  while true; do
    state=$(slice_state)
    case $(state_class "$state") in
      up) return 0 ;;
      pending) note "$NAME is $state; waiting ${POLL_SECONDS}s" && sleep "$POLL_SECONDS" ;;
      *) die "$NAME went $state while it was being created; see gcloud compute tpus ... describe $NAME" ;;
    esac
  done
}

delete_slice() {
  if ((QUEUED)); then
    run gcloud compute tpus queued-resources delete "$NAME" "${LOCATION[@]}" --force --quiet
  else
    run gcloud compute tpus tpu-vm delete "$NAME" "${LOCATION[@]}" --quiet
  fi
}

ssh_all() { # ssh_all REMOTE_COMMAND: run it on every worker, in parallel; fails if any worker fails
  run gcloud compute tpus tpu-vm ssh "$NAME" "${LOCATION[@]}" "${WORKERS[@]}" --command "$1"
}

# -- the code and its environment on the workers
ARCHIVE="" SHIPPED=0
make_archive() { # the checkout's tree, uncommitted changes to tracked files included, as a tarball named by its hash
  local git_dir index tree partial
  [[ -z $ARCHIVE ]] || return 0
  # The tree is written from a private copy of the index: the checkout's own index is neither locked nor changed, so
  # the parallel runs of a sweep (each its own tpu.sh) can all do this at once. (`git stash create` locks the index
  # and, with uncommitted changes, fails without a word when another git process holds that lock.)
  git_dir=$(git -C "$REPO_ROOT" rev-parse --absolute-git-dir) || die "cannot read $REPO_ROOT's git directory"
  index=$(mktemp "${TMPDIR:-/tmp}/trace-jax-index.XXXXXX")
  if ! { cp "$git_dir/index" "$index" && GIT_INDEX_FILE=$index git -C "$REPO_ROOT" add --update &&
    tree=$(GIT_INDEX_FILE=$index git -C "$REPO_ROOT" write-tree); }; then
    rm -f "$index"
    die "could not take a snapshot of the checkout $REPO_ROOT (its tracked files, uncommitted changes included); see" \
      "git's message above"
  fi
  rm -f "$index"
  ARCHIVE="${TMPDIR:-/tmp}/trace-jax-${tree:0:12}.tar.gz"
  # written under a name of this slice's, then renamed (atomic): runs of a sweep that ship the same tree never read
  # a tarball another run is still writing
  partial="$ARCHIVE.$NAME.partial"
  run git -C "$REPO_ROOT" archive --format=tar.gz -o "$partial" "$tree"
  run mv -f "$partial" "$ARCHIVE"
}

ship_code() { # once per (re)created slice
  if ((SHIPPED)); then return 0; fi
  SHIPPED=1
  make_archive
  run gcloud compute tpus tpu-vm scp "$ARCHIVE" "$NAME:trace-jax.tar.gz" "${LOCATION[@]}" "${WORKERS[@]}"
  ssh_all 'rm -rf ~/trace-jax && mkdir -p ~/trace-jax && tar -xzf ~/trace-jax.tar.gz -C ~/trace-jax'
}

setup_workers() {
  ship_code
  ssh_all "set -e; python3 -m pip install --user --quiet uv; ~/.local/bin/uv venv --allow-existing --python $(quote "$WORKER_PYTHON") ~/trace-jax-venv; ~/.local/bin/uv pip install --python ~/trace-jax-venv/bin/python --constraint ~/trace-jax/launch/constraints.txt --editable \"\$HOME/trace-jax[tpu]\""
  if [[ -n $MOUNT ]]; then
    local bucket=${MOUNT%%:*} dir=${MOUNT#*:}
    # gcsfuse lets orbax rename a finished checkpoint's directory (its atomic commit on a file system) only up to
    # --rename-dir-limit objects; docs/launch.md, "Durable storage".
    ssh_all "set -e; if ! command -v gcsfuse >/dev/null; then echo \"deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -cs) main\" | sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null; curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null; sudo apt-get update -qq; sudo apt-get install -y -qq gcsfuse; fi; sudo mkdir -p $(quote "$dir"); sudo chown \"\$USER\" $(quote "$dir"); mountpoint -q $(quote "$dir") || gcsfuse --implicit-dirs --rename-dir-limit=200000 $(quote "$bucket") $(quote "$dir")"
  fi
}

# -- the run
train_remote_command() {
  # shellcheck disable=SC2088  # the tilde is for the worker's shell to expand
  local train=('~/trace-jax-venv/bin/python' -m trace_jax.cli train) f p logs
  for f in "${GIN_FILES[@]}"; do train+=(--gin-file "$f"); done
  for p in "${GIN_PARAMS[@]}"; do train+=(--gin-param "$p"); done
  # JAX's own TPU pod detection; every worker runs the same program (the multi-host runtime, DistributedConfig).
  train+=(--gin-param 'DistributedConfig.mode = "auto"' --run-dir "$RUN_DIR" --no-progress)
  logs="$RUN_DIR/logs"
  # In the subshell $BASHPID becomes the trainer's pid (exec), which `stop` signals. The workers' shell is bash.
  printf '%s' "set -o pipefail; mkdir -p $(quote "$logs") && cd ~/trace-jax && (echo \$BASHPID > ~/trace-jax-train.pid; exec $(show "${train[@]}")) 2>&1 | tee -a $(quote "$logs")/\"\$(hostname)\".log"
}

run_training() {
  ship_code
  if [[ -n $LOG_DIR ]]; then
    if ((!DRY_RUN)); then mkdir -p "$LOG_DIR"; fi
    run gcloud compute tpus tpu-vm ssh "$NAME" "${LOCATION[@]}" "${WORKERS[@]}" --command "$(train_remote_command)" \
      --output-directory "$LOG_DIR"
  else
    ssh_all "$(train_remote_command)"
  fi
}

signal_trainer() { # signal_trainer SIGNAL: the worker command that sends SIGNAL to the trainer `run` started there
  # Only a pid file holding a number, and only while that process is still our trainer (its command line is the
  # venv's python running trace_jax.cli train): after the trainer exits its pid may belong to anything (gcsfuse).
  # shellcheck disable=SC2016  # expanded by the worker's shell
  printf 'pid=$(cat ~/trace-jax-train.pid 2>/dev/null) || exit 0; case $pid in "" | *[!0-9]*) echo "trace-jax: ~/trace-jax-train.pid does not hold a process id; nothing signalled" >&2; exit 0 ;; esac; if tr "\\0" " " </proc/"$pid"/cmdline 2>/dev/null | grep -q "trace-jax-venv/bin/python -m trace_jax[.]cli train"; then kill -%s "$pid" 2>/dev/null || true; else echo "trace-jax: process $pid is not the trainer (it has exited); nothing signalled" >&2; fi' "$1"
}

stop_training() {
  ssh_all "$(signal_trainer TERM)"
}

kill_leftovers() { # after a failed run: a trainer still alive on another worker would hold the TPU chips
  ssh_all "$(signal_trainer KILL)"
}

babysit() {
  local state failures=0 recreations=0 need_setup=1
  while true; do
    state=$(slice_state)
    case $(state_class "$state") in
      up)
        if ((need_setup)); then
          setup_workers
          need_setup=0
        fi
        if run_training; then
          if ((DRY_RUN)); then
            note "dry run: these are the commands of one babysit cycle without preemption"
          else
            note "run finished: $RUN_DIR"
          fi
          if ((DELETE_WHEN_DONE)); then delete_slice; fi
          return 0
        fi
        sleep "$POLL_SECONDS" # a preempted slice can still read READY for a moment
        state=$(slice_state)
        if [[ $(state_class "$state") == up ]]; then
          failures=$((failures + 1))
          ((failures <= MAX_FAILURES)) ||
            die "the run failed on a healthy slice $failures time(s) (--max-failures $MAX_FAILURES; $NAME is $state); see $RUN_DIR/logs/"
          note "the run failed on a healthy slice (failure $failures/$MAX_FAILURES); rerunning, which resumes"
          kill_leftovers || true
        else
          note "$NAME is $state (preempted?): recreating it; the rerun resumes from the latest checkpoint"
        fi
        ;;
      pending)
        note "$NAME is $state; waiting ${POLL_SECONDS}s"
        sleep "$POLL_SECONDS"
        ;;
      deleting)
        note "$NAME is being deleted; waiting ${POLL_SECONDS}s"
        sleep "$POLL_SECONDS"
        ;;
      gone)
        if [[ $state != MISSING ]]; then
          recreations=$((recreations + 1))
          ((recreations <= MAX_RECREATES)) || die "$NAME was lost $recreations times; giving up (--max-recreates)"
          note "$NAME is $state: deleting it to recreate it"
          delete_slice
        fi
        create_slice
        DRY_STATE=READY
        need_setup=1
        SHIPPED=0
        ;;
    esac
  done
}

case $COMMAND in
  create) create_slice ;;
  setup) setup_workers ;;
  run) run_training ;;
  babysit) babysit ;;
  stop) stop_training ;;
  delete) delete_slice ;;
  status)
    if ((DRY_RUN)); then slice_state >/dev/null; else slice_state; fi
    ;;
esac
