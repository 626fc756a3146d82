"""The analysis issue 47's protocol fixes in advance (trace_jax/rl/study.py): the endpoint, paired differences from
GRPO with t and bootstrap CIs, area under the accuracy curve, steps to GRPO's endpoint, the phase gate, the power
calculation and the powered study files, on synthetic run directories with known answers."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from tests.rl.test_study import REPO, _fake_arm, _write
from trace_jax.rl.gin_setup import ConfigError
from trace_jax.rl import study as study_module
from trace_jax.rl.study import (
    accuracy_auc, bootstrap_interval, endpoint, expand, load_study, paired_difference, paired_t_power, run_study,
    seeds_for_power, t_interval, write_results)

# Student t quantiles t_{0.975, df} from a printed table: df = 2, 3, 9
T_TABLE = {2: 4.302652729911275, 3: 3.182446305284263, 9: 2.262157162740992}

GATED = """
study.name = 'gated'
study.base = ['configs/tiny.gin']
study.methods = {'grpo': ['configs/credit/grpo.gin'], 'oracle_progress': ['configs/credit/oracle_progress.gin'],
                 'trace': ['configs/credit/trace.gin'], 'grpo_scaled': ['configs/credit/grpo_scaled.gin']}
study.seeds = [0, 1, 2]
study.share_warm_start = True
study.gate_method = 'oracle_progress'
study.gated_methods = ['trace']
"""


def test_endpoint_is_the_mean_of_the_last_two_evaluations():
    accuracy = {16: 0.3, 0: 0.1, 32: 0.5, 8: 0.2, 24: 0.4}
    assert endpoint(accuracy) == pytest.approx(0.45)
    assert endpoint({0: 0.25}) == 0.25  # a run evaluated once (warm start only): that evaluation
    assert endpoint({}) is None


def test_accuracy_auc_is_the_trapezoid_area_over_the_steps_spanned():
    accuracy = {0: 0.1, 8: 0.2, 16: 0.4, 24: 0.3, 32: 0.5}
    # 8 * (0.15 + 0.3 + 0.35 + 0.4) / 32
    assert accuracy_auc(accuracy) == pytest.approx(0.3)
    assert accuracy_auc({0: 0.2, 4: 0.2}) == pytest.approx(0.2)  # a flat curve: its level
    assert accuracy_auc({0: 0.2}) is None


@pytest.mark.parametrize("values", [[0.05, 0.06, 0.07], [0.02, 0.05, -0.01, 0.08], list(np.linspace(-0.1, 0.2, 10))])
def test_t_interval_is_the_paired_t_interval_of_the_t_table(values):
    from scipy import stats

    n, mean, std = len(values), statistics.fmean(values), statistics.stdev(values)
    half = T_TABLE[n - 1] * std / math.sqrt(n)
    assert t_interval(values) == pytest.approx((mean - half, mean + half), rel=1e-9)
    # the same as scipy's paired t test of two series whose differences these are
    base = np.linspace(0.1, 0.3, n)
    interval = stats.ttest_rel(base + np.asarray(values), base).confidence_interval(0.95)
    assert t_interval(values) == pytest.approx((interval.low, interval.high), rel=1e-9)
    assert t_interval(values[:1]) is None


def test_bootstrap_interval_of_two_seeds_spans_them():
    # resampling 2 seeds: the mean is a (1/4), (a + b) / 2 (1/2) or b (1/4), so the 2.5% and 97.5% quantiles are a, b
    assert bootstrap_interval([0.1, 0.3]) == pytest.approx((0.1, 0.3))
    assert bootstrap_interval([0.2, 0.2, 0.2]) == pytest.approx((0.2, 0.2))
    assert bootstrap_interval([0.4]) is None


def test_bootstrap_interval_is_fixed_by_its_seed_and_near_the_t_interval_for_many_seeds():
    values = list(np.random.default_rng(7).normal(0.05, 0.06, size=40))
    assert bootstrap_interval(values) == bootstrap_interval(values)
    assert bootstrap_interval(values, seed=1) != bootstrap_interval(values)
    low, high = bootstrap_interval(values)
    t_low, t_high = t_interval(values)
    assert low == pytest.approx(t_low, abs=0.006) and high == pytest.approx(t_high, abs=0.006)


def test_paired_difference_pairs_by_seed_and_skips_seeds_one_side_lacks():
    out = paired_difference({"0": 0.3, "1": 0.5, "2": None, "3": 0.4}, {"0": 0.25, "1": 0.44, "2": 0.3})
    assert out["per_seed"] == {"0": pytest.approx(0.05), "1": pytest.approx(0.06)}
    assert out["n"] == 2 and out["mean"] == pytest.approx(0.055)
    assert out["se"] == pytest.approx(statistics.stdev([0.05, 0.06]) / math.sqrt(2))


def _accuracies(seed: int, lift: float) -> dict[int, float]:
    """An arm's held-out accuracy at steps 0, 8 and 16: GRPO's of this seed is 0.1, 0.2 + s / 100, 0.3 + s / 100."""
    return {0: 0.1, 8: 0.2 + seed / 100 + lift, 16: 0.3 + seed / 100 + lift}


def _run_fake(lifts: dict[str, list[float]], calls: list[str]):
    def run_arm(arm):
        calls.append(arm.name)
        _fake_arm(Path(arm.run.run_dir), _accuracies(arm.seed, lifts[arm.method][arm.seed]), {1: 4.0, 16: 5.0},
                  [1.0] * 16)
        return 0
    return run_arm


def test_paired_differences_aucs_and_steps_on_synthetic_runs(tmp_path):
    study = load_study(_write(tmp_path, GATED))
    lifts = {"grpo": [0.0] * 3, "oracle_progress": [0.05, 0.06, 0.07], "trace": [-0.1, 0.0, 0.1],
             "grpo_scaled": [0.0, 0.0, 0.0]}
    assert run_study(study, tmp_path / "out", _run_fake(lifts, []), log=lambda _: None, plots=False) == 0
    results = json.loads((tmp_path / "out/results.json").read_text())
    oracle = results["endpoint_difference_from_grpo"]["oracle_progress"]
    assert oracle["per_seed"] == {"0": pytest.approx(0.05), "1": pytest.approx(0.06), "2": pytest.approx(0.07)}
    half = T_TABLE[2] * 0.01 / math.sqrt(3)
    assert oracle["ci_t"] == pytest.approx([0.06 - half, 0.06 + half])
    assert oracle["ci_bootstrap"][0] >= 0.05 - 1e-12 and oracle["ci_bootstrap"][1] <= 0.07 + 1e-12
    # GRPO's endpoint on seed s is 0.25 + s / 100; on seed 1 its curve is 0.1, 0.21, 0.31 at steps 0, 8, 16: AUC
    # (8 (0.1 + 0.21) / 2 + 8 (0.21 + 0.31) / 2) / 16
    assert results["methods"]["grpo"]["endpoint"]["per_seed"]["2"] == pytest.approx(0.27)
    assert results["methods"]["grpo"]["auc"]["per_seed"]["1"] == pytest.approx(0.2075)
    # the lift enters steps 8 and 16: the AUC's difference is 3/4 of it
    assert results["auc_difference_from_grpo"]["trace"]["per_seed"] == {
        "0": pytest.approx(-0.075), "1": pytest.approx(0.0), "2": pytest.approx(0.075)}
    assert results["initial_difference_from_grpo"]["trace"]["mean"] == pytest.approx(0.0)
    # GRPO's endpoint (0.25 + s/100) is reached at step 16 by GRPO; by trace at 8 on seed 2 (lift 0.1), 16 on seed 1,
    # never on seed 0 (lift -0.1)
    reach = results["steps_to_grpo_endpoint"]
    assert reach["grpo"] == {"per_seed": {"0": 16, "1": 16, "2": 16}, "reached": 3, "seeds": 3, "median": 16}
    assert reach["trace"]["per_seed"] == {"0": None, "1": 16, "2": 8} and reach["trace"]["median"] == 16
    table = (tmp_path / "out/results.md").read_text()
    low, high = 100 * (0.06 - half), 100 * (0.06 + half)
    assert (f"| oracle_progress | 3 | 10.0 +- 0.0 | +0.0 +- 0.0 [+0.0, +0.0] | 32.0 +- 2.0 | +6.0 +- 1.0 | "
            f"[{low:+.1f}, {high:+.1f}] | [+5.0, +7.0] | 25.2 +- 1.5 | +4.5 +- 0.8 [+2.6, +6.4] | 8; 3/3 |") in table
    assert "| trace | 3 |" in table and "| 16; 2/3 |" in table
    assert "Gate (the paired-t 95% CI" in table and "passed: oracle_progress - grpo = +6.0 points" in table
    # the per-seed table: every arm's evaluations, endpoint, difference from GRPO on its seed, tool calls per episode
    # (mean of 4 and 5), mean |A| per token (none recorded here) and wall minutes (the last record's wall_time, 16 s);
    # seeds in order, methods in the file's
    assert ("| step 0 (%) | step 8 (%) | step 16 (%) | endpoint (%) | vs GRPO (points) | tool calls / episode | "
            "mean abs A / token | held-out tool errors / episode, first -> last | wall (min) |") in table
    rows = [line for line in table.splitlines() if line.startswith(("| 0 |", "| 1 |", "| 2 |"))]
    assert [row.split(" | ")[:2] for row in rows] == [[f"| {seed}", method] for seed in (0, 1, 2) for method in lifts]
    assert "| 1 | grpo | 10.0 | 21.0 | 31.0 | 26.0 | - | 4.50 | - | - | 0.3 |" in rows
    assert "| 2 | trace | 10.0 | 32.0 | 42.0 | 37.0 | +10.0 | 4.50 | - | - | 0.3 |" in rows
    assert "| 0 | oracle_progress | 10.0 | 25.0 | 35.0 | 30.0 | +5.0 | 4.50 | - | - | 0.3 |" in rows
    assert study_module.seed_table({"methods": {}}) == ""
    # one seed: a difference without an interval prints no placeholder for one
    single = {"methods": {"grpo": {"seeds": [0]}, "trace": {"seeds": [0]}},
              "initial_difference_from_grpo": {"trace": {"mean": 0.0, "std": None, "ci_t": None}},
              "auc_difference_from_grpo": {"trace": {"mean": 0.034, "std": None, "ci_t": None}}}
    row = [line for line in study_module.endpoint_table(single).splitlines() if line.startswith("| trace |")][0]
    assert row.split(" | ")[3] == "+0.0" and row.split(" | ")[9] == "+3.4"


def test_sensitivity_repeats_the_differences_without_the_seeds_it_names(tmp_path):
    text = GATED.replace("study.seeds = [0, 1, 2]", "study.seeds = [0, 1, 2, 3]") + (
        "study.sensitivity = {'new warm starts': [3]}\n")
    study = load_study(_write(tmp_path, text))
    lifts = {"grpo": [0.0] * 4, "oracle_progress": [0.05, -0.04, 0.01, 0.0], "trace": [0.0] * 4,
             "grpo_scaled": [0.02, 0.04, 0.06, -0.3]}
    assert run_study(study, tmp_path / "out", _run_fake(lifts, []), log=lambda _: None, plots=False) == 0
    results = json.loads((tmp_path / "out/results.json").read_text())
    assert results["endpoint_difference_from_grpo"]["grpo_scaled"]["n"] == 4  # the main analysis keeps every seed
    analysis = results["sensitivity"]["new warm starts"]
    scaled = analysis["endpoint_difference_from_grpo"]["grpo_scaled"]
    assert analysis["left_out"] == [3] and scaled["n"] == 3 and "3" not in scaled["per_seed"]
    half = T_TABLE[2] * 0.02 / math.sqrt(3)
    assert scaled["mean"] == pytest.approx(0.04) and scaled["ci_t"] == pytest.approx([0.04 - half, 0.04 + half])
    assert analysis["auc_difference_from_grpo"]["grpo_scaled"]["mean"] == pytest.approx(0.03)  # 3/4 of the lift
    table = (tmp_path / "out/results.md").read_text()
    assert (f"| new warm starts (seeds 3) | grpo_scaled | 3 | +4.0 +- 2.0 | [{100 * (0.04 - half):+.1f}, "
            f"{100 * (0.04 + half):+.1f}] | [+2.0, +6.0] | +3.0 +- 1.5 [") in table
    assert "| new warm starts (seeds 3) | grpo |" not in table
    assert study_module.sensitivity_table({"methods": {}}) == ""
    for bad in ("{'x': [7]}", "{'x': [0, 1, 2]}", "{'': [3]}", "{'x': 3}"):
        with pytest.raises(ConfigError, match="study.sensitivity"):
            load_study(_write(tmp_path, text.replace("{'new warm starts': [3]}", bad), "bad.gin"))


PAIR = """
study.name = 'pair'
study.base = ['configs/tiny.gin']
study.methods = {'grpo': ['configs/credit/grpo.gin'], 'oracle_progress': ['configs/credit/oracle_progress.gin']}
study.seeds = [0, 1]
study.share_warm_start = True
"""


def test_credit_table_and_held_out_tool_errors_come_from_each_arms_records(tmp_path):
    study = load_study(_write(tmp_path, PAIR))
    # per arm: the turn credit's Spearman with progress on steps 1 and 2 (its mean is the arm's figure), the mean
    # |A| per token, and held-out tool errors at the evaluations of steps 0 and 2
    spearman = {("grpo", 0): (0.1, 0.2), ("grpo", 1): (0.2, 0.3), ("oracle_progress", 0): (0.3, 0.5),
                ("oracle_progress", 1): (0.4, 0.6)}

    def run_arm(arm):
        rho = spearman[(arm.method, arm.seed)]
        diagnostics = {0: {"eval/tool_errors": 0.1 * arm.seed},
                       1: {"credit/progress_spearman": rho[0], "credit/mean_abs_token_advantage": 0.4},
                       2: {"credit/progress_spearman": rho[1], "credit/mean_abs_token_advantage": 0.6,
                           "eval/tool_errors": 1.5 + arm.seed}}
        _fake_arm(Path(arm.run.run_dir), {0: 0.2, 2: 0.3}, {1: 4.0, 2: 6.0}, [1.0, 1.0], diagnostics=diagnostics)
        return 0

    assert run_study(study, tmp_path / "out", run_arm, log=lambda _: None, plots=False) == 0
    results = json.loads((tmp_path / "out/results.json").read_text())
    assert results["methods"]["grpo"]["eval_tool_errors"]["per_seed"] == {"0": [0.0, 1.5], "1": [0.1, 2.5]}
    table = (tmp_path / "out/results.md").read_text()
    # grpo: arm means 0.15 and 0.25 -> 0.200 +- 0.071; oracle: 0.4 and 0.5 -> 0.450 +- 0.071; |A| 0.5 on every arm
    assert "| grpo | 2 | 0.200 +- 0.071 | - | - | - | - | 0.500 +- 0.000 |" in table
    assert "| oracle_progress | 2 | 0.450 +- 0.071 | - | - | - | - | 0.500 +- 0.000 |" in table
    assert "| 1 | oracle_progress | 20.0 | 30.0 | 25.0 | +0.0 | 5.00 | 0.500 | 0.10 -> 2.50 | 0.0 |" in table
    # a record without any of the credit diagnostics has no credit table
    assert study_module.credit_table({"methods": {"grpo": {"seeds": [0], "diagnostics": {}}}}) == ""


def test_gate_runs_its_arms_first_then_the_gated_ones_when_the_gate_method_beats_grpo(tmp_path):
    study = load_study(_write(tmp_path, GATED))
    calls: list[str] = []
    lifts = {"grpo": [0.0] * 3, "oracle_progress": [0.05, 0.06, 0.07], "trace": [0.0] * 3, "grpo_scaled": [0.0] * 3}
    assert run_study(study, tmp_path / "out", _run_fake(lifts, calls), log=lambda _: None, plots=False) == 0
    assert calls[:6] == ["grpo/seed0", "oracle_progress/seed0", "grpo/seed1", "oracle_progress/seed1",
                         "grpo/seed2", "oracle_progress/seed2"]
    assert calls[6:] == ["trace/seed0", "grpo_scaled/seed0", "trace/seed1", "grpo_scaled/seed1", "trace/seed2",
                         "grpo_scaled/seed2"]
    gate = json.loads((tmp_path / "out/results.json").read_text())["gate"]
    assert gate["passed"] is True and gate["difference"]["n"] == 3
    assert study_module.run_order(study, expand(study, tmp_path / "out"))[6].name == "trace/seed0"


def test_gate_skips_the_gated_arms_when_the_gate_methods_ci_reaches_zero(tmp_path):
    study = load_study(_write(tmp_path, GATED))
    calls: list[str] = []
    lifts = {"grpo": [0.0] * 3, "oracle_progress": [0.05, -0.04, 0.01], "trace": [0.0] * 3,
             "grpo_scaled": [0.0] * 3}
    logged: list[str] = []
    assert run_study(study, tmp_path / "out", _run_fake(lifts, calls), log=logged.append, plots=False) == 0
    assert not any(name.startswith("trace/") for name in calls)
    assert [name for name in calls if name.startswith("grpo_scaled/")] == [f"grpo_scaled/seed{s}" for s in range(3)]
    results = json.loads((tmp_path / "out/results.json").read_text())
    assert results["gate"]["passed"] is False and results["gate"]["reason"].startswith("failed: ")
    assert [a["name"] for a in results["arms"] if a.get("skipped_by_gate")] == [f"trace/seed{s}" for s in range(3)]
    assert any("skipping the arms of trace" in line for line in logged)


def test_gate_is_undecided_while_a_seed_of_its_arms_is_unfinished(tmp_path):
    study = load_study(_write(tmp_path, GATED))
    out = tmp_path / "out"
    arms = {a.name: a for a in expand(study, out)}
    for seed in (0, 1):
        for method in ("grpo", "oracle_progress"):
            _fake_arm(Path(arms[f"{method}/seed{seed}"].run.run_dir), _accuracies(seed, 0.1), {1: 4.0}, [1.0])
    gate = write_results(study, out, plots=False)["gate"]
    assert gate["passed"] is None and "grpo: [2]" in gate["reason"]


@pytest.mark.parametrize("change, message", [
    ("study.gate_method = 'grpo'", "gate_method"),
    ("study.gated_methods = ['grpo']", "gated_methods"),
    ("study.gated_methods = ['nope']", "gated_methods"),
    ("study.seeds = [0]", "at least 2 seeds"),
    ("study.own_warm_start = ['nope']", "own_warm_start"),
])
def test_a_bad_gate_or_own_warm_start_names_the_field(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        load_study(_write(tmp_path, GATED + change + "\n"))


def test_own_warm_start_methods_warm_start_themselves(tmp_path):
    text = GATED.replace("study.gate_method = 'oracle_progress'\nstudy.gated_methods = ['trace']\n",
                         "study.own_warm_start = ['trace']\n")
    arms = {a.name: a for a in expand(load_study(_write(tmp_path, text)), tmp_path)}
    assert not any("init_from" in p for p in arms["trace/seed1"].run.gin_params)
    assert arms["grpo_scaled/seed1"].run.gin_params[-1] == f"TrainConfig.init_from = {str(tmp_path / 'grpo/seed1')!r}"


# ------------------------------------------------------------------------------------------------ power
def test_seeds_for_power_match_the_paired_t_tables():
    # two-sided 0.05, power 0.8: effect size d = 0.5 needs 34 pairs, d = 0.8 needs 15 (Cohen's / G*Power's tables)
    assert seeds_for_power(0.5, 1.0) == 34
    assert seeds_for_power(0.8, 1.0) == 15
    assert paired_t_power(0.8, 1.0, 15) >= 0.8 > paired_t_power(0.8, 1.0, 14)
    assert study_module.detectable_effect(1.0, 15) == pytest.approx(0.8, abs=0.03)


def test_paired_t_power_matches_a_simulation():
    rng = np.random.default_rng(0)
    from scipy import stats

    draws = rng.normal(0.05, 0.063, size=(20_000, 6))
    t = draws.mean(axis=1) / (draws.std(axis=1, ddof=1) / math.sqrt(6))
    simulated = float(np.mean(np.abs(t) > stats.t.ppf(0.975, 5)))
    assert paired_t_power(0.05, 0.063, 6) == pytest.approx(simulated, abs=0.01)


def test_power_of_the_first_studys_record_asks_for_15_seeds(capsys):
    from trace_jax.cli import main

    assert main(["study", str(REPO / "configs/studies/main.gin"), "--dir", str(REPO / "docs/results/study"),
                 "--power", "5"]) == 0
    text = capsys.readouterr().out
    assert "pooled std 6.3 points (14 df): 15 paired seeds for 5 points at 80% power" in text
    assert "the record's 3 seeds had power 0.13" in text


# ------------------------------------------------------------------------------------------------ the study files
def test_powered_study_files_parse_and_phase_2_continues_phase_1():
    from trace_jax.rl.sweep import validate_runs

    phase1, phase2, abc = (load_study(str(REPO / f"configs/studies/powered_{n}.gin"))
                           for n in ("phase1", "phase2", "abc"))
    assert phase1.name == phase2.name == "powered" and len(phase1.seeds) >= 10 and phase2.seeds == phase1.seeds
    arms1, arms2 = expand(phase1, "runs/x"), expand(phase2, "runs/x")
    # phase 1's arms are phase 2's with the same bindings, so phase 2 skips them once finished
    by_name = {a.name: a.run for a in arms2}
    assert all(by_name[a.name] == a.run for a in arms1)
    assert phase2.gate_method == "oracle_progress" and set(phase2.gated_methods) == {"trace_log_ratio",
                                                                                       "trace_alpha_favoured"}
    assert len(abc.seeds) >= 5 and abc.own_warm_start == ("sft",)
    configs = validate_runs([a.run for a in arms2[:5] + expand(abc, "runs/y")[:3]], what="powered")
    for config in configs:
        assert config.train.steps in (0, 32) and config.eval.every_steps == 8
        assert config.eval.num_tasks == config.data.num_eval_tasks == 256
    grpo, oracle, trace, favoured, scaled = (c.credit for c in configs[:5])
    assert (oracle.estimator, trace.estimator, scaled.estimator) == ("oracle_progress", "trace", "grpo_scaled")
    assert oracle.alpha_turn == trace.alpha_turn == scaled.alpha_turn == 0.2 and trace.horizon == 3
    abc_sft_grpo, abc_grpo, sft = configs[5:]
    assert abc_sft_grpo.credit.estimator == "grpo" and abc_sft_grpo.warmstart.weighting == "abc"
    assert abc_grpo.credit.estimator == "abc_grpo" and sft.train.steps == 0
    assert sft.warmstart.weighting == "uniform" and sft.warmstart.failed_share == abc_sft_grpo.warmstart.failed_share > 0


def test_the_powered_configs_held_out_split_has_256_distinct_tasks():
    from trace_jax.data.sources import procedural_splits
    from trace_jax.rl.gin_setup import parse

    data = parse([str(REPO / "configs/powered.gin")]).data
    splits = procedural_splits(data.world, data.tasks, num_train=data.num_train_tasks, num_eval=data.num_eval_tasks,
                               seed=data.seed)
    assert len({t.question for t in splits.heldout}) == 256
    assert not {t.question for t in splits.heldout} & {t.question for t in splits.train}
