"""Specification of the BM25 index cache: built once per corpus and parameters, loaded by every later caller,
written atomically in bm25s's own format, rebuilt with a warning when damaged."""

import json
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from trace_jax.envs import search_index
from trace_jax.envs.corpus import Corpus
from trace_jax.envs.search_index import SearchIndex, default_cache_dir, index_key, tokenize
from trace_jax.envs.synthetic import SyntheticCorpusConfig, synthetic_corpus

CONFIG = SyntheticCorpusConfig(num_docs=300, seed=5, median_words=120.0, min_words=5, max_words=3_000,
                               vocabulary_size=2_000)


@pytest.fixture(scope="module")
def corpus():
    return synthetic_corpus(CONFIG)


@pytest.fixture(scope="module")
def queries(corpus):
    # Queries with at least one indexed word (bm25s's get_scores refuses others).
    words = tokenize(max(corpus, key=lambda d: len(d.text)).text)
    return [f"{words[0]} xylophone", corpus[8].title] + [" ".join(words[i:i + 3]) for i in range(0, 30, 3)]


@pytest.fixture
def builds(monkeypatch):
    """Counts SearchIndex.build calls."""
    calls = []
    original = SearchIndex.build.__func__

    def counting(cls, *args, **kwargs):
        calls.append(1)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(SearchIndex, "build", classmethod(counting))
    return calls


def same_results(first, second, queries):
    return all(first.search(query, 10) == second.search(query, 10) for query in queries)


def test_second_construction_loads_instead_of_building(tmp_path, corpus, queries, builds):
    first = SearchIndex.load_or_build(corpus, tmp_path)
    second = SearchIndex.load_or_build(corpus, tmp_path)
    assert len(builds) == 1
    assert isinstance(second._data, np.memmap)  # shared through the page cache, not copied per process
    assert same_results(first, second, queries)


def test_concurrent_callers_build_once(tmp_path, corpus, queries, builds):
    with ThreadPoolExecutor(max_workers=3) as pool:
        indexes = list(pool.map(lambda _: SearchIndex.load_or_build(corpus, tmp_path), range(3)))
    assert len(builds) == 1
    assert all(same_results(index, indexes[0], queries) for index in indexes)


def test_an_identical_corpus_read_again_uses_the_same_entry(tmp_path, corpus, builds):
    SearchIndex.load_or_build(corpus, tmp_path)
    reread = Corpus.from_jsonl(corpus.write_jsonl(tmp_path / "corpus.jsonl"))
    SearchIndex.load_or_build(reread, tmp_path)
    assert len(builds) == 1 and index_key(reread) == index_key(corpus)


def test_a_changed_corpus_gets_a_new_key_and_is_built(tmp_path, corpus, builds):
    SearchIndex.load_or_build(corpus, tmp_path)
    changed = Corpus.from_records([*list(corpus)[:-1], {"docid": "new", "url": "u:new", "title": "New",
                                                        "text": "a new last document"}])
    assert index_key(changed) != index_key(corpus)
    index = SearchIndex.load_or_build(changed, tmp_path)
    assert len(builds) == 2 and index.search("new last document", 1)[0][0] == "new"


@pytest.mark.parametrize("parameters", [{"k1": 1.2}, {"b": 0.5}])
def test_changed_bm25_parameters_get_a_new_key(tmp_path, corpus, builds, parameters):
    SearchIndex.load_or_build(corpus, tmp_path)
    assert index_key(corpus, **parameters) != index_key(corpus)
    index = SearchIndex.load_or_build(corpus, tmp_path, **parameters)
    assert len(builds) == 2
    assert (index.k1, index.b) == (parameters.get("k1", 1.5), parameters.get("b", 0.75))
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


@pytest.mark.parametrize("damage", ["truncate data", "delete vocab", "garbage metadata", "wrong entry count"])
def test_a_damaged_entry_is_rebuilt_with_a_warning(tmp_path, corpus, queries, builds, damage):
    reference = SearchIndex.load_or_build(corpus, tmp_path)
    entry = tmp_path / index_key(corpus)
    if damage == "truncate data":
        data = entry / "data.csc.index.npy"
        data.write_bytes(data.read_bytes()[:200])
    elif damage == "delete vocab":
        (entry / "vocab.index.json").unlink()
    elif damage == "garbage metadata":
        (entry / "trace_jax_index.json").write_text("{not json", encoding="utf-8")
    else:
        meta = json.loads((entry / "trace_jax_index.json").read_text())
        (entry / "trace_jax_index.json").write_text(json.dumps({**meta, "entries": meta["entries"] + 1}))
    with pytest.warns(RuntimeWarning, match="could not be loaded.*rebuilding"):
        rebuilt = SearchIndex.load_or_build(corpus, tmp_path)
    assert len(builds) == 2 and same_results(rebuilt, reference, queries)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SearchIndex.load_or_build(corpus, tmp_path)  # the repaired entry loads quietly
    assert len(builds) == 2


