"""The run directory's record of a training run: metrics JSONL, TensorBoard events, PNG plots, summary, progress bar.

`RunWriter(run_dir)` owns these files in the run directory:

    metrics.jsonl     one JSON object per logged step: {"step": int, "wall_time": seconds since the run began
                      (continued across resumes), <name>: float, ...}. Non-finite values are never written as bare
                      NaN/Infinity (invalid JSON): they become null and their names are listed under "nonfinite"
                      with the value as text ("nan", "inf", "-inf"); `read_metrics` restores them.
    events.out.tfevents.*   TensorBoard scalars (tensorboardX), one tag per metric name.
    plots/*.png       `write_plots`: reward and held-out accuracy vs step and vs wall time, turns and tool calls per
                      episode, credit statistics, seconds per phase.
    summary.json      `write_summary`: a JSON object the caller fills (final figures, comparison, config names).

Metric names the plots look for (the loop may log more; every name goes to JSONL and TensorBoard):

    reward, eval/accuracy (+ eval/accuracy_se), turns, tool_calls, credit/<stat>, time/<phase>

`PhaseTimer` measures seconds per phase of a step (`with timer.phase("rollout"): ...`), as `time/<phase>` metrics, and
the part of them spent compiling JAX programs, as `compile_seconds`.

Progress bars: the RL bar starts when the loop calls `RunWriter.start_progress()` (just before the first RL step), so
its rate and ETA count RL steps only; stages before it (the warm start) show their own bar (`progress_bar`).

Resuming: `RunWriter(run_dir, resume_step=S)` keeps the lines of steps <= S (those the checkpoint of step S covers),
drops later ones, and continues the wall-time axis from the last kept line.

This module knows file formats and plotting; it knows nothing about models, rollouts or the train step.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PLOTS_DIR = "plots"
PHASES = ("rollout", "scoring", "credit", "update")


def _finite_or_text(value: float) -> tuple[float | None, str | None]:
    if math.isfinite(value):
        return value, None
    return None, "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _scalar(name: str, value: Any) -> float:
    try:
        return float(value)  # numpy / jax 0-d arrays and Python numbers
    except (TypeError, ValueError):
        raise ValueError(f"metric {name!r} must be a scalar number, got {type(value).__name__} {value!r}") from None


def encode_line(step: int, wall_time: float, metrics: Mapping[str, Any]) -> str:
    """One `metrics.jsonl` line (strict JSON: non-finite values become null + a "nonfinite" entry)."""
    record: dict[str, Any] = {"step": int(step), "wall_time": float(wall_time)}
    nonfinite: dict[str, str] = {}
    for name, value in metrics.items():
        if name in ("step", "wall_time", "nonfinite"):
            raise ValueError(f"metric name {name!r} is reserved in metrics.jsonl; rename it")
        number, text = _finite_or_text(_scalar(name, value))
        record[name] = number
        if text is not None:
            nonfinite[name] = text
    if nonfinite:
        record["nonfinite"] = nonfinite
    return json.dumps(record, allow_nan=False)


def read_metrics(path: str | os.PathLike) -> list[dict[str, float]]:
    """The records of a `metrics.jsonl` (a file or a run directory), non-finite values restored as floats."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON line ({error}); the file was cut mid-write?") from None
            for name, text in record.pop("nonfinite", {}).items():
                record[name] = float(text)
            records.append(record)
    return records


# JAX's duration events of one compilation: tracing to a jaxpr, lowering to MLIR, the backend (XLA) compile
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compile_seconds = [0.0]  # process total, kept by the listener below (registered once, on first use)
_compile_listener_lock = threading.Lock()


def compile_seconds() -> float:
    """Seconds this process has spent tracing, lowering and compiling JAX programs since the first call."""
    with _compile_listener_lock:
        if not getattr(compile_seconds, "registered", False):
            import jax.monitoring

            def listen(event: str, duration: float, **_: Any) -> None:
                if event in _COMPILE_EVENTS:
                    _compile_seconds[0] += duration

            jax.monitoring.register_event_duration_secs_listener(listen)
            compile_seconds.registered = True
    return _compile_seconds[0]


