"""Specification of the synthetic benchmark corpus: deterministic, log-normal lengths, Zipf words, browser-ready."""

import math
import re
from collections import Counter

import numpy as np
import pytest

from trace_jax.envs.search_index import SearchIndex, tokenize
from trace_jax.envs.synthetic import (FUNCTION_WORDS, SyntheticCorpusConfig, synthetic_corpus,
                                      synthetic_documents)

SMALL = SyntheticCorpusConfig(num_docs=400, seed=3, median_words=150.0, sigma=1.0, min_words=5, max_words=5_000,
                              vocabulary_size=3_000)


@pytest.fixture(scope="module")
def corpus():
    return synthetic_corpus(SMALL)


def word_counts(corpus):
    return np.array([len(document.text.split()) for document in corpus])


def test_same_config_gives_the_same_corpus(corpus):
    again = synthetic_corpus(SMALL)
    assert list(again) == list(corpus) and again.content_hash == corpus.content_hash


def test_another_seed_gives_another_corpus(corpus):
    other = synthetic_corpus(SyntheticCorpusConfig(**{**SMALL.__dict__, "seed": 4}))
    assert other.content_hash != corpus.content_hash


def test_each_document_depends_only_on_seed_and_position(corpus):
    assert list(synthetic_documents(SMALL, 120, 125)) == list(corpus[120:125])


def test_lengths_are_log_normal_with_the_configured_median_and_sigma(corpus):
    logs = np.log(word_counts(corpus))
    # 400 draws: the sample mean of log-length is within ~4 standard errors (0.05) of log(median).
    assert abs(logs.mean() - math.log(SMALL.median_words)) < 0.2
    assert abs(logs.std() - SMALL.sigma) < 0.15


def test_lengths_have_a_long_tail(corpus):
    counts = word_counts(corpus)
    assert counts.max() > 8 * np.median(counts) and counts.mean() > 1.3 * np.median(counts)


def test_lengths_are_clipped_to_the_configured_range():
    config = SyntheticCorpusConfig(num_docs=200, median_words=40.0, sigma=2.0, min_words=10, max_words=80,
                                   vocabulary_size=1_000)
    counts = word_counts(synthetic_corpus(config))
    assert counts.min() == 10 and counts.max() == 80


def test_default_config_has_browsecomp_plus_scale():
    config = SyntheticCorpusConfig()
    assert config.num_docs == 100_000 and 5_000 < config.mean_words < 5_400


def test_about_a_third_of_the_words_are_stopwords_as_in_prose(corpus):
    words = " ".join(document.text for document in corpus).replace(".", "").split()
    share = sum(word in FUNCTION_WORDS for word in words) / len(words)
    assert 0.25 < share < 0.5


def test_documents_have_ids_urls_titles_sentences_and_paragraphs(corpus):
    document = corpus[7]
    assert document.docid == "doc0000007" and document.url == "https://synthetic.local/doc0000007"
    assert re.fullmatch(r"([A-Z][a-z]+ ){1,4}[A-Z][a-z]+", document.title)
    long_document = max(corpus, key=lambda d: len(d.text))
    assert "\n" in long_document.text and ". " in long_document.text
    assert all(len(paragraph.split()) == SMALL.sentence_words * SMALL.paragraph_sentences
               for paragraph in long_document.text.split("\n")[:-1])


def test_a_word_of_one_document_finds_that_document(corpus):
    index = SearchIndex.build(corpus)
    words = [set(tokenize(f"{document.title} {document.text}")) for document in corpus]
    frequency = Counter(word for document_words in words for word in document_words)
    checked = 0
    for document, document_words in zip(corpus, words):
        unique = sorted(word for word in document_words if frequency[word] == 1)
        if unique:
            assert [docid for docid, _ in index.search(unique[0], 5)] == [document.docid]
            checked += 1
    assert checked >= 5


@pytest.mark.parametrize("field, value", [("num_docs", 0), ("sigma", -1.0), ("median_words", float("nan")),
                                          ("vocabulary_size", 10), ("seed", -1)])
def test_invalid_configs_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SyntheticCorpusConfig.{field}"):
        SyntheticCorpusConfig(**{field: value})


def test_min_words_above_max_words_is_refused():
    with pytest.raises(ValueError, match="min_words"):
        SyntheticCorpusConfig(min_words=50, max_words=10)
