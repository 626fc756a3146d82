"""`trace-jax credit-quality` (trace_jax/rl/credit_quality.py): each metric against a naive loop, and the command."""

from __future__ import annotations

import dataclasses
import json
import time

import jax.numpy as jnp
import numpy as np
import pytest

from tests.rl.test_credit_diagnostics import _episode
from tests.rl.test_rl_pipeline import PROMPTS, SMALL
from trace_jax.cli import main
from trace_jax.credit import CreditConfig, trace_values
from trace_jax.rl import cli as train_cli
from trace_jax.rl import credit_quality as cq
from trace_jax.rl.credit_diagnostics import progress_gains
from trace_jax.rl.loop import TURN_SCORES_FILE


def naive_auc(scores, positive):
    pos = [s for s, p in zip(scores, positive) if p]
    neg = [s for s, p in zip(scores, positive) if not p]
    if not pos or not neg:
        return float("nan")
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


def naive_ranks(values):
    return [1 + sum(v < x for v in values) + (sum(v == x for v in values) - 1) / 2 for x in values]


def naive_spearman(x, y):
    rx, ry = np.asarray(naive_ranks(list(x)), float), np.asarray(naive_ranks(list(y)), float)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = np.sqrt((rx ** 2).sum() * (ry ** 2).sum())
    return float((rx * ry).sum() / den) if den > 0 else float("nan")


def expand(counts, group, *arrays):
    """The bootstrap data set a row of group counts stands for: each group's items repeated count times."""
    index = [i for g, c in enumerate(counts) for _ in range(int(c)) for i in np.nonzero(group == g)[0]]
    return [np.asarray(a)[index] for a in arrays]


def test_auc_matches_the_pairwise_count_with_ties():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 40).astype(float)  # many ties
    positive = rng.random(40) < 0.3
    got = cq.weighted_auc(scores, positive, np.ones((1, 40)))[0]
    assert got == pytest.approx(naive_auc(scores, positive), abs=1e-12)
    assert cq.weighted_auc([1.0, 2.0, 3.0], [False, False, True], np.ones((1, 3)))[0] == 1.0
    assert np.isnan(cq.weighted_auc([1.0, 2.0], [True, True], np.ones((1, 2)))[0])


def test_spearman_with_ties_matches_average_ranks_by_loop():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 4, 30).astype(float)
    y = x + rng.integers(0, 3, 30)
    assert cq.weighted_spearman(x, y, np.ones((1, 30)))[0] == pytest.approx(naive_spearman(x, y), abs=1e-12)
    assert np.isnan(cq.weighted_spearman(x, np.zeros(30), np.ones((1, 30)))[0])


def test_weighted_metrics_equal_the_metrics_of_the_resampled_data_set():
    rng = np.random.default_rng(2)
    group = np.repeat(np.arange(6), 5)
    scores = rng.integers(0, 6, 30).astype(float)
    positive = rng.random(30) < 0.4
    other = rng.integers(0, 3, 30).astype(float)
    counts = cq.group_counts(6, 20, seed=3)
    auc = cq.weighted_auc(scores, positive, counts[:, group])
    rho = cq.weighted_spearman(scores, other, counts[:, group])
    mean = cq.weighted_mean(scores, counts[:, group] * positive)
    for b, row in enumerate(counts):
        s, p, o = expand(row, group, scores, positive, other)
        np.testing.assert_allclose(auc[b], naive_auc(s, p), atol=1e-12)
        np.testing.assert_allclose(rho[b], naive_spearman(s, o), atol=1e-12)
        np.testing.assert_allclose(mean[b], s[p].mean() if p.any() else np.nan, atol=1e-12)


def test_bootstrap_is_reproducible_with_a_seed_and_differs_with_another():
    a, b, c = cq.group_counts(9, 50, seed=7), cq.group_counts(9, 50, seed=7), cq.group_counts(9, 50, seed=8)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert (a.sum(axis=1) == 9).all()


def test_estimate_is_the_full_sample_and_the_percentile_interval_of_the_resamples():
    values = np.r_[0.5, np.linspace(0.0, 1.0, 401)]
    e = cq.estimate(values)
    assert e["value"] == 0.5
    assert e["low"] == pytest.approx(0.025) and e["high"] == pytest.approx(0.975)
    assert e["defined"] == 401
    assert cq.estimate(np.r_[0.5, np.nan, 1.0, np.nan])["defined"] == 1


