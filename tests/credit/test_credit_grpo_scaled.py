"""`grpo_scaled`: GRPO's advantage scaled to TRACE's mean |A| per trained token on the same batch (the step-size
control of issue 47), against a float64 loop on random batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.credit.test_credit_tokens_and_registry import GROUP, random_batch
from trace_jax import credit
from trace_jax.credit import reference as ref


def _mixed_batch(seed):
    """A random batch whose first group surely has both outcomes (so GRPO's advantages are not all 0)."""
    inputs = random_batch(seed)
    return inputs._replace(rewards=inputs.rewards.at[0].set(1.0).at[1].set(0.0))


def _mean_abs(tokens, loss_mask):
    trained = np.asarray(loss_mask) != 0
    return float(np.abs(np.asarray(tokens, np.float64)[trained]).mean())


@settings(deadline=None, max_examples=25)
@given(st.integers(0, 10_000), st.sampled_from([0.05, 0.2, 1.0, 3.0]), st.sampled_from([0, 1, 3]))
def test_scaled_advantages_have_traces_mean_abs_advantage(seed, alpha_turn, horizon):
    inputs = _mixed_batch(seed)
    got = credit.compute_advantages("grpo_scaled", inputs, check=True, alpha_turn=alpha_turn, horizon=horizon)
    trace = credit.compute_advantages("trace", inputs, alpha_turn=alpha_turn, horizon=horizon)
    want = ref.grpo_scaled_ref(inputs.turn_index, inputs.loss_mask, inputs.answer_scores, inputs.num_turns,
                               np.asarray(inputs.rewards, np.float64), GROUP, alpha_turn=alpha_turn, horizon=horizon)
    np.testing.assert_allclose(np.asarray(got.token_advantages), want, rtol=1e-5, atol=1e-6)
    assert _mean_abs(got.token_advantages, inputs.loss_mask) == pytest.approx(
        _mean_abs(trace.token_advantages, inputs.loss_mask), rel=1e-5)


@given(st.integers(0, 10_000))
def test_scaled_advantages_keep_grpos_sign_pattern_and_ratios(seed):
    inputs = _mixed_batch(seed)
    got = np.asarray(credit.compute_advantages("grpo_scaled", inputs, alpha_turn=1.0).token_advantages, np.float64)
    grpo = np.asarray(credit.compute_advantages("grpo", inputs).token_advantages, np.float64)
    np.testing.assert_array_equal(np.sign(got), np.sign(grpo))
    nonzero = grpo != 0
    ratios = got[nonzero] / grpo[nonzero]
    np.testing.assert_allclose(ratios, ratios[0], rtol=1e-5)  # one factor for the whole batch
    assert ratios[0] > 0


def test_no_turn_credit_gives_grpo_exactly():
    for seed in range(5):
        inputs = _mixed_batch(seed)
        got = credit.compute_advantages("grpo_scaled", inputs, alpha_turn=0.0)
        grpo = credit.compute_advantages("grpo", inputs)
        np.testing.assert_array_equal(np.asarray(got.token_advantages), np.asarray(grpo.token_advantages))
        np.testing.assert_array_equal(np.asarray(got.outcome_advantages), np.asarray(grpo.outcome_advantages))


def test_turn_credit_changes_the_scale_so_the_check_can_fail():
    inputs = _mixed_batch(3)
    got = credit.compute_advantages("grpo_scaled", inputs, alpha_turn=1.0).token_advantages
    grpo = credit.compute_advantages("grpo", inputs).token_advantages
    assert not np.allclose(np.asarray(got), np.asarray(grpo))


def test_a_batch_without_outcome_signal_stays_zero():
    # every group ties: GRPO's advantages are 0, TRACE's are not (its TD of the answer scores); nothing to scale
    inputs = random_batch(4)._replace(rewards=jnp.zeros(6, jnp.float32))
    got = np.asarray(credit.compute_advantages("grpo_scaled", inputs).token_advantages)
    assert np.all(np.isfinite(got)) and np.all(got == 0.0)
    assert _mean_abs(credit.compute_advantages("trace", inputs).token_advantages, inputs.loss_mask) > 0


def test_grpo_scaled_needs_the_references_answer_scores_and_jits():
    assert credit.get_estimator("grpo_scaled").requires == ("answer_scores",)
    inputs = _mixed_batch(5)
    with pytest.raises(ValueError, match="needs CreditInputs.answer_scores"):
        credit.compute_advantages("grpo_scaled", inputs._replace(answer_scores=None), check=True)
    jitted = jax.jit(lambda x: credit.compute_advantages("grpo_scaled", x).token_advantages)(inputs)
    np.testing.assert_allclose(jitted, credit.compute_advantages("grpo_scaled", inputs).token_advantages, atol=1e-6)


def test_mean_abs_scale_of_all_zero_advantages_is_one():
    mask = jnp.ones((2, 3))
    assert float(credit.registry.mean_abs_scale(jnp.zeros((2, 3)), jnp.ones((2, 3)), mask)) == 1.0
    assert float(credit.registry.mean_abs_scale(jnp.full((2, 3), 2.0), jnp.full((2, 3), -3.0), mask)) == 1.5
