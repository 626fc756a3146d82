"""The LLM-judge step scorer end to end against deterministic endpoints served by `trace_jax.serve` on 127.0.0.1: the
scripted rubric judge, a judge that writes nonsense, a flaky one and an unreachable one."""

import json

import pytest

from judge_cases import CLUES, GOLD, QUESTION, as_tuples, trajectories
from trace_jax.abc.judge import (
    JudgeConfig,
    LLMJudgeStepScorer,
    MalformedJudgement,
    case_payload,
    parse_counts,
    rubric_counts,
    scripted_rubric_reply,
)
from trace_jax.abc.scorer import StepScorer
from trace_jax.serve import ScriptedBackend, ServeConfig, ServerThread, create_app, free_port
from trace_jax.serve.client import EndpointConfig


@pytest.fixture(scope="module")
def judge_server():
    backend = ScriptedBackend(scripted_rubric_reply, name="rubric-judge")
    with ServerThread(create_app(backend, ServeConfig())) as server:
        yield server.url + "/v1", backend


@pytest.fixture(scope="module")
def nonsense_server():
    backend = ScriptedBackend(lambda request: "Step 2 found one clue, I think: n_found=1", name="sloppy")
    with ServerThread(create_app(backend, ServeConfig())) as server:
        yield server.url + "/v1", backend


def _scorer(url, model, tmp_path=None, **overrides):
    config = JudgeConfig(endpoint=EndpointConfig(base_url=url, model=model, timeout_s=10), backoff_s=0.0,
                         cache_dir=None if tmp_path is None else str(tmp_path / "cache"),
                         audit_path=None if tmp_path is None else str(tmp_path / "audit.jsonl"), **overrides)
    return LLMJudgeStepScorer(config)


def test_judge_implements_the_step_scorer_interface(judge_server):
    scorer = _scorer(judge_server[0], "rubric-judge")
    assert isinstance(scorer, StepScorer) and scorer.name == "judge"


@pytest.mark.parametrize("name", ["correct", "rejected", "cut_off", "guess"])
def test_judge_scores_every_step_as_the_rubric_says(judge_server, name):
    _, steps, expected = next(t for t in trajectories() if t[0] == name)
    scorer = _scorer(judge_server[0], "rubric-judge")
    counts = scorer.score(question=QUESTION, gold=GOLD, clues=CLUES, steps=steps)
    assert as_tuples(counts) == expected
    assert not any(c.flagged for c in counts)


def test_malformed_judge_output_is_retried_then_neutral_and_flagged(nonsense_server, tmp_path):
    url, backend = nonsense_server
    _, steps, _ = next(t for t in trajectories() if t[0] == "rejected")
    scorer = _scorer(url, "sloppy", tmp_path, max_attempts=3)
    before = backend.calls
    counts = scorer.score(question=QUESTION, gold=GOLD, clues=CLUES, steps=steps)
    assert backend.calls - before == 3 * len(steps)
    assert all(c.flagged and "malformed judge output" in c.note for c in counts)
    assert [(c.n_found, c.n_excluded, c.n_rejected) for c in counts] == [(0, 0, 0)] * len(steps)
    assert [c.ans for c in counts] == [0, 0, -1]  # the answer is checked locally, not by the judge
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert len(audit) == 3 * len(steps) and {a["status"] for a in audit} == {"malformed"}
    assert all(a["reply"].startswith("Step 2 found") and a["request"][0]["role"] == "system" for a in audit)
    assert not list((tmp_path / "cache").iterdir())  # failures are never cached


def test_a_retry_recovers_from_one_malformed_reply(tmp_path):
    replies = iter(["not json", '{"n_found": 1, "n_excluded": 0, "n_rejected": 0}'])
    backend = ScriptedBackend(lambda request: next(replies), name="flaky")
    _, steps, _ = next(t for t in trajectories() if t[0] == "guess")
    with ServerThread(create_app(backend, ServeConfig())) as server:
        counts = _scorer(server.url + "/v1", "flaky", tmp_path).score(question=QUESTION, gold=GOLD, clues=CLUES,
                                                                      steps=steps)
    assert backend.calls == 2 and not counts[0].flagged and counts[0].n_found == 1


