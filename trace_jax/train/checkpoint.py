"""Checkpoints of the train state with orbax `CheckpointManager`: async, every N steps, keep the last K, atomic.

A checkpoint of step `s` holds two items: `state` (the whole `TrainState`: step, float32 params, optimizer state,
RNG key) and `host` (an opaque JSON dict the loop hands in, e.g. the data iterator position and host-side RNG
seeds). Each step is written to a temporary directory and renamed when complete, so a process killed mid-write
leaves the previous step as the latest. `latest_step()` and `all_steps()` only see complete steps: a step directory
that lacks one of orbax's metadata files (a copy or a non-atomic rename cut short, e.g. on gcsfuse) is ignored.

`restore_latest(target)` is the trainer's start-up call. It tidies the directory (orbax's temporary directories of an
interrupted save are deleted, incomplete step directories are moved aside as `<step>.incomplete`) and restores the
newest step that restores: a step whose files are damaged (truncated, unreadable) is skipped with a
`CheckpointSkipped` warning, one line naming the step and the error (what orbax and its readers print or log while
a step fails to restore is held back: the one line says it), and moved aside as `<step>.damaged` once an older step
restored, so the run resumes from that step and later saves of the skipped step numbers do not collide. Nothing is
moved when no step restores: that raises `CheckpointRestoreError` listing every step's error. Readers (`trace-jax
eval`, `export_pretrained`) never tidy: a trainer may be writing the same directory.

`restore(target=...)` takes an abstract state (`abstract_train_state`) whose shardings say where every array goes,
so a checkpoint written on one mesh restores onto another. `PreemptionGuard` turns SIGTERM/SIGINT (TPU preemption,
Ctrl-C) into a flag the loop polls: `Checkpointer.maybe_save` then writes a forced checkpoint and the loop exits.
`export_pretrained` writes a saved step's params as a Hugging Face directory (`save_pretrained`).
`restore_params_from_copies` reads one step's params from the first of several directories holding it that restores
(the frozen reference: a damaged copy is skipped like a damaged policy step, but never for an older step).

This module knows nothing about losses, rollouts or the data pipeline (the host state is opaque).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import io
import logging
import os
import shutil
import signal
import sys
import threading
import traceback
import warnings
from typing import NamedTuple, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from trace_jax import models
from trace_jax.train.config import CheckpointConfig
from trace_jax.train.state import TrainState, state_shardings


# Files every complete step of a `Checkpointer` has (orbax writes them before the step's directory is renamed into
# place); a step directory without one of them was cut short.
_STEP_FILES = ("_CHECKPOINT_METADATA", os.path.join("state", "_METADATA"), os.path.join("host", "metadata"))


class CheckpointSkipped(UserWarning):
    """`restore_latest` skipped a step that does not restore (the message names the step and the error)."""


def _report_skipped(message: str, where: str) -> None:
    """A `CheckpointSkipped` warning shown as one line, `<where>:0: CheckpointSkipped: <message>`: located at the
    step directory `where` (no source line to quote), not at the caller's code, which says nothing about it."""
    warnings.warn_explicit(message, CheckpointSkipped, filename=where, lineno=0)


class CheckpointRestoreError(RuntimeError):
    """No step of a checkpoint directory restores (the message lists each step and its error)."""


class Restored(NamedTuple):
    """What `Checkpointer.restore_latest` restored: the train state, the host-state dict and the step."""

    state: "TrainState"
    host: dict
    step: int


def abstract_train_state(model_config, optimizer, *, mesh=None, rules=None) -> TrainState:
    """A `TrainState` of `jax.ShapeDtypeStruct`s (with shardings on `mesh`, or on the default device without one):
    the restore target that says what to build and where."""
    def fresh():
        from trace_jax.train.state import init_train_state

        params = models.init_params(model_config, jax.random.PRNGKey(0), dtype="float32")
        return init_train_state(model_config, optimizer, params, jax.random.PRNGKey(0))

    shapes = jax.eval_shape(fresh)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes)
    shardings = state_shardings(model_config, optimizer, mesh, rules)
    return jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                                  shardings)


class PreemptionGuard:
    """Records SIGTERM/SIGINT instead of dying, so the loop can checkpoint and exit cleanly.

    Use as a context manager (the previous handlers come back on exit). `requested` becomes True on the first
    signal; `signal_name` says which. Only the main thread can install handlers (Python's rule).
    """

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signals)
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, _frame):
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> "PreemptionGuard":
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        return False


