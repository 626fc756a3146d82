"""TRACE: turn-level credit from a frozen reference model's gold-answer scores (credit-spec section 2).

Pure functions over padded arrays with explicit lengths. A trajectory with `T_g` tool calls has `T_g + 1` states;
arrays are padded to a common `T`, and everything at or beyond a trajectory's length is ignored and returned as 0,
whatever the padding holds (NaN included). Knows nothing about models, tokens or tools; the scorer
(`trace_jax.scoring`) produces `answer_scores`, and `trace_jax.credit.tokens` broadcasts the credit to tokens.

Impossible answers: an answer score of `-inf` (or anything below `min_score`) is clamped to `min_score` before the
value is computed, so credit stays finite. The floor is per form (`config.FORM_MIN_SCORES`): -1e4 nats per token for
log_ratio (from an impossible answer to a likely one the TD is about `log(1e4 / d_{k+1})`, at most 11.5), -30 for
raw_delta and linear_gap, whose TDs grow linearly with the score (|delta| <= 30 and delta in [-300, 1)). Scores
above 0 (rounding noise in low precision) are clamped to 0. NaN inside a trajectory's real states is invalid input:
`validate_trace_inputs` rejects it on the host, and inside jit it propagates to that trajectory only.
"""

from __future__ import annotations

import jax.numpy as jnp

from trace_jax.credit._checks import check_choice, check_float, check_int, check_rank, check_same_batch, compute_dtype

from trace_jax.credit.config import FORM_MIN_SCORES, FORMS, default_min_score

DEFAULT_MIN_SCORE = FORM_MIN_SCORES["log_ratio"]


def _check_scores(answer_scores, num_turns):
    check_rank("answer_scores", answer_scores, 2, "[N, T+1] mean gold-answer log-prob per state")
    check_rank("num_turns", num_turns, 1, "[N] number of tool calls per trajectory")
    check_float("answer_scores", answer_scores)
    check_int("num_turns", num_turns)
    check_same_batch(answer_scores=answer_scores, num_turns=num_turns)
    if answer_scores.shape[1] < 1:
        raise ValueError(f"answer_scores{answer_scores.shape}: needs at least one state (T+1 >= 1)")


def _clean_scores(answer_scores, num_turns, min_score):
    """Scores in the compute dtype, clamped to [min_score, 0], with padded states replaced by 0 (never read).

    NaN is not clamped (`jnp.clip` keeps it): it is invalid input, rejected on the host by `validate_trace_inputs`.
    """
    dtype = compute_dtype(answer_scores)
    scores = answer_scores.astype(dtype)
    state = jnp.arange(scores.shape[1])
    real = state[None, :] <= num_turns[:, None]
    scores = jnp.where(real, scores, 0.0)
    return jnp.clip(scores, min_score, 0.0), real


def trace_values(answer_scores, num_turns, *, eps: float = 0.1, min_score: float | None = None):
    """State values from the log-ratio of the remaining gap.

        d_k = -l_k + eps;   V_k = log(d_0 / d_k)      (V_0 = 0; halving the gap adds log 2)

    Args:
      answer_scores: `[N, T+1]` float, `l_k` = mean log-prob of the gold answer after state `S_k` (`<= 0`).
      num_turns: `[N]` int, tool calls per trajectory `T_g` in `[0, T]`; states `0..T_g` are real.
      eps: gap offset; keeps `d_k > 0` when the reference is certain.
      min_score: scores below this (including `-inf`) are clamped to it; None = the log-ratio floor (-1e4).

    Returns:
      `V [N, T+1]` float32, 0 beyond each trajectory's last state.
    """
    _check_scores(answer_scores, num_turns)
    scores, real = _clean_scores(answer_scores, num_turns,
                                 default_min_score("log_ratio") if min_score is None else min_score)
    gap = -scores + eps
    values = jnp.log(gap[:, :1]) - jnp.log(gap)
    return jnp.where(real, values, 0.0)


def td_deltas(answer_scores, num_turns, *, form: str = "log_ratio", eps: float = 0.1,
              min_score: float | None = None):
    """One-step temporal differences of the state value, one per tool call.

        log_ratio  (default): delta_k = log(d_k / d_{k+1}) = V_{k+1} - V_k     (telescopes: sum_k delta_k = V_T)
        linear_gap:           delta_k = (l_{k+1} - l_k) / d_k
        raw_delta:            delta_k = l_{k+1} - l_k
    with `d_k = -l_k + eps`, for `k = 0 .. T_g - 1`.

    Args:
      answer_scores: `[N, T+1]` float gold-answer scores per state (see `trace_values`).
      num_turns: `[N]` int in `[0, T]`.
      form: one of `"log_ratio"`, `"linear_gap"`, `"raw_delta"` (the paper's ablation).
      eps: as in `trace_values`.
      min_score: score floor (`-inf` included); None = the form's floor (`config.FORM_MIN_SCORES`: -1e4 for
        log_ratio, -30 for raw_delta and linear_gap), which bounds |delta| by 11.5, 30 and 300 respectively.

    Returns:
      `[N, T]` float32, 0 for `k >= T_g`.
    """
    _check_scores(answer_scores, num_turns)
    check_choice("form", form, FORMS)
    scores, _ = _clean_scores(answer_scores, num_turns, default_min_score(form) if min_score is None else min_score)
    gap = -scores + eps
    if form == "log_ratio":
        deltas = jnp.log(gap[:, :-1]) - jnp.log(gap[:, 1:])
    elif form == "linear_gap":
        deltas = (scores[:, 1:] - scores[:, :-1]) / gap[:, :-1]
    else:
        deltas = scores[:, 1:] - scores[:, :-1]
    turn = jnp.arange(deltas.shape[1])
    return jnp.where(turn[None, :] < num_turns[:, None], deltas, 0.0)


