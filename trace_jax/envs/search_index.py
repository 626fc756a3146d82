"""BM25 search over a ``Corpus``: built once, cached on disk in bm25s's own format, scored fast in numpy.

The index is a bm25s Lucene BM25 matrix (``k1``/``b`` as given): documents x words, CSC, float32. It is built here
rather than by ``bm25s.BM25.index``, which needs every document as a Python list of token ids (8 bytes a token, 4 GB
for BrowseComp-Plus's 500M words) and counts them twice in Python loops; at that scale it took ~11 minutes under
load (extrapolated from 1,000 documents). The build here counts each document's words once (ASCII text through
``bytes.translate`` + ``split``, other text through the ``\\w+`` regex: the same tokens), optionally in worker
processes, and evaluates bm25s's formulas in bm25s's float32/float64 order, so the matrix is identical to
``bm25s.BM25.index``'s (tested) and bm25s can load and query the saved index.

Queries are scored here, not through ``bm25s.BM25.retrieve``: the per-call overhead of ``retrieve`` is several times
the actual work, and the browser calls ``search`` once per tool step. Scoring accumulates the same float32 posting
values in the same query-token order as bm25s, so scores are identical; ranking is by score, then by docid
(ascending) on ties, which makes results independent of corpus order and of platform.

**Cache.** ``SearchIndex.load_or_build(corpus, cache_dir)`` keeps each index in ``cache_dir/<key>/`` where ``key``
hashes the corpus content, ``k1``, ``b``, the tokenizer and the format: a changed corpus or parameter is a new key,
an unchanged one is loaded (memory-mapped, so processes share the pages) instead of built. Writes go to a temporary
directory renamed into place, so a reader sees a whole index or none; an entry that fails to load is rebuilt with a
warning; concurrent callers on one host take turns on a lock file, so one builds and the others load.
``default_cache_dir()`` is ``$TRACE_JAX_CACHE/bm25``, else ``$XDG_CACHE_HOME/trace_jax/bm25``, else
``~/.cache/trace_jax/bm25``; a run passes ``<run dir>/bm25`` or a shared directory.

It knows about documents and text only: no tools, pages or tasks.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import multiprocessing
import os
import re
import shutil
import time
import uuid
import warnings
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from trace_jax.envs.corpus import Corpus

TOKENIZER_VERSION = "word-lower-v1"
INDEX_FORMAT = "bm25s-lucene-csc-v1"
DEFAULT_K1 = 1.5
DEFAULT_B = 0.75
_TOKEN_PATTERN = re.compile(r"\w+")
_META_NAME = "trace_jax_index.json"
# ASCII bytes -> lower-case word characters, everything else -> space: ``\w+`` on ASCII text is then ``split()``.
_ASCII_WORDS = bytes((ord(chr(c).lower()) if c < 128 and (chr(c).isalnum() or c == 95) else 32) for c in range(256))
# Documents per task sent to a worker process, and the corpus size (characters) from which workers pay off.
_SHARD_DOCS = 2_000
_PARALLEL_MIN_CHARS = 50_000_000

log = logging.getLogger(__name__)


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


def default_cache_dir() -> Path:
    """Where indexes are cached when no directory is given (see the module docstring)."""
    root = os.environ.get("TRACE_JAX_CACHE")
    if root:
        return Path(root) / "bm25"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "trace_jax" / "bm25"


def _check_parameters(k1: float, b: float) -> tuple[float, float]:
    if not (isinstance(k1, (int, float)) and math.isfinite(k1) and k1 >= 0):
        raise ValueError(f"BM25 k1 must be a finite number >= 0, got {k1!r}.")
    if not (isinstance(b, (int, float)) and 0 <= b <= 1):
        raise ValueError(f"BM25 b must be in [0, 1], got {b!r}.")
    return float(k1), float(b)


def index_key(corpus: Corpus, *, k1: float = DEFAULT_K1, b: float = DEFAULT_B) -> str:
    """The cache key of ``corpus``'s index: a hash of its content, the BM25 parameters, tokenizer and format."""
    k1, b = _check_parameters(k1, b)
    spec = json.dumps({"corpus": corpus.content_hash, "k1": k1, "b": b, "tokenizer": TOKENIZER_VERSION,
                       "format": INDEX_FORMAT}, sort_keys=True)
    return hashlib.sha256(spec.encode("utf-8")).hexdigest()[:32]


