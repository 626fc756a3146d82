"""Search-environment benchmark: BM25 search latency and browser tool steps/s over synthetic corpora.

Builds procedural corpora (Zipf-distributed synthetic words, no downloads) of 10k and 100k documents, then measures
  * index build time (bm25s matrices + this project's tokenisation),
  * ``SearchIndex.search(query, topn=10)`` latency: mean / p50 / p99 over many queries, and the same for
    ``bm25s.BM25.retrieve`` on the same index as a reference (fewer queries; it is slower),
  * full tool steps/s through ``Browser.execute`` for a search -> open -> find cycle (3 steps; reset per cycle).

Run: ``python benchmarks/env_bench.py`` (``--sizes 10000 --queries 500`` for a quick look). Target: a search over
10k documents under 1 ms.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from trace_jax.envs.browser import Browser
from trace_jax.envs.corpus import Corpus, Document
from trace_jax.envs.search_index import SearchIndex, document_search_text, tokenize

SYLLABLES = ("ka lo mir ven ta dor si bel ru gan te ol mar ni vas ko ra len tu sha bo rin da fel pa zu hal ve mo kir "
             "ash lu gor ne tam sel").split()


def synthetic_vocabulary(size: int, rng: np.random.Generator) -> list[str]:
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choice(SYLLABLES, size=rng.integers(2, 4))))
    return sorted(words)


def synthetic_corpus(num_docs: int, *, words_per_doc: int = 120, vocabulary_size: int = 30_000,
                     seed: int = 0) -> Corpus:
    rng = np.random.default_rng(seed)
    vocabulary = np.array(synthetic_vocabulary(vocabulary_size, rng))
    ranks = np.arange(1, vocabulary_size + 1)
    probabilities = 1.0 / (ranks + 5.0)  # Zipf-like: a few very common words, a long tail
    probabilities /= probabilities.sum()
    word_ids = rng.choice(vocabulary_size, size=(num_docs, words_per_doc), p=probabilities)
    documents = []
    for n in range(num_docs):
        words = vocabulary[word_ids[n]].tolist()
        sentences = [" ".join(words[i:i + 12]).capitalize() + "." for i in range(0, words_per_doc, 12)]
        paragraphs = [" ".join(sentences[i:i + 4]) for i in range(0, len(sentences), 4)]
        title = " ".join(vocabulary[rng.integers(0, vocabulary_size, size=2)]).title()
        documents.append(Document(docid=f"doc{n:07d}", url=f"https://synthetic.local/{n}", title=title,
                                  text="\n".join(paragraphs)))
    return Corpus(documents)


def sample_queries(corpus: Corpus, count: int, seed: int = 1) -> list[str]:
    """Queries of 2-6 words drawn from random documents (so they hit, like real agent queries mostly do)."""
    rng = np.random.default_rng(seed)
    queries = []
    for _ in range(count):
        words = tokenize(corpus[int(rng.integers(len(corpus)))].text)
        queries.append(" ".join(rng.choice(words, size=int(rng.integers(2, 7)))))
    return queries


def latency_stats(seconds: list[float]) -> tuple[float, float, float]:
    micro = np.array(seconds) * 1e6
    return float(micro.mean()), float(np.percentile(micro, 50)), float(np.percentile(micro, 99))


def time_calls(function, inputs) -> list[float]:
    durations = []
    for item in inputs:
        start = time.perf_counter()
        function(item)
        durations.append(time.perf_counter() - start)
    return durations


def cpu_time_calls(function, inputs) -> list[float]:
    """Per-call CPU time of this process: unlike wall time, not inflated when other processes share the cores."""
    durations = []
    for item in inputs:
        start = time.process_time()
        function(item)
        durations.append(time.process_time() - start)
    return durations


def bench_size(num_docs: int, num_queries: int, num_reference_queries: int, num_cycles: int) -> dict:
    start = time.perf_counter()
    corpus = synthetic_corpus(num_docs)
    generate_s = time.perf_counter() - start
    start = time.perf_counter()
    index = SearchIndex.build(corpus)
    build_s = time.perf_counter() - start
    queries = sample_queries(corpus, num_queries)
    for query in queries[:50]:  # warm-up
        index.search(query, 10)
    ours = latency_stats(time_calls(lambda q: index.search(q, 10), queries))
    ours_cpu = latency_stats(cpu_time_calls(lambda q: index.search(q, 10), queries))

    import bm25s

    retriever = bm25s.BM25(method="lucene")
    retriever.index([tokenize(document_search_text(d.title, d.text)) for d in corpus], show_progress=False)
    reference_queries = queries[:num_reference_queries]

    def bm25s_search(query):
        return retriever.retrieve([tokenize(query)], k=10, show_progress=False, n_threads=1)

    reference = latency_stats(time_calls(bm25s_search, reference_queries))
    reference_cpu = latency_stats(cpu_time_calls(bm25s_search, reference_queries))
    agree = sum(
        [s for _, s in index.search(q, 10)] == sorted(retriever.retrieve(
            [tokenize(q)], k=10, show_progress=False)[1][0].tolist(), reverse=True)[: len(index.search(q, 10))]
        for q in reference_queries[:100])

    browser = Browser(corpus, index)
    rng = np.random.default_rng(2)
    patterns = [tokenize(corpus[int(rng.integers(len(corpus)))].text)[0] for _ in range(num_cycles)]
    start, start_cpu = time.perf_counter(), time.process_time()
    errors = 0
    for cycle in range(num_cycles):
        browser.reset()
        observations = (browser.execute("search", {"query": queries[cycle % len(queries)]}),
                        browser.execute("open", {"id": 0}),
                        browser.execute("find", {"pattern": patterns[cycle]}))
        errors += sum(text.startswith("Error: ") for text in observations)
    cycle_s, cycle_cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    return {"docs": num_docs, "generate_s": generate_s, "build_s": build_s, "vocab": index.vocabulary_size,
            "ours": ours, "ours_cpu": ours_cpu, "bm25s": reference, "agree": agree, "agree_of": min(100, len(reference_queries)),
            "steps_per_s": 3 * num_cycles / cycle_s, "steps_per_cpu_s": 3 * num_cycles / cycle_cpu_s,
            "bm25s_cpu": reference_cpu, "errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--reference-queries", type=int, default=200)
    parser.add_argument("--cycles", type=int, default=1000)
    args = parser.parse_args()
    rows = [bench_size(size, args.queries, args.reference_queries, args.cycles) for size in args.sizes]
    print(f"\nsearch latency, topn=10, {args.queries} queries of 2-6 words (bm25s.retrieve: "
          f"{args.reference_queries} queries, 1 thread); tool cycle = search + open + find\n")
    header = ("| docs | build s | search wall mean / p50 / p99 us | search CPU mean / p50 / p99 us | "
              "bm25s.retrieve wall mean / p50 / p99 us | bm25s.retrieve CPU mean / p50 / p99 us | "
              "speed-up (CPU mean) | same top-10 scores as bm25s | tool steps/s wall | tool steps per CPU s |")
    print(header)
    print("|" + "|".join("---" for _ in range(header.count("|") - 1)) + "|")

    def triple(stats):
        return " / ".join(f"{value:.0f}" for value in stats)

    for row in rows:
        print(f"| {row['docs']:,} | {row['build_s']:.1f} | {triple(row['ours'])} | {triple(row['ours_cpu'])} | "
              f"{triple(row['bm25s'])} | {triple(row['bm25s_cpu'])} | {row['bm25s_cpu'][0] / row['ours_cpu'][0]:.1f}x | "
              f"{row['agree']}/{row['agree_of']} | {row['steps_per_s']:,.0f} | {row['steps_per_cpu_s']:,.0f} |")
    for row in rows:
        if row["errors"]:
            print(f"note: {row['errors']} tool errors in the {row['docs']:,}-doc cycle run")


if __name__ == "__main__":
    main()
