"""Damaged JSONL through every reader of trajectories and external data: `trace-jax credit`, `trace-jax abc-score`
and the external importer get the same file of good records interleaved with bad lines (seeded random bytes, a BOM,
deep nesting, wrong types, malformed tool calls and content parts). Each must end normally (no traceback), report
every bad line by its number and still process every good record."""

import json
import random
import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).parent / "abc"))  # the judge's shared cases (tests/abc/judge_cases.py)

from judge_cases import CLUES, GOLD, to_messages, trajectories  # noqa: E402
from trace_jax import models  # noqa: E402
from trace_jax.abc.judge import scripted_rubric_reply  # noqa: E402
from trace_jax.cli import main  # noqa: E402
from trace_jax.data.external import load_external  # noqa: E402
from trace_jax.envs.oracle import trajectory_vocabulary  # noqa: E402
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer  # noqa: E402
from trace_jax.serve import ScriptedBackend, ServeConfig, ServerThread, create_app  # noqa: E402

SAMPLE = Path(__file__).parent / "data" / "credit_sample.jsonl"
BOM = "\ufeff".encode()


def _chat(**message_fields):
    """A record whose last message is an assistant message with the given (bad) fields."""
    return {"id": "bad", "answer": "x", "messages": [{"role": "user", "content": "q"},
                                                     {"role": "assistant", **message_fields}]}


def bad_lines(seed: int = 0, *, readable_chat_records: bool = True) -> list[bytes]:
    """Lines no reader may accept: seeded random bytes, deep nesting, wrong types, malformed chat fields, and (with
    `readable_chat_records`) well-formed chat records that each entry point refuses for its own reasons."""
    rng = random.Random(seed)
    lines = [bytes([rng.randrange(0x80, 0x100)]) + rng.randbytes(rng.randrange(8, 64)).replace(b"\n", b"")
             for _ in range(4)]  # a byte >= 0x80 first: not UTF-8, or (when it happens to be) not JSON
    lines += [b"{" + bytes(rng.choice(b"abc:,\"[]{} ") for _ in range(30)) for _ in range(2)]
    lines += [b"[" * 100_000 + b"]" * 100_000,
              json.dumps({"answer": "x", "messages": [{"role": "user", "content": "q"}],
                          "nested": json.loads("[" * 80 + "]" * 80)}).encode(),
              b'{"answer": "x", "messages": [{"role": "user", "content": "\\ud800"}]}',
              b'{"answer": "x", "messages": [{"role": "user", "content": "q"}], "n": ' + b"1" * 5000 + b"}",
              b"[1, 2]", b"42", b"null", b'"a string"']
    wrong = [{"answer": ["x"], "messages": [{"role": "user", "content": "q"}]},
             {"answer": "x", "messages": "hello"},
             {"answer": "x", "messages": [1, 2]},
             {"answer": "x", "messages": [{"role": 5, "content": "q"}]},
             _chat(content=7), _chat(content=[{"text": 5}]), _chat(content=[{"type": "image_url", "image_url": {"url": "x"}}]),
             _chat(content=None, tool_calls={"function": {"name": "search"}}),
             _chat(content=None, tool_calls="search"), _chat(content=None, tool_calls=[{"function": "oops"}]),
             _chat(content=None, tool_calls=[{"function": {"name": 5}}]),
             _chat(content=None, tool_calls=[{"function": {"name": "search", "arguments": 7}}]),
             _chat(content="x", reasoning_content=3)]
    if readable_chat_records:  # credit: a reward that is no float; abc-score: no clues; the importer: no query_id
        wrong.append({**_chat(content="x"), "reward": 10 ** 400})
    return lines + [json.dumps(record).encode() for record in wrong]


def interleave(good: list[bytes], seed: int = 0) -> tuple[bytes, list[int], list[int]]:
    """The file (a BOM before the first good line) and the 1-based numbers of its good and bad lines."""
    bad = bad_lines(seed)
    order = [("good", line) for line in good] + [("bad", line) for line in bad]
    random.Random(seed).shuffle(order)
    order.sort(key=lambda item: item[0] != "good" or item[1] is not good[0])  # the first good line opens the file
    content, good_numbers, bad_numbers = [], [], []
    for number, (kind, line) in enumerate(order, start=1):
        content.append((BOM + line) if number == 1 else line)
        (good_numbers if kind == "good" else bad_numbers).append(number)
    return b"\n".join(content) + b"\n", good_numbers, bad_numbers


def test_bad_lines_are_all_rejected_by_the_shared_reader():
    from trace_jax.jsonl import LineError, parse_chat_record

    for line in bad_lines(readable_chat_records=False):
        with pytest.raises(LineError):
            parse_chat_record(line, "answer", error=LineError)


