"""Search-environment benchmark at BrowseComp-Plus scale: index build, cache reuse, and search/open latency.

Generates the synthetic corpus of ``trace_jax.envs.synthetic`` (``--docs`` documents, ``--seed``; log-normal lengths
with a mean of ~5,180 words, Zipf words, no downloads), then measures

  * generation time (not part of any target),
  * the BM25 index build (``SearchIndex.build``: wall and CPU seconds, this process and its worker processes),
  * the cache: saving the index, then ``SearchIndex.load_or_build`` from the cache (what every later caller pays:
    the corpus hash and a memory-mapped load),
  * peak memory (max resident set of this process, and of the largest worker),
  * ``Browser.execute("search", {"query": ...})`` latency over ``--queries`` queries of 2-6 words drawn from random
    documents, and ``Browser.execute("open", {"id": k})`` of a random result of each (a fresh document each time,
    so every page is wrapped for the first time: no render cache helps), p50 / p99 / max in milliseconds, wall
    and CPU time of this process (the CPU figures are what a call costs; wall adds waiting for a shared core),
  * with ``--bm25s-reference``, ``bm25s.BM25.retrieve`` on the same saved index (loaded by bm25s itself) and whether
    its top-10 scores equal ours.

Targets (issue 27): for 100K documents the index builds in <= 2 minutes on 2 cores, and search and open take
p50 <= 20 ms and p99 <= 100 ms. Run ``python benchmarks/env_bench.py --docs 100000`` (heavy: ~4 GB of text, ~15 GB
peak); ``--docs 10000`` for a quick look. The load average is printed before and after, since a shared machine
inflates wall-clock figures.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from trace_jax.envs.browser import Browser
from trace_jax.envs.search_index import SearchIndex, index_key, tokenize
from trace_jax.envs.synthetic import SyntheticCorpusConfig, synthetic_corpus

TARGET_BUILD_S = 120.0
TARGET_P50_MS = 20.0
TARGET_P99_MS = 100.0


def sample_queries(corpus, count: int, seed: int) -> list[str]:
    """Queries of 2-6 indexed words drawn from random documents (so they hit, as agent queries mostly do)."""
    rng = np.random.default_rng(seed)
    queries = []
    while len(queries) < count:
        document = corpus[int(rng.integers(len(corpus)))]
        words = tokenize(document.text[:20_000])
        if words:
            queries.append(" ".join(rng.choice(words, size=int(rng.integers(2, 7))).tolist()))
    return queries


def percentiles_ms(seconds: list[float]) -> tuple[float, float, float]:
    milli = np.asarray(seconds) * 1e3
    return float(np.percentile(milli, 50)), float(np.percentile(milli, 99)), float(milli.max())


def cpu_seconds() -> tuple[float, float]:
    """(this process, its finished children) user + system CPU seconds."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def peak_gib() -> tuple[float, float]:
    """(max resident set of this process, of the largest finished child) in GiB (Linux reports KiB)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_maxrss / 2 ** 20, children.ru_maxrss / 2 ** 20


def verdict(ok: bool) -> str:
    return "meets" if ok else "MISSES"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=100_000, help="documents in the synthetic corpus")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed (queries use seed + 1)")
    parser.add_argument("--queries", type=int, default=1000, help="search + open pairs timed")
    parser.add_argument("--workers", type=int, default=None,
                        help="word-counting processes for the build (default: the available cores)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="index cache (default: a temporary directory, removed afterwards)")
    parser.add_argument("--bm25s-reference", action="store_true",
                        help="also time bm25s.BM25.retrieve on the saved index and compare its top-10 scores")
    args = parser.parse_args()
    if args.docs < 1 or args.queries < 1:
        parser.error("--docs and --queries must be >= 1")
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores")

    config = SyntheticCorpusConfig(num_docs=args.docs, seed=args.seed)
    start = time.perf_counter()
    corpus = synthetic_corpus(config)
    generate_s = time.perf_counter() - start
    words = np.array([text.count(" ") + text.count("\n") + 1 for text in (d.text for d in corpus)])
    chars = sum(len(d.text) for d in corpus)

    cpu_before = cpu_seconds()
    start = time.perf_counter()
    index = SearchIndex.build(corpus, workers=args.workers)
    build_s = time.perf_counter() - start
    cpu_after = cpu_seconds()
    build_cpu = (cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1])
    phases = index.build_seconds
    entries = len(index._data)

    with tempfile.TemporaryDirectory(prefix="env_bench_cache_") as scratch:
        cache_dir = args.cache_dir or Path(scratch)
        start = time.perf_counter()
        index.save(cache_dir / index_key(corpus))
        save_s = time.perf_counter() - start
        del index
        corpus._content_hash = None  # time the hash as a fresh process would pay it
        start = time.perf_counter()
        loaded = SearchIndex.load_or_build(corpus, cache_dir)
        load_s = time.perf_counter() - start

        browser = Browser(corpus, loaded)
        queries = sample_queries(corpus, args.queries, args.seed + 1)
        rng = np.random.default_rng(args.seed + 2)
        for query in queries[:20]:  # warm-up (first-call imports and allocations)
            browser.execute("search", {"query": query})
        browser._document_pages.clear()
        browser._search_entries.clear()
        search_times, open_times, errors, opened_words = [], [], 0, []
        search_cpu, open_cpu = [], []
        for query in queries:
            browser.reset()
            start, start_cpu = time.perf_counter(), time.process_time()
            results = browser.step("search", {"query": query})
            search_times.append(time.perf_counter() - start)
            search_cpu.append(time.process_time() - start_cpu)
            links = results.page.links if results.ok else {}
            if not links:
                errors += 1
                continue
            link = int(rng.integers(len(links)))
            start, start_cpu = time.perf_counter(), time.process_time()
            page = browser.step("open", {"id": link})
            open_times.append(time.perf_counter() - start)
            open_cpu.append(time.process_time() - start_cpu)
            errors += not page.ok
            opened_words.append(len(corpus.by_docid(links[link].docid).text.split()))

        reference = None
        if args.bm25s_reference:
            import bm25s

            retriever = bm25s.BM25.load(cache_dir / index_key(corpus), mmap=True)
            checked = queries[:200]
            times, agree = [], 0
            for query in checked:
                start = time.perf_counter()
                _, scores = retriever.retrieve([tokenize(query)], k=10, show_progress=False, n_threads=1)
                times.append(time.perf_counter() - start)
                ours = [score for _, score in loaded.search(query, 10)]
                agree += sorted(scores[0].tolist(), reverse=True)[: len(ours)] == ours
            reference = (percentiles_ms(times), agree, len(checked))

    search, opens = percentiles_ms(search_times), percentiles_ms(open_times)
    search_cpu, open_cpu = percentiles_ms(search_cpu), percentiles_ms(open_cpu)
    own_peak, child_peak = peak_gib()
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print(f"corpus: {len(corpus):,} documents, seed {args.seed}, {words.sum() / 1e6:,.0f}M words "
          f"({chars / 2 ** 30:.1f} GiB of text); words per document mean {words.mean():,.0f}, median "
          f"{np.median(words):,.0f}, p99 {np.percentile(words, 99):,.0f}, max {words.max():,}; "
          f"vocabulary {loaded.vocabulary_size:,} words; generated in {generate_s:.0f} s\n")
    print("| measure | value | target |")
    print("|---|---|---|")
    build_verdict = (verdict(build_s <= TARGET_BUILD_S) if args.docs >= 100_000
                     else "(the target is for 100,000 documents)")
    print(f"| index build, wall | {build_s:.1f} s | <= {TARGET_BUILD_S:.0f} s on 2 cores: {build_verdict} |")
    print(f"| index build, CPU (this process + workers) | {build_cpu[0]:.1f} + {build_cpu[1]:.1f} s | |")
    print(f"| index build phases, wall: count words / score / CSC matrix | {phases['count']:.1f} / "
          f"{phases['score']:.1f} / {phases['matrix']:.1f} s | |")
    print(f"| index entries (document, word pairs) | {entries:,} | |")
    print(f"| cache save / load_or_build from cache (hash + mmap load) | {save_s:.1f} s / {load_s:.1f} s | |")
    print(f"| peak resident memory: this process / largest worker | {own_peak:.1f} / {child_peak:.1f} GiB | |")
    print(f"| search p50 / p99 / max ({len(search_times)} queries) | "
          f"{search[0]:.2f} / {search[1]:.2f} / {search[2]:.1f} ms | p50 <= {TARGET_P50_MS:.0f}, p99 <= "
          f"{TARGET_P99_MS:.0f}: {verdict(search[0] <= TARGET_P50_MS and search[1] <= TARGET_P99_MS)} |")
    print(f"| search CPU time p50 / p99 / max | {search_cpu[0]:.2f} / {search_cpu[1]:.2f} / {search_cpu[2]:.1f} ms | |")
    print(f"| open p50 / p99 / max ({len(open_times)} pages, mean {np.mean(opened_words):,.0f} words) | "
          f"{opens[0]:.2f} / {opens[1]:.2f} / {opens[2]:.1f} ms | p50 <= {TARGET_P50_MS:.0f}, p99 <= "
          f"{TARGET_P99_MS:.0f}: {verdict(opens[0] <= TARGET_P50_MS and opens[1] <= TARGET_P99_MS)} |")
    print(f"| open CPU time p50 / p99 / max | {open_cpu[0]:.2f} / {open_cpu[1]:.2f} / {open_cpu[2]:.1f} ms | |")
    if reference is not None:
        (p50, p99, top), agree, checked = reference
        print(f"| bm25s.retrieve p50 / p99 / max (1 thread) | {p50:.2f} / {p99:.2f} / {top:.1f} ms | |")
        print(f"| same top-10 scores as bm25s.retrieve | {agree}/{checked} | |")
    if errors:
        print(f"\nnote: {errors} searches without results or failed opens")


if __name__ == "__main__":
    main()