class Checkpointer:
    """An orbax `CheckpointManager` for `TrainState` plus an opaque host-state dict (see the module doc)."""

    def __init__(self, config: CheckpointConfig, *, guard: PreemptionGuard | None = None):
        self.config = config
        self.guard = guard
        self.directory = os.path.abspath(config.directory)
        # the interval is applied here (step % every_steps == 0); orbax's own would also save the first step seen
        options = ocp.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=config.keep_last,
                                               enable_async_checkpointing=config.async_save, create=True)
        # handlers, not just item names: reading a checkpoint's metadata (`restore_params`) needs them
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_handlers={"state": ocp.StandardCheckpointHandler(),
                                                            "host": ocp.JsonCheckpointHandler()})

    # ------------------------------------------------------------------ saving
    def save(self, state: TrainState, host_state: dict | None = None, *, force: bool = False) -> bool:
        """Save `state` at its own step (if the interval says so, or always with `force`); returns whether it
        saved. Asynchronous when configured: call `wait_until_finished` before reading it back."""
        step = int(state.step)
        if step in self.manager.all_steps():
            return False  # already on disk (e.g. a forced save right after a regular save of this very step)
        if not force and step % self.config.every_steps:
            return False
        return self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                               host=ocp.args.JsonSave(dict(host_state or {}))),
                                 force=force)

    @property
    def stop_requested(self) -> bool:
        """True once the guard caught SIGTERM/SIGINT: the loop should `maybe_save` and exit."""
        return self.guard is not None and self.guard.requested

    def maybe_save(self, state: TrainState, host_state: dict | None = None) -> bool:
        """The loop's per-step call: a regular save every `every_steps`, and a forced, waited-for save when a stop
        was requested (after which the caller exits)."""
        if self.stop_requested:
            saved = self.save(state, host_state, force=True)
            self.wait_until_finished()
            return saved
        return self.save(state, host_state)

    def wait_until_finished(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # ------------------------------------------------------------------ reading
    def _complete(self, step: int) -> bool:
        step_dir = os.path.join(self.directory, str(step))
        return all(os.path.isfile(os.path.join(step_dir, name)) for name in _STEP_FILES)

    def all_steps(self) -> list[int]:
        """The complete steps on disk, oldest first (incomplete step directories are left out)."""
        self.manager.reload()
        return [step for step in sorted(self.manager.all_steps()) if self._complete(step)]

    def latest_step(self) -> int | None:
        """The newest complete step, or None when the directory holds none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, target: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
        """`(state, host_state)` of `step` (default: the latest), built as `target` says (an abstract state from
        `abstract_train_state`, on any mesh, or a concrete state of the same structure). Raises whatever orbax
        raises on damaged files; `restore_latest` falls back to an older step instead."""
        steps = self.all_steps()
        step = (steps[-1] if steps else None) if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}; start from scratch or point "
                                    "CheckpointConfig.directory at a run directory")
        if step not in steps:
            raise FileNotFoundError(f"checkpoint step {step} not in {self.directory} (or incomplete); have {steps}")
        abstract = jax.tree_util.tree_map(
            lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                                         sharding=x.sharding),
            target)
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                      host=ocp.args.JsonRestore()))
        return restored.state, dict(restored.host or {})

    def restore_latest(self, target: TrainState) -> Restored | None:
        """The trainer's start-up call: `tidy()` the directory, then restore the newest step that restores
        (see the module doc); None when there is no complete step (a fresh run).

        Every process of a multi-process run calls this together; they agree on the step. Raises
        `CheckpointRestoreError` when steps exist but none restores (nothing is moved then).
        """
        self.tidy()
        damaged: list[tuple[int, str]] = []
        for step in reversed(self.all_steps()):
            restored, value, reason = _restore_everywhere(lambda: self.restore(target, step),
                                                          os.path.join(self.directory, str(step)))
            if restored:
                state, host = value
                for bad_step, _ in damaged:
                    self._set_aside(bad_step, "damaged")
                if damaged:  # every process has the same list: they agreed on each step
                    _barrier("trace_jax checkpoint set aside")
                self.manager.reload()
                return Restored(state, host, step)
            damaged.append((step, reason))
            _report_skipped(f"checkpoint step {step} in {self.directory} does not restore ({reason}); skipping it "
                            "and trying the previous step", os.path.join(self.directory, str(step)))
        if damaged:
            listed = "; ".join(f"step {step}: {reason}" for step, reason in damaged)
            raise CheckpointRestoreError(
                f"no checkpoint in {self.directory} restores ({listed}); move that directory away to start the run "
                "from scratch, or copy an intact step back")
        return None

    def tidy(self) -> None:
        """Delete orbax's temporary directories of saves that never finished and move incomplete step directories
        aside (as `<step>.incomplete`, with a `CheckpointSkipped` warning). Only for the process that writes this
        directory, before its first save (process 0 acts, every process waits for it)."""
        if jax.process_index() == 0 and os.path.isdir(self.directory):
            for name in sorted(os.listdir(self.directory)):
                path = os.path.join(self.directory, name)
                if ocp.path.atomicity.TMP_DIR_SUFFIX in name:
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path)
                    else:
                        os.remove(path)
                elif name.isdigit() and os.path.isdir(path) and not self._complete(int(name)):
                    missing = [f for f in _STEP_FILES if not os.path.isfile(os.path.join(path, f))]
                    aside = self._set_aside(int(name), "incomplete")
                    _report_skipped(f"checkpoint step {name} in {self.directory} is incomplete (no "
                                    f"{', '.join(missing)}); ignored and moved to {aside}", path)
        _barrier("trace_jax checkpoint tidy")
        self.manager.reload()

    def _set_aside(self, step: int, label: str) -> str:
        """Rename a step's directory to `<step>.<label>[-N]` (orbax ignores names that are not step numbers)."""
        if jax.process_index() != 0:
            return ""
        source = os.path.join(self.directory, str(step))
        target, n = f"{source}.{label}", 1
        while os.path.exists(target):
            n += 1
            target = f"{source}.{label}-{n}"
        os.rename(source, target)
        return target

    def restore_params(self, step: int | None = None, *, shardings=None):
        """Only the params of a saved step (no target needed), on this process's first device, whatever mesh and
        however many processes wrote them (e.g. `export_pretrained` on one host after a multi-host run). With
        `shardings` (a params pytree of shardings, e.g. `models.param_shardings` on a mesh) each process reads its
        own shards straight into that layout instead."""
        steps = self.all_steps()
        step = (steps[-1] if steps else None) if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        if step not in steps:
            raise FileNotFoundError(f"checkpoint step {step} not in {self.directory} (or incomplete); have {steps}")
        # a target built from the checkpoint's own shapes: without one orbax rebuilds the writer's device mesh,
        # which fails on any other topology
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        saved = self.manager.item_metadata(step).state
        by_path = {} if shardings is None else {
            jax.tree_util.keystr(path): sharding
            for path, sharding in jax.tree_util.tree_leaves_with_path(shardings)}

        def place(path, m):
            in_params = path and getattr(path[0], "key", None) == "params"
            sharding = by_path.get(jax.tree_util.keystr(path[1:]), device) if in_params else device
            return jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding)

        target = jax.tree_util.tree_map_with_path(place, saved)
        raw = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        return raw.state["params"]