# Term counting (also run in worker processes) ----------------------------------------------------------------------


def _count_terms(documents: Sequence[tuple[str, str]], stopwords: frozenset[str]
                 ) -> tuple[list[bytes], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-document term counts of ``(title, text)`` pairs (``document_search_text``) with a vocabulary local to them.

    Returns ``(vocab, lengths, offsets, terms, counts)``: ``vocab`` lists the non-stopword words (UTF-8) in order of
    first occurrence; document ``i`` has ``lengths[i]`` indexed tokens and its distinct words are
    ``terms[offsets[i]:offsets[i + 1]]`` (ids into ``vocab``) with their counts.
    """
    stopwords = frozenset(word.encode("utf-8") for word in stopwords)
    ids: defaultdict[bytes, int] = defaultdict()
    ids.default_factory = ids.__len__  # an unseen word gets the next id
    lengths = np.zeros(len(documents), dtype=np.int64)
    offsets = np.zeros(len(documents) + 1, dtype=np.int64)
    terms: list[int] = []
    counts: list[int] = []
    for position, (title, body) in enumerate(documents):
        text = document_search_text(title, body)
        if text.isascii():
            tokens = text.encode("ascii").translate(_ASCII_WORDS).split()
        else:
            tokens = [token.encode("utf-8") for token in _TOKEN_PATTERN.findall(text.lower())]
        # Counting first keeps the big vocabulary dict out of the per-token loop (one lookup per distinct word).
        frequencies = Counter(tokens)
        length = len(tokens)
        for stopword in stopwords & frequencies.keys():
            length -= frequencies.pop(stopword)
        lengths[position] = length
        offsets[position + 1] = offsets[position] + len(frequencies)
        terms.extend(map(ids.__getitem__, frequencies))
        counts.extend(frequencies.values())
    return (list(ids), lengths, offsets, np.array(terms, dtype=np.int32), np.array(counts, dtype=np.int32))


# The documents a forked worker counts: set by the parent just before forking, read by the children.
_FORKED_DOCUMENTS: list[tuple[str, str]] = []


def _count_forked_shard(bounds: tuple[int, int], stopwords: frozenset[str]):
    return _count_terms(_FORKED_DOCUMENTS[bounds[0]:bounds[1]], stopwords)


def _count_in_workers(documents: list[tuple[str, str]], bounds: list[tuple[int, int]], stopwords: frozenset[str],
                      workers: int) -> list | None:
    """``_count_terms`` of each shard in ``workers`` forked processes (``None`` where that fails).

    Forked children read the documents from the parent's memory instead of receiving a pickled copy, and, unlike
    spawned ones, do not re-run the caller's ``__main__`` (a script without a ``__main__`` guard would otherwise
    break). They run only this module's pure-Python counting, never JAX, so the JAX threads a parent may hold do
    not matter; JAX's and Python's warnings about forking a threaded process are silenced for that reason.
    """
    global _FORKED_DOCUMENTS
    if "fork" not in multiprocessing.get_all_start_methods():
        return None
    _FORKED_DOCUMENTS = documents
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*fork\(\).*", category=RuntimeWarning)
            warnings.filterwarnings("ignore", message=r".*fork\(\).*", category=DeprecationWarning)
            with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork")) as pool:
                return list(pool.map(functools.partial(_count_forked_shard, stopwords=stopwords), bounds))
    except Exception as error:  # BrokenProcessPool, OSError, pickling; a bug in the counting re-raises in-process
        warnings.warn(f"BM25 build: worker processes failed ({type(error).__name__}: {error}); counting words in "
                      "this process instead.", RuntimeWarning, stacklevel=4)
        return None
    finally:
        _FORKED_DOCUMENTS = []


def _term_counts(documents: list[tuple[str, str]], workers: int):
    """``_count_terms`` over ``documents`` in shards, merged into one vocabulary (first-occurrence order, whatever the
    number of workers): ``(vocab, lengths, doc_of_entry, term_of_entry, count_of_entry)``."""
    bounds = [(start, min(start + _SHARD_DOCS, len(documents))) for start in range(0, len(documents), _SHARD_DOCS)]
    bounds = bounds or [(0, 0)]
    # The stopwords travel with the task, so a worker never imports bm25s (and JAX).
    stopwords = _stopwords()
    results = None
    if workers > 1 and len(bounds) > 1:
        results = _count_in_workers(documents, bounds, stopwords, workers)
    if results is None:
        results = [_count_terms(documents[start:stop], stopwords) for start, stop in bounds]
    vocab: defaultdict[bytes, int] = defaultdict()
    vocab.default_factory = vocab.__len__
    num_entries = sum(len(result[3]) for result in results)
    lengths = np.concatenate([result[1] for result in results])
    docs = np.empty(num_entries, dtype=np.int32)
    terms = np.empty(num_entries, dtype=np.int32)
    counts = np.empty(num_entries, dtype=np.int32)
    first_doc = first_entry = 0
    results.reverse()
    while results:  # shard by shard, releasing each one's arrays once copied
        local_vocab, shard_lengths, offsets, local_terms, shard_counts = results.pop()
        to_global = np.fromiter(map(vocab.__getitem__, local_vocab), dtype=np.int32, count=len(local_vocab))
        entries = slice(first_entry, first_entry + len(local_terms))
        terms[entries] = to_global[local_terms]
        counts[entries] = shard_counts
        docs[entries] = np.repeat(np.arange(first_doc, first_doc + len(shard_lengths), dtype=np.int32),
                                  np.diff(offsets))
        first_doc += len(shard_lengths)
        first_entry = entries.stop
    return [word.decode("utf-8") for word in vocab], lengths, docs, terms, counts


def _lucene_scores(lengths: np.ndarray, docs: np.ndarray, terms: np.ndarray, counts: np.ndarray, num_terms: int,
                   k1: float, b: float, threads: int = 1) -> np.ndarray:
    """bm25s's Lucene BM25 value of every (document, word) entry, with bm25s's arithmetic: idf in float64 through
    ``math.log`` stored as float32, ``tf / (k1 * ((1 - b) + b * len / avg_len) + tf)`` in float64 from float32 tf,
    the product in float64 stored as float32."""
    num_docs = len(lengths)
    doc_freq = np.bincount(terms, minlength=num_terms).tolist()
    idf = np.array([math.log(1 + (num_docs - df + 0.5) / (df + 0.5)) for df in doc_freq], dtype=np.float32)
    average_length = lengths.mean()
    length_norm = np.array([k1 * ((1 - b) + b * int(length) / average_length) for length in lengths.tolist()],
                           dtype=np.float64)
    scores = np.empty(len(terms), dtype=np.float32)

    idf64 = idf.astype(np.float64)  # exact widening, done once per word instead of once per entry

    def fill(start: int, stop: int) -> None:
        tf = counts[start:stop].astype(np.float64)  # small integers: the same value as through float32
        tf /= length_norm[docs[start:stop]] + tf
        tf *= idf64[terms[start:stop]]
        scores[start:stop] = tf

    step = 1 << 22  # bounds the float64 temporaries
    chunks = [(start, start + step) for start in range(0, len(terms), step)]
    if threads > 1 and len(chunks) > 1:  # numpy releases the GIL inside these array operations
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(lambda chunk: fill(*chunk), chunks))
    else:
        for chunk in chunks:
            fill(*chunk)
    return scores


def _csc(scores: np.ndarray, docs: np.ndarray, terms: np.ndarray, num_docs: int, num_terms: int):
    """Entries in document order -> CSC (one column per word, rows ascending), as bm25s stores it."""
    from scipy import sparse

    matrix = sparse.csc_matrix((scores, (docs, terms)), shape=(num_docs, num_terms), dtype=np.float32)
    matrix.sort_indices()
    return matrix.data, matrix.indices.astype(np.int32, copy=False), matrix.indptr.astype(np.int64, copy=False)


@contextlib.contextmanager
def _entry_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (``flock``) for the duration; a no-op where ``fcntl`` is missing.
    Writes stay atomic without it (temp dir + rename); the lock only spares concurrent callers a duplicate build."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class SearchIndex:
    """BM25 index over a corpus. ``search(query, topn) -> [(docid, score), ...]``, best first.

    Build with ``SearchIndex.build(corpus)``, or ``SearchIndex.load_or_build(corpus, cache_dir)`` to reuse the
    index cached for this corpus and these parameters (see the module docstring). Only documents with a positive
    score are returned, so a query without any indexed word gives ``[]``. An index fresh from ``build`` has
    ``build_seconds`` (wall seconds of its phases: ``count``, ``score``, ``matrix``, ``total``); a loaded one has
    ``{}``.
    """

    def __init__(self, corpus: Corpus, *, data: np.ndarray, indices: np.ndarray, indptr: np.ndarray,
                 vocab: dict[str, int], k1: float, b: float):
        self.corpus = corpus
        self.k1 = float(k1)
        self.b = float(b)
        # Kept as given (a memory map after load_or_build): int32 document ids as bm25s stores them.
        self._data = data if data.dtype == np.float32 else data.astype(np.float32)
        self._indices = indices if indices.dtype in (np.int32, np.int64) else indices.astype(np.int64)
        self._indptr = indptr if indptr.dtype == np.int64 else indptr.astype(np.int64)
        self._vocab = vocab
        self.build_seconds: dict[str, float] = {}
        self._num_docs = len(corpus)
        self._docids = corpus.docids
        # Rank of each document's docid in sorted order: the tie-break key for equal scores.
        order = sorted(range(self._num_docs), key=self._docids.__getitem__)
        self._docid_rank = np.empty(self._num_docs, dtype=np.int64)
        self._docid_rank[order] = np.arange(self._num_docs)

    # Building -----------------------------------------------------------------------------------------------------

    @classmethod
    def build(cls, corpus: Corpus, *, k1: float = DEFAULT_K1, b: float = DEFAULT_B,
              workers: int | None = None) -> "SearchIndex":
        """Build the index in memory. ``workers``: processes counting words (default: the available cores, for
        corpora over 50M characters; 1 below that, where starting processes costs more than it saves)."""
        k1, b = _check_parameters(k1, b)
        start = time.perf_counter()
        seconds = {}
        documents = [(document.title, document.text) for document in corpus]
        if workers is None:
            large = sum(len(text) for _, text in documents) >= _PARALLEL_MIN_CHARS
            workers = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                          8) if large else 1
        workers = max(1, int(workers))
        words, lengths, docs, terms, counts = _term_counts(documents, workers)
        seconds["count"] = time.perf_counter() - start
        if not words:
            # Nothing indexable (empty corpus or only stopwords): BM25's mean length would be zero.
            index = cls(corpus, data=np.zeros(0, np.float32), indices=np.zeros(0, np.int32),
                        indptr=np.zeros(1, np.int64), vocab={}, k1=k1, b=b)
        else:
            scores = _lucene_scores(lengths, docs, terms, counts, len(words), k1, b, threads=workers)
            del counts
            seconds["score"] = time.perf_counter() - start - sum(seconds.values())
            data, indices, indptr = _csc(scores, docs, terms, len(corpus), len(words))
            del scores, docs, terms
            seconds["matrix"] = time.perf_counter() - start - sum(seconds.values())
            index = cls(corpus, data=data, indices=indices, indptr=indptr,
                        vocab={word: i for i, word in enumerate(words)}, k1=k1, b=b)
        seconds["total"] = time.perf_counter() - start
        index.build_seconds = seconds
        log.info("built the BM25 index of %d documents (%d words, %d entries) in %.1f s", len(corpus), len(words),
                 len(index._data), seconds["total"])
        return index

    def _meta(self) -> dict:
        return {"key": index_key(self.corpus, k1=self.k1, b=self.b), "corpus_hash": self.corpus.content_hash,
                "num_docs": self._num_docs, "num_words": len(self._vocab), "entries": int(len(self._data)),
                "k1": self.k1, "b": self.b, "method": "lucene", "tokenizer": TOKENIZER_VERSION,
                "format": INDEX_FORMAT}

    def save(self, index_dir: str | os.PathLike) -> Path:
        """Write the index to ``index_dir`` with ``bm25s.BM25.save`` plus this module's metadata, atomically: it is
        written to a temporary sibling directory renamed into place. If another process has put a complete index
        there meanwhile, that one is kept (it is the same index)."""
        import bm25s

        index_dir = Path(index_dir)
        index_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp_dir = index_dir.with_name(f".{index_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            retriever = bm25s.BM25(method="lucene", k1=self.k1, b=self.b)
            retriever.scores = {"data": np.asarray(self._data), "indices": np.asarray(self._indices, np.int32),
                                "indptr": np.asarray(self._indptr), "num_docs": self._num_docs}
            retriever.vocab_dict = self._vocab
            retriever.nonoccurrence_array = None
            retriever.save(tmp_dir, show_progress=False)
            # Written last: its presence marks a complete index.
            (tmp_dir / _META_NAME).write_text(json.dumps(self._meta(), indent=1), encoding="utf-8")
            if index_dir.exists():
                if (index_dir / _META_NAME).is_file():
                    return index_dir  # a concurrent writer finished first
                shutil.rmtree(index_dir, ignore_errors=True)  # a damaged entry
            try:
                os.replace(tmp_dir, index_dir)
            except OSError:
                if not (index_dir / _META_NAME).is_file():
                    raise
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        return index_dir

    @classmethod
    def load(cls, corpus: Corpus, index_dir: str | os.PathLike, *, mmap: bool = True) -> "SearchIndex":
        """Load a saved index (memory-mapped by default); ``ValueError`` if it was built for a different corpus or
        tokenizer or its files are inconsistent."""
        import bm25s

        index_dir = Path(index_dir)
        meta = json.loads((index_dir / _META_NAME).read_text(encoding="utf-8"))
        if (meta.get("corpus_hash") != corpus.content_hash or meta.get("tokenizer") != TOKENIZER_VERSION
                or meta.get("format") != INDEX_FORMAT):
            raise ValueError(f"{index_dir}: index was built for a different corpus, tokenizer or format; rebuild it.")
        retriever = bm25s.BM25.load(index_dir, mmap=mmap, show_progress=False)
        data, indices, indptr = (retriever.scores[name] for name in ("data", "indices", "indptr"))
        vocab = retriever.vocab_dict
        consistent = (retriever.scores.get("num_docs") == len(corpus) == meta.get("num_docs")
                      and len(indptr) == len(vocab) + 1 == meta.get("num_words", -1) + 1
                      and len(data) == len(indices) == int(indptr[-1]) == meta.get("entries"))
        if not consistent:
            raise ValueError(f"{index_dir}: index files are inconsistent (truncated or mixed); rebuild it.")
        return cls(corpus, data=data, indices=indices, indptr=indptr, vocab=vocab, k1=meta["k1"], b=meta["b"])

    @classmethod
    def load_or_build(cls, corpus: Corpus, cache_dir: str | os.PathLike | None = None, *, k1: float = DEFAULT_K1,
                      b: float = DEFAULT_B, workers: int | None = None) -> "SearchIndex":
        """The index of ``corpus`` from ``cache_dir/<index_key>/`` (default ``default_cache_dir()``); built and
        saved there if absent, rebuilt with a warning if the entry cannot be loaded.

        Callers on one host that ask for the same entry at once (the training loop and an evaluation process, say)
        take turns on a lock file beside it, so one builds and the others load what it saved.
        """
        k1, b = _check_parameters(k1, b)
        index_dir = Path(cache_dir if cache_dir is not None else default_cache_dir()) / index_key(corpus, k1=k1, b=b)
        index_dir.parent.mkdir(parents=True, exist_ok=True)
        with _entry_lock(index_dir.with_name(f".{index_dir.name}.lock")):
            if index_dir.exists():
                try:
                    return cls.load(corpus, index_dir)
                except Exception as error:  # any damage (missing file, bad JSON, truncated array): rebuild
                    warnings.warn(f"BM25 index cache entry {index_dir} could not be loaded "
                                  f"({type(error).__name__}: {str(error)[:200]}); rebuilding it.", RuntimeWarning,
                                  stacklevel=2)
                    shutil.rmtree(index_dir, ignore_errors=True)
            index = cls.build(corpus, k1=k1, b=b, workers=workers)
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
