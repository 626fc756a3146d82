"""`trace-jax study FILE`: methods x seeds (plus one-at-a-time ablations) as resumable runs, then results and plots.

A study file is gin, parsed on its own like a sweep file (`sweep.parse_spec_file`)::

    # a study file (configs/studies/main.gin is one)
    study.name = 'main'                                   # default directory: runs/studies/main
    study.base = ['configs/study.gin']                    # gin files of every arm, in order
    study.params = ['TrainConfig.steps = 20']             # optional bindings every arm adds (the command's
                                                          #   --gin-param adds more after these)
    study.methods = {                                     # method -> its gin files (after the base)
        'grpo': ['configs/credit/grpo.gin'],
        'trace': ['configs/credit/trace.gin'],
    }
    study.seeds = [0, 1, 2]
    study.ablation_method = 'trace'                       # optional: one-at-a-time ablations of this method
    study.ablation_seeds = [0]
    study.ablations = {'CreditConfig.horizon': [0, 1, 3, 5]}
    study.share_warm_start = False                        # True: arms after a seed's first pass
                                                          #   TrainConfig.init_from = <that arm's run directory>
    study.own_warm_start = []                             # optional: methods that warm-start themselves anyway
    study.gate_method = ''                                # optional: a method that must beat GRPO first ...
    study.gated_methods = []                              # ... or these methods' arms are skipped (below)
    study.sensitivity = {}                                # optional: label -> seeds the differences are also
                                                          #   given without (e.g. {'new warm starts': [3, 4]})

expands into one arm per (seed, method), seed-major (every method of seed 0 first, so a study stopped early has
comparable arms), then one arm per (ablation seed, binding, value). An arm is a `sweep.Run` named
`<method>/seed<S>` or `ablation/<field>=<value>/seed<S>`, with run directory `<study dir>/<name>`. The seed binds
every field a seed must change (`SEED_FIELDS`: the policy's init, the warm start's order and its demonstrations'
detours, the rollout keys, the RL task order); the task splits and the world stay fixed, so every arm is evaluated
on the same held-out tasks.

Arms run in sequence, each as its own `trace-jax train` process (`run_arm_process`, the command `--print` shows).
Resume: an arm whose run directory holds `summary.json` is finished and skipped; an unfinished one is rerun in its
directory, where `train` resumes from its checkpoint. An arm whose parsed config equals an earlier arm's
(`mark_repeats`) shares that arm's run instead of repeating it. Each arm's directory records its bindings
(`study_arm.json`); a rerun whose arm has other bindings stops with an error instead of mixing configs. After
every arm, `results.json` and the plots are rewritten from the finished arms (`aggregate`; `results.md` holds
`results_table`, `endpoint_table`, `sensitivity_table`, `credit_table`, `ablation_table` and `seed_table`), so a
partial study has partial results.

The analysis issue 47's protocol fixes in advance: an arm's endpoint is the mean held-out accuracy of its last
`ENDPOINT_EVALUATIONS` evaluations; each method's paired difference from GRPO over seeds (endpoint, area under the
accuracy curve, accuracy after the warm start) has a 95% CI by paired t and by a seeded bootstrap over seeds; the
steps to reach GRPO's endpoint are counted per seed. `power_report` gives the seeds a paired t needs for an effect
at 80% power from a record's spread (`trace-jax study FILE --power POINTS`).

A gate (`study.gate_method`, `study.gated_methods`) makes a study two-phased: the arms of GRPO and the gate method
run first, over every seed; then, unless the gate method's endpoint beats GRPO's by its paired-t CI (lower end > 0),
the gated methods' arms are skipped (results.json's `gate` says which and why), and the other arms run.

A sensitivity analysis (`study.sensitivity`) repeats the paired differences from GRPO (endpoint and AUC, with their
CIs) without the seeds it names, for seeds a protocol decided in advance to report both ways (issue 47's phase 2 on
seeds whose warm starts were regenerated); results.json's `sensitivity` and results.md's sensitivity table hold them.
Runs are unaffected.

This module knows study files, run directories and the metrics files; training is the arm's `trace-jax train` process's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from trace_jax.rl.gin_setup import ConfigError
from trace_jax.rl.metrics import SUMMARY_FILE, read_metrics
from trace_jax.rl.sweep import Run, parse_spec_file, validate_runs, value_text

# Every config field a study's seed sets: TrainConfig.seed seeds the fresh policy's init, the warm start's batch
# order and the rollout keys (loop.py); DataConfig.shuffle_seed the order in which RL draws training tasks;
# WarmStartConfig.oracle_seed the oracle's detour draws in the warm start's demonstrations.
# Not seeded: DataConfig.seed and WorldConfig.seed (the tasks and held-out split, kept equal across arms).
SEED_FIELDS = ("TrainConfig.seed", "DataConfig.shuffle_seed", "WarmStartConfig.oracle_seed")
# The per-step credit diagnostics (trace_jax/rl/credit_diagnostics.py) results.json averages per method.
DIAGNOSTICS = ("credit/detour_turn_credit", "credit/on_path_turn_credit", "credit/detour_turn_share",
               "credit/progress_spearman", "zero_signal_groups", "zero_signal_groups_with_turn_credit",
               "credit/terminal_fill_share", "credit/mean_abs_token_advantage")
RESULTS_FILE = "results.json"
TABLE_FILE = "results.md"  # the *_table() functions' tables, which docs/results.md quotes
ARM_FILE = "study_arm.json"
PLOTS_DIR = "plots"
EXPECTED = ("expected study.name, study.base, study.methods, study.seeds and optionally study.params, "
            "study.ablation_method, study.ablation_seeds, study.ablations, study.share_warm_start, "
            "study.own_warm_start, study.gate_method, study.gated_methods; see trace_jax/rl/study.py")
BASE_METHOD = "grpo"  # every comparison is a paired difference from this method on the same seed
# The endpoint issue 47's protocol fixes in advance: the mean held-out accuracy of an arm's last two evaluations
# (one evaluation's near-tied greedy choices flip; two halve their weight), and 95% CIs of each method's paired
# difference from GRPO over seeds, by paired t and by a percentile bootstrap over seeds with a fixed seed.
ENDPOINT_EVALUATIONS = 2
CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
POWER = 0.8  # the power `power_report` sizes a study for


@dataclasses.dataclass(frozen=True)
class Study:
    """A parsed study file (see the module docstring)."""

    name: str
    base: tuple[str, ...]
    methods: tuple[tuple[str, tuple[str, ...]], ...]
    seeds: tuple[int, ...]
    params: tuple[str, ...] = ()
    ablation_method: str = ""
    ablation_seeds: tuple[int, ...] = ()
    ablations: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    share_warm_start: bool = False
    own_warm_start: tuple[str, ...] = ()
    gate_method: str = ""
    gated_methods: tuple[str, ...] = ()
    sensitivity: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __post_init__(self):
        if not re.fullmatch(r"[\w.-]+", self.name or ""):
            raise ValueError(f"study.name must be a non-empty directory-safe name (letters, digits, _ . -), got "
                             f"{self.name!r}")
        if not self.methods:
            raise ValueError("study.methods is empty; give method -> gin files, e.g. "
                             "{'grpo': ['configs/credit/grpo.gin']}")
        for method, _ in self.methods:
            if not re.fullmatch(r"[\w.-]+", method) or method == "ablation":
                raise ValueError(f"study.methods key {method!r} must be a directory-safe name other than "
                                 "'ablation'")
        if (not self.seeds and not self.ablations) or len(set(self.seeds)) < len(self.seeds) or any(
                not isinstance(s, int) or s < 0 for s in self.seeds):
            raise ValueError(f"study.seeds must be a list of distinct non-negative ints (empty only when "
                             f"study.ablations gives the arms), got {list(self.seeds)!r}")
        if self.ablations:
            names = [m for m, _ in self.methods]
            if self.ablation_method not in names:
                raise ValueError(f"study.ablation_method = {self.ablation_method!r} is not one of study.methods "
                                 f"{names}")
            if not self.ablation_seeds or any(not isinstance(s, int) or s < 0 for s in self.ablation_seeds):
                raise ValueError(f"study.ablation_seeds must be a non-empty list of non-negative ints, got "
                                 f"{list(self.ablation_seeds)!r}")
            for binding, values in self.ablations:
                if not re.fullmatch(r"(?:[\w.]+/)?\w+\.\w+", binding):
                    raise ValueError(f"study.ablations key {binding!r} is not a binding name like "
                                     "'CreditConfig.horizon'")
                if not values:
                    raise ValueError(f"study.ablations[{binding!r}] has no values; give a non-empty list")
        names = [m for m, _ in self.methods]
        unknown = sorted(set(self.own_warm_start) - set(names))
        if unknown:
            raise ValueError(f"study.own_warm_start names {unknown}, not methods of study.methods {names}")
        if self.own_warm_start and not self.share_warm_start:
            raise ValueError("study.own_warm_start only means something with study.share_warm_start = True")
        if self.own_warm_start and names[0] in self.own_warm_start:
            raise ValueError(f"study.own_warm_start: the first method ({names[0]!r}) is the one whose warm start the "
                             "others share; list another first")
        if self.gate_method or self.gated_methods:
            self._check_gate(names)
        for label, left_out in self.sensitivity:
            if not label.strip() or not left_out or not set(left_out) <= set(self.seeds) or (
                    len(set(self.seeds) - set(left_out)) < 2):
                raise ValueError(f"study.sensitivity[{label!r}] = {list(left_out)!r} must be a non-empty label "
                                 f"naming a non-empty list of seeds of study.seeds {list(self.seeds)} that leaves at "
                                 "least 2 of them (a paired interval)")

    def _check_gate(self, names: list[str]) -> None:
        if BASE_METHOD not in names or self.gate_method not in names or self.gate_method == BASE_METHOD:
            raise ValueError(f"study.gate_method = {self.gate_method!r} must name a method of study.methods other "
                             f"than {BASE_METHOD!r}, and {BASE_METHOD!r} must be one ({names})")
        gated = set(self.gated_methods)
        if not gated or not gated <= set(names) or gated & {BASE_METHOD, self.gate_method}:
            raise ValueError(f"study.gated_methods = {list(self.gated_methods)!r} must be a non-empty list of "
                             f"methods of study.methods {names}, without {BASE_METHOD!r} and the gate method")
        if len(self.seeds) < 2:
            raise ValueError("a gate compares paired differences over seeds (a t interval): give study.seeds at "
                             "least 2 seeds")
        if self.share_warm_start and names[0] not in (BASE_METHOD, self.gate_method):
            raise ValueError(f"with a gate and study.share_warm_start, the first method (whose warm start the "
                             f"others share) must be {BASE_METHOD!r} or the gate method, which run first; it is "
                             f"{names[0]!r}")

    def method_files(self, method: str) -> tuple[str, ...]:
        return dict(self.methods)[method]


def _study(name: str, base: Sequence[str], methods: Mapping[str, Sequence[str]], seeds: Sequence[int],
           params: Sequence[str] = (), ablation_method: str = "", ablation_seeds: Sequence[int] = (),
           ablations: Mapping[str, Sequence[Any]] | None = None, share_warm_start: bool = False,
           own_warm_start: Sequence[str] = (), gate_method: str = "", gated_methods: Sequence[str] = (),
           sensitivity: Mapping[str, Sequence[int]] | None = None) -> Study:
    if isinstance(base, str):
        base = [base]
    if not isinstance(methods, Mapping):
        raise ValueError(f"study.methods must be a dict method -> list of gin files, got {type(methods).__name__}")
    files = {}
    for method, value in methods.items():
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, Sequence) or not all(isinstance(f, str) for f in value):
            raise ValueError(f"study.methods[{method!r}] must be a list of gin file paths, got {value!r}")
        files[method] = tuple(value)
    ablations = ablations or {}
    if not isinstance(ablations, Mapping):
        raise ValueError(f"study.ablations must be a dict binding -> list of values, got {type(ablations).__name__}")
    for binding, values in ablations.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise ValueError(f"study.ablations[{binding!r}] must be a list of values, got {values!r}")
    sensitivity = sensitivity or {}
    if not isinstance(sensitivity, Mapping) or not all(
            isinstance(label, str) and isinstance(seeds, Sequence) and not isinstance(seeds, str)
            and all(isinstance(seed, int) for seed in seeds) for label, seeds in sensitivity.items()):
        raise ValueError(f"study.sensitivity must be a dict label -> list of seeds to leave out, got {sensitivity!r}")
    return Study(name=name, base=tuple(base), methods=tuple(files.items()), seeds=tuple(seeds), params=tuple(params),
                 ablation_method=ablation_method, ablation_seeds=tuple(ablation_seeds),
                 ablations=tuple((k, tuple(v)) for k, v in ablations.items()), share_warm_start=bool(share_warm_start),
                 own_warm_start=_names(own_warm_start, "study.own_warm_start"), gate_method=gate_method,
                 gated_methods=_names(gated_methods, "study.gated_methods"),
                 sensitivity=tuple((label, tuple(seeds)) for label, seeds in sensitivity.items()))


def _names(value: Any, field: str) -> tuple[str, ...]:
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{field} must be a list of method names, got {value!r}")
    return tuple(value)


def load_study(path: str) -> Study:
    """Parse a study file. Raises `gin_setup.ConfigError` naming the file and the problem."""
    return parse_spec_file(path, "study", _study, EXPECTED)


@dataclasses.dataclass(frozen=True)
class Arm:
    """One run of a study: the method (or `ablation`), its seed, the ablated binding and value, and the run."""

    method: str
    seed: int
    run: Run
    ablation: tuple[str, Any] | None = None
    repeat_of: str = ""  # an earlier arm with an equal config: this one shares its run directory, not run again

    @property
    def name(self) -> str:
        return self.run.name


def seed_bindings(seed: int) -> tuple[str, ...]:
    return tuple(f"{field} = {seed!r}" for field in SEED_FIELDS)


def _short_names(bindings: Sequence[str]) -> list[str]:
    """Field names (`horizon`), or `Config.field` where two configs share a field name (as `sweep.expand` does)."""
    shorts = [binding.split(".")[-1] for binding in bindings]
    if len(set(shorts)) < len(shorts):
        shorts = [binding.split("/")[-1] for binding in bindings]
    return shorts


def expand(study: Study, directory: str | Path) -> list[Arm]:
    """The arms of a study (see the module docstring for order, names and bindings)."""
    directory = Path(directory)
    arms: list[Arm] = []
    first_of_seed: dict[int, str] = {}

    def add(method: str, seed: int, name: str, files: tuple[str, ...], extra: tuple[str, ...],
            ablation: tuple[str, Any] | None = None) -> None:
        params = study.params + seed_bindings(seed) + extra
        run_dir = str(directory / name)
        own = method in study.own_warm_start  # e.g. another warm start compared with the shared one
        if study.share_warm_start and seed in first_of_seed and not own:
            params += (f"TrainConfig.init_from = {first_of_seed[seed]!r}",)
        if not own:
            first_of_seed.setdefault(seed, run_dir)
        arms.append(Arm(method=method, seed=seed, ablation=ablation,
                        run=Run(name=name, gin_files=study.base + files, gin_params=params, run_dir=run_dir)))

    for seed in study.seeds:
        for method, files in study.methods:
            add(method, seed, f"{method}/seed{seed}", files, ())
    if study.ablations:
        files = study.method_files(study.ablation_method)
        shorts = _short_names([binding for binding, _ in study.ablations])
        for seed in study.ablation_seeds:
            for (binding, values), short in zip(study.ablations, shorts):
                for value in values:
                    add("ablation", seed, f"ablation/{short}={value_text(value)}/seed{seed}", files,
                        (f"{binding} = {value!r}",), ablation=(binding, value))
    return arms


def mark_repeats(arms: Sequence[Arm], configs: Sequence[Any]) -> list[Arm]:
    """Arms whose parsed config (`gin_setup.parse`) equals an earlier arm's share that arm's run: `repeat_of` names
    it and the run directory is its (e.g. the K = 3 and alpha_turn = 0.2 ablations of a method whose defaults they
    are). `configs[i]` is arm i's config."""
    if len(configs) != len(arms):
        raise ValueError(f"mark_repeats: {len(arms)} arms but {len(configs)} configs")
    out: list[Arm] = []
    for index, (arm, config) in enumerate(zip(arms, configs)):
        first = next((out[j] for j in range(index) if configs[j] == config and not out[j].repeat_of), None)
        if first is not None:
            arm = dataclasses.replace(arm, repeat_of=first.name,
                                      run=dataclasses.replace(arm.run, run_dir=first.run.run_dir))
        out.append(arm)
    return out


