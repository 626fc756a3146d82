"""Task sources in the run: `DataConfig.source` (procedural, tfds, external), evaluation sets (`EvalConfig.sets`),
the external corpus's BM25 index built once, and bad task files failing before any compute.

One run serves the end-to-end assertions: `trace-jax train` for 2 RL steps of the tiny policy on a ~200-document
external set written here in the BrowseComp-Plus layout, evaluated on that set's held-out queries and on a
procedural set, then `trace-jax eval --set external`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.rl.test_rl_pipeline import SMALL
from trace_jax.cli import main
from trace_jax.data.external import load_external_corpus
from trace_jax.envs.search_index import SearchIndex
from trace_jax.rl import cli as train_cli
from trace_jax.rl.gin_setup import ConfigError, parse
from trace_jax.rl.loop import build_tasks, demonstrable_tasks, prompt_stream

NUM_DOCS = 200
NUM_QUERIES = 12
WORDS = ("amber basalt cedar delta ember fjord granite harbor iris juniper kestrel lagoon meadow nectar onyx prairie "
         "quartz river saffron tundra umber valley willow xenon yarrow zephyr").split()


def write_external_set(root: Path, *, missing_doc: bool = False, bad_json: bool = False) -> tuple[Path, Path]:
    """A BrowseComp-Plus-layout set: NUM_QUERIES queries, each answered by one evidence document (with an alias),
    over NUM_DOCS documents (the rest are filler)."""
    root.mkdir(parents=True, exist_ok=True)
    corpus, queries = root / "corpus.jsonl", root / "queries.jsonl"
    docs = []
    for i in range(NUM_DOCS):
        a, b = WORDS[i % len(WORDS)], WORDS[(i * 7 + 3) % len(WORDS)]
        if i < NUM_QUERIES:
            text = f"The {a} station of {b} county.\nIts keeper is named {WORDS[(i + 5) % len(WORDS)].title()}."
        else:
            text = f"A note about {a} and {b}, number {i}.\nNothing else is recorded here."
        docs.append({"docid": f"doc{i}", "title": f"{a.title()} {b.title()} {i}", "text": text})
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    lines = []
    for i in range(NUM_QUERIES):
        a, b = WORDS[i % len(WORDS)], WORDS[(i * 7 + 3) % len(WORDS)]
        keeper = WORDS[(i + 5) % len(WORDS)].title()
        evidence = "doc999" if missing_doc and i == 3 else f"doc{i}"
        lines.append(json.dumps({"query_id": i, "query": f"Who keeps the {a} station of {b} county?",
                                 "answer": keeper, "aliases": [f"keeper {keeper}"],
                                 "evidence_docs": [evidence], "gold_docs": [evidence]}))
    if bad_json:
        lines[5] = '{"query_id": 5, "query": "broken'
    queries.write_text("\n".join(lines) + "\n")
    return queries, corpus


def external_gin(queries: Path, corpus: Path, index_dir: Path, extra: str = "") -> str:
    return SMALL + f"""
