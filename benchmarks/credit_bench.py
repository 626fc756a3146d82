"""Jitted, batched credit vs the float64 numpy loop reference, side by side in one run.

    python benchmarks/credit_bench.py [--quick]

For each shape [trajectories x turns] it times TRACE turn credit (outcome z-score + TD + look-ahead) and ABC-GRPO
step advantages (group normalisation + backward accumulation), both jitted over the whole batch, against the loops
in `trace_jax.credit.reference`, checks that they agree, and prints turns/s and the speed ratio. GiGPO (episode +
anchor-state step advantages) runs at 1024x16 only: its loop reference scans the whole group for every step.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from trace_jax import credit  # noqa: E402
from trace_jax.credit import reference as ref  # noqa: E402

GROUP = 8


def make_inputs(n, t, seed=0):
    rng = np.random.default_rng(seed)
    return dict(
        scores=-rng.exponential(3.0, size=(n, t + 1)).astype(np.float32),
        turns=rng.integers(t // 2, t + 1, size=n).astype(np.int32),
        rewards=rng.integers(0, 2, size=n).astype(np.float32),
        step_rewards=rng.uniform(0, 2, size=(n, t)).astype(np.float32),
    )


@jax.jit
def trace_jit(scores, turns, rewards):
    outcome = credit.outcome_advantages(rewards.reshape(-1, GROUP)).reshape(-1)
    return credit.trace_turn_credit(scores, turns, outcome)


@jax.jit
def abc_jit(step_rewards, turns):
    n, t = step_rewards.shape
    return credit.abc_grpo_advantages(step_rewards.reshape(-1, GROUP, t), turns.reshape(-1, GROUP)).reshape(n, t)


@jax.jit
def gigpo_jit(anchor_keys, turns, rewards):
    n = rewards.shape[0]
    group_id = jnp.repeat(jnp.arange(n // GROUP), GROUP)
    outcome = credit.grouped_outcome_advantages(rewards, group_id, n // GROUP)
    steps = credit.gigpo_step_advantages(anchor_keys, turns, rewards, group_id, n // GROUP)
    real = jnp.arange(steps.shape[1])[None, :] <= turns[:, None]
    return jnp.where(real, outcome[:, None] + steps, 0.0)


def gigpo_keys(n, t, seed=0):
    """Observation histories over two pages per call, so anchor states are shared often."""
    rng = np.random.default_rng(seed)
    histories = rng.integers(0, 2, size=(n, t))
    keys = [[(i // GROUP, tuple(histories[i, :k])) for k in range(t + 1)] for i in range(n)]
    return keys, credit.anchor_key_ids(keys, t + 1)


def gigpo_loop(x, keys):
    n, t = len(x["rewards"]), x["scores"].shape[1] - 1
    out = np.zeros((n, t + 1))
    rows = ref.gigpo_ref(x["rewards"], [i // GROUP for i in range(n)], keys, x["turns"])
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def time_jax(fn, *args, repeats=5):
    jax.block_until_ready(fn(*args))  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best, np.asarray(out)


def time_loop(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def trace_loop(x):
    return ref.trace_batch_ref(x["scores"], x["turns"], x["rewards"], GROUP)


def abc_loop(x):
    n, t = x["step_rewards"].shape
    out = np.zeros((n, t))
    for start in range(0, n, GROUP):
        steps = x["turns"][start:start + GROUP]
        for g, row in enumerate(ref.abc_grpo_advantages_ref(x["step_rewards"][start:start + GROUP], steps)):
            out[start + g, : len(row)] = row
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    args = parser.parse_args()
    shapes = [(256, 64), (1024, 16)] if args.quick else [(4096, 64), (65536, 16), (1024, 16)]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores; groups of {GROUP}")
    header = f"{'method':<10} {'shape':>12} {'jit turns/s':>14} {'loop turns/s':>14} {'ratio':>9} {'max |diff|':>11}"
    print(header)
    print("-" * len(header))
    for n, t in shapes:
        x = make_inputs(n, t)
        real_turns = int(x["turns"].sum())
        cases = [
            ("TRACE", lambda: time_jax(trace_jit, x["scores"], x["turns"], x["rewards"]), lambda: trace_loop(x)),
            ("ABC-GRPO", lambda: time_jax(abc_jit, x["step_rewards"], x["turns"]), lambda: abc_loop(x)),
        ]
        if (n, t) == (1024, 16):
            keys, key_ids = gigpo_keys(n, t)
            cases.append(("GiGPO", lambda: time_jax(gigpo_jit, key_ids, x["turns"], x["rewards"]),
                          lambda: gigpo_loop(x, keys)))
        for name, run_jit, run_loop in cases:
            jit_seconds, jit_out = run_jit()
            loop_seconds, loop_out = time_loop(run_loop)
            diff = float(np.max(np.abs(jit_out - loop_out)))
            print(f"{name:<10} {f'{n}x{t}':>12} {real_turns / jit_seconds:>14.3e} {real_turns / loop_seconds:>14.3e} "
                  f"{loop_seconds / jit_seconds:>8.0f}x {diff:>11.2e}")
    print("turns/s counts real turns (num_turns summed), not padding; jit time is the best of 5 after compile.")


if __name__ == "__main__":
    main()
