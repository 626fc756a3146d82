"""`trace-jax train | eval | sweep`: the training commands (registered in `trace_jax/cli.py`).

    trace-jax train [--gin-file F ...] [--gin-param 'X.y = z' ...] [--run-dir D]
        no --gin-file: the embedded default, configs/tiny.gin. A run directory that holds a run resumes it.
    trace-jax eval --run-dir D [--step S] [--set NAME] [--mesh fsdp=4,tensor=2]
        evaluation of a saved step (default: the latest) with the run's own config, on every evaluation set
        (`EvalConfig.sets`) or only NAME, on the run's mesh (its MeshConfig) or the one --mesh names.
    trace-jax sweep SWEEP.gin [--print] [--runs-root R]
        expands a sweep file into runs; runs them in sequence here, or prints one launch command per run.

Flags are --kebab-case; the snake_case spellings (--gin_file, --run_dir, ...) are accepted too.

Compiled programs persist (JAX's persistent compilation cache), so a resumed run, an evaluation or the next run of
the same shapes loads them instead of compiling again: `--compilation-cache DIR` (all three commands), else
JAX_COMPILATION_CACHE_DIR, else `default_compilation_cache_dir()`; `--compilation-cache off` compiles everything
afresh. The directory is the host's, not the run's, so it is a flag and not a gin binding (docs/running.md,
"Compilation cache").

Every gin binding is parsed and every config built before any compute, so an unknown or invalid binding fails at
once with a message naming it (exit status 2). The three commands share this module; which one a parser belongs to
is the last word of its `prog` ("trace-jax train").

This module knows argparse and the loop's entry points; it knows nothing about training itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

DEFAULT_GIN = "configs/tiny.gin"
CACHE_OFF = "off"


def default_compilation_cache_dir() -> Path:
    """The compilation cache's default: `$TRACE_JAX_CACHE/xla`, else `$XDG_CACHE_HOME/trace_jax/xla`, else
    `~/.cache/trace_jax/xla` (the root of the BM25 index cache, `envs.search_index.default_cache_dir`). Per user and
    host rather than per run: every run, resume, evaluation and sweep of the same programs shares its entries."""
    root = os.environ.get("TRACE_JAX_CACHE")
    if root:
        return Path(root) / "xla"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "trace_jax" / "xla"


def compilation_cache_dir(flag: str | None) -> str | None:
    """The cache directory a command uses: `--compilation-cache` (`off`: None, no cache), else
    JAX_COMPILATION_CACHE_DIR, else `default_compilation_cache_dir()`."""
    if flag == CACHE_OFF:
        return None
    return flag or os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(default_compilation_cache_dir())


def enable_compilation_cache(directory: str | None) -> None:
    """Point JAX's persistent compilation cache at `directory` (None: turn it off), before any compile. Every
    program is written, however small or quick to compile (JAX's defaults skip programs compiled in under a second,
    most of a CPU run's), unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS / _MIN_ENTRY_SIZE_BYTES say otherwise."""
    import jax

    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size floor, none set for us


def _command(parser_or_args) -> str:
    prog = getattr(parser_or_args, "prog", None)
    if prog is not None:
        return prog.split()[-1]
    return parser_or_args.command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    command = _command(parser)
    if command == "train":
        parser.add_argument("--gin-file", "--gin_file", action="append", default=[],
                            help=f"gin config file (repeatable; default {DEFAULT_GIN}, the embedded default)")
        parser.add_argument("--gin-param", "--gin_param", action="append", default=[],
                            help="extra binding, e.g. 'CreditConfig.alpha_turn = 0.1' (repeatable; later wins)")
        parser.add_argument("--run-dir", "--run_dir", default=None,
                            help="run directory (default runs/<first gin file>-<time>); an existing run resumes")
        parser.add_argument("--no-progress", "--no_progress", action="store_true",
                            help="no progress bar (log lines only)")
    elif command == "eval":
        parser.add_argument("--run-dir", "--run_dir", required=True,
                            help="a run directory written by `trace-jax train`")
        parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
        parser.add_argument("--mesh", default=None,
                            help="evaluate on this mesh instead of the run's recorded MeshConfig, e.g. fsdp=4,tensor=2 "
                                 "(axes not named are 1, one may be -1; devices=N takes the first N devices)")
        parser.add_argument("--set", dest="set_name", default=None,
                            help="evaluate only this set of EvalConfig.sets (default: every set)")
    elif command == "sweep":
        parser.add_argument("sweep_file", help="a sweep gin file (configs/sweeps/*.gin)")
        parser.add_argument("--print", dest="print_only", action="store_true",
                            help="print one launch command per run instead of running them")
        parser.add_argument("--runs-root", "--runs_root", default="runs/sweeps",
                            help="runs go to <runs_root>/<sweep name>/<run>")
        parser.add_argument("--no-progress", "--no_progress", action="store_true", help="no progress bars")
    else:
        raise ValueError(f"trace_jax.rl.cli has no command {command!r}")
    parser.add_argument("--compilation-cache", "--compilation_cache", default=None, metavar="DIR",
                        help="persistent XLA compilation cache ('off': none; default: $JAX_COMPILATION_CACHE_DIR, "
                             f"else {default_compilation_cache_dir()})")


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run_train(gin_files, gin_params, run_dir, *, progress: bool = True) -> int:
    from trace_jax.rl.gin_setup import ConfigError, parse

    gin_files = list(gin_files) or [DEFAULT_GIN]
    try:
        config = parse(gin_files, gin_params)
    except ConfigError as error:
        return _fail(str(error))
    from trace_jax.rl.pipeline import check_compatible

    try:
        check_compatible(config.credit, config.loss, config.update,
                         config.train.prompts_per_step * config.rollout.group_size)
    except ValueError as error:
        return _fail(str(error))
    from trace_jax.train import distributed

    try:  # before any other JAX call: joining a multi-process run must come first
        _, process_count = distributed.initialize(config.distributed)
    except ValueError as error:
        return _fail(str(error))
    if run_dir is None:
        if process_count > 1:
            return _fail("a multi-process run needs --run-dir (the same directory on every host, shared storage for "
                         "the checkpoints); the default name has the time in it and would differ between hosts")
        run_dir = Path("runs") / f"{Path(gin_files[0]).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    from trace_jax.data.external import ExternalDataError
    from trace_jax.data.sources import SourceError
    from trace_jax.rl.loop import train

    try:
        train(config, run_dir, progress=progress)
    except (SourceError, ExternalDataError) as error:  # the task files: raised before any compute
        return _fail(str(error))
    return 0


def run(args: argparse.Namespace) -> int:
    command = _command(args)
    enable_compilation_cache(compilation_cache_dir(args.compilation_cache))
    if command == "train":
        return run_train(args.gin_file, args.gin_param, args.run_dir, progress=not args.no_progress)
    if command == "eval":
        from trace_jax.train.config import MeshConfig, TrainConfigError
        from trace_jax.rl.loop import evaluate_run

        try:
            mesh = None if args.mesh is None else MeshConfig.from_flag(args.mesh)
            evaluate_run(args.run_dir, args.step, set_name=args.set_name, mesh=mesh)
        except TrainConfigError as error:  # the recorded mesh does not fit this host's devices, or a bad --mesh
            return _fail(f"{error} (--mesh sets the mesh of the evaluation, e.g. --mesh fsdp=-1 for every device)")
        except (FileNotFoundError, ValueError) as error:  # no such run or step; a bad --set or task file
            return _fail(str(error))
        return 0
    from trace_jax.rl.gin_setup import ConfigError
    from trace_jax.rl.sweep import expand, load_sweep, validate_runs

    try:
        runs = expand(load_sweep(args.sweep_file), runs_root=args.runs_root)
        validate_runs(runs)
    except ConfigError as error:
        return _fail(str(error))
    if args.print_only:
        for r in runs:
            print(r.command())
        return 0
    for index, r in enumerate(runs):
        print(f"sweep run {index + 1}/{len(runs)}: {r.name}", flush=True)
        status = run_train(r.gin_files, r.gin_params, r.run_dir, progress=not args.no_progress)
        if status:
            return status
    return 0
