"""Every test vector printed in shared/docs/credit-spec.md, reproduced exactly (4 decimals)."""

import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import credit

TRACE_VECTORS = [
    # scores l, A_out, delta, r, turn-token advantage
    ([-3.0, -1.0, -0.5], 1.0, [1.0361, 0.6061], [2.1250, 2.2061], [1.4250, 1.4412]),
    ([-3.0, -2.5, -2.0], -1.0, [0.1759, 0.2136], [-1.0874, -1.3864], [-1.2175, -1.2773]),
    ([-5, -5, -1, -1.2, -0.2], 0.5, [0, 1.5339, -0.1671, 1.4663], [0.4591, 1.4705, 1.1989, 2.2663],
     [0.5918, 0.7941, 0.7398, 0.9533]),
]


def test_outcome_advantage_check_vector():
    adv = credit.outcome_advantages(jnp.array([1, 0, 0, 0, 1, 0, 0, 0], jnp.float32))
    np.testing.assert_allclose(adv, [1.7321, -0.5774, -0.5774, -0.5774, 1.7321, -0.5774, -0.5774, -0.5774],
                               atol=1e-4)


@pytest.mark.parametrize("scores, a_out, delta, r, token_adv", TRACE_VECTORS)
def test_trace_vectors(scores, a_out, delta, r, token_adv):
    answer_scores = jnp.array([scores], jnp.float32)
    num_turns = jnp.array([len(scores) - 1])
    outcome = jnp.array([a_out], jnp.float32)
    deltas = credit.td_deltas(answer_scores, num_turns)
    np.testing.assert_allclose(deltas[0], delta, atol=1e-4)
    turn_credit = credit.lookahead_credit(deltas, num_turns, outcome)
    np.testing.assert_allclose(turn_credit[0], r, atol=1e-4)
    np.testing.assert_allclose(credit.trace_turn_credit(answer_scores, num_turns, outcome)[0], r, atol=1e-4)
    # one token per tool-call turn, then two answer tokens and an observation token
    t = len(scores) - 1
    turn_index = jnp.array([list(range(t)) + [t, t, -1]])
    loss_mask = jnp.array([[1] * t + [1, 1, 0]])
    tokens = credit.token_advantages(turn_index, loss_mask, turn_credit, outcome, num_turns)
    np.testing.assert_allclose(tokens[0, :t], token_adv, atol=1e-4)
    np.testing.assert_allclose(tokens[0, t:], [a_out, a_out, 0.0], atol=1e-6)


def test_small_eps_check_values():
    scores = jnp.array([[-5.1187, -1.5712], [-10.6570, -7.1061]], jnp.float32)
    deltas = credit.td_deltas(scores, jnp.array([1, 1]), eps=0.001)
    np.testing.assert_allclose(deltas[:, 0], [1.1806, 0.4052], atol=1e-4)


def test_abc_sft_weight_checks():
    weights = credit.abc_sft_weights(jnp.array([0.0, 0.6, 1.0, 1.4, 2.0]))
    np.testing.assert_allclose(weights, [0.2384, 0.6201, 1.0, 1.3799, 1.7616], atol=1e-4)


def test_abc_grpo_joint_check_vector():
    adv = credit.abc_grpo_advantages(jnp.array([[1.8, 1.0, 2.0], [1.0, 0.2, 0.0]]), jnp.array([3, 3]))
    np.testing.assert_allclose(adv, [[1.1665, 0.3381, 1.3525], [-0.355, -1.4201, -1.3525]], atol=1e-4)


def test_abc_step_reward_formula_and_clip():
    rewards = credit.abc_step_rewards(jnp.array([0, 1, 3, 0, 0]), jnp.array([0, 0, 0, 1, 0]),
                                      jnp.array([0, 0, 0, 0, 2]), jnp.array([0, 0, 1, -1, 0]))
    np.testing.assert_allclose(rewards, [1.0, 1.8, 2.0, 0.4, 0.0], atol=1e-6)
