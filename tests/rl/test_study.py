"""`trace-jax study`: expansion of a study file into arms, resume, results.json aggregation, errors, one real run."""

from __future__ import annotations

import json
import shlex
import statistics
from pathlib import Path

import pytest

from trace_jax.rl import study as study_module
from trace_jax.rl.gin_setup import ConfigError
from trace_jax.rl.metrics import encode_line
from trace_jax.rl.study import SEED_FIELDS, expand, load_study, run_study, write_results

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str, name: str = "s.gin") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


SMALL = """
study.name = 'small'
study.base = ['configs/tiny.gin']
study.params = ['TrainConfig.steps = 2']
study.methods = {'grpo': ['configs/credit/grpo.gin'], 'trace': ['configs/credit/trace.gin']}
study.seeds = [0, 1]
study.ablation_method = 'trace'
study.ablation_seeds = [0]
study.ablations = {'CreditConfig.horizon': [0, 5]}
"""


def test_study_file_expands_into_methods_by_seeds_then_ablations(tmp_path):
    arms = expand(load_study(_write(tmp_path, SMALL)), tmp_path / "out")
    assert [a.name for a in arms] == ["grpo/seed0", "trace/seed0", "grpo/seed1", "trace/seed1",
                                      "ablation/horizon=0/seed0", "ablation/horizon=5/seed0"]
    assert arms[2].run.gin_files == ("configs/tiny.gin", "configs/credit/grpo.gin")
    assert arms[2].run.gin_params == ("TrainConfig.steps = 2", "TrainConfig.seed = 1", "DataConfig.shuffle_seed = 1",
                                      "WarmStartConfig.oracle_seed = 1")
    assert arms[5].run.gin_files == ("configs/tiny.gin", "configs/credit/trace.gin")
    assert arms[5].run.gin_params[-1] == "CreditConfig.horizon = 5"
    assert arms[5].run.run_dir == str(tmp_path / "out" / "ablation/horizon=5/seed0")


def test_a_seed_binds_init_warm_start_order_and_detours_rollouts_and_task_order():
    assert SEED_FIELDS == ("TrainConfig.seed", "DataConfig.shuffle_seed", "WarmStartConfig.oracle_seed")
    assert study_module.seed_bindings(7) == ("TrainConfig.seed = 7", "DataConfig.shuffle_seed = 7",
                                             "WarmStartConfig.oracle_seed = 7")


def test_shared_warm_start_points_later_arms_of_a_seed_at_its_first_arm(tmp_path):
    text = SMALL.replace("study.ablations", "study.share_warm_start = True\nstudy.ablations")
    arms = expand(load_study(_write(tmp_path, text)), tmp_path)
    assert not any("init_from" in p for p in arms[0].run.gin_params)
    assert arms[1].run.gin_params[-1] == f"TrainConfig.init_from = {str(tmp_path / 'grpo/seed0')!r}"
    assert arms[3].run.gin_params[-1] == f"TrainConfig.init_from = {str(tmp_path / 'grpo/seed1')!r}"


def test_shipped_study_file_expands_and_every_arm_config_parses():
    arms = expand(load_study(str(REPO / "configs/studies/main.gin")), "runs/x")
    main, ablations = arms[:24], arms[24:]
    assert {a.method for a in main} == {"grpo", "gspo", "gigpo", "trace_log_ratio", "trace_raw_delta",
                                       "trace_linear_gap", "abc_grpo", "abc_sft"}
    assert [a.seed for a in main] == [0] * 8 + [1] * 8 + [2] * 8
    assert [a.ablation for a in ablations] == [("CreditConfig.horizon", k) for k in (0, 1, 3, 5)] + [
        ("CreditConfig.alpha_turn", a) for a in (0.05, 0.2, 1.0, 3.0)]
    from trace_jax.rl.sweep import validate_runs

    configs = validate_runs([a.run for a in arms], what="study")
    # every arm after the first starts from seed 0's, 1's or 2's warm start; K = 3 and alpha_turn = 0.2 are TRACE's
    # defaults and share the main arm's run
    marked = study_module.mark_repeats(arms, configs)
    assert {a.name: a.repeat_of for a in marked if a.repeat_of} == {
        "ablation/horizon=3/seed0": "trace_log_ratio/seed0", "ablation/alpha_turn=0.2/seed0": "trace_log_ratio/seed0"}


