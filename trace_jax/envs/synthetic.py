"""A deterministic synthetic corpus at BrowseComp-Plus scale, for benchmarking the search environment.

BrowseComp-Plus has 100,195 web documents averaging 5,179 words. ``synthetic_corpus(SyntheticCorpusConfig())``
makes 100,000 documents of that size and shape without downloads:

* **Lengths** (words per document, stopwords included) follow a log-normal distribution,
  ``words = clip(round(exp(N(log(median_words), sigma ** 2))), min_words, max_words)``. The defaults
  ``median_words = 3_141, sigma = 1.0`` give a mean of ``median * exp(sigma ** 2 / 2) ~= 5,180`` words; 1% of the
  documents are longer than ``median * exp(2.326 * sigma) ~= 32,000`` words (the long tail that a page renderer and a
  BM25 build must survive), and ``max_words = 100_000`` caps the very few beyond.
* **Words** are drawn from a Zipf-like law ``p(rank) ~ 1 / (rank + 2.7)`` over ``vocabulary_size`` words. The most
  frequent ranks are English function words (``the``, ``of``, ``and`` ...), so about a third of the tokens are
  stopwords as in real prose; the rest are pseudo-words made of syllables.
* **Layout**: sentences of ``sentence_words`` words ending in ``.``, paragraphs of ``paragraph_sentences`` sentences
  separated by newlines; a 2-5 word title; ``docid = doc0000042``, ``url = https://synthetic.local/doc0000042``.

Determinism: document ``i`` depends only on ``(seed, i)`` (its own ``numpy.random.Generator`` seeded with
``[seed, i]``, sampled by inverse CDF with ``searchsorted``, no platform-dependent maths), so the same config gives
the same corpus on every machine and ``synthetic_documents`` can produce any range of documents independently.

This module knows about documents only: no index, tools or tasks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from trace_jax.envs.corpus import Corpus, Document

# Function words placed at the top Zipf ranks (all are in the English stopword list the index drops).
FUNCTION_WORDS = tuple(
    "the of and to a in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there all we their has been its if will would can no when what more".split())
SYLLABLES = tuple("ka lo mir ven ta dor si bel ru gan te ol mar ni vas ko ra len tu sha bo rin da fel pa zu hal ve "
                  "mo kir ash lu gor ne tam sel".split())
_ZIPF_OFFSET = 2.7


@dataclass(frozen=True)
class SyntheticCorpusConfig:
    """Size and shape of a synthetic corpus (defaults: BrowseComp-Plus scale; see the module docstring).

    Attributes:
      num_docs: documents.
      seed: the corpus is a pure function of the config; another seed gives another corpus.
      median_words: median words per document (log-normal ``exp(mu)``).
      sigma: log-normal shape; larger is a longer tail.
      min_words, max_words: lengths are clipped to this range.
      vocabulary_size: distinct words (function words included).
      sentence_words: words per sentence.
      paragraph_sentences: sentences per paragraph.
    """

    num_docs: int = 100_000
    seed: int = 0
    median_words: float = 3_141.0
    sigma: float = 1.0
    min_words: int = 20
    max_words: int = 100_000
    vocabulary_size: int = 100_000
    sentence_words: int = 12
    paragraph_sentences: int = 5

    def __post_init__(self):
        for name in ("num_docs", "min_words", "max_words", "sentence_words", "paragraph_sentences"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SyntheticCorpusConfig.{name} must be an int >= 1, got {value!r}.")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"SyntheticCorpusConfig.seed must be an int >= 0, got {self.seed!r}.")
        if self.min_words > self.max_words:
            raise ValueError(f"SyntheticCorpusConfig.min_words ({self.min_words}) must be <= max_words "
                             f"({self.max_words}).")
        if not (math.isfinite(self.median_words) and self.median_words >= 1):
            raise ValueError(f"SyntheticCorpusConfig.median_words must be a finite number >= 1, got "
                             f"{self.median_words!r}.")
        if not (math.isfinite(self.sigma) and 0 <= self.sigma <= 4):
            raise ValueError(f"SyntheticCorpusConfig.sigma must be in [0, 4], got {self.sigma!r}.")
        if not isinstance(self.vocabulary_size, int) or self.vocabulary_size < len(FUNCTION_WORDS) + 100:
            raise ValueError(f"SyntheticCorpusConfig.vocabulary_size must be an int >= {len(FUNCTION_WORDS) + 100}, "
                             f"got {self.vocabulary_size!r}.")

    @property
    def mean_words(self) -> float:
        """Mean of the unclipped log-normal length distribution."""
        return self.median_words * math.exp(self.sigma ** 2 / 2)


class _Sampler:
    """The vocabulary and word distribution shared by every document of one config."""

    def __init__(self, config: SyntheticCorpusConfig):
        self.config = config
        words = list(FUNCTION_WORDS)
        seen = set(words)
        rng = np.random.default_rng([config.seed, 2 ** 32 - 1])  # a stream no document index uses
        while len(words) < config.vocabulary_size:
            batch = config.vocabulary_size - len(words) + 1_000
            counts = rng.integers(2, 5, size=batch).tolist()
            syllables = rng.integers(0, len(SYLLABLES), size=(batch, 4)).tolist()
            for count, parts in zip(counts, syllables):
                word = "".join([SYLLABLES[s] for s in parts[:count]])
                if word not in seen and len(words) < config.vocabulary_size:
                    seen.add(word)
                    words.append(word)
        self.words = words
        # Each token is written with the separator that follows it, so a document is one join.
        self.with_space = np.array([word + " " for word in words], dtype=object)
        self.with_period = np.array([word + ". " for word in words], dtype=object)
        self.with_newline = np.array([word + ".\n" for word in words], dtype=object)
        weights = 1.0 / (np.arange(1, config.vocabulary_size + 1, dtype=np.float64) + _ZIPF_OFFSET)
        cdf = np.cumsum(weights)
        self.cdf = cdf / cdf[-1]
        self.first_content_word = len(FUNCTION_WORDS)

    def document(self, index: int) -> Document:
        config = self.config
        rng = np.random.default_rng([config.seed, index])
        length = int(round(math.exp(math.log(config.median_words) + config.sigma * float(rng.standard_normal()))))
        length = min(max(length, config.min_words), config.max_words)
        uniform = rng.random(length)
        # Inverse CDF on sorted draws (cache-friendly), scattered back to their positions.
        order = np.argsort(uniform, kind="stable")
        ids = np.empty(length, dtype=np.int64)
        ids[order] = np.searchsorted(self.cdf, uniform[order], side="right")
        np.minimum(ids, config.vocabulary_size - 1, out=ids)  # guards u == 1.0 rounding of the last cdf value
        tokens = self.with_space[ids]
        sentence = config.sentence_words
        paragraph = sentence * config.paragraph_sentences
        tokens[sentence - 1::sentence] = self.with_period[ids[sentence - 1::sentence]]
        tokens[paragraph - 1::paragraph] = self.with_newline[ids[paragraph - 1::paragraph]]
        text = "".join(tokens.tolist()).rstrip()
        title_ids = rng.integers(self.first_content_word, min(config.vocabulary_size, 5_000),
                                 size=int(rng.integers(2, 6)))
        title = " ".join(self.words[t].capitalize() for t in title_ids.tolist())
        docid = f"doc{index:07d}"
        return Document(docid=docid, url=f"https://synthetic.local/{docid}", title=title, text=text)


def synthetic_documents(config: SyntheticCorpusConfig, start: int = 0, stop: int | None = None
                        ) -> Iterator[Document]:
    """Documents ``start .. stop - 1`` of the corpus ``config`` describes (each independent of the others)."""
    stop = config.num_docs if stop is None else stop
    if not 0 <= start <= stop <= config.num_docs:
        raise ValueError(f"document range [{start}, {stop}) is outside [0, {config.num_docs}).")
    sampler = _Sampler(config)
    for index in range(start, stop):
        yield sampler.document(index)


def synthetic_corpus(config: SyntheticCorpusConfig | None = None, **overrides) -> Corpus:
    """The whole synthetic corpus in memory (``synthetic_corpus(num_docs=300, seed=1)`` for a small one)."""
    if config is None:
        config = SyntheticCorpusConfig(**overrides)
    elif overrides:
        raise TypeError("pass either a SyntheticCorpusConfig or keyword overrides, not both.")
    return Corpus(synthetic_documents(config))
