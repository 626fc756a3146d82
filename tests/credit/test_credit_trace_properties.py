"""TRACE invariants from credit-spec.md as property tests, plus agreement with the float64 numpy loop reference.

Shapes are fixed (N=6 trajectories in 2 groups of 3, up to T=6 turns) so each jitted function compiles once;
hypothesis varies the values, the turn counts and the options.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trace_jax import credit
from trace_jax.credit import reference as ref

N, T, GROUP = 6, 6, 3

scores_st = hnp.arrays(np.float32, (N, T + 1), elements=st.floats(-20.0, 0.0, width=32))
turns_st = hnp.arrays(np.int32, (N,), elements=st.integers(0, T))
rewards_st = hnp.arrays(np.float32, (N,), elements=st.sampled_from([0.0, 1.0, 0.5]))
forms = st.sampled_from(credit.trace.FORMS)


def _outcome(rewards):
    return credit.outcome_advantages(jnp.asarray(rewards).reshape(-1, GROUP)).reshape(-1)


@functools.partial(jax.jit, static_argnames=("form", "horizon"))
def _credit(scores, turns, outcome, form="log_ratio", horizon=3, gamma=0.8, terminal_fill=2.0):
    return credit.trace_turn_credit(scores, turns, outcome, form=form, horizon=horizon, gamma=gamma,
                                    terminal_fill=terminal_fill)


@given(scores_st, turns_st, rewards_st, forms, st.integers(0, 5), st.sampled_from([0.5, 0.8, 1.0]))
def test_matches_numpy_loop_reference(scores, turns, rewards, form, horizon, gamma):
    got = _credit(scores, turns, _outcome(rewards), form=form, horizon=horizon, gamma=gamma)
    want = ref.trace_batch_ref(scores, turns, rewards, GROUP, form=form, horizon=horizon, gamma=gamma)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@given(scores_st, turns_st)
def test_values_start_at_zero_and_vanish_past_the_end(scores, turns):
    values = np.asarray(jax.jit(credit.trace_values)(scores, turns))
    np.testing.assert_array_equal(values[:, 0], 0.0)
    for i in range(N):
        np.testing.assert_array_equal(values[i, turns[i] + 1:], 0.0)
        np.testing.assert_allclose(values[i, : turns[i] + 1], ref.trace_values_ref(scores[i], turns[i]), atol=2e-5)


@given(scores_st, turns_st)
def test_log_ratio_deltas_telescope_to_final_value(scores, turns):
    deltas = np.asarray(credit.td_deltas(scores, turns), np.float64)
    values = np.asarray(credit.trace_values(scores, turns), np.float64)
    final = values[np.arange(N), turns]
    np.testing.assert_allclose(deltas.sum(axis=1), final, atol=1e-4)


@given(scores_st, turns_st, forms)
def test_delta_sign_follows_score_change(scores, turns, form):
    deltas = np.asarray(credit.td_deltas(scores, turns, form=form))
    change = scores[:, 1:].astype(np.float64) - scores[:, :-1]
    real = np.arange(T)[None, :] < turns[:, None]
    clear = real & (np.abs(change) > 1e-4)
    np.testing.assert_array_equal(np.sign(deltas[clear]), np.sign(change[clear]))


@given(scores_st, turns_st, rewards_st)
def test_horizon_one_without_terminal_fill_is_plain_delta(scores, turns, rewards):
    got = _credit(scores, turns, _outcome(rewards), horizon=1, terminal_fill=0.0)
    np.testing.assert_allclose(got, credit.td_deltas(scores, turns), atol=1e-6)


@given(scores_st, turns_st, rewards_st, st.integers(0, 4))
def test_padding_beyond_num_turns_changes_nothing(scores, turns, rewards, horizon):
    outcome = _outcome(rewards)
    base = _credit(scores, turns, outcome, horizon=horizon)
    garbage = scores.copy()
    state = np.arange(T + 1)[None, :]
    garbage[state > turns[:, None]] = np.nan
    np.testing.assert_array_equal(_credit(garbage, turns, outcome, horizon=horizon), base)
    # more padded slots: same credit on the original slots, zeros on the new ones
    wider = np.concatenate([scores, np.full((N, 3), -7.0, np.float32)], axis=1)
    widened = credit.trace_turn_credit(wider, turns, outcome, horizon=horizon)
    np.testing.assert_allclose(widened[:, :T], base, atol=1e-6)
    np.testing.assert_array_equal(widened[:, T:], 0.0)


@given(scores_st, turns_st, rewards_st, st.permutations(range(N)))
def test_permuting_trajectories_permutes_results(scores, turns, rewards, order):
    order = np.asarray(order)
    group_id = np.repeat(np.arange(N // GROUP), GROUP)
    outcome = credit.grouped_outcome_advantages(jnp.asarray(rewards), jnp.asarray(group_id), N // GROUP)
    permuted_outcome = credit.grouped_outcome_advantages(jnp.asarray(rewards[order]), jnp.asarray(group_id[order]),
                                                         N // GROUP)
    np.testing.assert_allclose(permuted_outcome, np.asarray(outcome)[order], atol=1e-6)
    base = _credit(scores, turns, outcome)
    permuted = _credit(scores[order], turns[order], permuted_outcome)
    np.testing.assert_allclose(permuted, np.asarray(base)[order], atol=1e-6)


@given(scores_st, turns_st, rewards_st)
def test_jit_equals_eager(scores, turns, rewards):
    outcome = _outcome(rewards)
    eager = credit.trace_turn_credit(jnp.asarray(scores), jnp.asarray(turns), outcome)
    np.testing.assert_allclose(_credit(scores, turns, outcome), eager, atol=1e-6)


def test_vmap_over_an_extra_batch_axis():
    rng = np.random.default_rng(3)
    scores = -rng.exponential(3.0, size=(4, N, T + 1)).astype(np.float32)
    turns = rng.integers(0, T + 1, size=(4, N)).astype(np.int32)
    outcome = rng.normal(size=(4, N)).astype(np.float32)
    batched = jax.vmap(credit.trace_turn_credit)(scores, turns, outcome)
    for b in range(4):
        np.testing.assert_allclose(batched[b], credit.trace_turn_credit(scores[b], turns[b], outcome[b]), atol=1e-6)


def test_bfloat16_inputs_compute_in_float32():
    rng = np.random.default_rng(4)
    scores = jnp.asarray(-rng.exponential(3.0, size=(N, T + 1)), jnp.bfloat16)
    turns = jnp.asarray(rng.integers(0, T + 1, size=N), jnp.int32)
    outcome = jnp.asarray(rng.normal(size=N), jnp.bfloat16)
    got = credit.trace_turn_credit(scores, turns, outcome)
    assert got.dtype == jnp.float32
    want = credit.trace_turn_credit(scores.astype(jnp.float32), turns, outcome.astype(jnp.float32))
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_impossible_answer_scores_give_finite_credit():
    scores = jnp.array([[-jnp.inf, -2.0, -jnp.inf, -0.1], [-jnp.inf, -jnp.inf, -jnp.inf, -jnp.inf]])
    turns = jnp.array([3, 3])
    values = credit.trace_values(scores, turns)
    turn_credit = credit.trace_turn_credit(scores, turns, jnp.array([1.0, -1.0]))
    assert np.isfinite(values).all() and np.isfinite(turn_credit).all()
    deltas = credit.td_deltas(scores, turns)
    assert 8.0 < deltas[0, 0] < 9.0  # impossible -> likely: log(1e4 / 2.1), large but bounded
    np.testing.assert_allclose(deltas[0, 1], -deltas[0, 0], rtol=1e-6)  # and back
    np.testing.assert_array_equal(values[1], 0.0)  # never possible: no progress


def test_rounding_noise_above_zero_is_clamped():
    values = credit.trace_values(jnp.array([[-1.0, 1e-7, 0.0]]), jnp.array([2]))
    np.testing.assert_allclose(values[0, 1], values[0, 2])


def test_horizon_must_be_static_non_negative_int():
    with pytest.raises(ValueError, match="horizon"):
        credit.lookahead_credit(jnp.zeros((1, 2)), jnp.array([2]), jnp.zeros(1), horizon=-1)


def test_unknown_form_raises():
    with pytest.raises(ValueError, match="form='log'"):
        credit.td_deltas(jnp.zeros((1, 2)), jnp.array([1]), form="log")


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="disagree on N"):
        credit.td_deltas(jnp.zeros((2, 3)), jnp.array([1, 1, 1]))
    with pytest.raises(ValueError, match="integer"):
        credit.trace_values(jnp.zeros((2, 3)), jnp.array([1.0, 1.0]))
