"""Credit for episodes split into segment rows (context management): count each episode once.

With `RolloutConfig.context_budget` an episode that compacted its context is several rows of the batch, one per
stretch of context the policy saw (`rollout.batch`, fields `episode [N]` and `first_turn [N]`). Credit is a
statement about an *episode*: its reward enters its group's mean and std once, its turns are numbered across its
rows, TRACE scores each of its states once. So the estimator runs on the episodes, not on the rows:

  1. `turn_layout(num_turns, S)`: each episode as one pseudo-token per assistant turn (`turn_index [E, S]` =
     0..T_g, `loss_mask [E, S]` 1 on those), the layout every estimator reads; every built-in estimator gives a
     token the value of its turn (`tokens.py`), so the pseudo-token of turn k carries turn k's advantage;
  2. `episode_states(values [N, S], ...)`: per-state values of the rows (the scorer's answer scores, computed on
     the context the policy saw: the row) placed at the episode's state numbers, `[E, S]`;
  3. `segment_token_advantages(turn_advantages [E, S], episode, turn_index, loss_mask)`: the episode's per-turn
     advantages broadcast back onto its rows' tokens (`turn_index` of a row holds the episode's turn numbers).

Shapes: `E` episodes, `N` rows, `L` tokens per row, `S = T + 1` turn / state slots. Pure and jittable.
An estimator registered by research code must give a token the value of its turn for (1) to hold.
"""

from __future__ import annotations

import jax.numpy as jnp

from trace_jax.credit._checks import check_int, check_rank
from trace_jax.credit.tokens import gather_per_turn


def turn_layout(num_turns, num_slots: int):
    """One pseudo-token per assistant turn of each episode.

    Args:
      num_turns: `[E]` int tool calls per episode (`T_g`, at most `num_slots - 1`).
      num_slots: `S`, the turn slots (`max_turns + 1`).

    Returns:
      `(turn_index [E, S] int32, loss_mask [E, S] float32)`: slot k holds turn k for `k <= T_g` (mask 1), else -1
      (mask 0).
    """
    check_rank("num_turns", num_turns, 1, "[E] tool calls per episode")
    check_int("num_turns", num_turns)
    slots = jnp.arange(num_slots, dtype=jnp.int32)[None, :]
    real = slots <= jnp.asarray(num_turns, jnp.int32)[:, None]
    return jnp.where(real, slots, -1), real.astype(jnp.float32)


def episode_states(row_values, episode, first_turn, num_states, num_episodes: int):
    """Per-state values of segment rows placed at their episode's state numbers.

    `out[episode[n], first_turn[n] + j] = row_values[n, j]` for `j < num_states[n]`; slots no row covers are 0.

    Args:
      row_values: `[N, S]` float, column j = the row's j-th state.
      episode, first_turn, num_states: `[N]` int (the batch's fields; `num_states = num_turns + 1`).
      num_episodes: `E` (static).

    Returns:
      `[E, S]`.
    """
    check_rank("row_values", row_values, 2, "[N, S] per-state values of each row")
    for name, value in (("episode", episode), ("first_turn", first_turn), ("num_states", num_states)):
        check_rank(name, value, 1, "[N]")
        check_int(name, value)
    row_values = jnp.asarray(row_values)
    num_slots = row_values.shape[1]
    j = jnp.arange(num_slots)[None, :]
    target = jnp.asarray(first_turn)[:, None] + j
    keep = (j < jnp.asarray(num_states)[:, None]) & (target < num_slots)
    rows = jnp.broadcast_to(jnp.asarray(episode)[:, None], target.shape)
    # rows outside `keep` write to a slot past the end, which `mode="drop"` discards
    out = jnp.zeros((num_episodes, num_slots), row_values.dtype)
    return out.at[rows, jnp.where(keep, target, num_slots)].set(row_values, mode="drop")


def segment_token_advantages(turn_advantages, episode, turn_index, loss_mask):
    """Each row's token advantages from its episode's per-turn advantages.

    Args:
      turn_advantages: `[E, S]` float, slot k = turn k's advantage (an estimator's output on `turn_layout`).
      episode: `[N]` int episode of each row.
      turn_index: `[N, L]` int the episode's turn of each token (-1 outside assistant turns).
      loss_mask: `[N, L]`, nonzero on tokens the policy produced.

    Returns:
      `[N, L]` float32: the token's turn's advantage on trained tokens, 0 elsewhere.
    """
    check_rank("turn_advantages", turn_advantages, 2, "[E, S] per-turn advantages of each episode")
    check_rank("episode", episode, 1, "[N]")
    check_rank("turn_index", turn_index, 2, "[N, L]")
    check_int("turn_index", turn_index)
    per_row = jnp.asarray(turn_advantages, jnp.float32)[jnp.asarray(episode)]
    values = gather_per_turn(per_row, jnp.asarray(turn_index))
    return jnp.where((jnp.asarray(loss_mask) != 0) & (jnp.asarray(turn_index) >= 0), values, 0.0)