def test_an_arm_with_an_earlier_arms_config_shares_its_run(tmp_path):
    study = load_study(_write(tmp_path, SMALL.replace("[0, 5]", "[3, 5]")))  # trace.gin's horizon is 3
    from trace_jax.rl.sweep import validate_runs

    arms = expand(study, tmp_path / "out")
    arms = study_module.mark_repeats(arms, validate_runs([a.run for a in arms], what="study"))
    assert [a.repeat_of for a in arms] == ["", "", "", "", "trace/seed0", ""]
    assert arms[4].run.run_dir == arms[1].run.run_dir
    ran = []
    done = lambda arm: (ran.append(arm.name), _fake_arm(Path(arm.run.run_dir), {0: 0.1, 2: 0.4}, {1: 1.0},  # noqa
                                                        [1.0]), 0)[-1]
    assert run_study(study, tmp_path / "out", done, arms, log=lambda _: None, plots=False) == 0
    assert "ablation/horizon=3/seed0" not in ran and len(ran) == 5
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["ablations"]["horizon=3"]["final_accuracy"]["mean"] == pytest.approx(0.4)


def test_bad_study_file_names_the_file_and_binding(tmp_path):
    path = _write(tmp_path, SMALL.replace("study.seeds = [0, 1]", "study.seeds = [0, 0]"))
    with pytest.raises(ConfigError, match=r"s\.gin.*study\.seeds"):
        load_study(path)
    path = _write(tmp_path, SMALL + "study.method = {}\n", "typo.gin")
    with pytest.raises(ConfigError, match=r"typo\.gin.*method"):
        load_study(path)


def test_bad_binding_in_an_arm_names_the_study_file_arm_and_binding(tmp_path, capsys):
    from trace_jax.cli import main

    path = _write(tmp_path, SMALL.replace("'TrainConfig.steps = 2'", "'TrainConfig.stepz = 2'"))
    assert main(["study", path, "--print"]) == 2
    err = capsys.readouterr().err
    assert "s.gin" in err and "grpo/seed0" in err and "stepz" in err


def test_results_only_of_a_missing_study_directory_is_an_error_naming_it(tmp_path, capsys):
    from trace_jax.cli import main

    missing = tmp_path / "no-such-study"
    assert main(["study", _write(tmp_path, SMALL), "--dir", str(missing), "--results-only"]) == 2
    assert f"no study directory {missing}" in capsys.readouterr().err and not missing.exists()


def test_gin_params_of_the_command_reach_every_arm_after_the_study_params(tmp_path, capsys):
    from trace_jax.cli import main

    path = _write(tmp_path, SMALL + "study.share_warm_start = True\n")
    init = "TrainConfig.init_from = 'runs/studies/main/grpo/seed0'"
    assert main(["study", path, "--print", "--dir", str(tmp_path / "out"), "--gin-param", init]) == 0
    commands = capsys.readouterr().out.strip().splitlines()
    params = [[words[i + 1] for i, word in enumerate(words) if word == "--gin-param"]
              for words in map(shlex.split, commands)]
    assert len(params) == 6 and all(init in arm for arm in params)
    assert params[0].index("TrainConfig.steps = 2") < params[0].index(init)  # after study.params
    # an arm after the seed's first still points at that first arm (the later binding wins in gin)
    shared = f"TrainConfig.init_from = {str(tmp_path / 'out' / 'grpo/seed0')!r}"
    assert params[1].index(init) < params[1].index(shared)