def test_writes_leave_only_the_entry_and_its_lock_file(tmp_path, corpus):
    SearchIndex.load_or_build(corpus, tmp_path)
    key = index_key(corpus)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{key}.lock", key]


def test_saving_over_a_complete_entry_keeps_it(tmp_path, corpus):
    index = SearchIndex.load_or_build(corpus, tmp_path)
    entry = tmp_path / index_key(corpus)
    before = (entry / "data.csc.index.npy").stat().st_mtime_ns
    index.save(entry)  # a second writer finishing later
    assert (entry / "data.csc.index.npy").stat().st_mtime_ns == before
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [entry.name]


def test_the_cached_index_is_bm25s_own_format(tmp_path, corpus, queries):
    import bm25s

    ours = SearchIndex.load_or_build(corpus, tmp_path)
    retriever = bm25s.BM25.load(tmp_path / index_key(corpus))
    for query in queries:
        np.testing.assert_array_equal(retriever.get_scores(tokenize(query)), ours.scores(query))


def test_the_build_equals_bm25s_index_on_the_same_tokens(corpus, queries):
    import bm25s

    retriever = bm25s.BM25(method="lucene", k1=1.5, b=0.75)
    retriever.index([tokenize(f"{d.title}\n{d.text}") for d in corpus], show_progress=False)
    ours = SearchIndex.build(corpus)
    assert set(ours._vocab) == set(retriever.vocab_dict) - {""}  # bm25s adds an empty token
    for query in queries:
        np.testing.assert_array_equal(retriever.get_scores(tokenize(query)), ours.scores(query))


def test_worker_processes_build_the_same_index(corpus, queries, monkeypatch):
    monkeypatch.setattr(search_index, "_SHARD_DOCS", 70)  # several shards from a small corpus
    alone, shared = SearchIndex.build(corpus, workers=1), SearchIndex.build(corpus, workers=2)
    assert alone._vocab == shared._vocab
    for name in ("_data", "_indices", "_indptr"):
        np.testing.assert_array_equal(getattr(alone, name), getattr(shared, name))


def test_non_ascii_documents_are_tokenised_like_queries(tmp_path):
    corpus = Corpus.from_records([
        {"docid": "a", "url": "u:a", "title": "Zürich", "text": "Die Straße führt nach Genève."},
        {"docid": "b", "url": "u:b", "title": "Oslo", "text": "Plain ascii words about Oslo."}])
    index = SearchIndex.load_or_build(corpus, tmp_path)
    assert [d for d, _ in index.search("straße genève", 5)] == ["a"]
    assert [d for d, _ in index.search("ZÜRICH", 5)] == ["a"]


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TRACE_JAX_CACHE", str(tmp_path / "tj"))
    assert default_cache_dir() == tmp_path / "tj" / "bm25"
    monkeypatch.delenv("TRACE_JAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "trace_jax" / "bm25"


@pytest.mark.parametrize("parameters, match", [({"k1": -1.0}, "k1"), ({"b": 1.5}, "b must be in")])
def test_invalid_bm25_parameters_are_refused(corpus, parameters, match):
    with pytest.raises(ValueError, match=match):
        index_key(corpus, **parameters)


def _die(bounds, stopwords):
    os._exit(3)


def test_a_failing_worker_falls_back_to_counting_in_process(corpus, queries, monkeypatch):
    monkeypatch.setattr(search_index, "_SHARD_DOCS", 70)
    monkeypatch.setattr(search_index, "_count_forked_shard", _die)
    with pytest.warns(RuntimeWarning, match="worker processes failed.*counting words in this process"):
        index = SearchIndex.build(corpus, workers=2)
    assert same_results(index, SearchIndex.build(corpus, workers=1), queries)
