"""Causal attention: backward/forward time ratio, and train-shaped forward+backward of a whole model.

Part 1 (the kernel): causal self-attention with the tiny model's attention shape (4 query heads, 2 kv heads,
head_dim 16; batch 1) at each length. "new" = `attention.flash_attention` (custom_vjp, flash-style backward);
"old" = `attention.dense_attention` differentiated by JAX (the whole score matrix; the tiled path long causal
inputs took before, `decoder.prefix_attend`, is gone since attention has one implementation). Forward = the
jitted attention; backward = (jitted `grad` of `sum(out * g)`, which runs the forward too) minus the forward, so
bwd/fwd is the backward's own cost relative to the forward.
Target: new bwd/fwd <= 3.5.

Part 2 (the model): `jax.grad` of the summed `token_logprobs` of the tiny model (train-shaped: B=1, S=length),
tokens/s, "new" (this code) against "old" (the same model with `attention_impl="dense"`).

Every contender is timed interleaved with the others, best of several repeats (the machine is shared).

    python benchmarks/attention_bench.py [--lengths 1024,2048,4096] [--repeats 5] [--model-length 2048]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import models
from trace_jax.models import attention


def best_of(fns: dict, repeats: int) -> dict:
    """Best seconds per call of each fn, calls interleaved round-robin."""
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn())
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def kernel_rows(lengths, repeats):
    config = models.get_preset("tiny-qwen3")
    H, K, Dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    rows = []
    for S in lengths:
        rng = np.random.default_rng(S)
        q, k, v, g = (jnp.asarray(rng.normal(size=s), jnp.float32)
                      for s in ((1, S, H, Dh), (1, S, K, Dh), (1, S, K, Dh), (1, S, H, Dh)))
        ranges = attention.causal_ranges(1, S)
        kernels = {
            "new": lambda q, k, v: attention.flash_attention(q, k, v, ranges),
            "old": lambda q, k, v: attention.dense_attention(q, k, v, ranges.dense(S)),
        }
        fns = {}
        for name, kernel in kernels.items():
            fwd = jax.jit(kernel)
            grad = jax.jit(jax.grad(lambda q, k, v, g, kernel=kernel: jnp.sum(kernel(q, k, v) * g), argnums=(0, 1, 2)))
            jax.block_until_ready((fwd(q, k, v), grad(q, k, v, g)))  # compile
            fns[f"{name}_fwd"] = lambda fwd=fwd: fwd(q, k, v)
            fns[f"{name}_grad"] = lambda grad=grad: grad(q, k, v, g)
        best = best_of(fns, repeats)
        for name in kernels:  # the backward's own time: the gradient call runs the forward too
            best[f"{name}_bwd"] = best[f"{name}_grad"] - best[f"{name}_fwd"]
        rows.append((S, best))
    return rows


def model_rows(length, repeats):
    config = models.get_preset("tiny-qwen3")
    params = models.init_params(config, jax.random.PRNGKey(0))
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (1, length)))

    def train_step(config):
        return jax.jit(jax.grad(lambda p: models.token_logprobs(config, p, tokens).sum()))

    steps = {"new": train_step(config), "old": train_step(config.replace(attention_impl="dense"))}
    for step in steps.values():
        jax.block_until_ready(step(params))  # compile
    best = best_of({name: (lambda step=step: step(params)) for name, step in steps.items()}, repeats)
    return {name: length / seconds for name, seconds in best.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-length", type=int, default=2048)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"jax {jax.__version__} ({jax.default_backend()}), tiny-qwen3 attention (H=4, K=2, Dh=16, B=1), "
          f"best of {args.repeats}, interleaved")
    print("|     L | new fwd ms | new bwd ms | new bwd/fwd | old fwd ms | old bwd ms | old bwd/fwd |")
    print("|-------|------------|------------|-------------|------------|------------|-------------|")
    for S, b in kernel_rows(lengths, args.repeats):
        print(f"| {S:5d} | {b['new_fwd'] * 1e3:10.2f} | {b['new_bwd'] * 1e3:10.2f} | "
              f"{b['new_bwd'] / b['new_fwd']:11.2f} | {b['old_fwd'] * 1e3:10.2f} | {b['old_bwd'] * 1e3:10.2f} | "
              f"{b['old_bwd'] / b['old_fwd']:11.2f} |")
    tps = model_rows(args.model_length, args.repeats)
    print(f"\ntiny-qwen3 train-shaped grad of token_logprobs, B=1, S={args.model_length}: "
          f"new {tps['new']:,.0f} tok/s, old {tps['old']:,.0f} tok/s, new/old {tps['new'] / tps['old']:.2f}x")


if __name__ == "__main__":
    main()
