"""Broadcast per-trajectory and per-turn quantities onto tokens.

A token's turn comes from `turn_index [N, L]` (the assistant turn it belongs to: turn `k < T_g` emitted tool call
`k+1`, turn `T_g` is the final answer; -1 for prompt, observation and padding tokens) and `loss_mask [N, L]`
(1 on tokens the policy produced). Tokens outside the loss mask always get 0. Knows nothing about how the
per-turn values were computed.
"""

from __future__ import annotations

import jax.numpy as jnp

from trace_jax.credit._checks import check_float, check_int, check_rank, check_same_batch, compute_dtype


def _check_token_layout(turn_index, loss_mask, num_turns):
    check_rank("turn_index", turn_index, 2, "[N, L] assistant turn of each token (-1 elsewhere)")
    check_rank("loss_mask", loss_mask, 2, "[N, L] 1 on assistant tokens")
    check_rank("num_turns", num_turns, 1, "[N]")
    check_int("turn_index", turn_index)
    check_int("num_turns", num_turns)
    if turn_index.shape != loss_mask.shape:
        raise ValueError(f"turn_index{turn_index.shape} and loss_mask{loss_mask.shape} must have the same shape")
    check_same_batch(turn_index=turn_index, num_turns=num_turns)


def gather_per_turn(per_turn, turn_index, *, default=0.0):
    """Look up `per_turn[n, turn_index[n, t]]` for every token; `default` where the index is out of range.

    Args:
      per_turn: `[N, S]` values per turn or step.
      turn_index: `[N, L]` int, may hold -1 or values `>= S`.

    Returns:
      `[N, L]`.
    """
    num_slots = per_turn.shape[1]
    if num_slots == 0:
        return jnp.full(turn_index.shape, default, per_turn.dtype)
    inside = (turn_index >= 0) & (turn_index < num_slots)
    picked = jnp.take_along_axis(per_turn, jnp.clip(turn_index, 0, num_slots - 1), axis=1)
    return jnp.where(inside, picked, default)


def token_advantages(turn_index, loss_mask, turn_credit, outcome_adv, num_turns, *, alpha_out: float = 1.0,
                     alpha_turn: float = 0.2):
    """Per-token TRACE advantages (credit-spec section 2, "Token advantages").

        assistant tokens of turn k < T_g:       alpha_out * A_out + alpha_turn * r_k
        final-answer turn (k == T_g) tokens:    alpha_out * A_out     (T_g = 0: every assistant token)
        prompt / observation / padding tokens:  0   (loss_mask == 0 or turn_index == -1)
    Tokens with `turn_index > T_g` are malformed (rejected by `validate_token_layout`) and get 0.
    `alpha_turn = 0` reproduces GRPO exactly.

    Args:
      turn_index: `[N, L]` int assistant-turn index per token, -1 outside assistant turns.
      loss_mask: `[N, L]` bool/int/float, nonzero on tokens the policy produced.
      turn_credit: `[N, T]` float turn credit `r_k` (`trace_turn_credit`); entries `k >= T_g` are ignored.
      outcome_adv: `[N]` float outcome advantage per trajectory.
      num_turns: `[N]` int tool calls per trajectory.
      alpha_out, alpha_turn: weights of the outcome and the turn term.

    Returns:
      `[N, L]` float32 advantages.
    """
    _check_token_layout(turn_index, loss_mask, num_turns)
    check_rank("turn_credit", turn_credit, 2, "[N, T] turn credit")
    check_rank("outcome_adv", outcome_adv, 1, "[N]")
    check_float("turn_credit", turn_credit)
    check_float("outcome_adv", outcome_adv)
    check_same_batch(turn_credit=turn_credit, outcome_adv=outcome_adv, turn_index=turn_index)
    dtype = compute_dtype(turn_credit, outcome_adv)
    is_tool_turn = (turn_index >= 0) & (turn_index < num_turns[:, None])
    is_answer_turn = turn_index == num_turns[:, None]
    trained = (loss_mask != 0) & (is_tool_turn | is_answer_turn)
    outcome_term = alpha_out * outcome_adv.astype(dtype)[:, None]
    credit = gather_per_turn(turn_credit.astype(dtype), turn_index)
    turn_term = jnp.where(is_tool_turn, alpha_turn * credit, 0.0)
    return jnp.where(trained, outcome_term + turn_term, 0.0)


def sequence_advantages_to_tokens(advantages, loss_mask):
    """Broadcast one advantage per trajectory onto its trained tokens (GRPO / GSPO).

    Args:
      advantages: `[N]` float.
      loss_mask: `[N, L]`, nonzero on tokens the policy produced.

    Returns:
      `[N, L]` float32: `advantages[n]` on trained tokens, 0 elsewhere.
    """
    check_rank("advantages", advantages, 1, "[N]")
    check_rank("loss_mask", loss_mask, 2, "[N, L]")
    dtype = compute_dtype(advantages)
    return jnp.where(loss_mask != 0, advantages.astype(dtype)[:, None], 0.0)


def step_values_to_tokens(step_values, turn_index, loss_mask, num_steps):
    """Broadcast per-step values (ABC) onto the assistant tokens of each step.

    A token of assistant turn `k` belongs to step `min(k, num_steps - 1)`: with `num_steps = T_g + 1` the final
    answer is a step of its own; with `num_steps = max(T_g, 1)` it joins the last tool step, as in the ABC paper.

    Args:
      step_values: `[N, S]` float per-step values.
      turn_index: `[N, L]` int assistant-turn index per token, -1 elsewhere.
      loss_mask: `[N, L]`, nonzero on trained tokens.
      num_steps: `[N]` int in `[0, S]`; a trajectory with 0 steps gets 0 everywhere.

    Returns:
      `[N, L]` float32.
    """
    _check_token_layout(turn_index, loss_mask, num_steps)
    check_rank("step_values", step_values, 2, "[N, S]")
    dtype = compute_dtype(step_values)
    step = jnp.where(turn_index >= 0, jnp.minimum(turn_index, num_steps[:, None] - 1), -1)
    values = gather_per_turn(step_values.astype(dtype), step)
    return jnp.where((loss_mask != 0) & (step >= 0), values, 0.0)
