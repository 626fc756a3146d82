"""BM25 search over a ``Corpus``: built once with bm25s, saved next to the corpus, scored fast in numpy.

The index matrix comes from bm25s (Lucene BM25, ``k1``/``b`` as given), so scores are bm25s's own. Queries are scored
here, not through ``bm25s.BM25.retrieve``: the per-call overhead of ``retrieve`` is several times the actual work, and
the browser calls ``search`` once per tool step. Scoring accumulates the same float32 posting values in the same
query-token order as bm25s, so scores are identical; ranking is by score, then by docid (ascending) on ties, which
makes results independent of corpus order and of platform.

It knows about documents and text only: no tools, pages or tasks.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterable

import numpy as np

from trace_jax.envs.corpus import Corpus

TOKENIZER_VERSION = "word-lower-v1"
_TOKEN_PATTERN = re.compile(r"\w+")
_META_NAME = "trace_jax_index.json"


@functools.lru_cache(maxsize=1)
def _stopwords() -> frozenset[str]:
    # bm25s runs a JAX computation when imported: importing it on first use, not with this module, keeps JAX's
    # backend uninitialised until a multi-process run has called jax.distributed.initialize
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


def tokenize(text: str, *, stopwords: frozenset[str] | None = None) -> list[str]:
    """Lower-cased ``\\w+`` words without English stopwords (or without `stopwords`): used for both documents and
    queries."""
    stopwords = _stopwords() if stopwords is None else stopwords
    return [token for token in _TOKEN_PATTERN.findall(text.lower()) if token not in stopwords]


def document_search_text(title: str, text: str) -> str:
    """What is indexed for a document: its title (so entity names match) then its body."""
    return f"{title}\n{text}"


class SearchIndex:
    """BM25 index over a corpus. ``search(query, topn) -> [(docid, score), ...]``, best first.

    Build with ``SearchIndex.build(corpus)``, or ``SearchIndex.load_or_build(corpus)`` to reuse an index saved next
    to the corpus file (``<corpus file>.bm25/``) when its corpus hash and parameters match, rebuilding otherwise.
    Only documents with a positive score are returned, so a query without any indexed word gives ``[]``.
    """

    def __init__(self, corpus: Corpus, *, data: np.ndarray, indices: np.ndarray, indptr: np.ndarray,
                 vocab: dict[str, int], k1: float, b: float):
        self.corpus = corpus
        self.k1 = float(k1)
        self.b = float(b)
        self._data = np.ascontiguousarray(data, dtype=np.float32)
        self._indices = np.ascontiguousarray(indices, dtype=np.int64)
        self._indptr = np.ascontiguousarray(indptr, dtype=np.int64)
        self._vocab = vocab
        self._num_docs = len(corpus)
        self._docids = corpus.docids
        # Rank of each document's docid in sorted order: the tie-break key for equal scores.
        order = sorted(range(self._num_docs), key=self._docids.__getitem__)
        self._docid_rank = np.empty(self._num_docs, dtype=np.int64)
        self._docid_rank[order] = np.arange(self._num_docs)

    # Building -----------------------------------------------------------------------------------------------------

    @classmethod
    def build(cls, corpus: Corpus, *, k1: float = 1.5, b: float = 0.75) -> "SearchIndex":
        import bm25s
        from bm25s.tokenization import Tokenized

        vocab: dict[str, int] = {}
        token_ids = []
        for document in corpus:
            ids = []
            for token in tokenize(document_search_text(document.title, document.text)):
                token_id = vocab.get(token)
                if token_id is None:
                    token_id = vocab[token] = len(vocab)
                ids.append(token_id)
            token_ids.append(ids)
        if not vocab:
            # Nothing indexable (empty corpus or only stopwords): bm25s would divide by a zero mean length.
            return cls(corpus, data=np.zeros(0, np.float32), indices=np.zeros(0, np.int64),
                       indptr=np.zeros(1, np.int64), vocab={}, k1=k1, b=b)
        retriever = bm25s.BM25(method="lucene", k1=k1, b=b)
        retriever.index(Tokenized(ids=token_ids, vocab=vocab), show_progress=False, create_empty_token=False)
        scores = retriever.scores
        return cls(corpus, data=scores["data"], indices=scores["indices"], indptr=scores["indptr"],
                   vocab=vocab, k1=k1, b=b)

    @staticmethod
    def default_dir(corpus: Corpus) -> Path | None:
        return None if corpus.path is None else corpus.path.with_name(corpus.path.name + ".bm25")

    def _meta(self) -> dict:
        return {"corpus_hash": self.corpus.content_hash, "num_docs": self._num_docs, "k1": self.k1, "b": self.b,
                "method": "lucene", "tokenizer": TOKENIZER_VERSION}

    def save(self, index_dir: str | os.PathLike | None = None) -> Path:
        """Write the bm25s matrices plus vocab and metadata to ``index_dir`` (default: next to the corpus)."""
        index_dir = Path(index_dir) if index_dir is not None else self.default_dir(self.corpus)
        if index_dir is None:
            raise ValueError("This corpus was built in memory; pass index_dir= to save its index.")
        tmp_dir = index_dir.with_name(index_dir.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp_dir, ignore_errors=True)
        tmp_dir.mkdir(parents=True)
        np.save(tmp_dir / "data.npy", self._data)
        np.save(tmp_dir / "indices.npy", self._indices.astype(np.int32))
        np.save(tmp_dir / "indptr.npy", self._indptr)
        tokens = sorted(self._vocab, key=self._vocab.__getitem__)
        (tmp_dir / "vocab.json").write_text(json.dumps(tokens, ensure_ascii=False), encoding="utf-8")
        (tmp_dir / _META_NAME).write_text(json.dumps(self._meta(), indent=1), encoding="utf-8")
        # Replace atomically-enough: a reader sees the old index or the new one, never a half-written one.
        shutil.rmtree(index_dir, ignore_errors=True)
        os.replace(tmp_dir, index_dir)
        return index_dir

    @classmethod
    def load(cls, corpus: Corpus, index_dir: str | os.PathLike) -> "SearchIndex":
        """Load a saved index; ``ValueError`` if it was built for a different corpus or with different settings."""
        index_dir = Path(index_dir)
        meta = json.loads((index_dir / _META_NAME).read_text(encoding="utf-8"))
        if meta.get("corpus_hash") != corpus.content_hash or meta.get("tokenizer") != TOKENIZER_VERSION:
            raise ValueError(f"{index_dir}: index was built for a different corpus or tokenizer; rebuild it.")
        tokens = json.loads((index_dir / "vocab.json").read_text(encoding="utf-8"))
        return cls(corpus, data=np.load(index_dir / "data.npy"), indices=np.load(index_dir / "indices.npy"),
                   indptr=np.load(index_dir / "indptr.npy"), vocab={t: i for i, t in enumerate(tokens)},
                   k1=meta["k1"], b=meta["b"])

    @classmethod
    def load_or_build(cls, corpus: Corpus, index_dir: str | os.PathLike | None = None, *, k1: float = 1.5,
                      b: float = 0.75, save: bool = True) -> "SearchIndex":
        """Reuse the saved index if it matches the corpus hash and parameters; else build (and save) a new one."""
        index_dir = Path(index_dir) if index_dir is not None else cls.default_dir(corpus)
        if index_dir is not None and (index_dir / _META_NAME).is_file():
            try:
                index = cls.load(corpus, index_dir)
                if index.k1 == float(k1) and index.b == float(b):
                    return index
            except (ValueError, OSError, KeyError):
                pass  # stale or damaged: rebuild below
        index = cls.build(corpus, k1=k1, b=b)
        if save and index_dir is not None:
            index.save(index_dir)
        return index

    # Querying -----------------------------------------------------------------------------------------------------

    def query_token_ids(self, query: str) -> list[int]:
        vocab = self._vocab
        return [vocab[token] for token in tokenize(query) if token in vocab]

    def scores(self, query: str) -> np.ndarray:
        """float32 BM25 score of every document (corpus order), equal to bm25s's ``get_scores``."""
        scores = np.zeros(self._num_docs, dtype=np.float32)
        data, indices, indptr = self._data, self._indices, self._indptr
        for token_id in self.query_token_ids(query):
            start, end = indptr[token_id], indptr[token_id + 1]
            # Posting lists hold each document at most once, so fancy-index += is an exact scatter-add.
            scores[indices[start:end]] += data[start:end]
        return scores

    def search(self, query: str, topn: int = 10) -> list[tuple[str, float]]:
        """Top ``topn`` documents as ``(docid, score)``, by descending score then ascending docid."""
        if topn <= 0:
            return []
        token_ids = self.query_token_ids(query)
        if not token_ids:
            return []
        data, indices, indptr = self._data, self._indices, self._indptr
        if len(token_ids) == 1:
            start, end = indptr[token_ids[0]], indptr[token_ids[0] + 1]
            candidates, candidate_scores = indices[start:end], data[start:end]
        else:
            scores = np.zeros(self._num_docs, dtype=np.float32)
            for token_id in token_ids:
                start, end = indptr[token_id], indptr[token_id + 1]
                scores[indices[start:end]] += data[start:end]
            candidates = self._top_candidates(scores, token_ids, topn)
            candidate_scores = scores[candidates]
        keep = candidate_scores > 0
        if not keep.all():
            candidates, candidate_scores = candidates[keep], candidate_scores[keep]
        if len(candidates) > topn:
            # Keep everything tied with the topn-th score so the docid tie-break sees the whole tie group.
            threshold = -np.partition(-candidate_scores, topn - 1)[topn - 1]
            keep = candidate_scores >= threshold
            candidates, candidate_scores = candidates[keep], candidate_scores[keep]
        order = np.lexsort((self._docid_rank[candidates], -candidate_scores))[:topn]
        docids = self._docids
        return [(docids[i], float(s)) for i, s in zip(candidates[order].tolist(), candidate_scores[order].tolist())]

    def _top_candidates(self, scores: np.ndarray, token_ids: list[int], topn: int) -> np.ndarray:
        """A small superset of the top ``topn`` documents (with all ties), without sorting every match.

        The ``topn``-th best score among *any* ``>= topn`` matching documents is a lower bound on the overall
        ``topn``-th best score, so keeping documents at or above it is exact. The shortest posting lists (rarest
        words) hold the likely winners and give a tight bound cheaply.
        """
        indices, indptr = self._indices, self._indptr
        by_rarity = sorted(set(token_ids), key=lambda t: indptr[t + 1] - indptr[t])
        sample, size = [], 0
        for token_id in by_rarity:
            sample.append(indices[indptr[token_id]: indptr[token_id + 1]])
            size += len(sample[-1])
            if size >= 4 * topn:
                break
        if len(sample) == 1:
            sample_docs = sample[0]
        else:  # de-duplicate through a mask: cheaper than np.unique's sort for long posting lists
            mask = np.zeros(self._num_docs, dtype=bool)
            for docs in sample:
                mask[docs] = True
            sample_docs = np.flatnonzero(mask)
        if len(sample_docs) < topn:
            return np.flatnonzero(scores > 0)
        bound = -np.partition(-scores[sample_docs], topn - 1)[topn - 1]
        return np.flatnonzero(scores >= bound)

    def search_many(self, queries: Iterable[str], topn: int = 10) -> list[list[tuple[str, float]]]:
        return [self.search(query, topn) for query in queries]

    def __len__(self) -> int:
        return self._num_docs

    @property
    def vocabulary_size(self) -> int:
        return len(self._vocab)