def _fake_arm(directory: Path, accuracy: dict[int, float], tool_calls: dict[int, float], seconds: list[float],
              finished: bool = True, diagnostics: dict[int, dict[str, float]] | None = None,
              scoring: list[float] | None = None, compile: list[float] | None = None,
              comparison: dict | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in sorted(set(accuracy) | set(tool_calls)):
        metrics = dict((diagnostics or {}).get(step, {}))
        if step in tool_calls:
            metrics["tool_calls"] = tool_calls[step]
            metrics["time/step"] = seconds[step - 1]
            if scoring is not None:
                metrics["time/scoring"] = scoring[step - 1]
            if compile is not None:
                metrics["compile_seconds"] = compile[step - 1]
        if step in accuracy:
            metrics["eval/accuracy"] = accuracy[step]
        lines.append(encode_line(step, float(step), metrics))
    (directory / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    if finished:
        summary = {} if comparison is None else {"comparison": comparison}
        (directory / "summary.json").write_text(json.dumps(summary), encoding="utf-8")


def test_resume_skips_finished_arms_and_reruns_an_unfinished_one(tmp_path):
    study = load_study(_write(tmp_path, SMALL))
    out = tmp_path / "out"
    arms = expand(study, out)
    calls = []

    def killed_in_third(arm):
        calls.append(arm.name)
        if arm.name == "grpo/seed1":
            _fake_arm(Path(arm.run.run_dir), {0: 0.1}, {1: 4.0}, [1.0], finished=False)
            return 0  # what `train` returns when stopped by a signal: no summary.json
        _fake_arm(Path(arm.run.run_dir), {0: 0.1, 2: 0.2}, {1: 4.0, 2: 5.0}, [1.0, 2.0])
        return 0

    assert run_study(study, out, killed_in_third, log=lambda _: None, plots=False) == 3
    assert calls == ["grpo/seed0", "trace/seed0", "grpo/seed1"]
    calls.clear()
    assert run_study(study, out, lambda arm: killed_in_third(arm) if arm.name != "grpo/seed1" else (
        calls.append(arm.name), _fake_arm(Path(arm.run.run_dir), {0: 0.1, 2: 0.3}, {1: 4.0, 2: 5.0}, [1.0, 2.0]),
        0)[-1], log=lambda _: None, plots=False) == 0
    assert calls == [a.name for a in arms[2:]]
    results = json.loads((out / "results.json").read_text())
    assert all(a["finished"] for a in results["arms"])


def test_a_failing_arm_stops_the_study_with_its_status(tmp_path):
    study = load_study(_write(tmp_path, SMALL))
    assert run_study(study, tmp_path / "out", lambda arm: 2, log=lambda _: None, plots=False) == 2
    assert not (tmp_path / "out" / "trace/seed0").exists()


def test_a_changed_study_file_does_not_reuse_an_arm_directory(tmp_path):
    out = tmp_path / "out"
    done = lambda arm: (_fake_arm(Path(arm.run.run_dir), {0: 0.1}, {1: 1.0}, [1.0]), 0)[-1]  # noqa: E731
    run_study(load_study(_write(tmp_path, SMALL)), out, done, log=lambda _: None, plots=False)
    changed = load_study(_write(tmp_path, SMALL.replace("TrainConfig.steps = 2", "TrainConfig.steps = 3")))
    with pytest.raises(ConfigError, match=r"study_arm\.json.*grpo/seed0.*new --dir"):
        run_study(changed, out, done, log=lambda _: None, plots=False)


def test_results_aggregate_mean_and_std_over_seeds_per_method(tmp_path):
    study = load_study(_write(tmp_path, SMALL))
    out = tmp_path / "out"
    arms = {a.name: a for a in expand(study, out)}
    _fake_arm(Path(arms["grpo/seed0"].run.run_dir), {0: 0.1, 2: 0.3}, {1: 4.0, 2: 6.0}, [1.0, 3.0],
              comparison={"difference": 0.2, "se": 0.04})
    _fake_arm(Path(arms["grpo/seed1"].run.run_dir), {0: 0.2, 2: 0.6}, {1: 5.0, 2: 7.0}, [2.0, 4.0],
              comparison={"difference": 0.4, "se": 0.05})
    _fake_arm(Path(arms["trace/seed0"].run.run_dir), {0: 0.1, 2: 0.5}, {1: 4.0, 2: 4.0}, [5.0, 7.0],
              scoring=[1.0, 0.0], comparison={"difference": 0.4, "se": 0.045})  # 5 / (5 - 1) = 1.25, 1.0: 1.125
    _fake_arm(Path(arms["ablation/horizon=0/seed0"].run.run_dir), {0: 0.1, 2: 0.2}, {1: 3.0, 2: 3.0}, [1.0, 1.0],
              diagnostics={1: {"credit/terminal_fill_share": 0.5}, 2: {"credit/terminal_fill_share": 0.3}},
              comparison={"difference": 0.1, "se": 0.03})
    results = write_results(study, out, plots=True)
    grpo = results["methods"]["grpo"]
    assert grpo["seeds"] == [0, 1]
    assert grpo["accuracy"]["steps"] == [0, 2]
    assert grpo["accuracy"]["per_seed"] == {"0": [0.1, 0.3], "1": [0.2, 0.6]}
    assert grpo["accuracy"]["mean"] == pytest.approx([0.15, 0.45])
    assert grpo["accuracy"]["std"] == pytest.approx([statistics.stdev([0.1, 0.2]), statistics.stdev([0.3, 0.6])])
    assert grpo["final_accuracy"]["mean"] == pytest.approx(0.45)
    assert grpo["final_accuracy"]["per_seed"] == {"0": 0.3, "1": 0.6}  # keyed by seed, like every per-seed figure
    assert grpo["initial_accuracy"]["per_seed"] == {"0": 0.1, "1": 0.2}  # the warm start's spread over seeds
    assert grpo["tool_calls"]["mean"] == pytest.approx([4.5, 6.5])
    assert grpo["tool_calls_per_episode"] == pytest.approx(5.5)
    assert grpo["median_step_seconds"] == pytest.approx(2.5)  # median over seeds of each seed's median (2, 3)
    trace = results["methods"]["trace"]
    assert trace["seeds"] == [0] and trace["accuracy"]["std"] == [None, None]  # one seed: no spread
    assert results["ablations"]["horizon=0"]["final_accuracy"]["mean"] == pytest.approx(0.2)
    assert [a["finished"] for a in results["arms"]] == [True, True, True, False, True, False]
    assert json.loads((out / "results.json").read_text()) == results
    assert {p.name for p in (out / "plots").iterdir()} == {"accuracy.png", "tool_calls.png", "ablations.png",
                                                            "differences.png"}
    # GRPO's final mean is 0.45: trace's mean curve (0.1, 0.5) reaches it at step 2, as GRPO's own does
    assert results["steps_to_grpo_final"] == {"grpo": 2, "trace": 2}
    assert grpo["wall_seconds"] == {"0": 2.0, "1": 2.0}  # each run's last wall_time
    assert results["wall_seconds_finished_arms"] == pytest.approx(8.0)  # four finished runs
    table = (out / "results.md").read_text()
    assert results["methods"]["trace"]["median_scoring_ratio"] == pytest.approx(1.125)
    assert grpo["median_scoring_ratio"] is None  # no time/scoring logged
    # the runs' own paired comparisons: mean +- std over seeds, or one seed's difference with its SE
    assert grpo["difference"]["mean"] == pytest.approx(0.3) and grpo["difference"]["se"] == {"0": 0.04, "1": 0.05}
    assert grpo["difference"]["per_seed"] == {"0": pytest.approx(0.2), "1": pytest.approx(0.4)}
    # trace's final 0.5 against GRPO's 0.3 on seed 0, the one seed both have
    assert results["difference_from_grpo"]["trace"]["per_seed"] == {"0": pytest.approx(0.2)}
    assert "| grpo | 2 | 15.0 +- 7.1 | 45.0 +- 21.2 | +30.0 +- 14.1 | - | 2 | 5.50 | 2.5 | 1.00 | - | - |" in table
    assert "| trace | 1 | 10.0 | 50.0 | +40.0 (SE 4.5) | +20.0 | 2 | 4.00 | 6.0 | 2.40 | - | 1.125 |" in table
    results["steps_to_grpo_final"]["trace"] = None
    assert "| trace | 1 | 10.0 | 50.0 | +40.0 (SE 4.5) | +20.0 | not reached |" in study_module.results_table(results)
    # the ablations' own table, below the methods': the terminal-fill share is the mean over the arm's steps
    assert "| trace ablation | seeds |" in table
    assert "| horizon=0 | 1 | 10.0 | 20.0 | +10.0 (SE 3.0) | 3.00 | 0.40 | - |" in table


@pytest.mark.slow  # ~10-30 s under load (compiles one rollout, update and evaluation of a one-layer policy)
def test_study_command_runs_one_real_arm_end_to_end(tmp_path, capsys, monkeypatch):
    # The arm's own `trace-jax train` command line, run in this process: the study's process boundary (its own
    # process, signals passed on) is test_an_arm_runs_as_its_own_process_and_a_sigterm_to_the_study_reaches_it's.
    # The policy and sizes are the RL tests' SMALL config (tests/rl/test_rl_pipeline.py), whose programs those
    # tests compile alike.
    import sys

    from tests.rl.test_rl_pipeline import SMALL
    from trace_jax.cli import main

    launched = []

    def run_arm_in_this_process(arm, *, progress=True):
        argv = arm.run.argv(sys.executable) + ([] if progress else ["--no-progress"])
        assert argv[:4] == [sys.executable, "-m", "trace_jax.cli", "train"]
        launched.append(arm.name)
        return main(argv[3:])

    monkeypatch.setattr(study_module, "run_arm_process", run_arm_in_this_process)
    base = _write(tmp_path, SMALL, "small.gin")
    path = _write(tmp_path, f"""
study.name = 'e2e'
study.base = [{base!r}]
study.params = ['TrainConfig.steps = 1']
study.methods = {{'grpo': ['configs/credit/grpo.gin']}}
study.seeds = [3]
""")
    out = tmp_path / "study"

    assert main(["study", path, "--dir", str(out), "--no-progress"]) == 0
    assert launched == ["grpo/seed3"]
    assert (out / "grpo/seed3/summary.json").exists()
    results = json.loads((out / "results.json").read_text())
    assert results["methods"]["grpo"]["accuracy"]["steps"] == [0, 1]
    assert (out / "plots/accuracy.png").exists()
    capsys.readouterr()
    assert main(["study", path, "--dir", str(out), "--no-progress"]) == 0
    assert "grpo/seed3 finished before, skipped" in capsys.readouterr().out
    assert launched == ["grpo/seed3"]


def test_results_hold_each_methods_credit_diagnostics_and_step_time_ratio_to_grpo(tmp_path):
    study = load_study(_write(tmp_path, SMALL))
    out = tmp_path / "out"
    arms = {a.name: a for a in expand(study, out)}
    detour = "credit/detour_turn_credit"
    # seed 0 logs the diagnostic at both steps, seed 1 at one (a step without detours leaves it out)
    _fake_arm(Path(arms["trace/seed0"].run.run_dir), {0: 0.1}, {1: 4.0, 2: 4.0}, [3.0, 3.0],
              diagnostics={1: {detour: -0.2, "zero_signal_groups": 0.5}, 2: {detour: -0.4, "zero_signal_groups": 0.0}})
    _fake_arm(Path(arms["trace/seed1"].run.run_dir), {0: 0.1}, {1: 4.0, 2: 4.0}, [3.0, 3.0],
              diagnostics={2: {detour: 0.1}})
    _fake_arm(Path(arms["grpo/seed0"].run.run_dir), {0: 0.1}, {1: 4.0, 2: 4.0}, [2.0, 2.0], compile=[1.0, 0.0])
    _fake_arm(Path(arms["grpo/seed1"].run.run_dir), {0: 0.1}, {1: 4.0, 2: 4.0}, [2.0, 2.0])  # logged no compile
    results = write_results(study, out, plots=False)
    trace = results["methods"]["trace"]["diagnostics"]
    assert trace[detour]["per_seed"] == {"0": pytest.approx(-0.3), "1": pytest.approx(0.1)}
    assert trace[detour]["mean"] == pytest.approx(-0.1)
    assert trace["zero_signal_groups"]["per_seed"] == {"0": 0.25, "1": None}
    assert results["methods"]["grpo"]["diagnostics"][detour]["mean"] is None
    assert results["step_time_ratio_to_grpo"] == {"grpo": 1.0, "trace": 1.5}
    # GRPO's steady step: seed 0's median of 2 - 1 and 2 - 0; seed 1 logged no compile time; trace none at all
    assert results["methods"]["grpo"]["median_steady_step_seconds"] == pytest.approx(1.5)
    assert results["methods"]["trace"]["median_steady_step_seconds"] is None
    assert results["steady_step_time_ratio_to_grpo"] == {"grpo": 1.0}


def test_an_arm_runs_as_its_own_process_and_a_sigterm_to_the_study_reaches_it(tmp_path):
    import os
    import signal
    import threading

    from trace_jax.rl.sweep import Run

    marker = tmp_path / "started"
    # the marker appears whole (written aside, then renamed): the SIGTERM it triggers cannot meet an empty file
    script = ("import os, signal, sys, time, pathlib\n"
              "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
              f"pathlib.Path({str(marker) + '.part'!r}).write_text(str(os.getpid()))\n"
              f"os.replace({str(marker) + '.part'!r}, {str(marker)!r})\n"
              "time.sleep(60)\n")

    class ScriptRun(Run):
        def argv(self, python="python"):
            return [python, "-c", script]

    arm = study_module.Arm(method="grpo", seed=0, run=ScriptRun("grpo/seed0", (), (), str(tmp_path / "arm")))

    def stop_when_started():
        while not marker.exists():
            threading.Event().wait(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # what `kill <study pid>` does

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=stop_when_started, daemon=True).start()
    assert study_module.run_arm_process(arm, progress=False) == 7  # the arm's own exit status
    assert int(marker.read_text()) != os.getpid()  # a process of its own
    assert signal.getsignal(signal.SIGTERM) is before  # the study's handlers are restored
