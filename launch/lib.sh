# shellcheck shell=bash
# Shared by the launchers (sourced, not run): printing and running commands, --dry-run, errors.
#
# Every command that acts on the world goes through `run` (or `capture`): with DRY_RUN=1 it is printed, one
# copy-pasteable line per command on stdout, and not executed; otherwise it is echoed to stderr with a "+ " and
# executed. Errors are one line "error: ..." on stderr and exit status 2, before anything was spent.
# This file knows bash; it knows nothing about TPUs, SLURM or trace-jax.

LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck disable=SC2034  # used by the scripts that source this file
REPO_ROOT=$(dirname "$LAUNCH_DIR")
PYTHON=${PYTHON:-python3}
exec 3>&1 # the script's stdout, for what a dry run prints from inside $(...)
DRY_RUN=${DRY_RUN:-0}

die() {
  echo "error: $*" >&2
  exit 2
}

note() {
  echo "[launch $(date -u +%H:%M:%S)] $*" >&2
}

# One argument as the shell would need it typed: bare when safe, in double quotes when it holds single quotes and
# nothing double quotes would expand, else in single quotes.
quote() {
  local arg=$1
  if [[ $arg =~ ^[A-Za-z0-9_./:=@,+%~-]+$ ]]; then
    printf '%s' "$arg"
  elif [[ $arg == *\'* && $arg != *[\"\$\`\\!]* ]]; then
    printf '"%s"' "$arg"
  else
    printf "'%s'" "${arg//\'/\'\\\'\'}"
  fi
}

# A command as one line of shell.
show() {
  local line="" arg
  for arg in "$@"; do
    line+="${line:+ }$(quote "$arg")"
  done
  printf '%s\n' "$line"
}

run() {
  if ((DRY_RUN)); then
    show "$@"
  else
    echo "+ $(show "$@")" >&2
    "$@"
  fi
}

# Run a query and print its stdout; in a dry run print the command and then $DRY_ANSWER as the answer.
capture() {
  if ((DRY_RUN)); then
    show "$@" >&3
    printf '%s\n' "${DRY_ANSWER:-}"
  else
    "$@"
  fi
}

# need VALUE FLAG: die unless the flag was given.
need() {
  [[ -n $1 ]] || die "$2 is required (see --help)"
}

# need_int VALUE FLAG [MIN]
need_int() {
  if ! [[ $1 =~ ^[0-9]+$ ]] || (($1 < ${3:-0})); then
    die "$2 must be an integer >= ${3:-0}, got '$1'"
  fi
}

# need_port VALUE FLAG: die unless VALUE is a TCP port number, 1-65535.
need_port() {
  if ! [[ $1 =~ ^[0-9]{1,5}$ ]] || ((10#$1 < 1 || 10#$1 > 65535)); then
    die "$2 must be a port number from 1 to 65535, got '$1'"
  fi
}

# one_line VALUE FLAG: die when VALUE holds a newline or another control character (it would end or corrupt the
# line of a generated script it is written into).
one_line() {
  if [[ $1 == *[[:cntrl:]]* ]]; then
    die "$2 holds a newline or another control character; give it on one line, got $(quote "$1")"
  fi
}

# has_value FLAG "$#": die unless FLAG is followed by a value.
has_value() {
  (($2 >= 2)) || die "$1 needs a value"
}

# common_arg "$@": the flags every launcher shares (the gin config, the run directory, --dry-run, --help); sets
# SHIFT to the words it took. Anything else is an unknown argument. The caller's `usage` prints its own help. Flags
# are --kebab-case; the snake_case spellings (--gin_file) are accepted too, as `trace-jax` accepts them.
# shellcheck disable=SC2034  # GIN_FILES, GIN_PARAMS, RUN_DIR, SHIFT are the sourcing script's
common_arg() {
  case $1 in
    --gin-file | --gin_file) has_value "$1" "$#"; GIN_FILES+=("$2"); SHIFT=2 ;;
    --gin-param | --gin_param) has_value "$1" "$#"; GIN_PARAMS+=("$2"); SHIFT=2 ;;
    --run-dir | --run_dir) has_value "$1" "$#"; RUN_DIR=$2; SHIFT=2 ;;
    --dry-run) DRY_RUN=1; SHIFT=1 ;;
    -h | --help) usage 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
}

# Run launch/check.py (the config, mesh and run-directory checks) and read what it prints as data, never as code:
# NUL-terminated NAME, VALUE pairs. Only the names below are accepted; NAME[] appends VALUE to the array NAME.
# shellcheck disable=SC2034  # ACCELERATOR_TYPE, ..., RUN_ARGV are the sourcing script's
preflight() {
  local out name value unknown=""
  out=$(mktemp "${TMPDIR:-/tmp}/trace-jax-check.XXXXXX")
  if ! JAX_PLATFORMS=cpu "$PYTHON" "$LAUNCH_DIR/check.py" "$@" >"$out"; then
    rm -f "$out"
    exit 2
  fi
  while IFS= read -r -d '' name && IFS= read -r -d '' value; do
    case $name in
      ACCELERATOR_TYPE) ACCELERATOR_TYPE=$value ;;
      RUNTIME_VERSION) RUNTIME_VERSION=$value ;;
      CHIPS) CHIPS=$value ;;
      MESH) MESH=$value ;;
      SWEEP_NAME) SWEEP_NAME=$value ;;
      'RUN_NAMES[]') RUN_NAMES+=("$value") ;;
      'RUN_ARGC[]') RUN_ARGC+=("$value") ;;
      'RUN_ARGV[]') RUN_ARGV+=("$value") ;;
      *) unknown=$name && break ;;
    esac
  done <"$out"
  rm -f "$out"
  [[ -z $unknown ]] || die "launch/check.py printed an unexpected name $(quote "$unknown"); is launch/ one checkout?"
}