# ------------------------------------------------------------------------------------------------ running
def arm_finished(arm: Arm) -> bool:
    return (Path(arm.run.run_dir) / SUMMARY_FILE).exists()


def _arm_record(arm: Arm) -> dict:
    return {"name": arm.name, "method": arm.method, "seed": arm.seed, "gin_files": list(arm.run.gin_files),
            "gin_params": list(arm.run.gin_params)}


def _claim_directory(arm: Arm) -> None:
    """Record the arm's bindings in its run directory; a directory holding another arm's record is an error."""
    run_dir = Path(arm.run.run_dir)
    path = run_dir / ARM_FILE
    record = _arm_record(arm)
    if path.exists():
        previous = json.loads(path.read_text(encoding="utf-8"))
        if previous != record:
            raise ConfigError(f"{path} records another config for arm {arm.name!r} than the study file gives now "
                              f"(was {previous['gin_files']} + {previous['gin_params']}); the study file changed "
                              "since this directory was started: use a new --dir, or delete that arm's directory "
                              "to rerun it")
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


RunArm = Callable[[Arm], int]


def run_study(study: Study, directory: str | Path, run_arm: RunArm, arms: Sequence[Arm] | None = None, *,
              log: Callable[[str], None] = print, plots: bool = True) -> int:
    """Run a study's unfinished arms (default `expand(study, directory)`) in sequence with `run_arm` (returns an
    exit status), writing `results.json` (and plots) after each. Returns 0 when every arm finished (or was skipped
    by the study's gate, see the module docstring), else the first failing status (an arm that returns 0 without
    a `summary.json`, i.e. stopped by a signal, gives 3)."""
    directory = Path(directory)
    arms = expand(study, directory) if arms is None else list(arms)
    directory.mkdir(parents=True, exist_ok=True)
    if study.gate_method:  # the gate's arms first (seed-major), then the gate decides which of the others run
        first = gate_arms(study, arms)
        status = _run_arms(study, directory, arms, first, run_arm, log, plots)
        if status:
            return status
        gate = write_results(study, directory, arms, plots=plots)["gate"]
        if gate["passed"] is None:  # every gate arm finished, yet a seed has no endpoint (a run without evaluations)
            log(f"study gate {gate['reason']}; the gated arms wait (rerun once the gate arms have evaluations)")
            return 3
        if not gate["passed"]:
            log(f"study gate: {gate['reason']}; skipping the arms of {', '.join(study.gated_methods)}")
        rest = [arm for arm in arms if arm not in first and (gate["passed"] or arm.method not in study.gated_methods)]
        status = _run_arms(study, directory, arms, rest, run_arm, log, plots)
    else:
        status = _run_arms(study, directory, arms, arms, run_arm, log, plots)
    if status:
        return status
    write_results(study, directory, arms, plots=plots)
    return 0