def test_last_state_separation_compares_correct_and_wrong_episodes_of_one_group_only():
    # group 0: correct values 2, 1 vs wrong 1, 0 -> pairs (2>1, 2>0, 1=1, 1>0) = 3.5 of 4; group 1: all correct
    # (no pairs); group 2: correct -5 vs wrong 3 -> 0 of 1. Across groups the correct -5 would beat nothing.
    values = np.array([2.0, 1.0, 1.0, 0.0, 9.0, 9.0, -5.0, 3.0])
    correct = np.array([1, 1, 0, 0, 1, 1, 1, 0], bool)
    group = np.array([0, 0, 0, 0, 1, 1, 2, 2])
    auc, gap = cq.group_separation(values, correct, group, np.ones((1, 3)))
    assert auc[0] == pytest.approx(3.5 / 5)
    assert gap[0] == pytest.approx(((1.5 - 0.5) + (-5 - 3)) / 2)
    counts = cq.group_counts(3, 30, seed=0)
    auc, gap = cq.group_separation(values, correct, group, counts)
    for b, row in enumerate(counts):  # naive: pairs inside each drawn copy of a group
        wins = pairs = 0.0
        gaps = []
        for g, c in enumerate(row):
            r, w = values[(group == g) & correct], values[(group == g) & ~correct]
            if r.size and w.size:
                wins += c * naive_auc(np.r_[r, w], np.r_[np.ones(r.size), np.zeros(w.size)].astype(bool)) * r.size \
                    * w.size
                pairs += c * r.size * w.size
                gaps += [r.mean() - w.mean()] * int(c)
        np.testing.assert_allclose(auc[b], wins / pairs if pairs else np.nan, atol=1e-12)
        np.testing.assert_allclose(gap[b], np.mean(gaps) if gaps else np.nan, atol=1e-12)


def test_a_chain_page_counts_as_opened_first_only_on_the_first_turn_that_shows_it():
    episode = _episode()
    page = episode.observations[2]  # the chain's page "Tuda Trading", opened at turn 2
    episode = dataclasses.replace(episode, tool_calls=[*episode.tool_calls[:3], ("open", {"id": 0})],
                                  observations=[*episode.observations[:3], page],
                                  turn_texts=[*episode.turn_texts[:3], "o", "<answer>Kirda</answer>"])
    assert cq.chain_page_opens(episode).tolist() == [False, False, True, False]
    assert cq.chain_page_opens(dataclasses.replace(episode, clues=())) is None