def _restore_everywhere(restore, step_dir: str):
    """Run `restore()` (of the step in `step_dir`, under `_quiet_abandoned_reads`, its output held by
    `_held_output`) and agree with every process on the outcome: `(True, value, None)` when it restored everywhere
    (the held output is then printed and logged as it would have been), else `(False, None, reason)` with this
    process's error, or that another process failed (the held output, tracebacks of orbax's abandoned reads among
    it, is dropped: the caller reports the failure in one line). Any failure means: try the next candidate
    (MemoryError still raises)."""
    value, reason = None, "it failed to restore on another process"
    with _held_output() as held:  # MemoryError and other exceptions that propagate release the held output
        try:
            with _quiet_abandoned_reads(step_dir):
                value = restore()
            ok = True
        except MemoryError:
            raise
        except Exception as error:  # noqa: BLE001 - any failure of this candidate means: try the next one
            ok, reason = False, _describe(error)
    if _on_every_process(ok):
        held.release()
        return True, value, None
    return False, None, reason


# the loggers orbax (through absl) and tensorstore's Python side report on
_HELD_LOGGERS = ("absl", "orbax")


class _HeldOutput:
    """What Python code printed to stderr and logged on `_HELD_LOGGERS` while a restore ran."""

    def __init__(self):
        self.stderr = io.StringIO()
        self.records: list[tuple[logging.Logger, logging.LogRecord]] = []

    def release(self) -> None:
        """Print and log what was held, as it would have been (once)."""
        text, records = self.stderr.getvalue(), self.records
        self.stderr, self.records = io.StringIO(), []
        if text:
            sys.stderr.write(text)
        for logger, record in records:
            logger.handle(record)


