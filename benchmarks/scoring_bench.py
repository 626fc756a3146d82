"""Prefix-fork answer scoring vs one forward per prefix, side by side (design.md, "Prefix-fork scoring").

For each case (model, L, T, m) it times, on the same random trajectory and answer:
  packed  one pass, packed layout (trajectory + T+1 answer copies, explicit mask)
  cached  one pass, cached-prefix layout (block-causal prefill, then all copies as one query block with per-query
          key limits)
  fork    = whichever layout `method="fork", layout="auto"` picks for the shape (cached above 128 packed tokens)
  naive   ours, one jitted forward per prefix (prefix cut to a multiple of 64 tokens)
  torch   transformers (torch, CPU), one forward per prefix with full logits: what a researcher would write
and prints the naive/fork time ratio beside the token ratio `sum_k (b_k + m) / (L + (T+1) m)`, the speed-up of
fork over the torch loop, and each JAX path's compiled temp memory (XLA memory_analysis; naive = its largest prefix).

Targets (issue 4): naive/fork >= 0.6 x token ratio; fork >= 5x faster than the torch loop.

    .venv/bin/python benchmarks/scoring_bench.py                 # all cases (several minutes on 2 CPU cores)
    .venv/bin/python benchmarks/scoring_bench.py --quick         # small shapes, a smoke run
    .venv/bin/python benchmarks/scoring_bench.py --smollm2-dir DIR   # real SmolLM2 weights instead of random ones

Times are the best of at least `--repeats` calls (more, up to 30, while a path's calls take under 3 s in all),
interleaved round-robin across all paths (torch included), after one warm-up call each (compilation excluded).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

# torch runs interleaved with JAX: OpenMP's default busy-waiting would steal the cores from the JAX calls between
# torch calls (see model_bench.py). Set OMP_WAIT_POLICY yourself to override; must precede importing torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from trace_jax import models  # noqa: E402
from trace_jax.scoring import choose_layout, compiled_memory, score_answer_prefixes  # noqa: E402
from trace_jax.scoring import naive as naive_module  # noqa: E402


def make_case(vocab, length, turns, m, seed=0, prompt=64):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocab, (1, length))
    boundaries = np.sort(np.concatenate([[prompt], rng.integers(prompt + 1, length + 1, turns)]))[None, :]
    answer = rng.integers(3, vocab, (1, m))
    mask = np.ones((1, m), np.int32)
    mask[0, :2] = 0  # a two-token template, then the gold answer
    return tokens, boundaries, np.array([turns + 1]), answer, mask


def best_times(fns, repeats, budget_s=3.0, max_repeats=30):
    """Best wall time of each `fns[label]()` after a warm-up, calls interleaved round-robin (so drift on a shared
    box hits every path alike): at least `repeats` rounds, more (up to `max_repeats`) while a path's calls so far
    took under `budget_s` in all, so short calls get enough samples."""
    for fn in fns.values():
        jax.block_until_ready(fn())  # warm-up / compile
    times = {label: [] for label in fns}
    for round_ in range(max_repeats):
        busy = False
        for label, fn in fns.items():
            if round_ >= repeats and sum(times[label]) >= budget_s:
                continue
            busy = True
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[label].append(time.perf_counter() - start)
        if not busy:
            break
    return {label: min(t) for label, t in times.items()}


def naive_temp_bytes(config, params, tokens, boundaries, answer):
    """Largest compiled temp memory over the naive loop's prefix shapes."""
    m = answer.shape[1]
    widths = sorted({-(-(int(b) + m) // 64) * 64 for b in boundaries[0]})
    worst = 0
    for width in widths:
        lowered = naive_module._prefix_answer_log_probs.lower(
            params, jnp.zeros((1, width), jnp.int32), jnp.ones((1,), jnp.int32), jnp.asarray(answer, jnp.int32),
            config=config, logprob_chunk=256)
        worst = max(worst, lowered.compile().memory_analysis().temp_size_in_bytes)
    return worst


def torch_naive(model, tokens, boundaries, answer, mask):
    import torch

    scores = []
    with torch.no_grad():
        for b in boundaries[0]:
            ids = torch.as_tensor(np.concatenate([tokens[0, :b], answer[0]])[None, :], dtype=torch.long)
            logits = model(input_ids=ids).logits[0].float()
            logprobs = torch.log_softmax(logits[b - 1:b - 1 + answer.shape[1]], dim=-1)
            picked = logprobs.gather(-1, torch.as_tensor(answer[0], dtype=torch.long)[:, None])[:, 0].numpy()
            scores.append(float((picked * mask[0]).sum() / mask[0].sum()))
    return np.asarray(scores)


def run_case(name, config, params, hf_dir, length, turns, m, repeats, with_torch):
    tokens, boundaries, num_states, answer, mask = make_case(config.vocab_size, length, turns, m)
    args = (config, params, tokens, boundaries, num_states, answer, mask)
    row = {"case": f"{name} L={length} T={turns} m={m}"}
    naive_tokens = int((boundaries[0] + m).sum())
    fork_tokens = length + (turns + 1) * m
    row["token_ratio"] = naive_tokens / fork_tokens
    results, fns = {}, {}
    if with_torch:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(max(1, os.cpu_count() or 1))
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        results["torch"] = torch_naive(model, tokens, boundaries, answer, mask)
        fns["torch"] = lambda: torch_naive(model, tokens, boundaries, answer, mask)
    for label, method, layout in (("packed", "fork", "packed"), ("cached", "fork", "cached"),
                                  ("naive", "naive", "auto")):
        kwargs = dict(method=method, layout=layout)
        results[label] = np.asarray(score_answer_prefixes(*args, **kwargs).answer_scores)[0]
        fns[label] = functools.partial(lambda kw: score_answer_prefixes(*args, **kw).answer_scores, kwargs)
    row.update({f"{label}_s": t for label, t in best_times(fns, repeats).items()})
    row["auto_layout"] = choose_layout(length, turns + 1, m)
    row["fork_s"] = row[f"{row['auto_layout']}_s"]
    row["max_diff_fork_naive"] = float(np.abs(results["packed"] - results["naive"]).max())
    row["max_diff_cached_naive"] = float(np.abs(results["cached"] - results["naive"]).max())
    row["fork_temp_mb"] = compiled_memory(*args, layout="packed")["temp_bytes"] / 2**20
    row["cached_temp_mb"] = compiled_memory(*args, layout="cached")["temp_bytes"] / 2**20
    row["naive_temp_mb"] = naive_temp_bytes(config, params, tokens, boundaries, answer) / 2**20
    if with_torch:
        row["max_diff_torch_naive"] = float(np.abs(results["torch"] - results["naive"]).max())
    return row


def print_table(rows):
    header = ("| case | token ratio | naive s | packed s | cached s | fork = | naive/fork | target 0.6xTR | torch s | "
              "torch/fork | mem packed MiB | mem cached MiB | mem naive MiB | max diff |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in rows:
        speedup = r["naive_s"] / r["fork_s"]
        torch_cell = f"{r['torch_s']:.2f}" if "torch_s" in r else "-"
        torch_ratio = f"{r['torch_s'] / r['fork_s']:.1f}x" if "torch_s" in r else "-"
        diff = max(r["max_diff_fork_naive"], r["max_diff_cached_naive"])
        print(f"| {r['case']} | {r['token_ratio']:.2f} | {r['naive_s']:.3f} | {r['packed_s']:.3f} | "
              f"{r['cached_s']:.3f} | {r['auto_layout']} | {speedup:.2f} | {0.6 * r['token_ratio']:.2f} "
              f"{'ok' if speedup >= 0.6 * r['token_ratio'] else 'MISSED'} | {torch_cell} | {torch_ratio} | "
              f"{r['fork_temp_mb']:.1f} | {r['cached_temp_mb']:.1f} | {r['naive_temp_mb']:.1f} | {diff:.1e} |")
    sys.stdout.flush()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-torch", action="store_true", help="skip the transformers loop")
    parser.add_argument("--no-smollm2", action="store_true", help="skip the SmolLM2-135M case")
    parser.add_argument("--smollm2-dir", default=None,
                        help="HF dir of real SmolLM2-135M weights (default: random weights with its shape)")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} x{jax.device_count()}, {os.cpu_count()} CPU cores")
    tiny_cases = [(256, 4, 8)] if args.quick else [(1024, 16, 8), (2048, 32, 16)]
    smol_cases = [] if args.no_smollm2 else ([(256, 4, 8)] if args.quick else [(1024, 16, 8)])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        config = models.get_preset("tiny-qwen3")
        params = models.init_params(config, jax.random.PRNGKey(0))
        tiny_dir = os.path.join(tmp, "tiny")
        models.save_pretrained(tiny_dir, config, params)
        for length, turns, m in tiny_cases:
            rows.append(run_case("tiny-qwen3", config, params, tiny_dir, length, turns, m, args.repeats,
                                 not args.no_torch))
            print_table(rows[-1:])
        if smol_cases:
            if args.smollm2_dir:
                config, params = models.load_pretrained(args.smollm2_dir)
                smol_dir, label = args.smollm2_dir, "SmolLM2-135M"
            else:
                config = models.get_preset("smollm2-135m")
                params = models.init_params(config, jax.random.PRNGKey(1))
                smol_dir, label = os.path.join(tmp, "smol"), "SmolLM2-135M (random weights)"
                models.save_pretrained(smol_dir, config, params)
            for length, turns, m in smol_cases:
                rows.append(run_case(label, config, params, smol_dir, length, turns, m, args.repeats,
                                     not args.no_torch))
                print_table(rows[-1:])
    print("\nSummary")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