def gate_arms(study: Study, arms: Sequence[Arm]) -> list[Arm]:
    """The arms a study's gate decides from (GRPO's and the gate method's, seed-major), which run before the others;
    none without a gate."""
    if not study.gate_method:
        return []
    return [arm for arm in arms if arm.ablation is None and arm.method in (BASE_METHOD, study.gate_method)]


def run_order(study: Study, arms: Sequence[Arm]) -> list[Arm]:
    """The order `run_study` runs `arms` in: the gate's arms first, if the study has a gate, then the others."""
    first = gate_arms(study, arms)
    return first + [arm for arm in arms if arm not in first]


def _run_arms(study: Study, directory: Path, arms: Sequence[Arm], todo: Sequence[Arm], run_arm: RunArm,
              log: Callable[[str], None], plots: bool) -> int:
    """Run `todo` (a part of the study's `arms`) in order; 0, or the first failing arm's status."""
    status = 0
    for arm in todo:
        index = arms.index(arm)
        if arm.repeat_of:
            log(f"study arm {index + 1}/{len(arms)}: {arm.name} has the config of {arm.repeat_of}: shares its run")
            continue
        _claim_directory(arm)
        if arm_finished(arm):
            log(f"study arm {index + 1}/{len(arms)}: {arm.name} finished before, skipped")
            continue
        log(f"study arm {index + 1}/{len(arms)}: {arm.name}")
        status = run_arm(arm)
        if status == 0 and not arm_finished(arm):
            log(f"study arm {arm.name} stopped before its end; rerun the same command to resume it")
            status = 3
        write_results(study, directory, arms, plots=plots)
        if status:
            return status
    return 0


# ------------------------------------------------------------------------------------------------ results
def _series(records: list[dict], name: str) -> dict[int, float]:
    """`name` by step (a later record of a step wins: the loop logs the final evaluation after the last step)."""
    return {int(r["step"]): float(r[name]) for r in records if r.get(name) is not None}


def _mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n - 1; None for one value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else None)


def arm_results(arm_dir: str | Path) -> dict:
    """One finished arm's figures from its `metrics.jsonl`: held-out accuracy by evaluation step (step 0 = before RL,
    after any warm start), training-rollout tool calls per episode by step, held-out tool errors per episode by
    evaluation step, the median in-loop RL step seconds (`time/step`: rollout, scoring, credit and update; evaluations
    excluded), the same without the step's JAX compile time (`median_steady_step_seconds`, from the `compile_seconds`
    metric; None for runs that did not log it), the median over RL steps of the step over the same step without its
    reference scoring (`median_scoring_ratio`: `time/step` / (`time/step` - `time/scoring`), the method's cost over
    GRPO's on the same trajectories; about 1 for methods without scoring), the endpoint (`endpoint`) and area under the
    accuracy curve (`accuracy_auc`), each of `DIAGNOSTICS` averaged over the RL steps that logged it (None when none
    did), the run's wall seconds (its last record's `wall_time`, which continues across resumes: build, any warm start,
    evaluations and steps) and, from `summary.json`'s comparison of the evaluations before and after RL, the difference
    and its paired standard error (None where it has none)."""
    records = read_metrics(arm_dir)
    try:
        comparison = json.loads((Path(arm_dir) / SUMMARY_FILE).read_text(encoding="utf-8")).get("comparison")
    except (OSError, ValueError, AttributeError):
        comparison = None
    comparison = comparison if isinstance(comparison, dict) else {}
    accuracy = _series(records, "eval/accuracy")
    tool_calls = _series(records, "tool_calls")
    eval_tool_errors = _series(records, "eval/tool_errors")
    step_seconds = [r["time/step"] for r in records if r.get("time/step") is not None]
    steady = [r["time/step"] - r["compile_seconds"] for r in records
              if r.get("time/step") is not None and r.get("compile_seconds") is not None]
    # the step over the same step without the reference's scoring pass: what the method costs over GRPO on its own
    # trajectories, whatever their lengths (GRPO's credit is arithmetic of milliseconds)
    scoring_ratios = [r["time/step"] / (r["time/step"] - r["time/scoring"]) for r in records
                      if r.get("time/step") is not None and r.get("time/scoring") is not None
                      and r["time/step"] > r["time/scoring"]]
    diagnostics = {}
    for name in DIAGNOSTICS:
        values = [float(v) for v in _series(records, name).values() if math.isfinite(v)]
        diagnostics[name] = statistics.fmean(values) if values else None
    walls = [float(r["wall_time"]) for r in records if r.get("wall_time") is not None]
    return {"accuracy": accuracy, "endpoint": endpoint(accuracy), "auc": accuracy_auc(accuracy),
            "tool_calls": tool_calls, "eval_tool_errors": eval_tool_errors, "diagnostics": diagnostics,
            "median_step_seconds": statistics.median(step_seconds) if step_seconds else None,
            "median_steady_step_seconds": statistics.median(steady) if steady else None,
            "median_scoring_ratio": statistics.median(scoring_ratios) if scoring_ratios else None,
            "wall_seconds": max(walls) if walls else None,
            "difference": comparison.get("difference"), "difference_se": comparison.get("se")}


