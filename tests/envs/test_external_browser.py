"""Specification of the browser over an external corpus (BrowseComp-Plus layout): the same tools and observation
format as the procedural environment, the index built once and reused, answers checked against every alias."""

import json
import re

import pytest

from trace_jax.data.external import load_external
from trace_jax.envs.answers import answer_reward, exact_match
from trace_jax.envs.corpus import CorpusError
from trace_jax.envs.corpus_browser import corpus_browser
from trace_jax.envs.oracle import make_browser
from trace_jax.envs.search_index import SearchIndex, index_key
from trace_jax.envs.world import WorldConfig, build_world

FILLER = ("The archive holds letters, ledgers and maps from several centuries. Each entry lists a place, a date and "
          "a short note by the clerk who filed it. ") * 6
EVIDENCE = [
    {"docid": "e1", "url": "https://archive.example/orlan-bridge", "title": "Orlan Bridge",
     "text": "Orlan Bridge crosses the Tesk river.\nIt was designed by the engineer Mira Halvorsen in 1891.\n"
             + FILLER},
    {"docid": "e2", "title": "Mira Halvorsen",
     "text": "Mira Halvorsen was an engineer.\nShe was born in the harbour town of Quellport.\n" + FILLER},
]


def corpus_records():
    """About 200 documents: two evidence documents and numbered distractors, some without url or title."""
    records = list(EVIDENCE)
    for n in range(198):
        record = {"docid": f"x{n:03d}", "text": f"Distractor page {n} about the river trade.\n" + FILLER}
        if n % 3:
            record["title"] = f"Trade record {n}"
        if n % 2:
            record["url"] = f"https://archive.example/record/{n}"
        records.append(record)
    return records


QUERIES = [{"query_id": 1, "query": "In which town was the designer of Orlan Bridge born?", "answer": "Quellport",
            "answers": ["Quellport harbour", "the town of Quellport", ""],
            "evidence_docs": [{"docid": "e1"}], "gold_docs": ["e2"]}]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    folder = tmp_path_factory.mktemp("external")
    return load_external(write_jsonl(folder / "queries.jsonl", QUERIES),
                         write_jsonl(folder / "corpus.jsonl", corpus_records()))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bm25")


@pytest.fixture
def browser(dataset, cache_dir):
    return corpus_browser(dataset.corpus, cache_dir=cache_dir)


def test_search_open_and_find_reach_the_evidence_chain(browser):
    results = browser.step("search", {"query": "Orlan Bridge designer"})
    assert results.page.results[0][0] == "e1"
    page = browser.execute("open", {"id": 0})
    assert "Mira Halvorsen in 1891" in page
    browser.execute("search", {"query": "Mira Halvorsen born"})
    assert "Quellport" in browser.execute("open", {"id": 0})
    assert "# 【0†match at L1】" in browser.execute("find", {"pattern": "born in"})


def test_observations_have_the_procedural_format(browser, dataset):
    procedural = make_browser(build_world(WorldConfig(seed=3)))
    for tools in (browser, procedural):
        search = tools.execute("search", {"query": "river"})
        opened = tools.execute("open", {"id": 0})
        assert re.match(r"\[0\] Search results for `river`\n\*\*viewing lines \[0 - \d+\] of \d+\*\*\n\nL0: 【0†",
                        search)
        assert re.match(r"\[1\] .+ \(.+\)\n\*\*viewing lines \[0 - \d+\] of \d+\*\*\n\nL0: ", opened)
        assert tools.execute("open", {"id": 99}).startswith("Error: Invalid link id `99`")


def test_documents_without_url_or_title_get_the_importer_defaults(browser):
    document = browser.corpus.by_docid("x000")
    assert document.url == "doc://x000" and document.title.startswith("Distractor page 0")
    assert "doc://x000" in browser.execute("open", {"id": "doc://x000"})


def test_the_index_is_built_once_for_every_browser(dataset, tmp_path, monkeypatch):
    calls = []
    original = SearchIndex.build.__func__
    monkeypatch.setattr(SearchIndex, "build",
                        classmethod(lambda cls, *a, **k: calls.append(1) or original(cls, *a, **k)))
    first = corpus_browser(dataset.corpus, cache_dir=tmp_path)
    second = corpus_browser(dataset.corpus, cache_dir=tmp_path)
    assert calls == [1] and (tmp_path / index_key(dataset.corpus)).is_dir()
    assert first.execute("search", {"query": "Quellport"}) == second.execute("search", {"query": "Quellport"})


def test_the_default_cache_is_the_user_cache_dir(dataset, tmp_path, monkeypatch):
    monkeypatch.setenv("TRACE_JAX_CACHE", str(tmp_path))
    corpus_browser(dataset.corpus)
    assert (tmp_path / "bm25" / index_key(dataset.corpus)).is_dir()


def test_cache_dir_false_builds_in_memory(dataset, tmp_path, monkeypatch):
    monkeypatch.setenv("TRACE_JAX_CACHE", str(tmp_path))
    corpus_browser(dataset.corpus, cache_dir=False)
    assert not (tmp_path / "bm25").exists()


def test_a_corpus_file_or_records_give_the_same_browser(dataset, tmp_path, cache_dir):
    path = dataset.corpus.write_jsonl(tmp_path / "corpus.jsonl")
    records = [document.to_record() for document in dataset.corpus]
    expected = corpus_browser(dataset.corpus, cache_dir=cache_dir).execute("search", {"query": "Tesk river"})
    for documents in (path, records):
        assert corpus_browser(documents, cache_dir=cache_dir).execute("search", {"query": "Tesk river"}) == expected


def test_a_record_missing_a_field_is_named(tmp_path):
    with pytest.raises(CorpusError, match="document 1: missing field 'url'"):
        corpus_browser([{"docid": "a", "url": "u", "title": "t", "text": "x"}, {"docid": "b", "title": "t",
                                                                                 "text": "y"}], cache_dir=tmp_path)


def test_every_alias_of_the_task_is_accepted(dataset):
    task = dataset.tasks[0]
    assert task.gold_answers == ("Quellport", "Quellport harbour", "the town of Quellport", "")
    for alias in ("Quellport", "quellport harbour", "The Town of Quellport."):
        assert answer_reward(f"It is <answer>{alias}</answer>", task.gold_answers).reward == 1.0


def test_wrong_answers_and_an_empty_alias_accept_nothing(dataset):
    gold = dataset.tasks[0].gold_answers
    for wrong in ("Orlan", "the", "a", ".", "town"):
        assert answer_reward(f"<answer>{wrong}</answer>", gold).reward == 0.0
    assert not exact_match("The", ["", "  "])


def test_article_only_answers_are_compared_as_words():
    assert exact_match("A", ["a"]) and exact_match("(A)", "A") and not exact_match("the", "A")
