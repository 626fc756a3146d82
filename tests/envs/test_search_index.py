"""BM25 index: same scores and rankings as bm25s, docid tie-break, determinism, save/load (the cache has its own\ntests in test_index_cache.py)."""

import random

import numpy as np
import pytest

from trace_jax.envs.corpus import Corpus
from trace_jax.envs.search_index import SearchIndex, document_search_text, tokenize

WORDS = ("river city company founder mayor bridge valley north south harbor mill stone forest lake tower market "
         "school museum garden castle").split()


def procedural_corpus(num_docs, seed=0):
    rng = random.Random(seed)
    records = []
    for n in range(num_docs):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))
        records.append({"docid": f"doc{n:05d}", "url": f"https://p.local/{n}", "title": rng.choice(WORDS),
                        "text": text})
    return Corpus.from_records(records)


@pytest.fixture(scope="module")
def corpus():
    return procedural_corpus(400)


@pytest.fixture(scope="module")
def index(corpus):
    return SearchIndex.build(corpus)


def test_tokenize_lowercases_and_drops_stopwords():
    assert tokenize("The River-Thames, in LONDON!") == ["river", "thames", "london"]


def test_scores_equal_bm25s_scores(corpus, index):
    import bm25s

    retriever = bm25s.BM25(method="lucene", k1=1.5, b=0.75)
    retriever.index([tokenize(document_search_text(d.title, d.text)) for d in corpus], show_progress=False)
    rng = random.Random(1)
    for _ in range(30):
        query = " ".join(rng.sample(WORDS, rng.randint(1, 4)))
        expected = retriever.get_scores(tokenize(query))
        np.testing.assert_array_equal(index.scores(query), expected)


def test_rankings_equal_bm25s_rankings_up_to_docid_tie_break(corpus, index):
    import bm25s

    retriever = bm25s.BM25(method="lucene", k1=1.5, b=0.75)
    retriever.index([tokenize(document_search_text(d.title, d.text)) for d in corpus], show_progress=False)
    docids = corpus.docids
    rng = random.Random(2)
    for _ in range(30):
        query = " ".join(rng.sample(WORDS, rng.randint(1, 4)))
        scores = retriever.get_scores(tokenize(query))
        expected = sorted(((docids[i], float(s)) for i, s in enumerate(scores) if s > 0),
                          key=lambda item: (-item[1], item[0]))[:10]
        documents, bm25s_scores = retriever.retrieve([tokenize(query)], k=10, show_progress=False)
        assert sorted(bm25s_scores[0].tolist(), reverse=True) == [s for _, s in expected]
        assert index.search(query, 10) == expected


def test_ties_are_broken_by_ascending_docid():
    # Identical documents score identically; corpus order is the reverse of docid order.
    records = [{"docid": f"d{n}", "url": f"u{n}", "title": "same", "text": "same words here"} for n in (3, 1, 2)]
    index = SearchIndex.build(Corpus.from_records(records))
    assert [docid for docid, _ in index.search("words", 10)] == ["d1", "d2", "d3"]
    assert [docid for docid, _ in index.search("same words", 2)] == ["d1", "d2"]


def test_search_is_deterministic_across_builds(corpus, index):
    rebuilt = SearchIndex.build(procedural_corpus(400))
    for query in ("river city", "castle castle market", "north"):
        assert rebuilt.search(query, 10) == index.search(query, 10)


def test_topn_and_queries_without_indexed_words(index):
    assert len(index.search("river", 3)) == 3
    assert index.search("river", 0) == [] and index.search("", 5) == [] and index.search("the of and", 5) == []
    assert index.search("xylophone", 5) == []


def test_only_positive_scores_are_returned():
    corpus = Corpus.from_records([{"docid": "a", "url": "a", "title": "t", "text": "apple"},
                                  {"docid": "b", "url": "b", "title": "t", "text": "pear"}])
    assert [d for d, _ in SearchIndex.build(corpus).search("apple", 10)] == ["a"]


def test_empty_corpus_and_stopword_only_corpus():
    assert SearchIndex.build(Corpus.from_records([])).search("river", 5) == []
    corpus = Corpus.from_records([{"docid": "a", "url": "a", "title": "the", "text": "of the"}])
    assert SearchIndex.build(corpus).search("the", 5) == []


def test_save_and_load_give_the_same_rankings(tmp_path, corpus, index):
    index.save(tmp_path / "idx")
    loaded = SearchIndex.load(corpus, tmp_path / "idx")
    for query in ("river city", "castle market", "lake"):
        assert loaded.search(query, 10) == index.search(query, 10)


def test_load_refuses_an_index_of_another_corpus(tmp_path, index):
    index.save(tmp_path / "idx")
    with pytest.raises(ValueError, match="different corpus"):
        SearchIndex.load(procedural_corpus(30), tmp_path / "idx")


def test_top_candidate_pruning_matches_a_full_sort_for_every_topn():
    rng = random.Random(3)
    vocabulary = [f"w{n}" for n in range(300)]
    weights = [1 / (n + 1) for n in range(300)]  # Zipf-like: rare and common words mixed in one query
    records = [{"docid": f"d{rng.randint(0, 10**6):07d}-{n}", "url": f"u{n}", "title": "",
                "text": " ".join(rng.choices(vocabulary, weights, k=rng.randint(3, 30)))} for n in range(600)]
    corpus = Corpus.from_records(records)
    index = SearchIndex.build(corpus)
    for _ in range(60):
        query = " ".join(rng.choices(vocabulary, k=rng.randint(2, 5)))
        scores = index.scores(query)
        full = sorted(((corpus[i].docid, float(s)) for i, s in enumerate(scores) if s > 0),
                      key=lambda item: (-item[1], item[0]))
        for topn in (1, 3, 10, 50, 1000):
            assert index.search(query, topn) == full[:topn]