def endpoint(accuracy: Mapping[int, float], evaluations: int = ENDPOINT_EVALUATIONS) -> float | None:
    """The protocol's endpoint: the mean held-out accuracy of the last `evaluations` evaluations (by step; all of
    them when the run has fewer); None without any."""
    last = [accuracy[step] for step in sorted(accuracy)[-evaluations:]]
    return statistics.fmean(last) if last else None


def accuracy_auc(accuracy: Mapping[int, float]) -> float | None:
    """Area under the held-out accuracy curve (trapezoids between evaluation steps) over the steps it spans: the
    run's mean accuracy over RL steps, in accuracy units, so runs of equal length compare; None with fewer than two
    evaluations."""
    steps = sorted(accuracy)
    if len(steps) < 2 or steps[-1] == steps[0]:
        return None
    area = sum((b - a) * (accuracy[a] + accuracy[b]) / 2 for a, b in zip(steps, steps[1:]))
    return area / (steps[-1] - steps[0])


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The paired t interval of the mean of per-seed differences: mean +- t_{(1+c)/2, n-1} s / sqrt(n) (s the
    sample std); None for fewer than two values."""
    from scipy import stats

    if len(values) < 2:
        return None
    mean, std = _mean_std(values)
    half = float(stats.t.ppf((1 + confidence) / 2, len(values) - 1)) * std / math.sqrt(len(values))
    return mean - half, mean + half


def bootstrap_interval(values: Sequence[float], confidence: float = CONFIDENCE, resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = BOOTSTRAP_SEED) -> tuple[float, float] | None:
    """The percentile bootstrap interval of the mean over seeds: `resamples` draws of n seeds with replacement
    (`numpy.random.default_rng(seed)`, so a record gives the same interval every time), the mean of each, and
    their (1 - c) / 2 and (1 + c) / 2 quantiles (numpy's linear interpolation); None for fewer than two values."""
    import numpy as np

    if len(values) < 2:
        return None
    draws = np.random.default_rng(seed).integers(0, len(values), size=(resamples, len(values)))
    means = np.asarray(values, np.float64)[draws].mean(axis=1)
    low, high = np.quantile(means, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(low), float(high)


def paired_difference(per_seed: Mapping[str, float | None], base: Mapping[str, float | None]) -> dict:
    """`per_seed - base` on the seeds both have: per seed, mean and sample std (`_over_seeds`), the seed count
    `n`, the standard error of the mean `se`, and the 95% CIs `ci_t` (paired t) and `ci_bootstrap` ([low, high];
    None with fewer than two seeds)."""
    differences = {seed: value - base[seed] for seed, value in per_seed.items()
                   if value is not None and base.get(seed) is not None}
    values = list(differences.values())
    out = _over_seeds(differences)
    interval_t, interval_boot = t_interval(values), bootstrap_interval(values)
    out.update(n=len(values), se=out["std"] / math.sqrt(len(values)) if out["std"] is not None else None,
               ci_t=list(interval_t) if interval_t else None,
               ci_bootstrap=list(interval_boot) if interval_boot else None)
    return out


def _over_seeds(per_seed: dict[str, float | None]) -> dict:
    """A per-seed figure keyed by seed, with the mean and sample std of the seeds that have it (None without)."""
    values = [v for v in per_seed.values() if v is not None]
    mean, std = _mean_std(values) if values else (None, None)
    return {"per_seed": per_seed, "mean": mean, "std": std}


def _group(arm_figures: Mapping[int, dict]) -> dict:
    """Per-seed series and their mean / std over seeds at the steps every seed has."""
    seeds = sorted(arm_figures)
    out: dict[str, Any] = {"seeds": seeds}
    for name in ("accuracy", "tool_calls", "eval_tool_errors"):
        per_seed = {seed: arm_figures[seed].get(name) or {} for seed in seeds}
        steps = sorted(set.intersection(*(set(s) for s in per_seed.values()))) if per_seed else []
        stats = [_mean_std([per_seed[seed][step] for seed in seeds]) for step in steps]
        out[name] = {"steps": steps, "per_seed": {str(seed): [per_seed[seed][step] for step in steps]
                                                  for seed in seeds},
                     "mean": [m for m, _ in stats], "std": [s for _, s in stats]}
    for key, pick in (("initial_accuracy", min), ("final_accuracy", max)):  # step 0 (after any warm start), last
        per_seed = {str(seed): arm_figures[seed]["accuracy"][pick(arm_figures[seed]["accuracy"])] for seed in seeds
                    if arm_figures[seed]["accuracy"]}
        out[key] = _over_seeds(per_seed)
    for key in ("endpoint", "auc"):
        out[key] = _over_seeds({str(seed): arm_figures[seed].get(key) for seed in seeds})
    # the run's own paired comparison (after RL - after warm start, on the same held-out tasks), per seed
    out["difference"] = {**_over_seeds({str(seed): arm_figures[seed].get("difference") for seed in seeds}),
                         "se": {str(seed): arm_figures[seed].get("difference_se") for seed in seeds}}
    calls = [statistics.fmean(arm_figures[seed]["tool_calls"].values()) for seed in seeds
             if arm_figures[seed]["tool_calls"]]
    out["tool_calls_per_episode"] = statistics.fmean(calls) if calls else None
    for name in ("median_step_seconds", "median_steady_step_seconds", "median_scoring_ratio"):
        # the median over the seeds whose arm has the figure
        values = [arm_figures[seed][name] for seed in seeds if arm_figures[seed].get(name) is not None]
        out[name] = statistics.median(values) if values else None
    out["wall_seconds"] = {str(seed): arm_figures[seed].get("wall_seconds") for seed in seeds}
    out["diagnostics"] = {}
    for name in DIAGNOSTICS:
        out["diagnostics"][name] = _over_seeds({str(seed): arm_figures[seed]["diagnostics"].get(name)
                                                for seed in seeds})
    return out


def _step_time_ratios(methods: Mapping[str, dict], name: str = "median_step_seconds") -> dict[str, float]:
    """Each method's median in-loop step seconds (or another per-method figure `name`) over GRPO's (the issue's
    TRACE / GRPO step-time figure); empty without a finished GRPO arm that has it."""
    base = methods.get("grpo", {}).get(name)
    if not base:
        return {}
    return {m: group[name] / base for m, group in methods.items() if group.get(name) is not None}


def _difference_from(methods: Mapping[str, dict], base: str = BASE_METHOD, figure: str = "final_accuracy"
                     ) -> dict[str, dict]:
    """Per method, its `figure` (a per-seed figure of `_group`: final_accuracy, endpoint, auc, initial_accuracy)
    minus `base`'s on the same seed (the seeds both have), with the mean, sample std, SE and 95% CIs over those
    seeds (`paired_difference`); empty without `base`."""
    if base not in methods:
        return {}
    reference = methods[base].get(figure, {}).get("per_seed", {})
    return {method: paired_difference(group.get(figure, {}).get("per_seed", {}), reference)
            for method, group in methods.items()}


def _sensitivity(study: Study, methods: Mapping[str, dict]) -> dict[str, dict]:
    """Per `study.sensitivity` label: the seeds it leaves out and each method's endpoint and AUC differences from
    GRPO over the other seeds (`paired_difference`, as in the main analysis)."""
    out = {}
    for label, left_out in study.sensitivity:
        kept = {m: {figure: {"per_seed": {seed: value for seed, value in group.get(figure, {}).get("per_seed", {})
                                          .items() if int(seed) not in left_out}}
                    for figure in ("endpoint", "auc")} for m, group in methods.items()}
        out[label] = {"left_out": list(left_out),
                      "endpoint_difference_from_grpo": _difference_from(kept, figure="endpoint"),
                      "auc_difference_from_grpo": _difference_from(kept, figure="auc")}
    return out


def _first_reaching(steps: Sequence[int], values: Sequence[float], target: float) -> int | None:
    """The first of `steps` whose value is >= `target`; None where none is."""
    return next((step for step, value in zip(steps, values) if value >= target), None)


def _steps_to_reach(methods: Mapping[str, dict], base: str = BASE_METHOD) -> dict[str, int | None]:
    """Per method, the first evaluation step at which its mean held-out accuracy over seeds reaches GRPO's final
    mean (the seed table's "steps to reach GRPO's final accuracy"); None where it never does; empty without GRPO."""
    target = methods.get(base, {}).get("accuracy", {}).get("mean")
    if not target:
        return {}
    return {method: _first_reaching(group.get("accuracy", {}).get("steps", []),
                                    group.get("accuracy", {}).get("mean", []), target[-1])
            for method, group in methods.items()}


def _steps_to_reach_per_seed(methods: Mapping[str, dict], base: str = BASE_METHOD) -> dict[str, dict]:
    """Per method and seed, the first evaluation step at which the seed's held-out accuracy reaches GRPO's endpoint
    on the same seed (None: never), how many seeds reach it, and the median over seeds (a seed that never reaches
    it counts as later than any step; None when the median is such a seed); empty without GRPO."""
    targets = methods.get(base, {}).get("endpoint", {}).get("per_seed")
    if not targets:
        return {}
    out = {}
    for method, group in methods.items():
        series = group.get("accuracy", {})
        per_seed = {seed: _first_reaching(series.get("steps", []), values, targets[seed])
                    for seed, values in series.get("per_seed", {}).items() if targets.get(seed) is not None}
        ranks = [math.inf if step is None else step for step in per_seed.values()]
        median = statistics.median(ranks) if ranks else math.inf
        out[method] = {"per_seed": per_seed, "reached": sum(step is not None for step in per_seed.values()),
                       "seeds": len(per_seed), "median": None if math.isinf(median) else median}
    return out


def gate_decision(study: Study, methods: Mapping[str, dict]) -> dict | None:
    """The study's gate (None without one): `passed` is True when the gate method's endpoint beats GRPO's by the
    paired-t 95% CI over every seed of the study (its lower end > 0), False when it does not, and None while a
    seed of either method is unfinished; `reason` says which, with the difference and its CIs."""
    if not study.gate_method:
        return None
    names = (BASE_METHOD, study.gate_method)
    done = {m: set(methods.get(m, {}).get("seeds", [])) for m in names}
    out = {"method": study.gate_method, "gated_methods": list(study.gated_methods),
           "criterion": f"the paired-t {CONFIDENCE:.0%} CI of the endpoint difference {study.gate_method} - "
                        f"{BASE_METHOD} over all {len(study.seeds)} seeds lies above 0"}
    missing = {m: sorted(set(study.seeds) - done[m]) for m in names if set(study.seeds) - done[m]}
    if missing:
        return {**out, "passed": None, "difference": None,
                "reason": "undecided: unfinished seeds " + "; ".join(f"{m}: {s}" for m, s in missing.items())}
    difference = paired_difference(methods[study.gate_method]["endpoint"]["per_seed"],
                                   methods[BASE_METHOD]["endpoint"]["per_seed"])
    low, high = difference["ci_t"] or (None, None)
    passed = low is not None and low > 0
    text = (f"{study.gate_method} - {BASE_METHOD} = {100 * difference['mean']:+.1f} points, paired-t CI "
            f"[{100 * low:+.1f}, {100 * high:+.1f}]" if low is not None else "no interval")
    return {**out, "passed": passed, "difference": difference,
            "reason": f"{'passed' if passed else 'failed'}: {text} over {difference['n']} seeds"}


def _percent(figures: Mapping[str, Any] | None, *, signed: bool = False) -> str:
    """`mean +- std` in percent (points) of a {mean, std} figure; the mean alone for one seed; "-" for none."""
    figures = figures or {}
    if figures.get("mean") is None:
        return "-"
    std = figures.get("std")
    return f"{100 * figures['mean']:{'+' if signed else ''}.1f}" + (f" +- {100 * std:.1f}" if std is not None else "")


def _difference(group: Mapping[str, Any]) -> str:
    """After RL - after warm start in points: mean +- std over seeds, or for one seed the run's paired SE."""
    figures = group.get("difference") or {}
    text = _percent(figures, signed=True)
    ses = [se for se in (figures.get("se") or {}).values() if se is not None]
    if text != "-" and len(group.get("seeds", [])) == 1 and ses:
        text += f" (SE {100 * ses[0]:.1f})"
    return text


def results_table(results: Mapping[str, Any]) -> str:
    """The main table of docs/results.md (the seed paper's layout) from `results.json`: one row per method with
    held-out accuracy after the warm start and after RL (mean +- sample std over seeds), the run's gain (after RL
    - after warm start; for one seed with its paired SE), the difference from GRPO's final on the same seed, the
    steps to reach GRPO's final mean, tool calls per episode, the median in-loop step, its ratio to GRPO's with and
    without compile time and the step over the same step without reference scoring (TRACE's own cost on its own
    trajectories)."""
    from_grpo = results.get("difference_from_grpo", {})
    reach = results.get("steps_to_grpo_final", {})
    ratios = results.get("step_time_ratio_to_grpo", {})
    steady = results.get("steady_step_time_ratio_to_grpo", {})
    lines = ["| method | seeds | held out after warm start (%) | held out after RL (%) | RL gain (points) | "
             "vs GRPO, same seed (points) | steps to GRPO's final | tool calls / episode | median step (s) | "
             "step / GRPO | steady step / GRPO | step / same step unscored |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, group in results.get("methods", {}).items():
        calls = group.get("tool_calls_per_episode")
        seconds = group.get("median_step_seconds")
        step = reach.get(method, "-")  # None: never reached; "-": no GRPO to reach
        lines.append(" | ".join([
            f"| {method}", str(len(group.get("seeds", []))), _percent(group.get("initial_accuracy")),
            _percent(group.get("final_accuracy")), _difference(group),
            "-" if method == "grpo" else _percent(from_grpo.get(method), signed=True),
            "not reached" if step is None else str(step),
            "-" if calls is None else f"{calls:.2f}", "-" if seconds is None else f"{seconds:.1f}",
            "-" if method not in ratios else f"{ratios[method]:.2f}",
            "-" if method not in steady else f"{steady[method]:.2f}",
            "-" if group.get("median_scoring_ratio") is None else f"{group['median_scoring_ratio']:.3f}"]) + " |")
    return "\n".join(lines) + "\n"


def _interval(ci: Sequence[float] | None) -> str:
    return "-" if not ci else f"[{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"


def _with_ci(figures: Mapping[str, Any] | None) -> str:
    """A paired difference in points (`_percent`), then its paired-t CI where it has one (none for one seed)."""
    ci = (figures or {}).get("ci_t")
    return _percent(figures, signed=True) + (f" {_interval(ci)}" if ci else "")


def _median_step(step: float | None) -> str:
    return "not reached" if step is None else f"{step:g}"


def endpoint_table(results: Mapping[str, Any]) -> str:
    """The protocol's table (issue 47) from `results.json`: one row per method with held-out accuracy after the
    warm start and its paired difference from GRPO's (with the paired-t CI), the endpoint (mean of the last
    `ENDPOINT_EVALUATIONS` evaluations; mean +- std over seeds), its paired difference from GRPO with the 95% CIs by
    paired t and by bootstrap over seeds, the area under the accuracy curve (mean accuracy over the run) and its
    difference from GRPO with the paired-t CI, and the steps to reach GRPO's endpoint (median over seeds; seeds that
    reach it); then the gate's decision, if the study has one."""
    initial = results.get("initial_difference_from_grpo") or {}
    ends = results.get("endpoint_difference_from_grpo") or {}
    aucs = results.get("auc_difference_from_grpo") or {}
    reach = results.get("steps_to_grpo_endpoint") or {}
    evaluations = (results.get("endpoint") or {}).get("evaluations", ENDPOINT_EVALUATIONS)
    lines = [f"| method | seeds | after warm start (%) | vs GRPO (points), t CI | endpoint: last {evaluations} "
             "evaluations (%) | vs GRPO (points) | 95% CI, paired t | 95% CI, bootstrap | accuracy AUC (%) | "
             "vs GRPO (points), t CI | steps to GRPO's endpoint (median; seeds) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, group in results.get("methods", {}).items():
        base = method == BASE_METHOD
        steps = reach.get(method) or {}
        paired = lambda figures: "-" if base else _percent(figures, signed=True)  # noqa: E731
        with_ci = lambda figures: "-" if base else _with_ci(figures)  # noqa: E731
        lines.append(" | ".join([
            f"| {method}", str(len(group.get("seeds", []))), _percent(group.get("initial_accuracy")),
            with_ci(initial.get(method)),
            _percent(group.get("endpoint")), paired(ends.get(method)),
            "-" if base else _interval((ends.get(method) or {}).get("ci_t")),
            "-" if base else _interval((ends.get(method) or {}).get("ci_bootstrap")),
            _percent(group.get("auc")),
            with_ci(aucs.get(method)),
            "-" if not steps else f"{_median_step(steps['median'])}; {steps['reached']}/{steps['seeds']}"]) + " |")
    gate = results.get("gate")
    if gate:
        lines += ["", f"Gate ({gate['criterion']}): {gate['reason']}."]
    return "\n".join(lines) + "\n"


def sensitivity_table(results: Mapping[str, Any]) -> str:
    """The sensitivity analyses' table (`study.sensitivity`) from `results.json`: per label and method other than
    GRPO, the seeds left out and counted, and the endpoint and AUC differences from GRPO over the others with their
    95% CIs; empty without any."""
    sensitivity = results.get("sensitivity") or {}
    if not sensitivity:
        return ""
    lines = ["| without | method | seeds | endpoint vs GRPO (points) | 95% CI, paired t | 95% CI, bootstrap | "
             "AUC vs GRPO (points), t CI |", "|---|---|---|---|---|---|---|"]
    for label, analysis in sensitivity.items():
        aucs = analysis.get("auc_difference_from_grpo") or {}
        seeds = ", ".join(str(seed) for seed in analysis.get("left_out", []))
        for method, ends in (analysis.get("endpoint_difference_from_grpo") or {}).items():
            if method == BASE_METHOD:
                continue
            lines.append(" | ".join([
                f"| {label} (seeds {seeds})", method, str(ends.get("n", 0)), _percent(ends, signed=True),
                _interval(ends.get("ci_t")), _interval(ends.get("ci_bootstrap")), _with_ci(aucs.get(method))]) + " |")
    return "\n".join(lines) + "\n"


def seed_table(results: Mapping[str, Any]) -> str:
    """Every finished arm of `results.json`, one row per seed and method (seeds in order, methods in the study
    file's): its held-out accuracy at each evaluation step (the first is after the warm start), the endpoint, its
    paired difference from GRPO's on the same seed, training tool calls per episode (mean over steps), the mean |A|
    per trained token (the arm's step size, mean over steps), held-out tool errors per episode at the first and last
    evaluation and the arm's wall minutes (build, any warm start, evaluations and RL steps); "" without finished
    arms. The per-seed record behind the endpoint table, so docs/results.md quotes it rather than retyping it."""
    methods = results.get("methods") or {}
    ends = results.get("endpoint_difference_from_grpo") or {}
    steps = sorted({step for group in methods.values() for step in (group.get("accuracy") or {}).get("steps", [])})
    if not steps:
        return ""
    seeds = sorted({seed for group in methods.values() for seed in group.get("seeds", [])})
    lines = ["| seed | method | " + " | ".join(f"step {step} (%)" for step in steps)
             + " | endpoint (%) | vs GRPO (points) | tool calls / episode | mean abs A / token | held-out tool "
             "errors / episode, first -> last | wall (min) |",
             "|---|---|" + "---|" * len(steps) + "---|---|---|---|---|---|"]
    for seed in seeds:
        for method, group in methods.items():
            if seed not in group.get("seeds", []):
                continue
            key, accuracy = str(seed), group.get("accuracy") or {}
            by_step = dict(zip(accuracy.get("steps", []), (accuracy.get("per_seed") or {}).get(key, [])))
            end = ((group.get("endpoint") or {}).get("per_seed") or {}).get(key)
            difference = ((ends.get(method) or {}).get("per_seed") or {}).get(key)
            calls = ((group.get("tool_calls") or {}).get("per_seed") or {}).get(key) or []
            errors = ((group.get("eval_tool_errors") or {}).get("per_seed") or {}).get(key) or []
            wall = (group.get("wall_seconds") or {}).get(key)
            size = (((group.get("diagnostics") or {}).get("credit/mean_abs_token_advantage") or {}).get("per_seed")
                    or {}).get(key)
            lines.append(" | ".join(
                [f"| {seed}", method] + ["-" if by_step.get(step) is None else f"{100 * by_step[step]:.1f}"
                                         for step in steps]
                + ["-" if end is None else f"{100 * end:.1f}",
                   "-" if method == BASE_METHOD or difference is None else f"{100 * difference:+.1f}",
                   f"{statistics.fmean(calls):.2f}" if calls else "-", "-" if size is None else f"{size:.3f}",
                   f"{errors[0]:.2f} -> {errors[-1]:.2f}" if errors else "-",
                   "-" if wall is None else f"{wall / 60:.1f}"]) + " |")
    return "\n".join(lines) + "\n"


CREDIT_COLUMNS = (  # (diagnostic, column heading, digits): the credit each method gave in its own training steps
    ("credit/progress_spearman", "Spearman of turn credit with progress gain", 3),
    ("credit/on_path_turn_credit", "on-path turn credit", 3),
    ("credit/detour_turn_credit", "detour turn credit", 3),
    ("zero_signal_groups", "zero-signal groups (share)", 2),
    ("zero_signal_groups_with_turn_credit", "of them with turn credit", 2),
    ("credit/mean_abs_token_advantage", "mean abs advantage per token", 3))


def credit_table(results: Mapping[str, Any]) -> str:
    """What each method's credit was in its own training batches, beside its accuracy: one row per method with
    `CREDIT_COLUMNS`' diagnostics (docs/credit.md, "Credit diagnostics"), each averaged over an arm's RL steps,
    then mean +- std over seeds; "" when no method logged any of them."""
    methods = results.get("methods") or {}
    cells = {m: [((group.get("diagnostics") or {}).get(name) or {}) for name, _, _ in CREDIT_COLUMNS]
             for m, group in methods.items()}
    if not any(figure.get("mean") is not None for row in cells.values() for figure in row):
        return ""

    def cell(figure: Mapping[str, Any], digits: int) -> str:
        if figure.get("mean") is None:
            return "-"
        std = figure.get("std")
        return f"{figure['mean']:.{digits}f}" + ("" if std is None else f" +- {std:.{digits}f}")

    lines = ["| method | seeds | " + " | ".join(heading for _, heading, _ in CREDIT_COLUMNS) + " |",
             "|---|---|" + "---|" * len(CREDIT_COLUMNS)]
    for method, row in cells.items():
        lines.append(" | ".join([f"| {method}", str(len(methods[method].get("seeds", [])))]
                                + [cell(figure, digits) for figure, (_, _, digits) in zip(row, CREDIT_COLUMNS)])
                     + " |")
    return "\n".join(lines) + "\n"


def ablation_table(results: Mapping[str, Any]) -> str:
    """The ablations of `results.json` as a table: one row per ablation arm (binding = value, in the study file's
    order) with the main table's accuracy columns, tool calls per episode, TRACE's terminal-fill share (the share
    of tool turns whose look-ahead window reaches the episode's end; mean over steps) and the step over the same
    step without reference scoring; "" without ablations."""
    ablations = {k: v for k, v in (results.get("ablations") or {}).items() if k != "method"}
    if not ablations:
        return ""
    lines = [f"| {results['ablations'].get('method', '')} ablation | seeds | held out after warm start (%) | "
             "held out after RL (%) | RL gain (points) | tool calls / episode | terminal-fill share | "
             "step / same step unscored |", "|---|---|---|---|---|---|---|---|"]
    for name, group in ablations.items():
        calls = group.get("tool_calls_per_episode")
        fill = ((group.get("diagnostics") or {}).get("credit/terminal_fill_share") or {}).get("mean")
        ratio = group.get("median_scoring_ratio")
        lines.append(" | ".join([
            f"| {name}", str(len(group.get("seeds", []))), _percent(group.get("initial_accuracy")),
            _percent(group.get("final_accuracy")), _difference(group), "-" if calls is None else f"{calls:.2f}",
            "-" if fill is None else f"{fill:.2f}", "-" if ratio is None else f"{ratio:.3f}"]) + " |")
    return "\n".join(lines) + "\n"


def aggregate(study: Study, directory: str | Path, arms: Sequence[Arm] | None = None) -> dict:
    """`results.json`'s content from the finished arms (unfinished ones are listed, not counted)."""
    arms = expand(study, directory) if arms is None else arms
    by_method: dict[str, dict[int, dict]] = {}
    by_ablation: dict[str, dict[int, dict]] = {}
    listing = []
    walls: dict[str, float | None] = {}  # by run directory: repeats share their arm's run, counted once
    for arm in arms:
        finished = arm_finished(arm)
        listing.append({"name": arm.name, "run_dir": arm.run.run_dir, "finished": finished,
                        **({"repeat_of": arm.repeat_of} if arm.repeat_of else {})})
        if not finished:
            continue
        figures = arm_results(arm.run.run_dir)
        walls[arm.run.run_dir] = figures["wall_seconds"]
        if arm.ablation is None:
            by_method.setdefault(arm.method, {})[arm.seed] = figures
        else:  # the name is ablation/<field>=<value>/seed<S>
            by_ablation.setdefault(arm.name.split("/")[1], {})[arm.seed] = figures
    methods = {m: _group(by_method[m]) for m, _ in study.methods if m in by_method}
    gate = gate_decision(study, methods)
    if gate is not None and gate["passed"] is False:
        for entry, arm in zip(listing, arms):
            if arm.method in study.gated_methods and not entry["finished"]:
                entry["skipped_by_gate"] = True
    return {"study": study.name, "seed_fields": list(SEED_FIELDS), "std": "sample standard deviation over seeds "
            "(n - 1); null with one seed", "diagnostics": "mean over each arm's RL steps, then over seeds "
            "(docs/credit.md, 'Credit diagnostics')", "arms": listing,
            "endpoint": {"evaluations": ENDPOINT_EVALUATIONS, "confidence": CONFIDENCE,
                         "bootstrap": {"resamples": BOOTSTRAP_RESAMPLES, "seed": BOOTSTRAP_SEED},
                         "definition": f"mean held-out accuracy of an arm's last {ENDPOINT_EVALUATIONS} evaluations; "
                                       f"differences are paired by seed against {BASE_METHOD}"},
            "gate": gate,
            "methods": methods, "step_time_ratio_to_grpo": _step_time_ratios(methods),
            "steady_step_time_ratio_to_grpo": _step_time_ratios(methods, "median_steady_step_seconds"),
            "difference_from_grpo": _difference_from(methods),
            "endpoint_difference_from_grpo": _difference_from(methods, figure="endpoint"),
            "auc_difference_from_grpo": _difference_from(methods, figure="auc"),
            "initial_difference_from_grpo": _difference_from(methods, figure="initial_accuracy"),
            "steps_to_grpo_final": _steps_to_reach(methods),
            "steps_to_grpo_endpoint": _steps_to_reach_per_seed(methods),
            "sensitivity": _sensitivity(study, methods),
            "wall_seconds_finished_arms": sum(w for w in walls.values() if w is not None),
            "ablations": {"method": study.ablation_method, **{k: _group(v) for k, v in by_ablation.items()}}
            if study.ablations else {}}


# ------------------------------------------------------------------------------------------------ power
def paired_t_power(effect: float, std: float, seeds: int, confidence: float = CONFIDENCE) -> float:
    """The power of the two-sided paired t test at level 1 - `confidence` over `seeds` paired seeds to detect a true
    mean difference `effect` when the per-seed differences have standard deviation `std`: P(|T| > t_crit) with T
    noncentral t (df = seeds - 1, noncentrality effect / std * sqrt(seeds))."""
    from scipy import stats

    if seeds < 2 or not std > 0:
        raise ValueError(f"paired_t_power needs seeds >= 2 and std > 0, got seeds={seeds}, std={std}")
    df, shift = seeds - 1, effect / std * math.sqrt(seeds)
    critical = stats.t.ppf((1 + confidence) / 2, df)
    return float(stats.nct.sf(critical, df, shift) + stats.nct.cdf(-critical, df, shift))


def seeds_for_power(effect: float, std: float, power: float = POWER, confidence: float = CONFIDENCE,
                    max_seeds: int = 10_000) -> int:
    """The fewest paired seeds (>= 2) whose `paired_t_power` reaches `power`."""
    for seeds in range(2, max_seeds + 1):
        if paired_t_power(effect, std, seeds, confidence) >= power:
            return seeds
    raise ValueError(f"more than {max_seeds} seeds for effect {effect} at std {std}")


def detectable_effect(std: float, seeds: int, power: float = POWER, confidence: float = CONFIDENCE) -> float:
    """The smallest true difference `seeds` paired seeds detect with `power` (bisection on `paired_t_power`)."""
    low, high = 0.0, std
    while paired_t_power(high, std, seeds, confidence) < power:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if paired_t_power(middle, std, seeds, confidence) < power else (low, middle)
    return high


def pooled_std(differences: Mapping[str, Mapping[str, Any]]) -> tuple[float | None, int]:
    """The pooled sample std of per-seed paired differences over methods (each method's variance weighted by its
    n - 1; methods with fewer than two seeds left out) and its degrees of freedom."""
    parts = [(d["n"] - 1, d["std"] ** 2) for d in differences.values()
             if d.get("n", 0) >= 2 and d.get("std") is not None]
    df = sum(n for n, _ in parts)
    return (math.sqrt(sum(n * v for n, v in parts) / df) if df else None), df


def power_report(results: Mapping[str, Any], effect: float, power: float = POWER) -> str:
    """Seeds needed for a paired-t study to detect `effect` (accuracy, 0.05 = 5 points) with `power`, from the
    spread of the per-seed differences from GRPO in `results` (results.json's content): for the endpoint and for
    the last evaluation alone, each method's std and seeds, the pooled std, the seeds needed, the power the record's
    own seeds had and the effect they could detect."""
    lines = [f"Paired t, two-sided {1 - CONFIDENCE:.2f}, {power:.0%} power, effect {100 * effect:g} points; spread of "
             f"each method's per-seed difference from {BASE_METHOD} in study {results.get('study', '')!r}:"]
    for key, label in (("endpoint_difference_from_grpo", f"endpoint (mean of the last {ENDPOINT_EVALUATIONS} "
                                                          "evaluations)"),
                       ("difference_from_grpo", "last evaluation")):
        differences = {m: d for m, d in (results.get(key) or {}).items() if m != BASE_METHOD}
        std, df = pooled_std(differences)
        lines.append(f"- {label}: " + ", ".join(
            f"{m} {100 * d['std']:.1f} ({d['n']} seeds)" for m, d in differences.items() if d.get("std") is not None))
        if std is None:
            lines.append("  no method has two seeds: no spread to pool")
            continue
        seeds = max((d["n"] for d in differences.values()), default=0)
        lines.append(f"  pooled std {100 * std:.1f} points ({df} df): {seeds_for_power(effect, std, power)} paired "
                     f"seeds for {100 * effect:g} points at {power:.0%} power"
                     + (f"; the record's {seeds} seeds had power {paired_t_power(effect, std, seeds):.2f} for it "
                        f"and detect {100 * detectable_effect(std, seeds, power):.1f} points at {power:.0%}"
                        if seeds >= 2 else ""))
    return "\n".join(lines) + "\n"


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_plots(results: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """accuracy.png (held-out accuracy vs step: mean over seeds, band = min..max over seeds, one line per method),
    tool_calls.png (training tool calls per episode vs step, mean over seeds), with ablations ablations.png
    (held-out accuracy vs step per ablation arm) and, with GRPO and another method, differences.png (each method's
    endpoint minus GRPO's per seed, with the mean and its paired-t CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def draw(groups: Mapping[str, dict], name: str, ylabel: str, filename: str, title: str) -> None:
        groups = {k: v for k, v in groups.items() if isinstance(v, dict) and v.get(name, {}).get("steps")}
        if not groups:
            return
        fig, ax = plt.subplots(figsize=(8, 5))
        for label, group in groups.items():
            series = group[name]
            line, = ax.plot(series["steps"], series["mean"], marker="o" if len(series["steps"]) < 30 else None,
                            label=f"{label} ({len(group['seeds'])} seed{'s' if len(group['seeds']) > 1 else ''})")
            if len(group["seeds"]) > 1:
                columns = list(zip(*series["per_seed"].values()))
                ax.fill_between(series["steps"], [min(c) for c in columns], [max(c) for c in columns],
                                color=line.get_color(), alpha=0.15)
        ax.set(xlabel="RL step", ylabel=ylabel, title=title)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def draw_differences() -> None:
        """The endpoint's paired differences from GRPO: each seed a dot, the mean with its paired-t 95% CI."""
        rows = [(m, d) for m, d in (results.get("endpoint_difference_from_grpo") or {}).items()
                if m != BASE_METHOD and d.get("n")]
        if not rows:
            return
        fig, ax = plt.subplots(figsize=(8, 1.2 + 0.5 * len(rows)))
        for y, (method, difference) in enumerate(rows):
            values = [100 * v for v in difference["per_seed"].values()]
            ax.plot(values, [y] * len(values), "o", color="0.6", markersize=4)
            low, high = (100 * v for v in difference["ci_t"]) if difference.get("ci_t") else (None, None)
            mean = 100 * difference["mean"]
            ax.errorbar([mean], [y], xerr=None if low is None else [[mean - low], [high - mean]], fmt="D",
                        color="C0", capsize=4)
        ax.axvline(0, color="k", linewidth=0.8)
        ax.set_yticks(range(len(rows)), [m for m, _ in rows])
        ax.set(xlabel=f"endpoint - {BASE_METHOD}'s on the same seed (points)",
               title=f"{results.get('study', '')}: paired differences (dots: seeds; diamond: mean, paired-t 95% CI)")
        fig.tight_layout()
        path = out / "differences.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    study = results.get("study", "")
    draw(results["methods"], "accuracy", "held-out greedy accuracy", "accuracy.png",
         f"{study}: held-out accuracy (mean over seeds; band: min-max)")
    draw(results["methods"], "tool_calls", "tool calls per episode (training rollouts)", "tool_calls.png",
         f"{study}: tool calls per episode (mean over seeds; band: min-max)")
    draw({k: v for k, v in results.get("ablations", {}).items() if k != "method"}, "accuracy",
         "held-out greedy accuracy", "ablations.png",
         f"{study}: ablations of {results.get('ablations', {}).get('method', '')}")
    draw_differences()
    return written


def write_results(study: Study, directory: str | Path, arms: Sequence[Arm] | None = None, *,
                  plots: bool = True) -> dict:
    directory = Path(directory)
    results = _json_safe(aggregate(study, directory, arms))
    (directory / RESULTS_FILE).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    ablations = ablation_table(results)
    tables = [results_table(results), endpoint_table(results), sensitivity_table(results), credit_table(results),
              ablations, seed_table(results)]
    (directory / TABLE_FILE).write_text("\n".join(table for table in tables if table), encoding="utf-8")
    if plots:
        write_plots(results, directory / PLOTS_DIR)
    return results


# ------------------------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("study_file", help="a study gin file (configs/studies/*.gin)")
    parser.add_argument("--dir", default=None, help="study directory (default runs/studies/<study name>); "
                        "rerunning with the same directory resumes the study")
    parser.add_argument("--print", dest="print_only", action="store_true",
                        help="print one launch command per arm instead of running them")
    parser.add_argument("--results-only", "--results_only", action="store_true",
                        help="rewrite results.json and the plots from the finished arms; run nothing")
    parser.add_argument("--power", type=float, default=None, metavar="POINTS",
                        help="print the paired seeds needed to detect POINTS of held-out accuracy at 80%% power, "
                        "from the spread of the finished arms' per-seed differences from GRPO; run nothing")
    parser.add_argument("--no-progress", "--no_progress", action="store_true", help="no progress bars")
    parser.add_argument("--gin-param", "--gin_param", action="append", default=[],
                        help="a binding every arm adds after the study file's study.params (repeatable), e.g. "
                        "\"TrainConfig.init_from = 'runs/studies/main/grpo/seed0'\" to start an ablation study "
                        "from the main study's warm start of the same seed")


def run_arm_process(arm: Arm, *, progress: bool = True) -> int:
    """Run one arm as its own `trace-jax train` process and return its exit status. A fresh process per arm keeps
    the arms' step times comparable (each compiles its own programs; no arm inherits another's caches, heap or
    threads) and an arm's crash from ending the study. SIGTERM and SIGINT are passed on to the arm, which
    checkpoints before it stops."""
    import signal
    import subprocess

    argv = arm.run.argv(sys.executable) + ([] if progress else ["--no-progress"])
    sys.stdout.flush()
    child = subprocess.Popen(argv)
    forward = lambda signum, _frame: child.send_signal(signum)  # noqa: E731
    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        return child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run(args: argparse.Namespace) -> int:
    try:
        study = load_study(args.study_file)
        if args.gin_param:
            study = dataclasses.replace(study, params=study.params + tuple(args.gin_param))
        directory = Path(args.dir or Path("runs/studies") / study.name)
        arms = expand(study, directory)
        arms = mark_repeats(arms, validate_runs([arm.run for arm in arms], what=f"study {args.study_file}"))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.print_only:
        for arm in run_order(study, arms):
            print(f"# {arm.name}: the run of {arm.repeat_of}" if arm.repeat_of else arm.run.command())
        return 0
    if args.results_only or args.power is not None:
        if not directory.is_dir():
            print(f"error: no study directory {directory} (the study's runs are there; --dir names another)",
                  file=sys.stderr)
            return 2
        if args.power is not None:
            if not 0 < args.power < 100:
                print(f"error: --power {args.power}: give the effect in points of accuracy, in (0, 100)",
                      file=sys.stderr)
                return 2
            print(power_report(_json_safe(aggregate(study, directory, arms)), args.power / 100), end="")
            return 0
        write_results(study, directory, arms)
        return 0

    try:
        return run_study(study, directory, lambda arm: run_arm_process(arm, progress=not args.no_progress), arms)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