def test_cache_prevents_repeat_calls(judge_server, tmp_path):
    url, backend = judge_server
    _, steps, expected = next(t for t in trajectories() if t[0] == "correct")
    first = _scorer(url, "rubric-judge", tmp_path).score(question=QUESTION, gold=GOLD, clues=CLUES, steps=steps)
    calls = backend.calls
    again = _scorer(url, "rubric-judge", tmp_path).score(question=QUESTION, gold=GOLD, clues=CLUES, steps=steps)
    assert backend.calls == calls
    assert as_tuples(again) == as_tuples(first) == expected
    statuses = [json.loads(line)["status"] for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert statuses == ["ok"] * len(steps) + ["cache_hit"] * len(steps)


def test_cache_key_holds_the_judge_model_and_the_earlier_steps(judge_server, tmp_path):
    url, backend = judge_server
    _, steps, _ = next(t for t in trajectories() if t[0] == "rejected")
    _scorer(url, "rubric-judge", tmp_path).score(question=QUESTION, gold=GOLD, clues=CLUES, steps=steps)
    calls = backend.calls
    # the same last step after a different history is a different case
    _scorer(url, "rubric-judge", tmp_path).score(question=QUESTION, gold=GOLD, clues=CLUES, steps=steps[1:])
    assert backend.calls == calls + 2


def test_unreachable_judge_is_flagged_not_fatal(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    _, steps, _ = next(t for t in trajectories() if t[0] == "guess")
    counts = _scorer(url, "nobody", tmp_path, max_attempts=2).score(question=QUESTION, gold=GOLD, clues=CLUES,
                                                                    steps=steps)
    assert counts[0].flagged and "endpoint error" in counts[0].note and counts[0].ans == -1


def test_wrong_model_is_not_retried(judge_server, tmp_path):
    url, backend = judge_server
    _, steps, _ = next(t for t in trajectories() if t[0] == "guess")
    calls = backend.calls
    counts = _scorer(url, "no-such-model", tmp_path, max_attempts=3).score(question=QUESTION, gold=GOLD,
                                                                           clues=CLUES, steps=steps)
    assert counts[0].flagged and "404" in counts[0].note and backend.calls == calls
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert len(audit) == 1


@pytest.mark.parametrize("reply", [
    "", "n_found: 1", "[1, 0, 0]", '{"n_found": 1, "n_excluded": 0}',
    '{"n_found": 1, "n_excluded": 0, "n_rejected": 0, "confidence": 0.9}', '{"n_found": -1, "n_excluded": 0, '
    '"n_rejected": 0}', '{"n_found": 1.0, "n_excluded": 0, "n_rejected": 0}', '{"n_found": true, "n_excluded": 0, '
    '"n_rejected": 0}', '{"n_found": 3, "n_excluded": 0, "n_rejected": 0}', '{"n_found": 0, "n_excluded": 2, '
    '"n_rejected": 0}', 'Sure! {"n_found": 1, "n_excluded": 0, "n_rejected": 0}', "[" * 100_000,
    '{"n_found": ' + "1" * 5000 + ', "n_excluded": 0, "n_rejected": 0}', None, ["parts"]])
def test_parse_counts_rejects_anything_but_the_counts_object(reply):
    with pytest.raises(MalformedJudgement):
        parse_counts(reply, CLUES)


def test_parse_counts_accepts_the_object_with_a_reason_or_in_a_fence():
    assert parse_counts('{"n_found": 2, "n_excluded": 1, "n_rejected": 0}', CLUES) == (2, 1, 0)
    assert parse_counts('```json\n{"n_found": 0, "n_excluded": 0, "n_rejected": 1, "reason": "x"}\n```',
                        CLUES) == (0, 0, 1)


def test_judge_prompt_never_shows_steps_after_the_judged_one():
    _, steps, _ = next(t for t in trajectories() if t[0] == "correct")
    payload = case_payload(QUESTION, GOLD, list(CLUES), steps, 2, observation_chars=50)
    assert [s["step"] for s in payload["steps"]] == [1, 2, 3] and payload["judge_step"] == 3
    assert all(len(s["observation"]) < 100 for s in payload["steps"])  # cut, with a note of how much
    assert rubric_counts(case_payload(QUESTION, GOLD, list(CLUES), steps, 1, 6000)) == {
        "n_found": 1, "n_excluded": 0, "n_rejected": 0}


def test_judge_config_reads_the_endpoint_from_the_environment(monkeypatch):
    monkeypatch.setenv("TRACE_JAX_JUDGE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("TRACE_JAX_JUDGE_MODEL", "judge-model")
    monkeypatch.delenv("TRACE_JAX_JUDGE_API_KEY", raising=False)
    config = JudgeConfig.from_env(max_attempts=2)
    assert (config.endpoint.base_url, config.endpoint.model, config.endpoint.api_key) == (
        "http://127.0.0.1:9/v1", "judge-model", None)
    assert config.max_attempts == 2
    monkeypatch.delenv("TRACE_JAX_JUDGE_URL")
    with pytest.raises(ValueError, match="TRACE_JAX_JUDGE_URL"):
        JudgeConfig.from_env()


def _cache_entries(tmp_path):
    return sorted((tmp_path / "cache").glob("*.json"))


def test_a_cached_judgement_out_of_range_is_judged_again_not_trusted(judge_server, tmp_path):
    url, backend = judge_server
    _, steps, expected = next(t for t in trajectories() if t[0] == "guess")
    _scorer(url, "rubric-judge", tmp_path).score(question=QUESTION, gold=GOLD, clues=CLUES, steps=steps)
    (entry,) = _cache_entries(tmp_path)
    for tampered in ([9, 0, 0], [-1, 0, 0], [0, 0], "x", [True, 0, 0]):
        entry.write_text(json.dumps({"counts": tampered}))
        calls = backend.calls
        counts = _scorer(url, "rubric-judge", tmp_path).score(question=QUESTION, gold=GOLD, clues=CLUES, steps=steps)
        assert as_tuples(counts) == expected and backend.calls == calls + 1, tampered
        assert json.loads(entry.read_text())["counts"] == list(expected[0][:3])  # overwritten with the fresh one
    entry.write_bytes(b"\xff{not json")
    _scorer(url, "rubric-judge", tmp_path).score(question=QUESTION, gold=GOLD, clues=CLUES, steps=steps)
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [a["status"] for a in audit].count("cache_invalid") == 6
    assert "must be an int in [0, 2]" in next(a["error"] for a in audit if a["status"] == "cache_invalid")


def test_cache_key_holds_the_endpoint_temperature_and_max_tokens(judge_server, tmp_path):
    url, backend = judge_server
    _, steps, _ = next(t for t in trajectories() if t[0] == "guess")

    def judged(scorer_url=url, backend_=backend, **fields):
        calls = backend_.calls
        _scorer(scorer_url, "rubric-judge", tmp_path, **fields).score(question=QUESTION, gold=GOLD, clues=CLUES,
                                                                      steps=steps)
        return backend_.calls - calls

    assert judged() == 1 and judged() == 0
    assert judged(temperature=0.5) == 1 and judged(temperature=0.5) == 0
    assert judged(max_tokens=64) == 1 and judged(max_tokens=64) == 0
    other = ScriptedBackend(scripted_rubric_reply, name="rubric-judge")
    with ServerThread(create_app(other, ServeConfig())) as server:
        assert judged(server.url + "/v1", other) == 1  # same model name, another endpoint
    # credentials are not part of the endpoint's identity
    assert judged(url.replace("http://", "http://user:pw@")) == 0


def test_cache_files_are_written_through_temporaries_named_by_process_and_thread(judge_server, tmp_path,
                                                                                monkeypatch):
    import os
    import pathlib
    import threading

    url, _ = judge_server
    _, steps, _ = next(t for t in trajectories() if t[0] == "correct")
    written = []
    original = pathlib.Path.write_bytes

    def recording(self, data):
        written.append((self.name, threading.get_ident()))
        return original(self, data)

    monkeypatch.setattr(pathlib.Path, "write_bytes", recording)
    _scorer(url, "rubric-judge", tmp_path, concurrency=4).score(question=QUESTION, gold=GOLD, clues=CLUES,
                                                               steps=steps)
    assert len(written) == len(steps) and len({ident for _, ident in written}) > 1
    assert all(name.endswith(f".{os.getpid()}.{ident}.tmp") for name, ident in written)
    assert not list((tmp_path / "cache").glob("*.tmp")) and len(_cache_entries(tmp_path)) == len(steps)


def test_an_unwritable_cache_or_audit_warns_and_scoring_goes_on(judge_server, tmp_path):
    from trace_jax.abc.judge import JudgeStorageWarning

    url, backend = judge_server
    _, steps, expected = next(t for t in trajectories() if t[0] == "rejected")
    (tmp_path / "cache").write_text("a file where the cache directory should be")
    (tmp_path / "audit.jsonl").mkdir()  # a directory where the audit file should be
    with pytest.warns(JudgeStorageWarning) as caught:
        counts = _scorer(url, "rubric-judge", tmp_path, concurrency=1).score(question=QUESTION, gold=GOLD,
                                                                             clues=CLUES, steps=steps)
    assert as_tuples(counts) == expected and not any(c.flagged for c in counts)
    messages = [str(w.message) for w in caught if issubclass(w.category, JudgeStorageWarning)]
    assert len(messages) == 2  # once each, not once per step
    assert any("judge cache" in m and "without a cache" in m for m in messages)
    assert any("judge audit" in m and "without an audit" in m for m in messages)


def test_a_cache_that_stops_being_writable_mid_run_warns_once(judge_server, tmp_path):
    import shutil

    from trace_jax.abc.judge import JudgeStorageWarning

    url, _ = judge_server
    _, steps, expected = next(t for t in trajectories() if t[0] == "correct")
    scorer = _scorer(url, "rubric-judge", tmp_path, concurrency=1)
    shutil.rmtree(tmp_path / "cache")
    (tmp_path / "cache").write_text("the disk is gone")
    with pytest.warns(JudgeStorageWarning, match="judge cache") as caught:
        counts = scorer.score(question=QUESTION, gold=GOLD, clues=CLUES, steps=steps)
    assert as_tuples(counts) == expected
    assert sum(issubclass(w.category, JudgeStorageWarning) for w in caught) == 1


def _step(text, observation=None):
    from trace_jax.abc.scorer import Step

    return Step(assistant=text, observation=observation)


CUT_AT_CAP = [_step("search", "[0] Search results for `Gamma`\nL0: nothing"), _step("<tool_call>")]
WITH_ERROR = [_step("open", "Error: No pages are open yet; call search first."),
              _step("The answer is Paris.\n<answer>Paris</answer>")]


@pytest.mark.parametrize("no_answer", [-1, 0])
def test_judge_scores_an_episode_that_runs_out_of_turns_with_no_answer(judge_server, no_answer):
    counts = _scorer(judge_server[0], "rubric-judge", no_answer=no_answer).score(
        question=QUESTION, gold=GOLD, clues=CLUES, steps=CUT_AT_CAP)
    assert [c.ans for c in counts] == [0, no_answer]


def test_judge_scores_a_failed_tool_call_at_the_floor_without_asking_by_default(judge_server):
    url, backend = judge_server
    before = backend.calls
    counts = _scorer(url, "rubric-judge").score(question=QUESTION, gold=GOLD, clues=CLUES, steps=WITH_ERROR)
    assert backend.calls - before == 1  # only the answer step is judged
    assert [(c.tool_error, c.n_found, c.ans) for c in counts] == [(True, 0, 0), (False, 0, 1)]


def test_judge_with_error_step_neutral_judges_a_failed_tool_call_as_any_step(judge_server):
    url, backend = judge_server
    before = backend.calls
    counts = _scorer(url, "rubric-judge", error_step="neutral").score(question=QUESTION, gold=GOLD, clues=CLUES,
                                                                      steps=WITH_ERROR)
    assert backend.calls - before == 2
    assert [c.tool_error for c in counts] == [False, False] and not any(c.flagged for c in counts)


def test_judge_config_names_a_bad_episode_option():
    with pytest.raises(ValueError, match="JudgeConfig.no_answer"):
        JudgeConfig(endpoint=EndpointConfig(base_url="http://127.0.0.1:1/v1", model="m"), no_answer=-2)
