"""`trace-jax credit`: scores and credit equal the API's, malformed lines are reported and skipped, receipts escape."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import models
from trace_jax.cli import main
from trace_jax.credit import grouped_outcome_advantages, trace_turn_credit, trace_values
from trace_jax.envs.oracle import trajectory_vocabulary
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
from trace_jax.scoring import score_answer_prefixes

DATA = Path(__file__).resolve().parents[1] / "data"
SAMPLE = DATA / "credit_sample.jsonl"
MALFORMED = DATA / "credit_malformed.jsonl"


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    """A random one-layer Qwen3 saved with save_pretrained next to a word tokenizer over the oracle's vocabulary.

    One layer and width 32 (the RL tests' SMALL policy): every claim here compares the CLI with the API on the same
    model, which any size shows, and the trajectories are long enough that a larger model's compiles and passes
    were most of this module's time."""
    directory = tmp_path_factory.mktemp("credit_reference")
    build_word_tokenizer(trajectory_vocabulary(), directory)
    vocab = len(load_tokenizer(directory))
    config = models.get_preset("tiny-qwen3", vocab_size=-(-vocab // 64) * 64, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    params = models.init_params(config, jax.random.PRNGKey(0))
    params = jax.tree_util.tree_map(lambda p: p * 4.0 if p.ndim >= 2 else p, params)  # less uniform scores
    models.save_pretrained(directory, config, params)
    return directory


def _run(reference_dir, input_path, out_dir, *flags):
    return main(["credit", str(input_path), "--reference", str(reference_dir), "--out", str(out_dir), *flags])


def _read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def sample_run(reference_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("credit_out")
    assert _run(reference_dir, SAMPLE, out) == 0
    return out, _read_jsonl(out / "credit.jsonl")


def _api_scores(reference_dir, records, opening="<answer>"):
    """The same trajectories through ChatFormat + score_answer_prefixes directly, in file order, the gold answer
    scored after `opening` (encoded on its own: right for an opening that ends where a pre-token must end)."""
    config, params = models.load_pretrained(reference_dir)
    tokenizer = load_tokenizer(reference_dir)
    chat = ChatFormat(tokenizer)
    template = tokenizer.encode(opening, add_special_tokens=False)
    convs = [chat.messages_to_ids(r["messages"], r.get("tools")) for r in records]
    answers = [template + tokenizer.encode(r["answer"], add_special_tokens=False) for r in records]
    n, length = len(records), max(len(c.ids) for c in convs)
    slots, m = max(len(c.boundaries) for c in convs), max(len(a) for a in answers)
    tokens, boundaries = np.zeros((n, length), np.int32), np.ones((n, slots), np.int32)
    answer_tokens, answer_mask = np.zeros((n, m), np.int32), np.zeros((n, m), np.int32)
    for i, (c, a) in enumerate(zip(convs, answers)):
        tokens[i, :len(c.ids)] = c.ids
        boundaries[i, :len(c.boundaries)] = c.boundaries
        answer_tokens[i, :len(a)] = a
        answer_mask[i, len(template):len(a)] = 1
    num_states = np.array([len(c.boundaries) for c in convs], np.int32)
    result = score_answer_prefixes(config, params, tokens, boundaries, num_states, answer_tokens, answer_mask)
    return np.asarray(result.answer_scores), num_states


def test_sample_scores_and_credit_equal_the_api(reference_dir, sample_run):
    _, results = sample_run
    records = _read_jsonl(SAMPLE)
    assert [r["id"] for r in results] == [r["id"] for r in records]
    scores, num_states = _api_scores(reference_dir, records)
    num_turns = jnp.asarray(num_states - 1)
    groups = {g: i for i, g in enumerate(dict.fromkeys(r["group"] for r in records))}
    outcome = grouped_outcome_advantages(jnp.asarray([r["reward"] for r in records], jnp.float32),
                                         jnp.asarray([groups[r["group"]] for r in records]), len(groups))
    credit = np.asarray(trace_turn_credit(jnp.asarray(scores), num_turns, outcome))
    values = np.asarray(trace_values(jnp.asarray(scores), num_turns))
    assert np.ptp(scores[0, :num_states[0]]) > 1e-3  # states are told apart
    for i, result in enumerate(results):
        t = int(num_states[i]) - 1
        assert result["num_turns"] == t
        np.testing.assert_allclose(result["answer_scores"], scores[i, :t + 1], atol=1e-5)
        np.testing.assert_allclose(result["values"], values[i, :t + 1], atol=1e-5)
        np.testing.assert_allclose(result["turn_credit"], credit[i, :t], atol=1e-5)
        np.testing.assert_allclose(result["outcome_advantage"], float(outcome[i]), atol=1e-5)
        np.testing.assert_allclose(result["turn_advantage"], float(outcome[i]) + 0.2 * credit[i, :t], atol=1e-5)


def test_failed_trajectory_in_a_group_gets_negative_outcome_advantage(sample_run):
    _, results = sample_run
    failed = [r for r in results if r["reward"] == 0.0]
    assert failed and all(r["outcome_advantage"] < 0 for r in failed)
    assert all(r["outcome_advantage"] == 0.0 for r in results if r["group"] == "w3-s5-000001")  # all solved


def test_receipts_and_plot_are_written(sample_run):
    out, results = sample_run
    for result in results:
        page = (out / result["receipt"]).read_text()
        assert page.startswith("<!DOCTYPE html>") and page.count("class=\"bar-wrap\"") == result["num_turns"]
    assert (out / "credit_by_turn.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scored"] == len(results) == 6 and summary["skipped"] == 0


def test_malformed_lines_are_reported_with_line_numbers_and_skipped(reference_dir, tmp_path, capsys):
    assert _run(reference_dir, MALFORMED, tmp_path) == 0
    captured = capsys.readouterr()
    for line in (2, 3, 4, 6, 7, 8, 9):
        assert f"credit_malformed.jsonl:{line}: skipped" in captured.err
    assert "scored 2 of 9 records (7 malformed, skipped)" in captured.out
    results = _read_jsonl(tmp_path / "credit.jsonl")
    assert [r["line"] for r in results] == [1, 10]
    errors = json.loads((tmp_path / "summary.json").read_text())["errors"]
    assert [e["line"] for e in errors] == [2, 3, 4, 6, 7, 8, 9]
    assert "'answer'" in errors[1]["error"] and "reward" in errors[4]["error"]


def test_receipt_escapes_record_text(reference_dir, tmp_path):
    assert _run(reference_dir, MALFORMED, tmp_path, "--no-plot") == 0
    result = _read_jsonl(tmp_path / "credit.jsonl")[1]
    assert result["id"] == "html<&>check" and "<" not in result["receipt"]
    page = (tmp_path / result["receipt"]).read_text()
    assert "<script>" not in page and "&lt;script&gt;" in page and "html&lt;&amp;&gt;check" in page
    assert not (tmp_path / "credit_by_turn.png").exists()


def test_credit_flags_reach_the_credit_api(reference_dir, sample_run, tmp_path):
    _, default_results = sample_run
    flags = ("--horizon", "1", "--terminal-fill", "0", "--alpha-turn", "0", "--form", "raw_delta", "--no-receipts",
             "--no-plot")
    assert _run(reference_dir, SAMPLE, tmp_path, *flags) == 0
    for default, result in zip(default_results, _read_jsonl(tmp_path / "credit.jsonl")):
        np.testing.assert_allclose(result["answer_scores"], default["answer_scores"], atol=1e-6)
        np.testing.assert_allclose(result["turn_credit"], np.diff(result["answer_scores"]), atol=1e-5)  # K=1: r=delta
        np.testing.assert_allclose(result["turn_advantage"], result["outcome_advantage"], atol=1e-6)  # GRPO


def test_answer_template_flag_scores_the_gold_after_the_given_opening(reference_dir, sample_run, tmp_path):
    _, default_results = sample_run
    records = _read_jsonl(SAMPLE)
    assert _run(reference_dir, SAMPLE, tmp_path, "--answer-template", "The answer is:{answer}", "--no-receipts",
                "--no-plot") == 0
    results = _read_jsonl(tmp_path / "credit.jsonl")
    scores, num_states = _api_scores(reference_dir, records, opening="The answer is:")
    tokenizer = load_tokenizer(reference_dir)
    for i, (result, default) in enumerate(zip(results, default_results)):
        assert tokenizer.decode(result["template_token_ids"]) == "The answer is:"
        assert result["answer_token_ids"] == default["answer_token_ids"]  # the same gold tokens, other context
        np.testing.assert_allclose(result["answer_scores"], scores[i, :num_states[i]], atol=1e-5)
        assert not np.allclose(result["answer_scores"], default["answer_scores"], atol=1e-3)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["settings"]["scored_template"] == "The answer is:{answer}"


@pytest.mark.parametrize("flag, template", [
    ("answer_tag", "<answer>{answer}"), ("<answer>", "<answer>{answer}"), ("", "{answer}"),
    ("Answer: ", "Answer: {answer}"), (" The answer is {answer}", " The answer is {answer}")])
def test_answer_template_flag_takes_a_name_a_template_or_an_open_tag(flag, template):
    from trace_jax.scoring.cli import answer_template_from_flag

    assert answer_template_from_flag(flag) == template


def test_a_malformed_answer_template_is_a_usage_error(reference_dir, tmp_path, capsys):
    assert _run(reference_dir, SAMPLE, tmp_path, "--answer-template", "The answer is {answer}.") == 2
    assert "--answer-template" in capsys.readouterr().err
    assert _run(reference_dir, SAMPLE, tmp_path, "--answer-template", "{answr}") == 2
    assert "holds {answer} 0 times" in capsys.readouterr().err


def test_missing_input_or_reference_is_a_usage_error(reference_dir, tmp_path, capsys):
    assert _run(reference_dir, tmp_path / "missing.jsonl", tmp_path) == 2
    assert main(["credit", str(SAMPLE), "--reference", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    assert "not a directory" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- estimators
GROUPS = DATA / "credit_groups.jsonl"  # `make-tasks --num 3 --seed 1 --oracle --group-size 4 ...` (see docs/scoring.md)


def _api_inputs(reference_dir, records):
    """The records through ChatFormat, the continuation builder, score_answer_prefixes and the rule scorer, in
    file order, as `CreditInputs` (independently of the CLI's code paths)."""
    from trace_jax import credit
    from trace_jax.abc.rules import RuleBasedStepScorer, steps_from_messages
    from trace_jax.scoring.continuation import build_answer_continuation

    config, params = models.load_pretrained(reference_dir)
    tokenizer = load_tokenizer(reference_dir)
    chat = ChatFormat(tokenizer)
    convs = [chat.messages_to_ids(r["messages"], r.get("tools")) for r in records]
    answers = [build_answer_continuation(tokenizer, chat, r["answer"]) for r in records]
    n, length = len(records), max(len(c.ids) for c in convs)
    slots, m = max(len(c.boundaries) for c in convs), max(len(a.ids) for a in answers)
    tokens, boundaries = np.zeros((n, length), np.int32), np.ones((n, slots), np.int32)
    answer_tokens, answer_mask = np.zeros((n, m), np.int32), np.zeros((n, m), np.int32)
    loss_mask, turn_index = np.zeros((n, length), np.float32), np.full((n, length), -1, np.int32)
    for i, (c, a) in enumerate(zip(convs, answers)):
        tokens[i, :len(c.ids)] = c.ids
        boundaries[i, :len(c.boundaries)] = c.boundaries
        answer_tokens[i, :len(a.ids)] = a.ids
        answer_mask[i, :len(a.ids)] = a.mask
        loss_mask[i, :len(c.ids)] = c.loss_mask
        turn_index[i, :len(c.ids)] = c.turn_index
    num_states = np.array([len(c.boundaries) for c in convs], np.int32)
    scores = score_answer_prefixes(config, params, tokens, boundaries, num_states, answer_tokens, answer_mask)
    groups = {g: i for i, g in enumerate(dict.fromkeys(r["group"] for r in records))}
    keys = []
    for r in records:
        observations = [m["content"] for m in r["messages"] if m["role"] == "tool"]  # one tool message per call
        keys.append(credit.state_keys(observations))  # CreditConfig.gigpo_anchor default: observation
    counts = [RuleBasedStepScorer().score(question=r["question"], gold=[r["answer"], *r["aliases"]],
                                          clues=r["clues"], steps=steps_from_messages(r["messages"]))
              for r in records]
    from trace_jax.abc import counts_to_arrays
    arrays = counts_to_arrays(counts)
    # CreditConfig.abc_answer_step default: the answer turn is part of the last tool step
    *folded, num_steps = credit.fold_answer_steps(*(jnp.asarray(arrays[k]) for k in ("n_found", "n_excluded",
                                                                                      "n_rejected", "ans")),
                                                  jnp.asarray(arrays["num_steps"]), jnp.asarray(num_states - 1))
    return credit.CreditInputs(
        rewards=jnp.asarray([r["reward"] for r in records], jnp.float32),
        group_id=jnp.asarray([groups[r["group"]] for r in records], jnp.int32),
        loss_mask=jnp.asarray(loss_mask), turn_index=jnp.asarray(turn_index),
        num_turns=jnp.asarray(num_states - 1), answer_scores=scores.answer_scores,
        step_rewards=credit.abc_step_rewards(*folded), num_steps=num_steps,
        anchor_keys=jnp.asarray(credit.anchor_key_ids(keys, slots)))


@pytest.fixture(scope="module")
def group_api(reference_dir):
    records = _read_jsonl(GROUPS)
    return records, _api_inputs(reference_dir, records)


@pytest.fixture(scope="module")
def group_scores():
    """The CLI's reference scores of the group sample, kept from its first run in this module: every estimator
    reads the same scores (the tests below compare them with the API's on each run), so the later runs reuse them
    instead of scoring the 12 long trajectories again."""
    return {}


@pytest.fixture
def scores_once(group_scores, monkeypatch):
    from trace_jax.scoring import cli

    real = cli.score_records

    def score_records(config, params, prepared, **kwargs):
        key = (tuple(sorted(kwargs.items())),
               *((p.ids.tobytes(), np.asarray(p.boundaries).tobytes(), np.asarray(p.continuation.ids).tobytes(),
                  np.asarray(p.continuation.mask).tobytes()) for p in prepared))
        if key not in group_scores:
            group_scores[key] = real(config, params, prepared, **kwargs)
        return [s.copy() for s in group_scores[key]]

    monkeypatch.setattr(cli, "score_records", score_records)


def test_shipped_group_sample_has_groups_with_differing_rewards():
    records = _read_jsonl(GROUPS)
    by_group = {}
    for r in records:
        by_group.setdefault(r["group"], set()).add(r["reward"])
    assert len(by_group) == 3 and sum(len(v) > 1 for v in by_group.values()) >= 2
    assert all(r.get("clues") for r in records)


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "gspo", "trace", "trace_raw_delta", "trace_linear_gap", "abc_grpo",
                                       "gigpo"])
def test_every_estimator_from_the_cli_equals_compute_advantages(reference_dir, group_api, scores_once, tmp_path,
                                                                estimator):
    from trace_jax import credit

    assert estimator in credit.estimator_names()
    records, inputs = group_api
    assert _run(reference_dir, GROUPS, tmp_path, "--estimator", estimator, "--no-receipts", "--no-plot") == 0
    results = _read_jsonl(tmp_path / "credit.jsonl")
    want = np.asarray(credit.compute_advantages(estimator, inputs).token_advantages)
    rebuilt = np.zeros_like(want)
    for i, result in enumerate(results):
        assert result["estimator"] == estimator and result["flags"] == []
        for (start, end), advantage in zip(result["turn_spans"], result["turn_advantages"]):
            rebuilt[i, start:end] = advantage
        want_scores = np.asarray(inputs.answer_scores)[i, :result["num_turns"] + 1]
        np.testing.assert_allclose(result["answer_scores"], want_scores, atol=1e-5)
    trained = np.asarray(inputs.loss_mask) != 0
    np.testing.assert_allclose(rebuilt[trained], want[trained], atol=2e-5)
    if estimator in ("trace", "grpo", "gigpo"):
        solved_groups = {r["group"] for r in records if r["reward"] == 1.0}
        assert any(abs(r["outcome_advantage"]) > 0.5 for r in results if r["group"] in solved_groups)


def test_every_registered_estimator_is_a_cli_choice(capsys):
    from trace_jax import credit

    with pytest.raises(SystemExit):
        main(["credit", "--help"])
    text = capsys.readouterr().out
    for name in credit.estimator_names():
        assert name in text


def test_output_reports_group_statistics_gaps_and_the_scored_answer_ids(reference_dir, scores_once, tmp_path):
    assert _run(reference_dir, GROUPS, tmp_path, "--no-receipts", "--no-plot", "--eps", "0.2") == 0
    results = _read_jsonl(tmp_path / "credit.jsonl")
    tokenizer = load_tokenizer(reference_dir)
    for result in results:
        members = [r["reward"] for r in results if r["group"] == result["group"]]
        assert result["group_size"] == len(members) == 4
        assert result["group_reward_mean"] == pytest.approx(np.mean(members), abs=1e-6)
        assert result["group_reward_std"] == pytest.approx(np.std(members), abs=1e-6)
        np.testing.assert_allclose(result["gaps"], 0.2 - np.asarray(result["answer_scores"]), atol=1e-5)
        assert tokenizer.decode(result["answer_token_ids"]) == result["answer"]
        assert tokenizer.decode(result["template_token_ids"]) == "<answer>"


# ---------------------------------------------------------------------------------------------------- warnings
def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _sample_records():
    return _read_jsonl(SAMPLE)


def test_group_of_one_and_missing_reward_are_flagged_counted_and_warned(reference_dir, tmp_path, capsys):
    records = _sample_records()[:3]
    pair = [dict(records[0], id="a", group="g", reward=1.0), dict(records[1], id="b", group="g", reward=0.0)]
    no_reward = dict(records[2], id="c", group="g")
    no_reward.pop("reward")
    alone = dict(records[2], id="d", reward=1.0)
    alone.pop("group")
    path = _write(tmp_path / "in.jsonl", pair + [no_reward, alone])
    assert _run(reference_dir, path, tmp_path / "out", "--no-receipts", "--no-plot") == 0
    err = capsys.readouterr().err
    assert "warning" in err and "1 in a group of one" in err and "1 without a reward" in err
    results = {r["id"]: r for r in _read_jsonl(tmp_path / "out" / "credit.jsonl")}
    assert results["c"]["flags"] == ["missing_reward"] and results["c"]["outcome_advantage"] == 0.0
    assert results["d"]["flags"] == ["group_of_one"] and results["d"]["outcome_advantage"] == 0.0
    # the record without a reward leaves the group's statistics alone: the pair is +-1
    assert results["a"]["outcome_advantage"] == pytest.approx(1.0)
    assert results["b"]["outcome_advantage"] == pytest.approx(-1.0)
    assert results["a"]["group_size"] == 2 and results["a"]["group_reward_mean"] == 0.5
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["groups_of_one"], summary["missing_reward"]) == (1, 1)


def test_a_skipped_line_marks_its_group_incomplete(reference_dir, tmp_path, capsys):
    records = _sample_records()[:2]
    bad = dict(records[1], answer="")
    path = _write(tmp_path / "in.jsonl", [records[0], bad])
    assert _run(reference_dir, path, tmp_path / "out", "--no-receipts", "--no-plot") == 0
    assert "1 in a group with a skipped line" in capsys.readouterr().err
    (result,) = _read_jsonl(tmp_path / "out" / "credit.jsonl")
    assert "group_incomplete" in result["flags"]


def test_record_cut_on_a_tool_message_keeps_its_last_state(reference_dir, tmp_path):
    record = _sample_records()[0]
    cut = dict(record, id="cut", messages=record["messages"][:-1])  # drop the final answer: ends on a tool message
    assert cut["messages"][-1]["role"] == "tool"
    path = _write(tmp_path / "in.jsonl", [record, cut])
    assert _run(reference_dir, path, tmp_path / "out", "--no-receipts", "--no-plot") == 0
    full, truncated = _read_jsonl(tmp_path / "out" / "credit.jsonl")
    assert truncated["ended_on_tool"] and truncated["num_turns"] == full["num_turns"]
    assert len(truncated["answer_scores"]) == truncated["num_turns"] + 1
    assert truncated["boundaries"][-1] == truncated["num_tokens"]  # S_T: after the last observation
    # the same states score the same (same context up to each boundary)
    np.testing.assert_allclose(truncated["answer_scores"], full["answer_scores"], atol=1e-5)
    assert truncated["final_advantage"] is None and len(truncated["turn_advantage"]) == truncated["num_turns"]


def test_nonfinite_scores_are_never_written(reference_dir, tmp_path, monkeypatch, capsys):
    from trace_jax.scoring import cli

    real = cli.score_records

    def with_nan(*args, **kwargs):
        scores = real(*args, **kwargs)
        scores[1] = scores[1].copy()
        scores[1][1] = np.nan
        return scores

    monkeypatch.setattr(cli, "score_records", with_nan)
    path = _write(tmp_path / "in.jsonl", _sample_records())  # the sample's batch shape: its programs are compiled
    assert _run(reference_dir, path, tmp_path / "out", "--no-plot") == 0
    assert "1 with non-finite scores" in capsys.readouterr().err

    def reject(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    text = (tmp_path / "out" / "credit.jsonl").read_text()
    results = [json.loads(line, parse_constant=reject) for line in text.splitlines()]
    assert results[1]["flags"] == ["nonfinite_scores"] and results[1]["answer_scores"] is None
    assert results[1]["turn_credit"] is None and set(results[1]["turn_advantages"]) == {None}
    assert results[0]["answer_scores"] is not None and results[2]["turn_credit"] is not None
    assert json.loads((tmp_path / "out" / "summary.json").read_text(), parse_constant=reject)["nonfinite_scores"] == 1
    # an estimator that does not read the scores keeps the row's advantages
    assert _run(reference_dir, path, tmp_path / "grpo", "--no-plot", "--no-receipts", "--estimator", "grpo") == 0
    grpo = _read_jsonl(tmp_path / "grpo" / "credit.jsonl")
    assert grpo[1]["answer_scores"] is None and None not in grpo[1]["turn_advantages"]


def test_abc_grpo_names_the_missing_clue_chain(reference_dir, tmp_path, capsys):
    assert _run(reference_dir, SAMPLE, tmp_path, "--estimator", "abc_grpo", "--no-receipts", "--no-plot") == 1
    assert "field 'clues'" in capsys.readouterr().err


def test_illegal_credit_option_is_a_usage_error(reference_dir, tmp_path, capsys):
    assert _run(reference_dir, SAMPLE, tmp_path, "--gamma", "1.5") == 2
    assert "CreditConfig.gamma" in capsys.readouterr().err


def test_thinking_format_renders_reasoning_and_answers_after_an_empty_think_block(reference_dir, tmp_path):
    record = _sample_records()[0]
    messages = [dict(m) for m in record["messages"]]
    messages[2]["reasoning_content"] = "Kaol first."  # the first assistant message
    path = _write(tmp_path / "in.jsonl", [dict(record, messages=messages)])
    for thinking in ("none", "hybrid"):
        assert _run(reference_dir, path, tmp_path / thinking, "--thinking", thinking, "--no-receipts",
                    "--no-plot") == 0
    plain, = _read_jsonl(tmp_path / "none" / "credit.jsonl")
    hybrid, = _read_jsonl(tmp_path / "hybrid" / "credit.jsonl")
    tokenizer = load_tokenizer(reference_dir)
    assert tokenizer.decode(plain["template_token_ids"]) == "<answer>"
    assert tokenizer.decode(hybrid["template_token_ids"]) == "<think>\n\n</think>\n\n<answer>"
    assert hybrid["num_tokens"] > plain["num_tokens"]  # the reasoning is rendered in its think block
    assert hybrid["answer_token_ids"] == plain["answer_token_ids"]
    summary = json.loads((tmp_path / "hybrid" / "summary.json").read_text())
    assert summary["settings"]["chat_thinking"] == "hybrid"


def test_records_longer_than_the_reference_context_are_reported_and_skipped(reference_dir, sample_run, tmp_path,
                                                                           capsys):
    import shutil

    _, results = sample_run
    # positions the fork pass uses: the trajectory, then answer copy k at b_k .. b_k + m - 2
    needed = [max(r["num_tokens"], r["boundaries"][-1] + len(r["template_token_ids"]) + len(r["answer_token_ids"])
                  - 1) for r in results]
    context = sorted(set(needed))[-2]  # the longest record(s) no longer fit
    short_dir = tmp_path / "short_context"
    shutil.copytree(reference_dir, short_dir)
    config = json.loads((short_dir / "config.json").read_text())
    (short_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context}))
    assert _run(short_dir, SAMPLE, tmp_path / "out", "--no-receipts", "--no-plot") == 0
    err = capsys.readouterr().err
    too_long = [i + 1 for i, n in enumerate(needed) if n > context]
    assert too_long
    for line in too_long:
        assert f"credit_sample.jsonl:{line}: skipped: the record needs {needed[line - 1]} positions" in err
    assert f"the reference model's context is {context} (max_position_embeddings)" in err
    scored = _read_jsonl(tmp_path / "out" / "credit.jsonl")
    assert [r["line"] for r in scored] == [i + 1 for i, n in enumerate(needed) if n <= context]
    by_line = {r["line"]: r for r in results}
    for record in scored:  # the records that fit score as they did under the long context
        np.testing.assert_allclose(record["answer_scores"], by_line[record["line"]]["answer_scores"], atol=1e-5)
