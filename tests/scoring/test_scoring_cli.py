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
    """A random tiny Qwen3 saved with save_pretrained next to a word tokenizer over the oracle's vocabulary."""
    directory = tmp_path_factory.mktemp("credit_reference")
    build_word_tokenizer(trajectory_vocabulary(), directory)
    vocab = len(load_tokenizer(directory))
    config = models.get_preset("tiny-qwen3", vocab_size=-(-vocab // 64) * 64)
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


def _api_scores(reference_dir, records):
    """The same trajectories through ChatFormat + score_answer_prefixes directly, in file order."""
    config, params = models.load_pretrained(reference_dir)
    tokenizer = load_tokenizer(reference_dir)
    chat = ChatFormat(tokenizer)
    template = tokenizer.encode("<answer>", add_special_tokens=False)
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


def test_missing_input_or_reference_is_a_usage_error(reference_dir, tmp_path, capsys):
    assert _run(reference_dir, tmp_path / "missing.jsonl", tmp_path) == 2
    assert main(["credit", str(SAMPLE), "--reference", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    assert "not a directory" in capsys.readouterr().err