def discount_matrix(size: int, gamma, dtype, *, horizon: int | None = None):
    """`W[k, u] = gamma^(u-k)` for `k <= u` (and `u < k + horizon` when given), else 0.

    With a horizon it is turn `k`'s look-ahead window; without one, `W @ x` accumulates `x` backwards with `gamma`.
    """
    offset = jnp.arange(size)[None, :] - jnp.arange(size)[:, None]
    inside = (offset >= 0) if horizon is None else (offset >= 0) & (offset < horizon)
    return jnp.where(inside, jnp.power(jnp.asarray(gamma, dtype), jnp.maximum(offset, 0).astype(dtype)), 0.0)


def lookahead_credit(deltas, num_turns, outcome_adv, *, horizon: int = 3, gamma: float = 0.8,
                     terminal_fill: float = 2.0):
    """K-step look-ahead turn credit with terminal fill.

    For `k = 0 .. T_g - 1`, with `K = horizon` and `lambda = terminal_fill`:

        K >= 1:  h = min(k + K - 1, T_g - 1)
                 c_k = sum_{u=k..h} gamma^(u-k) delta_u / sum_{u=k..h} gamma^(u-k)     (normalised average)
        K == 0:  h = k,  c_k = 0
        r_k = c_k + [h == T_g - 1] * lambda * gamma^(T_g - k) * A_out

    Turn credit is not group-normalised, centred or clipped.

    Args:
      deltas: `[N, T]` float one-step TDs (`td_deltas`); entries at `k >= T_g` are ignored.
      num_turns: `[N]` int in `[0, T]`.
      outcome_adv: `[N]` float outcome advantage `A_out` of each trajectory.
      horizon: static look-ahead `K >= 0`.
      gamma: discount inside the window and for the terminal fill.
      terminal_fill: `lambda_term`, weight of the outcome advantage for windows that reach the last turn.

    Returns:
      `r [N, T]` float32, 0 for `k >= T_g`.
    """
    check_rank("deltas", deltas, 2, "[N, T] one-step TDs")
    check_rank("num_turns", num_turns, 1, "[N]")
    check_rank("outcome_adv", outcome_adv, 1, "[N]")
    check_float("deltas", deltas)
    check_float("outcome_adv", outcome_adv)
    check_int("num_turns", num_turns)
    check_same_batch(deltas=deltas, num_turns=num_turns, outcome_adv=outcome_adv)
    if not isinstance(horizon, int) or horizon < 0:
        raise ValueError(f"horizon must be a non-negative Python int (static), got {horizon!r}")
    dtype = compute_dtype(deltas, outcome_adv)
    num_slots = deltas.shape[1]
    turn = jnp.arange(num_slots, dtype=jnp.int32)
    real = turn[None, :] < num_turns[:, None]
    deltas = jnp.where(real, deltas.astype(dtype), 0.0)
    if horizon == 0:
        window_average = jnp.zeros_like(deltas)
        reaches_end = turn[None, :] == num_turns[:, None] - 1
    else:
        weights = discount_matrix(num_slots, gamma, dtype, horizon=horizon)
        numerator = jnp.einsum("ku,nu->nk", weights, deltas)
        denominator = jnp.einsum("ku,nu->nk", weights, real.astype(dtype))
        window_average = numerator / jnp.where(real, denominator, 1.0)
        reaches_end = turn[None, :] + horizon - 1 >= num_turns[:, None] - 1
    steps_to_end = (num_turns[:, None] - turn[None, :]).astype(dtype)
    fill = terminal_fill * jnp.power(jnp.asarray(gamma, dtype), jnp.maximum(steps_to_end, 0.0))
    credit = window_average + jnp.where(reaches_end, fill * outcome_adv.astype(dtype)[:, None], 0.0)
    return jnp.where(real, credit, 0.0)


def trace_turn_credit(answer_scores, num_turns, outcome_adv, *, form: str = "log_ratio", eps: float = 0.1,
                      horizon: int = 3, gamma: float = 0.8, terminal_fill: float = 2.0,
                      min_score: float | None = None):
    """TRACE turn credit: `lookahead_credit(td_deltas(answer_scores, ...), ...)`.

    Args:
      answer_scores: `[N, T+1]` gold-answer scores per state.
      num_turns: `[N]` int in `[0, T]`.
      outcome_adv: `[N]` outcome advantages.
      form, eps, min_score: see `td_deltas`; horizon, gamma, terminal_fill: see `lookahead_credit`.

    Returns:
      `r [N, T]` float32 turn credit, 0 beyond each trajectory's turns.
    """
    deltas = td_deltas(answer_scores, num_turns, form=form, eps=eps, min_score=min_score)
    return lookahead_credit(deltas, num_turns, outcome_adv, horizon=horizon, gamma=gamma,
                            terminal_fill=terminal_fill)
