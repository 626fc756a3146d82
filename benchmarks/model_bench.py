"""Forward throughput of the trace-jax decoder vs transformers (torch) on the same CPU and the same weights.

For each model shape and (batch, length) cell: ours = jitted `trace_jax.models.forward` (full float32 logits, after a
warm-up compile); torch = `AutoModelForCausalLM` under `torch.inference_mode()` (after a warm-up call). Both load the
same random weights: ours writes them with `save_pretrained` and transformers reads that directory. Prints one table
with tokens/s side by side and the ratio ours / torch. Calls of the two are interleaved so that both see the
same load on a shared machine (medians of >= 3 calls each).

    .venv/bin/python benchmarks/model_bench.py [--models tiny-qwen3,smollm2-135m] [--batches 1,4] [--lengths 128,512]
"""

from __future__ import annotations

import argparse
import os

# On a shared, oversubscribed CPU, OpenMP's default busy-waiting makes torch 5-10x slower; passive waiting is
# torch's best setting here, so use it (set OMP_WAIT_POLICY yourself to override). Must precede importing torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from trace_jax import models


def timed_pair(fn_a, fn_b, min_reps=3, min_seconds=2.0, max_reps=20):
    """Median seconds per call of fn_a() and fn_b(), calls interleaved so both see the same machine load."""
    times_a, times_b = [], []
    start = time.perf_counter()
    while len(times_a) < min_reps or (time.perf_counter() - start < min_seconds and len(times_a) < max_reps):
        for fn, times in ((fn_a, times_a), (fn_b, times_b)):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return float(np.median(times_a)), float(np.median(times_b))


def bench_model(preset, batches, lengths, seed=0):
    config = models.get_preset(preset)
    params = models.init_params(config, jax.random.PRNGKey(seed))
    with tempfile.TemporaryDirectory() as directory:
        models.save_pretrained(directory, config, params)
        torch_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    rows = []
    for batch in batches:
        for length in lengths:
            tokens = np.random.RandomState(seed).randint(0, config.vocab_size, (batch, length))
            jax_tokens = jnp.asarray(tokens)
            torch_tokens = torch.tensor(tokens)
            models.forward(config, params, jax_tokens).block_until_ready()  # compile
            with torch.inference_mode():
                torch_model(torch_tokens)  # warm-up
                ours, theirs = timed_pair(lambda: models.forward(config, params, jax_tokens).block_until_ready(),
                                          lambda: torch_model(torch_tokens).logits)
            n = batch * length
            rows.append((preset, batch, length, n / ours, n / theirs, theirs / ours))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny-qwen3,smollm2-135m")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--lengths", default="128,512")
    args = parser.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
          f"{os.cpu_count()} CPUs, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, float32, full logits")
    header = f"| {'model':<14} | {'B':>2} | {'S':>4} | {'ours tok/s':>11} | {'torch tok/s':>11} | {'ours/torch':>10} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for preset in args.models.split(","):
        for name, b, s, ours, theirs, ratio in bench_model(preset, batches, lengths):
            print(f"| {name:<14} | {b:>2} | {s:>4} | {ours:>11,.0f} | {theirs:>11,.0f} | {ratio:>9.2f}x |", flush=True)


if __name__ == "__main__":
    main()