@contextlib.contextmanager
def _held_output():
    """Hold back stderr and the records of `_HELD_LOGGERS` while the body runs (a restore attempt); the caller
    releases them (`_HeldOutput.release`) or drops them; an exception that leaves the body releases them."""
    held = _HeldOutput()
    filters = []
    for name in _HELD_LOGGERS:
        logger = logging.getLogger(name)

        def hold(record, logger=logger):
            held.records.append((logger, record))
            return False

        logger.addFilter(hold)
        filters.append((logger, hold))
    failed = False
    try:
        with contextlib.redirect_stderr(held.stderr):
            yield held
    except BaseException:
        failed = True
        raise
    finally:
        for logger, hold in filters:
            logger.removeFilter(hold)
        if failed:
            held.release()


@contextlib.contextmanager
def _quiet_abandoned_reads(step_dir: str | None = None):
    """Drop Python's reports of orbax reads abandoned by a failed restore, and nothing else.

    orbax reads a step's arrays as many coroutines; when one read fails (a truncated file), the others are dropped
    and Python reports each one as it is garbage-collected ("Exception ignored in: <coroutine object
    _read_array_index_and_device_put ...>", then "Event loop is closed"): about 2,600 lines for a tiny model, all
    about the failure `restore_latest` already reports once, as a `CheckpointSkipped` warning. While a restore runs
    (and a garbage collection after it), those reports are dropped; any other unraisable exception still reaches
    the hook that was there before.

    Reads still in flight when the attempt fails finish later, on tensorstore's threads, and report then ("Event
    loop is closed" from `call_soon_threadsafe`; "coroutine ... was never awaited" and asyncio's "_GatheringFuture
    exception was never retrieved" at a later collection): after a failed attempt these filters therefore stay for
    the rest of the process (`_keep_dropping_abandoned_reads`), still passing every other report on.
    """
    previous = sys.unraisablehook
    hook = previous if isinstance(previous, _AbandonedReadFilter) else _AbandonedReadFilter(previous)
    sys.unraisablehook = hook
    asyncio_logger = logging.getLogger("asyncio")
    filtering_already = _ABANDONED_GATHER in asyncio_logger.filters
    asyncio_logger.addFilter(_ABANDONED_GATHER)  # a no-op when it is there
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        try:
            gc.collect()
        finally:
            if failed:
                _keep_dropping_abandoned_reads(step_dir)
            else:
                if sys.unraisablehook is hook:
                    sys.unraisablehook = previous
                if not filtering_already:
                    asyncio_logger.removeFilter(_ABANDONED_GATHER)