DataConfig.source = 'external'
DataConfig.queries = '{queries}'
DataConfig.corpus = '{corpus}'
DataConfig.index_dir = '{index_dir}'
DataConfig.eval_fraction = 0.25
EvalConfig.sets = {{'external': 'heldout', 'procedural': 'procedural'}}
TrainConfig.steps = 2
""" + extra


@pytest.fixture(scope="module")
def external_run(tmp_path_factory):
    """Train 2 steps on the external set, then `trace-jax eval --set external`, counting BM25 builds of its corpus."""
    root = tmp_path_factory.mktemp("external_run")
    queries, corpus = write_external_set(root / "set")
    gin_file = root / "external.gin"
    gin_file.write_text(external_gin(queries, corpus, root / "bm25"))
    external_hash = load_external_corpus(corpus).content_hash
    builds = []
    build = SearchIndex.build.__func__

    def counting_build(cls, corpus_, **kwargs):
        builds.append(corpus_.content_hash == external_hash)
        return build(cls, corpus_, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SearchIndex, "build", classmethod(counting_build))
        run_dir = root / "run"
        status = train_cli.run_train([str(gin_file)], [], str(run_dir), progress=False)
        eval_status = main(["eval", "--run_dir", str(run_dir), "--set", "external"])
    return {"status": status, "eval_status": eval_status, "run_dir": run_dir, "builds": builds,
            "queries": queries, "corpus": corpus, "root": root}


@pytest.mark.slow
def test_external_run_trains_and_reports_both_sets_in_summary(external_run):
    assert external_run["status"] == 0
    summary = json.loads((external_run["run_dir"] / "summary.json").read_text())
    table = summary["eval_sets"]
    assert table["columns"] == ["external", "procedural", "average"]
    for label in ("initial", "final"):
        row = table["rows"][label]
        assert row["external"]["num_tasks"] == 2 and row["procedural"]["num_tasks"] == 2
        assert row["average"]["accuracy"] == pytest.approx(
            (row["external"]["accuracy"] + row["procedural"]["accuracy"]) / 2)
        assert set(row["external"]["statuses"]) and "tool_calls_per_episode" in row["procedural"]
    assert summary["steps"] == 2
    assert (external_run["run_dir"] / "plots" / "eval_sets.png").exists()


@pytest.mark.slow
def test_external_corpus_index_is_built_once_for_training_and_evaluation(external_run):
    assert external_run["eval_status"] == 0
    assert external_run["builds"].count(True) == 1


@pytest.mark.slow
def test_eval_of_one_set_writes_its_own_file(external_run):
    data = json.loads((external_run["run_dir"] / "eval_step2_external.json").read_text())
    assert list(data["sets"]) == ["external"] and data["num_tasks"] == 2


@pytest.mark.slow
def test_each_step_records_its_prompts_from_the_external_training_split(external_run):
    records = [json.loads(line) for line in (external_run["run_dir"] / "prompts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(len(r["task_ids"]) == 2 and all(t.startswith("browsecomp_plus-") for t in r["task_ids"])
               for r in records)


def test_external_tasks_are_checked_against_their_aliases(tmp_path):
    queries, corpus = write_external_set(tmp_path / "set")
    gin_file = tmp_path / "external.gin"
    gin_file.write_text(external_gin(queries, corpus, tmp_path / "bm25"))
    config = parse([str(gin_file)])
    splits, _, eval_sets = build_tasks(config)
    task = eval_sets["external"].tasks[0]
    assert f"keeper {task.answer}" in task.gold_answers
    from trace_jax.envs.answers import exact_match

    assert exact_match(f"keeper {task.answer}", task.gold_answers)
    assert not {t.task_id for t in splits.train} & {t.task_id for t in splits.heldout}


# ------------------------------------------------------------------------------------------------ bad input
def _no_compute(monkeypatch):
    from trace_jax import models

    def refuse(*args, **kwargs):
        raise AssertionError("compute started before the task files were checked")

    monkeypatch.setattr(models, "init_params", refuse)


def test_missing_corpus_path_fails_before_compute_naming_the_field(tmp_path, capsys, monkeypatch):
    queries, _ = write_external_set(tmp_path / "set")
    gin_file = tmp_path / "x.gin"
    gin_file.write_text(external_gin(queries, tmp_path / "nowhere.jsonl", tmp_path / "bm25"))
    _no_compute(monkeypatch)
    assert train_cli.run_train([str(gin_file)], [], str(tmp_path / "run"), progress=False) == 2
    err = capsys.readouterr().err
    assert "DataConfig.corpus" in err and "nowhere.jsonl" in err and "no such file" in err


def test_evidence_doc_missing_from_the_corpus_fails_before_compute_naming_file_line_and_fix(tmp_path, capsys,
                                                                                           monkeypatch):
    queries, corpus = write_external_set(tmp_path / "set", missing_doc=True)
    gin_file = tmp_path / "x.gin"
    gin_file.write_text(external_gin(queries, corpus, tmp_path / "bm25"))
    _no_compute(monkeypatch)
    assert train_cli.run_train([str(gin_file)], [], str(tmp_path / "run"), progress=False) == 2
    err = capsys.readouterr().err
    assert f"{queries}:4" in err and "doc999" in err and "is not in the corpus" in err
    assert "DataConfig.skip_bad_lines" in err


def test_malformed_query_line_surfaces_the_importers_file_and_line(tmp_path, capsys, monkeypatch):
    queries, corpus = write_external_set(tmp_path / "set", bad_json=True)
    gin_file = tmp_path / "x.gin"
    gin_file.write_text(external_gin(queries, corpus, tmp_path / "bm25"))
    _no_compute(monkeypatch)
    assert train_cli.run_train([str(gin_file)], [], str(tmp_path / "run"), progress=False) == 2
    assert f"{queries}:6" in capsys.readouterr().err


@pytest.mark.parametrize("binding, named", [
    ("DataConfig.source = 'csv:x'", "DataConfig.source"),
    ("DataConfig.source = 'tfds:'", "DataConfig.source"),
    ("DataConfig.source = 'external'", "DataConfig.queries"),
    ("DataConfig.eval_fraction = 1.5", "DataConfig.eval_fraction"),
    ("EvalConfig.sets = {'a b': 'heldout'}", "EvalConfig.sets"),
    ("EvalConfig.sets = {'x': 'nowhere'}", "EvalConfig.sets['x']"),
])
def test_bad_source_bindings_fail_at_parse_naming_the_field(tmp_path, binding, named):
    gin_file = tmp_path / "x.gin"
    gin_file.write_text(SMALL + binding + "\n")
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        parse([str(gin_file)])


# ------------------------------------------------------------------------------------------------ warm start
def test_warm_start_demonstrates_external_tasks_through_their_evidence_docs(tmp_path):
    from trace_jax.data.sources import external_splits
    from trace_jax.envs.corpus_browser import corpus_browser
    from trace_jax.envs.oracle import solve

    queries, corpus = write_external_set(tmp_path / "set")
    splits = external_splits(str(queries), str(corpus), eval_fraction=0.0, seed=0, num_train=4, num_eval=0)
    browser = corpus_browser(splits.corpus, cache_dir=False)
    results = [solve(browser.fork(), task) for task in demonstrable_tasks(splits.train)]
    assert all(r.solved for r in results)
    assert all(any(m.get("name") == "open" for m in r.messages if m["role"] == "tool") for r in results)


def test_warm_start_refuses_tasks_without_evidence_naming_the_fix():
    from trace_jax.envs.tasks import Task

    bare = [Task(task_id="q1", question="?", answer="a", aliases=(), qtype="external", hops=0, clues=(),
                 program={}, source="external", world={})]
    with pytest.raises(ValueError, match="WarmStartConfig.steps = 0"):
        demonstrable_tasks(bare)


# ------------------------------------------------------------------------------------------------ tfds
def test_tfds_source_trains_the_same_tasks_in_the_same_order_as_procedural(tmp_path):
    import dataclasses

    from trace_jax.data.search_tasks import BUILDER_CONFIGS

    tiny = next(c for c in BUILDER_CONFIGS if c.name == "tiny")  # the procedural source bound to the same world
    world = "".join(f"WorldConfig.{k} = {v!r}\n" for k, v in tiny.world_config().to_dict().items())
    tasks = "".join(f"TaskConfig.{f.name} = {getattr(tiny.task_config(), f.name)!r}\n"
                    for f in dataclasses.fields(tiny.task_config()))
    common = (SMALL + world + tasks
              + f"DataConfig.num_train_tasks = {tiny.train_size}\nDataConfig.seed = {tiny.task_seed}\n")
    procedural_gin, tfds_gin = tmp_path / "p.gin", tmp_path / "t.gin"
    procedural_gin.write_text(common)
    tfds_gin.write_text(common + f"DataConfig.source = 'tfds:trace_jax_search_tasks/tiny'\n"
                        f"DataConfig.data_dir = '{tmp_path / 'tfds'}'\n")
    procedural, tfds_config = parse([str(procedural_gin)]), parse([str(tfds_gin)])
    (a, browser_a, _), (b, browser_b, _) = build_tasks(procedural), build_tasks(tfds_config)
    assert [t.question for t in a.train] == [t.question for t in b.train]
    assert [d.docid for d in browser_a.corpus] == [d.docid for d in browser_b.corpus]
    stream_a, stream_b = prompt_stream(procedural, a.train), prompt_stream(tfds_config, b.train)
    for _ in range(20):  # 20 steps of 2 prompts: past the first epoch of 32 tasks
        assert [t.question for t in next(stream_a)] == [t.question for t in next(stream_b)]


def test_an_unknown_tfds_builder_is_named_before_compute(tmp_path):
    from trace_jax.data.sources import SourceError

    gin_file = tmp_path / "t.gin"
    gin_file.write_text(SMALL + f"DataConfig.source = 'tfds:no_such_builder/x'\nDataConfig.data_dir = '{tmp_path}'\n")
    with pytest.raises(SourceError, match="tfds:no_such_builder/x"):
        build_tasks(parse([str(gin_file)]))