class PhaseTimer:
    """Wall seconds per named phase of one step; `with timer.phase("rollout"): ...` adds to that phase.

    `metrics()` returns `{"time/<phase>": seconds, ..., "time/step": total, "compile_seconds": seconds}` and
    `reset()` starts the next step. Phases may repeat within a step (e.g. several update epochs); their times add
    up. `compile_seconds` is the part of the phases' time JAX spent tracing, lowering and compiling programs (a step
    whose batch needs a new length bucket compiles its update and scorer for it), so `time/step - compile_seconds`
    is the step's steady-state time.
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.compile = 0.0
        self._clock = time.perf_counter

    @contextlib.contextmanager
    def phase(self, name: str):
        compiled = compile_seconds()
        start = self._clock()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + self._clock() - start
            self.compile += compile_seconds() - compiled

    def metrics(self, prefix: str = "time/") -> dict[str, float]:
        out = {f"{prefix}{name}": seconds for name, seconds in self.seconds.items()}
        out[f"{prefix}step"] = sum(self.seconds.values())
        out["compile_seconds"] = self.compile
        return out

    def reset(self) -> None:
        self.seconds = {}
        self.compile = 0.0


class RunWriter:
    """Writes `metrics.jsonl`, TensorBoard events, plots and the summary of one run (see the module docstring).

    Args:
      run_dir: the run directory (created if missing).
      total_steps: for the progress bar (None: no total).
      resume_step: keep the existing lines of steps <= this, drop the rest, continue the wall-time axis; None
        starts a fresh `metrics.jsonl` (an existing one is replaced).
      tensorboard: write TensorBoard event files.
      progress: show a tqdm progress bar of the RL steps (step, reward, accuracy, seconds per step), from
        `start_progress()` on (or from the first RL step logged, if the caller never calls it).
      write_files: False keeps the history in memory and writes nothing (no files, events, plots, summary or
        bar): the writer of a multi-process run's non-primary processes, so only process 0 writes the run's record.
    """

    def __init__(self, run_dir: str | os.PathLike, *, total_steps: int | None = None, resume_step: int | None = None,
                 tensorboard: bool = True, progress: bool = True, write_files: bool = True):
        self.run_dir = Path(run_dir)
        self.write_files = write_files
        self.metrics_path = self.run_dir / METRICS_FILE
        self.history: list[dict[str, float]] = []
        if resume_step is not None and self.metrics_path.exists():
            self.history = [r for r in read_metrics(self.metrics_path) if r["step"] <= resume_step]
        self._time_offset = self.history[-1]["wall_time"] if self.history else 0.0
        self._start = time.perf_counter()
        self._last_step_time: float | None = None
        self._latest: dict[str, float] = {}
        self._tb = None
        self._bar = None
        self._progress_ended = False
        self._total_steps = total_steps
        self._progress = progress and write_files
        if not write_files:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, "w", encoding="utf-8") as handle:  # rewrite: drops steps past the checkpoint
            for record in self.history:
                handle.write(encode_line(record["step"], record["wall_time"],
                                         {k: v for k, v in record.items() if k not in ("step", "wall_time")}) + "\n")
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=str(self.run_dir), flush_secs=10)

    def start_progress(self) -> None:
        """Show the RL progress bar from now on (its clock, rate and ETA start here); no-op without `progress` or
        when already shown."""
        if self._progress and self._bar is None:
            self._bar = progress_bar(self._total_steps, "train",
                                     initial=int(self.history[-1]["step"]) if self.history else 0)
            self._last_step_time = time.perf_counter()

    def end_progress(self) -> None:
        """Close the RL progress bar for good, so that what the run prints after its last step (the end-of-run
        evaluation, the summary) starts on a line of its own; later `log` calls do not reopen it."""
        self._progress_ended = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    @property
    def wall_time(self) -> float:
        """Seconds since the run began, continued across resumes."""
        return self._time_offset + time.perf_counter() - self._start

    def continue_wall_time(self, seconds: float) -> None:
        """Count `seconds` of earlier attempts into `wall_time` from now on: a run resumed from a checkpoint that
        holds no metrics history of its own (the warm start's) continues its clock from there."""
        if seconds < 0:
            raise ValueError(f"continue_wall_time needs seconds >= 0, got {seconds}")
        self._time_offset += seconds

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Append one step's metrics (scalars) to JSONL and TensorBoard, and advance the progress bar.

        Returns the record written (with `step` and `wall_time`). Logging the same step twice writes two lines
        (an evaluation after the step's update, say); `read_metrics` readers merge them by step if they wish.
        """
        wall = self.wall_time
        line = encode_line(step, wall, metrics)
        if self.write_files:
            with open(self.metrics_path, "a", encoding="utf-8") as handle:
                handle.write(line + "\n")
        record = {"step": int(step), "wall_time": wall, **{k: _scalar(k, v) for k, v in metrics.items()}}
        self.history.append(record)
        if self._tb is not None:
            for name, value in record.items():
                if name != "step":
                    self._tb.add_scalar(name, value, global_step=int(step), walltime=None)
        self._latest.update({k: v for k, v in record.items() if k != "step"})
        # start_progress() was not called (and end_progress() not yet): open the bar here
        if self._bar is None and self._progress and step > 0 and not self._progress_ended:
            earlier = [r["step"] for r in self.history[:-1]]
            self._bar = progress_bar(self._total_steps, "train", initial=int(max(earlier, default=0)))
        if self._bar is not None:
            self._update_bar(int(step))
        return record

    def _update_bar(self, step: int) -> None:
        now = time.perf_counter()
        advance = step - self._bar.n
        if advance > 0:
            seconds = None if self._last_step_time is None else (now - self._last_step_time) / advance
            self._last_step_time = now
            self._bar.update(advance)
            if seconds is not None:
                self._latest["s/step"] = seconds
        shown = {}
        for key, label in (("reward", "reward"), ("eval/accuracy", "acc"), ("s/step", "s/step")):
            if key in self._latest and math.isfinite(self._latest[key]):
                shown[label] = f"{self._latest[key]:.3g}"
        self._bar.set_postfix(shown, refresh=True)

    def write_summary(self, summary: Mapping[str, Any]) -> Path | None:
        """Write `summary.json` (strict JSON; non-finite numbers become null); None when not writing files."""
        if not self.write_files:
            return None
        path = self.run_dir / SUMMARY_FILE

        def clean(value):
            if isinstance(value, Mapping):
                return {str(k): clean(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [clean(v) for v in value]
            if isinstance(value, float) and not math.isfinite(value):
                return None
            if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # numpy / jax scalars
                return clean(value.item())
            return value

        path.write_text(json.dumps(clean(summary), indent=2, allow_nan=False) + "\n", encoding="utf-8")
        return path

    def write_plots(self) -> list[Path]:
        """PNG plots of the history so far (see `write_plots`); none when not writing files."""
        if not self.write_files:
            return []
        return write_plots(self.history, self.run_dir / PLOTS_DIR)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self.end_progress()

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _NoBar:
    """What `progress_bar` returns when disabled: the bar's methods, doing nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int | None, desc: str, *, unit: str = "step", initial: int = 0, enabled: bool = True):
    """A tqdm bar for one stage of a run (`update`, `set_postfix`, `close`), or a silent stand-in when disabled."""
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True)


def _series(history: Iterable[Mapping[str, float]], name: str, axis: str = "step") -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for record in history:
        value = record.get(name)
        if value is not None and math.isfinite(value):
            xs.append(record[axis])
            ys.append(value)
    return xs, ys


def write_plots(history: list[Mapping[str, float]], out_dir: str | os.PathLike) -> list[Path]:
    """Write the run's PNG plots into `out_dir`; a plot whose metrics were never logged is skipped.

      reward_accuracy.png  reward and held-out accuracy (with +- SE band) vs step and vs wall time (2 x 2)
      episodes.png         generated turns and tool calls per episode vs step
      credit.png           every `credit/<stat>` metric vs step
      phase_times.png      seconds per phase (`time/<phase>`) per step, stacked
      eval_sets.png        accuracy (+- SE band) of each evaluation set (`eval/<set>/accuracy`) and their average
                           (`eval/average/accuracy`) vs step, when a run evaluates several sets

    Returns the paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = {name for record in history for name in record}
    written: list[Path] = []

    def save(fig, filename):
        fig.tight_layout()
        path = out / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if {"reward", "eval/accuracy"} & names:
        fig, axes = plt.subplots(2, 2, figsize=(10, 7))
        for column, (axis, label) in enumerate((("step", "step"), ("wall_time", "wall time (s)"))):
            ax = axes[0, column]
            xs, ys = _series(history, "reward", axis)
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, color="tab:blue")
            ax.set(xlabel=label, ylabel="mean reward (training rollouts)", title=f"reward vs {label}")
            ax = axes[1, column]
            xs, ys = _series(history, "eval/accuracy", axis)
            _, se = _series([r for r in history if r.get("eval/accuracy") is not None], "eval/accuracy_se", axis)
            ax.plot(xs, ys, marker="o", color="tab:green")
            if len(se) == len(ys) and ys:
                ax.fill_between(xs, [y - s for y, s in zip(ys, se)], [y + s for y, s in zip(ys, se)],
                                color="tab:green", alpha=0.2, label="+- 1 SE")
                ax.legend(loc="lower right")
            ax.set(xlabel=label, ylabel="held-out greedy accuracy", title=f"held-out accuracy vs {label}")
            for a in axes[:, column]:
                a.grid(alpha=0.3)
        save(fig, "reward_accuracy.png")

    if {"turns", "tool_calls"} & names:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, label in (("turns", "generated turns"), ("tool_calls", "tool calls")):
            xs, ys = _series(history, name)
            if xs:
                ax.plot(xs, ys, label=label)
        ax.set(xlabel="step", ylabel="per episode", title="episode length (training rollouts)")
        ax.legend()
        ax.grid(alpha=0.3)
        save(fig, "episodes.png")

    set_names = sorted(n.split("/")[1] for n in names
                       if n.startswith("eval/") and n.endswith("/accuracy") and n.count("/") == 2)
    if set_names:
        set_names = [n for n in set_names if n != "average"] + (["average"] if "average" in set_names else [])
        fig, ax = plt.subplots(figsize=(7, 4))
        for name in set_names:
            key = f"eval/{name}/accuracy"
            rows = [r for r in history if r.get(key) is not None]
            xs, ys = _series(rows, key)
            _, se = _series(rows, f"eval/{name}/accuracy_se")
            line, = ax.plot(xs, ys, marker="o", label=name, linestyle="--" if name == "average" else "-")
            if len(se) == len(ys) and ys:
                ax.fill_between(xs, [y - e for y, e in zip(ys, se)], [y + e for y, e in zip(ys, se)],
                                color=line.get_color(), alpha=0.15)
        ax.set(xlabel="step", ylabel="greedy accuracy", title="accuracy per evaluation set (+- 1 SE)")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        save(fig, "eval_sets.png")

    credit_names = sorted(n for n in names if n.startswith("credit/"))
    if credit_names:
        columns = min(3, len(credit_names))
        rows = -(-len(credit_names) // columns)
        fig, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3 * rows), squeeze=False)
        for ax, name in zip(axes.flat, credit_names):
            xs, ys = _series(history, name)
            ax.plot(xs, ys, color="tab:purple")
            ax.set(xlabel="step", title=name)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(credit_names):]:
            ax.axis("off")
        save(fig, "credit.png")

    phase_names = [n for n in sorted(names) if n.startswith("time/") and n != "time/step"]
    if phase_names:
        ordered = [f"time/{p}" for p in PHASES if f"time/{p}" in phase_names]
        ordered += [n for n in phase_names if n not in ordered]
        steps = [r["step"] for r in history if any(r.get(n) is not None for n in ordered)]
        fig, ax = plt.subplots(figsize=(7, 4))
        bottom = [0.0] * len(steps)
        for name in ordered:
            values = []
            for record in history:
                if any(record.get(n) is not None for n in ordered):
                    value = record.get(name)
                    values.append(value if value is not None and math.isfinite(value) else 0.0)
            ax.bar(steps, values, bottom=bottom, label=name[len("time/"):], width=0.8)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set(xlabel="step", ylabel="seconds", title="seconds per phase")
        ax.legend(fontsize="small")
        save(fig, "phase_times.png")
    return written
