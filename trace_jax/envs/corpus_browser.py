"""The one builder of the agent's browser over a corpus: the procedural world's or an external set's.

``corpus_browser(documents, ...)`` takes any corpus of ``(docid, url, title, text)`` documents (a ``Corpus``, a
``.jsonl``/``.parquet`` file, or an iterable of records or ``Document`` s) and returns a ``Browser`` with the same
tools (``search``/``open``/``find``) and observation format as the procedural environment. Its BM25 index comes from
the on-disk cache (``SearchIndex.load_or_build``: built once per corpus and parameters, then loaded by every caller
and process) unless ``cache_dir=False``. External sets read by ``trace_jax.data.external`` already give a ``Corpus``
(``load_external(...).corpus``), so they need no conversion. ``oracle.make_browser`` is this builder applied to a
world.

The environment's difficulty knobs live here too: snippet length, view size and retrieval noise
(``retrieval_noise_filter``).

This module knows about corpora, the index and the browser; not about tasks, models or training.
"""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

from trace_jax.envs.browser import Browser
from trace_jax.envs.corpus import Corpus, Document
from trace_jax.envs.search_index import DEFAULT_B, DEFAULT_K1, SearchIndex


def retrieval_noise_filter(docids: Sequence[str], rate: float, seed: int = 0
                           ) -> Callable[[str, list[tuple[str, float]]], list[tuple[str, float]]]:
    """A ``Browser.result_filter`` that replaces each result, with probability ``rate``, by a random document.

    Deterministic in (seed, query): the same query always shows the same results.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"retrieval noise rate must be in [0, 1], got {rate!r}.")
    all_docids = list(docids)

    def apply(query: str, results: list[tuple[str, float]]) -> list[tuple[str, float]]:
        if rate == 0.0 or not results:
            return results
        digest = hashlib.sha256(f"{seed}:{query}".encode("utf-8")).digest()
        rng = random.Random(int.from_bytes(digest[:8], "big"))
        shown = {docid for docid, _ in results}
        out = []
        for docid, score in results:
            if rng.random() < rate:
                replacement = all_docids[rng.randrange(len(all_docids))]
                if replacement not in shown:
                    shown.add(replacement)
                    docid = replacement
            out.append((docid, score))
        return out

    return apply


def as_corpus(documents: Corpus | str | os.PathLike | Iterable[Document | Mapping[str, Any]]) -> Corpus:
    """A ``Corpus`` from a corpus, a corpus file (``Corpus.load``) or records with ``docid``, ``url``, ``title`` and
    ``text`` (``Corpus.from_records``: a missing or mistyped field raises ``CorpusError`` naming the record)."""
    if isinstance(documents, Corpus):
        return documents
    if isinstance(documents, (str, os.PathLike)):
        return Corpus.load(documents)
    return Corpus.from_records(documents, source="document")


def corpus_browser(documents: Corpus | str | os.PathLike | Iterable[Document | Mapping[str, Any]], *,
                   cache_dir: str | os.PathLike | None | Literal[False] = None, k1: float = DEFAULT_K1,
                   b: float = DEFAULT_B, index: SearchIndex | None = None, snippet_chars: int = 160,
                   view_lines: int = 30, wrap_width: int = 80, retrieval_noise: float = 0.0,
                   noise_seed: int = 0) -> Browser:
    """A browser over ``documents`` (see the module docstring).

    Args:
      documents: the corpus, a corpus file, or document records.
      cache_dir: where the BM25 index is cached (``None``: ``search_index.default_cache_dir()``; a run passes
        ``<run dir>/bm25``); ``False`` builds it in memory without touching the disk.
      k1, b: BM25 parameters (part of the cache key).
      index: an index already built over this very ``Corpus`` object (skips the cache).
      snippet_chars, view_lines, wrap_width: what a search result and a page view show.
      retrieval_noise, noise_seed: ``retrieval_noise_filter`` on the search results (0 = none).
    """
    corpus = as_corpus(documents)
    if index is None:
        if cache_dir is False:
            index = SearchIndex.build(corpus, k1=k1, b=b)
        else:
            index = SearchIndex.load_or_build(corpus, None if cache_dir is None else Path(cache_dir), k1=k1, b=b)
    result_filter = (retrieval_noise_filter(corpus.docids, retrieval_noise, noise_seed)
                     if retrieval_noise > 0 else None)
    return Browser(corpus, index, snippet_chars=snippet_chars, view_lines=view_lines, wrap_width=wrap_width,
                   result_filter=result_filter)