class _AbandonedReadFilter:
    """An unraisable hook that drops `_abandoned_read` reports and passes every other one to `previous`."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable):
        if not _abandoned_read(unraisable):
            self.previous(unraisable)


class _AbandonedGatherFilter(logging.Filter):
    """Drops asyncio's "... exception was never retrieved" records of futures that failed in orbax's code or whose
    error names a step directory that failed to restore (tensorstore sets its errors on the futures with no Python
    frames): the reads and gathers of a failed restore, collected later."""

    def __init__(self):
        super().__init__()
        self.failed_steps: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if "exception was never retrieved" not in str(record.msg) or not record.exc_info:
            return True
        error = record.exc_info[1]
        while error is not None:
            frames = traceback.extract_tb(error.__traceback__)
            if any(f"{os.sep}orbax{os.sep}" in frame.filename for frame in frames):
                return False
            text = str(error)
            if any(f"{step_dir}{os.sep}" in text for step_dir in self.failed_steps):
                return False
            error = error.__cause__ or error.__context__
        return True


_ABANDONED_GATHER = _AbandonedGatherFilter()

# orbax's read coroutines that a failed restore leaves unawaited (orbax/checkpoint/_src/serialization)
_UNAWAITED_READ = r"coroutine '_read\w*' was never awaited"


def _keep_dropping_abandoned_reads(step_dir: str | None = None) -> None:
    """Drop abandoned-read reports for the rest of the process: the unraisable filter wraps the hook in place (once;
    a hook set later by the user replaces it), asyncio's logger drops never-retrieved futures of orbax's reads and
    of `step_dir` (the step that failed), and a warnings filter drops RuntimeWarnings of orbax read coroutines never
    awaited."""
    if step_dir is not None:
        _ABANDONED_GATHER.failed_steps.add(os.path.normpath(step_dir))
    if not isinstance(sys.unraisablehook, _AbandonedReadFilter):
        sys.unraisablehook = _AbandonedReadFilter(sys.unraisablehook)
    logging.getLogger("asyncio").addFilter(_ABANDONED_GATHER)
    warnings.filterwarnings("ignore", message=_UNAWAITED_READ, category=RuntimeWarning)


def _abandoned_read(unraisable) -> bool:
    """An unraisable exception from an orbax read coroutine, or from its event loop being closed under it."""
    target = unraisable.object
    if inspect.iscoroutine(target) and f"{os.sep}orbax{os.sep}" in target.cr_code.co_filename:
        return True
    error = unraisable.exc_value
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def restore_params_from_copies(copies: Sequence[Checkpointer], step: int, *, shardings=None, what: str):
    """The params of `step` from the first of `copies` (checkpointers of directories that may each hold that step)
    that restores it: a copy without the step is passed over, a copy whose step does not restore (damaged files) is
    skipped with a `CheckpointSkipped` warning naming the directory and the error, as `restore_latest` skips a
    damaged policy step. Never an older step: a reference must be the step asked for. `what` names the step in
    errors (e.g. "TrainConfig.reference_checkpoint = 'runs/a@200'").

    Raises FileNotFoundError when no copy holds the step (listing each copy's steps), `CheckpointRestoreError` when
    every copy that holds it fails (listing each error)."""
    failed: list[tuple[str, str]] = []
    held: list[str] = []
    for copy in copies:
        steps = copy.all_steps()
        if step not in steps:
            held.append(f"{copy.directory}: {steps}")
            continue
        ok, params, reason = _restore_everywhere(lambda: copy.restore_params(step, shardings=shardings),
                                                 os.path.join(copy.directory, str(step)))
        if ok:
            return params
        failed.append((copy.directory, reason))
        _report_skipped(f"{what}: step {step} in {copy.directory} does not restore ({reason}); trying the next copy",
                        os.path.join(copy.directory, str(step)))
    if failed:
        listed = "; ".join(f"{directory}: {reason}" for directory, reason in failed)
        raise CheckpointRestoreError(f"{what}: no copy of step {step} restores ({listed}); copy an intact step back "
                                     "or choose another step")
    raise FileNotFoundError(f"{what}: no complete step {step} in {'; '.join(held) or 'no directory'} (steps held "
                            "listed); choose a step that was saved")


def _describe(error: BaseException) -> str:
    """An exception as one short line: the type and first message line of its root cause (orbax wraps tensorstore's
    informative `ValueError: OUT_OF_RANGE: Error reading "params.embed/0.0" ...` in a generic `Exception`)."""
    seen = [error]
    while (cause := seen[-1].__cause__ or seen[-1].__context__) is not None and cause not in seen:
        seen.append(cause)
    root = seen[-1]
    lines = str(root).strip().splitlines()
    text = lines[0] if lines else ""
    return f"{type(root).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def _on_every_process(ok: bool) -> bool:
    """True when `ok` holds on every process (a collective in a multi-process run)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok, np.int32))))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def export_pretrained(checkpoint_dir: str, out_dir: str, model_config, *, step: int | None = None,
                      dtype=None) -> int:
    """Write the params of a saved step (default: latest) as a Hugging Face directory via `save_pretrained`;
    returns the step exported."""
    checkpointer = Checkpointer(CheckpointConfig(directory=str(checkpoint_dir), async_save=False))
    try:
        step = checkpointer.latest_step() if step is None else step
        params = checkpointer.restore_params(step)
    finally:
        checkpointer.close()
    models.save_pretrained(out_dir, model_config, params, dtype=dtype)
    return int(step)
