"""Oracle-progress credit: TRACE's token mixing with the turn term set to the oracle's progress gain.

    A_out       = GRPO's group statistic of the rewards (credit-spec section 1)
    r_k         = progress gain of tool turn k: the share of the task's clue chain that turn k's observation reveals
                  for the first time (`trace_jax.rl.credit_diagnostics.progress_gains`), k = 0 .. T-1
    tokens of tool turn k < T:   alpha_out * A_out + alpha_turn * r_k
    tokens of the answer turn:   alpha_out * A_out                       (the token broadcast of `token_advantages`)

It is the ceiling for any turn credit on these tasks: a turn term that knew exactly which turns advanced the chain.
`alpha_turn = 0` reproduces GRPO exactly. A task without a clue chain has gains 0 (GRPO on its rows).

This module knows arrays only: the gains come from the caller (the RL pipeline computes them from its episodes).
"""

from __future__ import annotations

import jax.numpy as jnp

from trace_jax.credit._checks import check_float, check_int, check_rank, check_same_batch, compute_dtype


def progress_turn_credit(progress_gains, num_turns):
    """The turn term `r_k`: `progress_gains [N, T]` with the padded turns `k >= T_g` set to exactly 0.

    Args:
      progress_gains: `[N, T]` float progress gain per tool turn (entries `k >= num_turns` are ignored).
      num_turns: `[N]` int tool calls per trajectory.

    Returns:
      `[N, T]` float (float32 unless given float64).
    """
    check_rank("progress_gains", progress_gains, 2, "[N, T] progress gain per tool turn")
    check_rank("num_turns", num_turns, 1, "[N]")
    check_float("progress_gains", progress_gains)
    check_int("num_turns", num_turns)
    check_same_batch(progress_gains=progress_gains, num_turns=num_turns)
    gains = progress_gains.astype(compute_dtype(progress_gains))
    real = jnp.arange(gains.shape[1])[None, :] < num_turns[:, None]
    return jnp.where(real, gains, 0.0)