def test_progress_gains_are_the_oracle_estimators_input_one_row_per_episode_zero_without_a_chain():
    gains = progress_gains([_episode(), _episode(clues=())], 6)
    np.testing.assert_array_equal(gains, [[0, 0, 0.5, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    assert gains.dtype == np.float32


def test_a_template_without_the_answer_at_its_end_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--templates"):
        cq.check_template("<answer>{answer}</answer>")
    with pytest.raises(ValueError, match="--templates"):
        cq.check_template("no field")
    cq.check_template("The answer is {answer}")


def test_every_estimator_family_is_an_arm_and_trace_per_template():
    arms = cq.arms(["A {answer}", "B {answer}"])
    trace = [a for a in arms if a.form]
    assert len(trace) == 2 * 3 * 4 and {a.horizon for a in trace} == {0, 1, 3, 5}
    assert [a.estimator for a in arms if not a.form] == ["grpo", "gigpo", "abc_grpo", "oracle_progress"]


def naive_ordering(values, reference, unit):
    """Pairwise ordering agreement by a double loop over items (pairs of one unit whose reference differs)."""
    wins = pairs = 0.0
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            if unit[i] != unit[j] or reference[i] == reference[j]:
                continue
            pairs += 1
            same = np.sign(values[i] - values[j]) == np.sign(reference[i] - reference[j])
            wins += 1.0 if same else 0.5 if values[i] == values[j] else 0.0
    return wins / pairs if pairs else float("nan")


def test_ordering_agreement_matches_a_pair_loop_per_unit_and_per_resample():
    rng = np.random.default_rng(4)
    group = np.repeat(np.arange(5), 12)
    episode = group * 3 + rng.integers(0, 3, 60)  # episodes nest in groups
    values = rng.integers(0, 4, 60).astype(float)  # ties in both
    reference = rng.integers(0, 3, 60).astype(float)
    for unit in (group, episode):
        assert cq.ordering_agreement(values, reference, group, unit, np.ones((1, 5)))[0] == \
            pytest.approx(naive_ordering(values, reference, unit), abs=1e-12)
    counts = cq.group_counts(5, 20, seed=1)
    got = cq.ordering_agreement(values, reference, group, episode, counts)
    for b, row in enumerate(counts):  # a group drawn c times: its pairs counted c times, no pairs across copies
        wins = pairs = 0.0
        for g, c in enumerate(row):
            at = group == g
            n = sum(1 for i in np.nonzero(at)[0] for j in np.nonzero(at)[0]
                    if i < j and episode[i] == episode[j] and reference[i] != reference[j])
            if n:
                wins += c * n * naive_ordering(values[at], reference[at], episode[at])
                pairs += c * n
        np.testing.assert_allclose(got[b], wins / pairs if pairs else np.nan, atol=1e-12)


def test_the_favoured_alpha_is_the_best_criterion_and_ties_go_to_the_smallest_alpha():
    assert cq.favoured_alpha([0.1, 0.2, 1.0], [0.6, 0.7, 0.65]) == 0.2
    assert cq.favoured_alpha([0.1, 0.2, 1.0], [0.7, 0.6, 0.7]) == 0.1
    assert cq.favoured_alpha([0.1, 0.2, 1.0], [0.7 - 1e-12, 0.6, 0.7]) == 0.1  # rounding is a tie
    assert cq.favoured_alpha([0.1, 0.2, 1.0], [0.7 - 1e-6, 0.6, 0.7]) == 1.0
    assert cq.favoured_alpha([0.1, 0.2], [None, 0.5]) == 0.2
    assert cq.favoured_alpha([0.1, 0.2], [None, float("nan")]) is None


def test_alphas_parse_sorted_and_bad_values_are_refused_naming_the_flag():
    assert cq.parse_alphas("1, 0.05,0.2") == (0.05, 0.2, 1.0)
    assert cq.parse_alphas("0") == (0.0,)
    assert 0.2 in cq.DEFAULT_ALPHAS
    for bad in ("", "0.1,,0.2", "0.1,x", "-0.5", "nan", "inf", "0.2,0.2"):
        with pytest.raises(ValueError, match="--alphas"):
            cq.parse_alphas(bad)


def synthetic_sample(turn_terms: str, seed: int = 0, groups: int = 24, size: int = 8, turns: int = 5) -> dict:
    """A pooled sample whose TRACE log-ratio TDs are known: each state's score is chosen so that
    `delta_k = log(d_k / d_{k+1})` equals the progress gain ('progress') or independent noise ('noise'). Progress
    gains are 0 or 1/4 per turn; an episode is correct with probability rising with its total progress."""
    rng = np.random.default_rng(seed)
    episodes = groups * size
    progress = np.where(rng.random((episodes, turns)) < 0.3, 0.25, 0.0)
    reward = (rng.random(episodes) < 0.1 + 0.6 * progress.sum(1) / (0.25 * turns)).astype(float)
    deltas = progress if turn_terms == "progress" else rng.uniform(0.0, 0.25, (episodes, turns))
    gap = 3.0 * np.exp(-np.c_[np.zeros(episodes), np.cumsum(deltas, 1)])  # d_k, 3 -> >= 3 e^-1.25 > eps
    scores = 0.1 - gap  # l_k = eps - d_k (eps = 0.1, CreditConfig's)
    return {"group": np.repeat(np.arange(groups), size), "reward": reward, "correct": reward > 0,
            "num_turns": np.full(episodes, turns), "judged": np.ones((episodes, turns), bool),
            "progress": progress, "scores": {"T {answer}": scores}}


def _alpha_rows(data, config, alphas=(0.01, 0.1, 1.0, 10.0, 100.0)):
    from trace_jax.credit import CreditConfig

    counts = np.vstack([np.ones((1, int(data["group"].max()) + 1)), cq.group_counts(24, 30, seed=0)])
    table = cq.alpha_table(data, ["T {answer}"], CreditConfig(**config), alphas, counts, run_template="T {answer}")
    return table, table["templates"]["T {answer}"]["rows"]


def test_with_turn_terms_equal_to_progress_agreement_rises_with_alpha():
    # K = 1 and no terminal fill: r_k = delta_k = the progress gain, so the advantage is A_out + alpha g_k
    table, rows = _alpha_rows(synthetic_sample("progress"), {"horizon": 1, "terminal_fill": 0.0})
    agreement = [r[cq.ALPHA_CRITERION]["value"] for r in rows]
    assert all(b >= a for a, b in zip(agreement, agreement[1:])) and agreement[-1] > agreement[0] + 0.05
    assert agreement[-1] == pytest.approx(1.0)
    assert table["favoured"] == 100.0
    assert [r["within_episode_ordering"]["value"] for r in rows] == pytest.approx([1.0] * len(rows))


def test_with_independent_noise_as_turn_terms_agreement_falls_with_alpha():
    table, rows = _alpha_rows(synthetic_sample("noise"), {"horizon": 1, "terminal_fill": 0.0})
    agreement = [r[cq.ALPHA_CRITERION]["value"] for r in rows]
    # small alpha: the outcome orders turns of different episodes, and correct episodes progressed more (> 0.5);
    # large alpha: the noise orders every pair (-> 0.5)
    assert agreement[0] > 0.55 and agreement[-1] < agreement[0] - 0.03
    assert all(b <= a + 1e-9 for a, b in zip(agreement, agreement[1:]))
    assert table["favoured"] == 0.01


def test_alpha_cannot_change_how_turns_of_one_episode_are_ordered():
    _, rows = _alpha_rows(synthetic_sample("noise", seed=3), {})  # TRACE's defaults: K = 3, terminal fill 2
    within = [r["within_episode_ordering"]["value"] for r in rows]
    assert max(within) - min(within) < 1e-9 and within[0] != pytest.approx(1.0)


def test_the_alpha_advantage_is_alpha_out_a_out_plus_alpha_times_traces_turn_credit():
    from trace_jax.credit import CreditConfig, grouped_outcome_advantages, trace_turn_credit

    data = synthetic_sample("noise", seed=5, groups=4)
    data["num_turns"] = np.random.default_rng(6).integers(0, 6, len(data["group"]))  # ragged, 0 included
    config = CreditConfig(alpha_out=0.7)
    got = cq.trace_alpha_advantages(config, data["scores"]["T {answer}"], data["reward"], data["group"],
                                    data["num_turns"], 0.5)
    outcome = np.asarray(grouped_outcome_advantages(jnp.asarray(data["reward"], jnp.float32),
                                                    jnp.asarray(data["group"]), 4), np.float64)
    turn = np.asarray(trace_turn_credit(jnp.asarray(data["scores"]["T {answer}"], jnp.float32),
                                        jnp.asarray(data["num_turns"]), jnp.asarray(outcome, jnp.float32)))
    want = 0.7 * outcome[:, None] + 0.5 * turn
    real = np.arange(5)[None, :] < data["num_turns"][:, None]
    np.testing.assert_allclose(got[real], want[real], atol=1e-5)
    assert np.isnan(got[~real]).all()


def test_the_difference_column_is_zero_at_the_configs_alpha_and_absent_when_it_is_off_the_grid():
    from trace_jax.credit import CreditConfig

    data = synthetic_sample("noise", groups=6)
    counts = np.vstack([np.ones((1, 6)), cq.group_counts(6, 20, seed=0)])
    table = cq.alpha_table(data, ["T {answer}"], CreditConfig(), (0.1, 0.2, 1.0), counts)
    rows = table["templates"]["T {answer}"]["rows"]
    assert rows[1]["difference_from_config_alpha"]["value"] == 0.0
    assert table["favoured"] is None  # the run's template was not scored: per-template only
    assert table["templates"]["T {answer}"]["favoured"] in (0.1, 0.2, 1.0)
    table = cq.alpha_table(data, ["T {answer}"], CreditConfig(), (0.1, 1.0), counts)
    assert all(r["difference_from_config_alpha"] is None for r in table["templates"]["T {answer}"]["rows"])


def test_the_report_states_the_favoured_alpha_on_one_line_with_its_difference_from_the_configs():
    from trace_jax.credit import CreditConfig

    data = synthetic_sample("progress", groups=6)
    counts = np.vstack([np.ones((1, 6)), cq.group_counts(6, 20, seed=0)])
    table = cq.alpha_table(data, ["T {answer}"], CreditConfig(horizon=1, terminal_fill=0.0), (0.2, 50.0), counts,
                           run_template="T {answer}")
    line = cq.favoured_line(table)
    assert table["favoured"] == 50.0 and line.startswith("**Favoured alpha_turn: 50**")
    assert "minus its value at the config's 0.2" in line and "\n" not in line
    table = cq.alpha_table(data, ["T {answer}"], CreditConfig(), (0.2, 50.0), counts, run_template="other {answer}")
    assert "per template" in cq.favoured_line(table) and "`T {answer}`" in cq.favoured_line(table)


def _report_dir(root, name, criteria, alphas=(0.1, 0.2, 1.0), template="T {answer}"):
    """A finished report directory holding only an alpha table with these criterion point estimates."""
    rows = [{"alpha": a, cq.ALPHA_CRITERION: {"value": c}} for a, c in zip(alphas, criteria)]
    directory = root / name
    directory.mkdir()
    (directory / "credit_quality.json").write_text(json.dumps({"alpha": {
        "alphas": list(alphas), "run_template": template, "templates": {template: {"rows": rows}}}}))
    return directory


def test_over_several_warm_starts_the_favoured_alpha_has_the_best_mean_criterion(tmp_path):
    one = _report_dir(tmp_path, "s0", [0.60, 0.70, 0.62])
    two = _report_dir(tmp_path, "s1", [0.64, 0.58, 0.66])  # means 0.62, 0.64, 0.64: a tie -> 0.2
    alpha, means = cq.favoured_over_reports([one, two])
    assert alpha == 0.2 and means == pytest.approx({0.1: 0.62, 0.2: 0.64, 1.0: 0.64})
    other = _report_dir(tmp_path, "s2", [0.6, 0.6], alphas=(0.1, 0.2))
    with pytest.raises(ValueError, match="s2"):
        cq.favoured_over_reports([one, other])


def test_the_favoured_from_option_prints_the_favoured_alpha_without_sampling(tmp_path, capsys):
    one = _report_dir(tmp_path, "s0", [0.60, 0.70, 0.62])
    assert main(["credit-quality", "--favoured-from", str(one)]) == 0
    assert "favoured alpha_turn: 0.2" in capsys.readouterr().out
    assert main(["credit-quality", "--favoured-from", str(tmp_path / "none")]) == 2
    assert "--favoured-from" in capsys.readouterr().err
    assert main(["credit-quality", "--out-dir", str(tmp_path / "out")]) == 2
    assert "--policy" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A two-step GRPO run of the small config with `kl_metric` (GRPO reads no scores: kl_metric alone makes the
    reference score its rollouts, configs/study.gin's reason)."""
    root = tmp_path_factory.mktemp("credit_quality")
    gin = root / "small.gin"
    gin.write_text(SMALL + "TrainConfig.steps = 2\nCreditConfig.estimator = 'grpo'\nUpdateConfig.kl_metric = True\n")
    assert train_cli.run_train([str(gin)], [], str(root / "run"), progress=False) == 0
    return root / "run"


@pytest.mark.slow
def test_a_two_step_run_records_scores_and_values_of_every_episode_and_kl_ref(tiny_run):
    records = [json.loads(line) for line in (tiny_run / TURN_SCORES_FILE).read_text().splitlines()]
    rows = PROMPTS * 2  # RolloutConfig.group_size = 2 in SMALL
    assert [r["step"] for r in records] == [1] * rows + [2] * rows
    for r in records:
        assert len(r["scores"]) == len(r["values"]) == r["num_turns"] + 1
        assert 0 <= r["group"] < PROMPTS and r["reward"] in (0.0, 1.0) and isinstance(r["correct"], bool)
        values = trace_values(jnp.asarray([r["scores"]], jnp.float32), jnp.asarray([r["num_turns"]]))
        np.testing.assert_allclose(r["values"], np.asarray(values)[0], atol=2e-4)
    metrics = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    assert all("kl_ref" in m for m in metrics if "reward" in m)


@pytest.mark.slow
def test_the_command_on_a_run_directory_writes_json_markdown_and_plot(tiny_run, tmp_path):
    out = tmp_path / "out"
    start = time.perf_counter()
    # no --gin-file: the run's own config.gin; the policy of step 2 against the run's initial policy as reference
    assert main(["credit-quality", "--policy", f"{tiny_run}@2", "--reference", f"{tiny_run}@0", "--out-dir", str(out),
                 "--tool-turns", "6", "--max-batches", "2", "--bootstrap", "50"]) == 0
    print(f"credit-quality end to end: {time.perf_counter() - start:.1f} s")
    report = json.loads((out / "credit_quality.json").read_text())
    assert set(report["templates"]) == set(cq.DEFAULT_TEMPLATES)
    for entry in report["templates"].values():
        assert set(entry["forms"]) == set(cq.FORMS)
    assert len(report["arms"]) == len(cq.arms(cq.DEFAULT_TEMPLATES))
    assert report["episodes"] > 0 and report["bootstrap"] == 50 and report["reference"] == f"{tiny_run}@0"
    assert "| estimator |" in (out / "credit_quality.md").read_text()
    assert (out / "credit_quality.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_the_command_writes_the_alpha_table_reproducible_from_its_episode_record(tiny_run, tmp_path):
    out = tmp_path / "out"
    assert main(["credit-quality", "--policy", f"{tiny_run}@2", "--out-dir", str(out), "--tool-turns", "6",
                 "--max-batches", "2", "--bootstrap", "50", "--alphas", "0.2,1,0.05"]) == 0
    report = json.loads((out / "credit_quality.json").read_text())
    alpha = report["alpha"]
    assert alpha["alphas"] == [0.05, 0.2, 1.0] and set(alpha["templates"]) == set(cq.DEFAULT_TEMPLATES)
    assert "avoured alpha_turn" in (out / "credit_quality.md").read_text()
    # the table from the per-episode record is the run's own (same data, resamples and seed)
    assert cq.alpha_table_from_record(out, (0.05, 0.2, 1.0)) == alpha
    # at the config's alpha_turn (0.2), the pooled advantages are the TRACE K=3 arm's per-batch turn credit: its
    # mean over detour turns (every judged turn of this policy) is the arm's
    data = cq.read_episodes(out / cq.EPISODES_FILE)
    detour = data["judged"] & ~data["on_path"]
    assert detour.any()
    for template in cq.DEFAULT_TEMPLATES:
        arm = next(a for a in report["arms"] if a["label"] == f"trace K=3 [{template}]")
        advantage = cq.trace_alpha_advantages(CreditConfig(**report["credit"]), data["scores"][template],
                                              data["reward"], data["group"], data["num_turns"], 0.2)
        assert advantage[detour].mean() == pytest.approx(arm["turn_credit"]["detour_mean"]["value"], rel=1e-4,
                                                         abs=1e-9)


def test_a_bad_template_fails_before_any_compute_naming_the_flag(tmp_path, capsys):
    assert main(["credit-quality", "--policy", "init", "--gin-file", "configs/tiny.gin", "--out-dir",
                 str(tmp_path / "out"), "--templates", "<answer>{answer}</answer>"]) == 2
    assert "--templates" in capsys.readouterr().err


def test_a_bad_alpha_grid_fails_before_any_compute_naming_the_flag(tmp_path, capsys):
    assert main(["credit-quality", "--policy", "init", "--gin-file", "configs/tiny.gin", "--out-dir",
                 str(tmp_path / "out"), "--alphas", "0.2,-1"]) == 2
    assert "--alphas" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_policy_that_is_no_checkpoint_fails_naming_the_flag(tmp_path, capsys):
    gin = tmp_path / "small.gin"
    gin.write_text(SMALL)
    assert main(["credit-quality", "--policy", str(tmp_path / "nothing"), "--gin-file", str(gin), "--out-dir",
                 str(tmp_path / "out")]) == 2
    assert "--policy/--reference" in capsys.readouterr().err
