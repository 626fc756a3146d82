"""Sweeps: a gin file naming base configs and axes of bindings, expanded into runs (the cartesian product).

Format (a sweep file is itself gin, parsed on its own, apart from any run's config)::

    # configs/sweeps/horizon_alpha.gin
    sweep.name = 'horizon_alpha'                       # runs go to <runs_root>/<name>/<run name>
    sweep.base = ['configs/tiny.gin']                  # gin files every run starts from, in order
    sweep.params = ["TrainConfig.steps = 30"]          # optional bindings every run adds
    sweep.axes = {                                     # binding -> values; one run per combination
        'CreditConfig.horizon': [1, 3, 5],
        'CreditConfig.alpha_turn': [0.1, 0.2],
    }

expands into 3 x 2 = 6 runs in axis order (the last axis varies fastest), each with the base files, the shared
params and one binding per axis, named from the axes' short names and values (`horizon=1,alpha_turn=0.1`).
`Run.command()` is the launch command (`python -m trace_jax.cli train --gin-file ... --gin-param ... --run-dir ...`)
for a scheduler or a TPU VM; `trace-jax sweep` runs them in sequence or prints the commands.

This module knows gin and the CLI's flags; it knows nothing about training itself.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import shlex
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import gin

from trace_jax.rl import gin_setup


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a sweep: its name, gin files, bindings and run directory."""

    name: str
    gin_files: tuple[str, ...]
    gin_params: tuple[str, ...]
    run_dir: str

    def argv(self, python: str = "python") -> list[str]:
        """The arguments that launch this run (`trace-jax train` as a module of `python`)."""
        parts = [python, "-m", "trace_jax.cli", "train"]
        for path in self.gin_files:
            parts += ["--gin-file", path]
        for binding in self.gin_params:
            parts += ["--gin-param", binding]
        return parts + ["--run-dir", self.run_dir]

    def command(self, python: str = "python") -> str:
        """The shell command that launches this run."""
        return " ".join(shlex.quote(p) for p in self.argv(python))


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A parsed sweep file (see the module docstring)."""

    name: str
    base: tuple[str, ...]
    axes: tuple[tuple[str, tuple[Any, ...]], ...]
    params: tuple[str, ...] = ()

    def __post_init__(self):
        if not re.fullmatch(r"[\w.-]+", self.name or ""):
            raise ValueError(f"sweep.name must be a non-empty directory-safe name (letters, digits, _ . -), got "
                             f"{self.name!r}")
        if not self.axes:
            raise ValueError("sweep.axes is empty; give at least one binding with a list of values, e.g. "
                             "sweep.axes = {'CreditConfig.alpha_turn': [0.1, 0.2]}")
        for binding, values in self.axes:
            if not re.fullmatch(r"(?:[\w.]+/)?\w+\.\w+", binding):
                raise ValueError(f"sweep.axes key {binding!r} is not a binding name like 'LossConfig.eps_high'")
            if not values:
                raise ValueError(f"sweep.axes[{binding!r}] has no values; give a non-empty list")

    @property
    def num_runs(self) -> int:
        total = 1
        for _, values in self.axes:
            total *= len(values)
        return total


def _sweep(name: str, base: Sequence[str], axes: Mapping[str, Sequence[Any]], params: Sequence[str] = ()) -> Sweep:
    if isinstance(base, str):
        base = [base]
    if not isinstance(axes, Mapping):
        raise ValueError(f"sweep.axes must be a dict binding -> list of values, got {type(axes).__name__}")
    for binding, values in axes.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise ValueError(f"sweep.axes[{binding!r}] must be a list of values, got {values!r}")
    return Sweep(name=name, base=tuple(base), axes=tuple((k, tuple(v)) for k, v in axes.items()),
                 params=tuple(params))


_SPEC_SCOPE = "trace_jax.sweep"


def parse_spec_file(path: str, name: str, build: Callable[..., Any], expected: str) -> Any:
    """Parse a gin file that configures one function, `name`, on its own (apart from any run's config), and call it.

    The file's bindings are `<name>.<argument> = ...`; `build` receives them and returns the parsed object. Raises
    `gin_setup.ConfigError` naming the file, the problem and `expected` (what the file should hold). Shared by sweep
    and study files.
    """
    try:
        configurable = gin.get_configurable(f"{_SPEC_SCOPE}.{name}")
    except ValueError:
        configurable = gin.external_configurable(build, name=name, module=_SPEC_SCOPE)
    resolved = gin_setup._resolve(path)
    gin_setup._set_include_paths()
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings([resolved], [], finalize_config=False)
        return configurable()
    except (ValueError, SyntaxError, TypeError) as error:
        raise gin_setup.ConfigError(f"{name} file {resolved}: {str(error).splitlines()[0]} ({expected})") from None
    finally:
        gin.clear_config()


def load_sweep(path: str) -> Sweep:
    """Parse a sweep file. Raises `gin_setup.ConfigError` naming the file and the problem."""
    return parse_spec_file(path, "sweep", _sweep, "expected sweep.name, sweep.base, sweep.axes and optionally "
                           "sweep.params; see trace_jax/rl/sweep.py")


def value_text(value: Any) -> str:
    """A value as a directory-safe piece of a run name (`0.2`, `trace_raw_delta`, `configs_credit_grpo.gin`)."""
    text = value if isinstance(value, str) else repr(value)
    return re.sub(r"[^\w.+-]+", "_", text).strip("_") or "empty"


def expand(sweep: Sweep, runs_root: str = "runs/sweeps") -> list[Run]:
    """The runs of a sweep: the cartesian product of its axes, last axis fastest."""
    keys = [binding for binding, _ in sweep.axes]
    shorts = [binding.split(".")[-1] for binding in keys]
    if len(set(shorts)) < len(shorts):  # two configs share a field name: keep the config in the run name
        shorts = [binding.split("/")[-1] for binding in keys]
    runs = []
    for values in itertools.product(*(values for _, values in sweep.axes)):
        name = ",".join(f"{short}={value_text(v)}" for short, v in zip(shorts, values))
        params = sweep.params + tuple(f"{key} = {value!r}" for key, value in zip(keys, values))
        runs.append(Run(name=name, gin_files=sweep.base, gin_params=params,
                        run_dir=str(Path(runs_root) / sweep.name / name)))
    return runs


def validate_runs(runs: Sequence[Run], what: str = "sweep") -> list[gin_setup.RunConfig]:
    """Parse every run's config (no compute) so a bad axis fails before the first run starts; returns them."""
    configs = []
    for run in runs:
        try:
            configs.append(gin_setup.parse(run.gin_files, run.gin_params))
        except gin_setup.ConfigError as error:
            raise gin_setup.ConfigError(f"{what} run {run.name!r}: {error}") from None
    return configs
