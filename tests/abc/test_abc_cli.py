"""`trace-jax abc-score` against the scripted rubric judge on 127.0.0.1: rewards, SFT weights and ABC-GRPO advantages
equal the credit API's on the judge's counts; the cache makes a rerun free; clues are recovered when missing."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from judge_cases import CLUES, DOCS, GOLD, scripted_judge_and_agent, to_messages, trajectories
from trace_jax.cli import main
from trace_jax.credit import abc_sft_weights, abc_step_rewards, grouped_abc_grpo_advantages
from trace_jax.serve import ScriptedBackend, ServeConfig, ServerThread, create_app, free_port


@pytest.fixture(scope="module")
def judge():
    backend = ScriptedBackend(scripted_judge_and_agent, name="rubric-judge")
    with ServerThread(create_app(backend, ServeConfig())) as server:
        yield server.url + "/v1", backend


def _records(with_clues=True):
    cases = {name: (steps, expected) for name, steps, expected in trajectories()}
    records = []
    for name, group in (("correct", "q"), ("rejected", "q"), ("cut_off", "q"), ("guess", None)):
        record = {"id": name, "messages": to_messages(cases[name][0]), "answer": GOLD[0], "aliases": GOLD[1:]}
        if group:
            record["group"] = group
        if with_clues:
            record["clues"] = [c.to_dict() for c in CLUES]
        records.append(record)
    return records, cases


def _write(path, records, extra_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "".join(extra_lines), encoding="utf-8")
    return path


def _read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _score(url, input_path, out, *flags):
    return main(["abc-score", str(input_path), "--judge-url", url, "--judge-model", "rubric-judge", "--out",
                 str(out), "--backoff", "0", *flags])


def test_abc_score_writes_counts_rewards_weights_and_advantages_from_the_credit_api(judge, tmp_path):
    url, _ = judge
    records, cases = _records()
    assert _score(url, _write(tmp_path / "in.jsonl", records), tmp_path / "out") == 0
    results = _read(tmp_path / "out" / "abc.jsonl")
    assert [r["id"] for r in results] == ["correct", "rejected", "cut_off", "guess"]
    counts = [[tuple(c[k] for k in ("n_found", "n_excluded", "n_rejected", "ans")) for c in r["counts"]]
              for r in results]
    assert counts == [cases[r["id"]][1] for r in results]
    width = max(len(c) for c in counts)
    arrays = np.zeros((4, 4, width), np.int32)
    for i, rows in enumerate(counts):
        arrays[:, i, :len(rows)] = np.asarray(rows).T
    rewards = abc_step_rewards(*(jnp.asarray(a) for a in arrays))
    advantages = grouped_abc_grpo_advantages(rewards, jnp.asarray([len(c) for c in counts]),
                                             jnp.asarray([0, 0, 0, 1]), 2)
    for i, r in enumerate(results):
        n = len(counts[i])
        np.testing.assert_allclose(r["step_rewards"], np.asarray(rewards)[i, :n], atol=1e-6)
        np.testing.assert_allclose(r["sft_weights"], np.asarray(abc_sft_weights(rewards))[i, :n], atol=1e-6)
        np.testing.assert_allclose(r["advantages"], np.asarray(advantages)[i, :n], atol=1e-5)
        assert not any(r["flagged"]) and r["clue_source"] == "record"
    assert results[1]["step_rewards"] == [1.0, 1.8, 0.0]  # credit-spec: clip(1 + 0.8 found - 0.8 rejected + ans)
    assert (tmp_path / "out" / "receipts" / "correct-L1.html").read_text().count("<tr>") > 9
    (clues,) = _read(tmp_path / "out" / "clues.jsonl")
    assert clues["source"] == "record" and len(clues["clues"]) == 3


def test_rerun_makes_no_judge_calls_thanks_to_the_cache(judge, tmp_path):
    url, backend = judge
    records, _ = _records()
    path = _write(tmp_path / "in.jsonl", records)
    assert _score(url, path, tmp_path / "out") == 0
    calls = backend.calls
    first = _read(tmp_path / "out" / "abc.jsonl")
    assert _score(url, path, tmp_path / "out") == 0
    assert backend.calls == calls
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["judge_calls"] == 0
    assert [r["step_rewards"] for r in _read(tmp_path / "out" / "abc.jsonl")] == [r["step_rewards"] for r in first]


def test_missing_clues_are_recovered_from_the_corpus(judge, tmp_path):
    url, _ = judge
    records, cases = _records(with_clues=False)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS), encoding="utf-8")
    assert _score(url, _write(tmp_path / "in.jsonl", records[:1]), tmp_path / "out", "--corpus", str(corpus)) == 0
    (result,) = _read(tmp_path / "out" / "abc.jsonl")
    assert result["clue_source"] == "recovered"
    assert [c["value"] for c in result["clues"]] == ["Paris", "Alpha river"]
    # without the exclude clue, opening Gamma's page finds nothing
    expected = [(f, 0 if (f, x) == (0, 1) else x, r, a) for f, x, r, a in cases["correct"][1]]
    assert [tuple(c[k] for k in ("n_found", "n_excluded", "n_rejected", "ans")) for c in result["counts"]] == expected
    (clues,) = _read(tmp_path / "out" / "clues.jsonl")
    assert clues["source"] == "recovered" and len(clues["dropped"]) == 1


def test_malformed_records_are_reported_with_line_numbers_and_skipped(judge, tmp_path, capsys):
    url, _ = judge
    records, _ = _records()
    no_clues = dict(records[3])
    del no_clues["clues"]
    path = _write(tmp_path / "in.jsonl", records[:1] + [no_clues],
                  ["{not json\n", json.dumps({"messages": [], "answer": "x"}) + "\n",
                   json.dumps({"messages": records[0]["messages"]}) + "\n"])
    assert _score(url, path, tmp_path / "out") == 0
    err = capsys.readouterr().err
    assert "in.jsonl:2: skipped: no 'clues' field; pass --corpus" in err
    assert "in.jsonl:3: skipped: invalid JSON" in err
    assert "in.jsonl:4: skipped: field 'messages'" in err
    assert "in.jsonl:5: skipped: field 'answer'" in err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["records"], summary["scored"], summary["skipped"]) == (5, 1, 4)


def test_unreachable_or_wrong_judge_is_a_usage_error(judge, tmp_path, capsys, monkeypatch):
    url, _ = judge
    records, _ = _records()
    path = _write(tmp_path / "in.jsonl", records)
    dead = f"http://127.0.0.1:{free_port()}/v1"
    assert _score(dead, path, tmp_path / "out") == 2
    assert "does not answer" in capsys.readouterr().err
    assert main(["abc-score", str(path), "--judge-url", url, "--judge-model", "gpt-5", "--out",
                 str(tmp_path / "out")]) == 2
    assert "does not serve model 'gpt-5'" in capsys.readouterr().err
    monkeypatch.delenv("TRACE_JAX_JUDGE_URL", raising=False)
    assert main(["abc-score", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "no endpoint URL" in capsys.readouterr().err
    monkeypatch.setenv("TRACE_JAX_JUDGE_URL", url)
    monkeypatch.setenv("TRACE_JAX_JUDGE_MODEL", "rubric-judge")
    assert main(["abc-score", str(path), "--out", str(tmp_path / "out")]) == 0  # the environment names the judge


def test_receipt_escapes_record_text(judge, tmp_path):
    url, _ = judge
    records, _ = _records()
    record = dict(records[3], id="<script>x</script>")
    record["messages"] = [{"role": "user", "content": "<b>Who?</b>"}] + record["messages"][2:]
    assert _score(url, _write(tmp_path / "in.jsonl", [record]), tmp_path / "out") == 0
    (receipt,) = (tmp_path / "out" / "receipts").iterdir()
    html = receipt.read_text()
    assert "<b>Who?</b>" not in html and "&lt;b&gt;Who?&lt;/b&gt;" in html and "<script>" not in html


def test_summary_and_outputs_never_hold_the_judge_credentials(judge, tmp_path):
    url, _ = judge
    records, _ = _records()
    secret_url = url.replace("http://", "http://alice:s3cret@")
    assert main(["abc-score", str(_write(tmp_path / "in.jsonl", records[3:])), "--judge-url", secret_url,
                 "--judge-model", "rubric-judge", "--judge-api-key", "sk-k3y", "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["settings"]["judge_url"] == url
    for written in (tmp_path / "out").rglob("*"):
        if written.is_file():
            text = written.read_text(errors="replace")
            assert "s3cret" not in text and "sk-k3y" not in text, written


def test_a_record_too_long_for_the_judge_context_is_reported_and_skipped(tmp_path, capsys):
    from fake_endpoint import FakeEndpoint, Reply, ok

    from trace_jax.abc.judge import case_from_messages, scripted_rubric_reply

    def judge_with_a_short_context(method, path, body):
        if path.endswith("/models"):
            return Reply(body={"object": "list", "data": [{"id": "rubric-judge", "object": "model"}]})
        if len(case_from_messages(body["messages"])["steps"]) > 3:  # vLLM's wording of an over-long prompt
            return Reply(status=400, body={"error": {"message": "This model's maximum context length is 512 tokens. "
                                                                "However, you requested 900 tokens.", "code": 400}})
        return ok(scripted_rubric_reply(body))

    records, cases = _records()
    with FakeEndpoint([judge_with_a_short_context]) as fake:
        assert _score(fake.url, _write(tmp_path / "in.jsonl", records), tmp_path / "out") == 0
    err = capsys.readouterr().err
    assert "in.jsonl:1: skipped: step 4 of 9: the judge prompt is longer than the judge model's context" in err
    assert "maximum context length is 512" in err and "--observation-chars" in err
    results = _read(tmp_path / "out" / "abc.jsonl")
    assert [r["id"] for r in results] == ["rejected", "cut_off", "guess"] and not any(any(r["flagged"]) for r in results)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["scored"], summary["skipped"], [e["line"] for e in summary["errors"]]) == (3, 1, [1])