def _assert_reported(err: str, name: str, bad_numbers, summary_errors):
    assert "Traceback" not in err
    for number in bad_numbers:
        assert f"{name}:{number}: skipped: " in err, number
    assert [e["line"] for e in summary_errors] == bad_numbers


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz_reference")
    build_word_tokenizer(trajectory_vocabulary(), directory)
    vocab = len(load_tokenizer(directory))
    config = models.get_preset("tiny-qwen3", vocab_size=-(-vocab // 64) * 64)
    models.save_pretrained(directory, config, models.init_params(config, jax.random.PRNGKey(0)))
    return directory


def test_credit_reports_every_bad_line_and_scores_every_good_record(reference_dir, tmp_path, capsys):
    good = SAMPLE.read_bytes().splitlines()[:3]
    content, good_numbers, bad_numbers = interleave(good)
    (tmp_path / "in.jsonl").write_bytes(content)
    assert main(["credit", str(tmp_path / "in.jsonl"), "--reference", str(reference_dir), "--out",
                 str(tmp_path / "out"), "--no-receipts", "--no-plot"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    _assert_reported(capsys.readouterr().err, "in.jsonl", bad_numbers, summary["errors"])
    scored = [json.loads(line) for line in (tmp_path / "out" / "credit.jsonl").read_text().splitlines()]
    assert [r["line"] for r in scored] == good_numbers
    assert sorted(r["id"] for r in scored) == sorted(json.loads(line)["id"] for line in good)


@pytest.fixture(scope="module")
def judge_url():
    backend = ScriptedBackend(scripted_rubric_reply, name="rubric-judge")
    with ServerThread(create_app(backend, ServeConfig())) as server:
        yield server.url + "/v1"


def test_abc_score_reports_every_bad_line_and_scores_every_good_record(judge_url, tmp_path, capsys):
    cases = {name: steps for name, steps, _ in trajectories()}
    good = [json.dumps({"id": name, "messages": to_messages(cases[name]), "answer": GOLD[0],
                        "clues": [c.to_dict() for c in CLUES]}).encode() for name in ("rejected", "guess")]
    content, good_numbers, bad_numbers = interleave(good, seed=1)
    (tmp_path / "in.jsonl").write_bytes(content)
    assert main(["abc-score", str(tmp_path / "in.jsonl"), "--judge-url", judge_url, "--judge-model",
                 "rubric-judge", "--out", str(tmp_path / "out"), "--backoff", "0", "--no-receipts"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    _assert_reported(capsys.readouterr().err, "in.jsonl", bad_numbers, summary["errors"])
    scored = [json.loads(line) for line in (tmp_path / "out" / "abc.jsonl").read_text().splitlines()]
    assert [r["line"] for r in scored] == good_numbers and not any(any(r["flagged"]) for r in scored)


def test_the_importer_reports_every_bad_line_and_imports_every_good_record(tmp_path):
    corpus = [{"docid": "d1", "text": "Kalo is a city."}, {"docid": "d2", "text": "Venmir is a river."}]
    queries = [{"query_id": i, "query": f"question {i}?", "answer": "Kalo", "gold_docs": ["d1", "d2"][: i % 2 + 1]}
               for i in range(3)]
    corpus_content, corpus_good, corpus_bad = interleave([json.dumps(d).encode() for d in corpus], seed=2)
    query_content, query_good, query_bad = interleave([json.dumps(q).encode() for q in queries], seed=3)
    (tmp_path / "corpus.jsonl").write_bytes(corpus_content)
    (tmp_path / "queries.jsonl").write_bytes(query_content)
    with pytest.warns(UserWarning, match="line\\(s\\) skipped; the rest was imported"):
        dataset = load_external(tmp_path / "queries.jsonl", tmp_path / "corpus.jsonl")
    assert sorted(d.docid for d in dataset.corpus) == ["d1", "d2"]
    assert [t.task_id for t in dataset.tasks] == [f"browsecomp_plus-{i}" for i in range(3)]
    reported = [(Path(s.path).name, s.line) for s in dataset.skipped]
    assert reported == [("corpus.jsonl", n) for n in corpus_bad] + [("queries.jsonl", n) for n in query_bad]
    assert all(s.error for s in dataset.skipped)


def _mutations(line: bytes, count: int, seed: int):
    """`count` copies of `line`, each with a few seeded random byte flips, insertions or deletions."""
    rng = random.Random(seed)
    for _ in range(count):
        data = bytearray(line)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(data))
            action = rng.randrange(3)
            if action == 0:
                data[at] = rng.randrange(256)
            elif action == 1:
                data.insert(at, rng.choice(b'{}[]",:\\0 \xff\xc3'))
            else:
                del data[at]
        yield bytes(data).replace(b"\n", b" ")


def test_mutated_records_are_prepared_or_reported_by_both_clis(reference_dir):
    """Records one to three random byte edits away from good ones: each is prepared or refused with the CLI's
    RecordError, never another exception."""
    import argparse

    from trace_jax.abc import cli as abc_cli
    from trace_jax.credit.config import CreditConfig
    from trace_jax.models.chat import ChatFormat
    from trace_jax.scoring import cli as credit_cli

    credit_args = argparse.ArgumentParser()
    credit_cli.add_arguments(credit_args)
    credit_args = credit_args.parse_args(["in.jsonl", "--reference", "r", "--out", "o"])
    abc_args = argparse.ArgumentParser()
    abc_cli.add_arguments(abc_args)
    abc_args = abc_args.parse_args(["in.jsonl", "--out", "o"])
    tokenizer = load_tokenizer(reference_dir)
    chat = ChatFormat(tokenizer)
    good = SAMPLE.read_bytes().splitlines()[0]
    outcomes = {"prepared": 0, "refused": 0}
    for number, line in enumerate(_mutations(good, 150, seed=4), start=1):
        try:
            credit_cli.prepare_record(number, line, chat, tokenizer, credit_args, CreditConfig(),
                                      max_positions=4096)
            outcomes["prepared"] += 1
        except credit_cli.RecordError:
            outcomes["refused"] += 1
        try:
            abc_cli.prepare_record(number, line, abc_args)
        except abc_cli.RecordError:
            pass
    assert outcomes["prepared"] and outcomes["refused"]  # the edits hit both harmless and fatal places
