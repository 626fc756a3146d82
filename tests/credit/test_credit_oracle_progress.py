"""`oracle_progress`: GRPO + alpha_turn * the oracle's progress gain, mixed and broadcast as TRACE mixes r_k."""

import jax.numpy as jnp
import numpy as np
import pytest

from tests.credit.test_credit_tokens_and_registry import random_batch
from trace_jax import credit

# Two trajectories of one group (rewards 1, 0: A_out = +1, -1) with 2 and 1 tool calls. Token layout per row:
# prompt (-1), turn 0 (two tokens), observation (-1), turn 1 ..., the answer turn (turn T).
TURN_INDEX = jnp.array([[-1, 0, 0, -1, 1, -1, 2, 2],
                        [-1, 0, -1, 1, 1, -1, -1, -1]], jnp.int32)
LOSS_MASK = (TURN_INDEX >= 0).astype(jnp.int32)
NUM_TURNS = jnp.array([2, 1], jnp.int32)
GAINS = jnp.array([[0.5, 0.25, 0.9],   # the third entry is padding (row 0 has 2 tool turns)
                   [0.0, 0.7, 0.3]], jnp.float32)  # row 1: turn 1 is its answer turn, gains 0.7 / 0.3 are padding


def _inputs(gains=GAINS):
    return credit.CreditInputs(rewards=jnp.array([1.0, 0.0]), group_id=jnp.array([0, 0], jnp.int32),
                               loss_mask=LOSS_MASK, turn_index=TURN_INDEX, num_turns=NUM_TURNS, progress_gains=gains)


def test_oracle_progress_token_advantages_on_a_hand_example():
    result = credit.compute_advantages("oracle_progress", _inputs(), check=True, alpha_turn=0.2)
    # row 0: A_out = +1; turn 0 tokens 1 + 0.2 * 0.5 = 1.1, turn 1 token 1 + 0.2 * 0.25 = 1.05, answer tokens 1
    # row 1: A_out = -1; turn 0 token -1 + 0.2 * 0 = -1, answer turn (k = 1 = T) tokens -1 (its gain is padding)
    want = np.array([[0, 1.1, 1.1, 0, 1.05, 0, 1.0, 1.0],
                     [0, -1.0, 0, -1.0, -1.0, 0, 0, 0]])
    np.testing.assert_allclose(np.asarray(result.token_advantages), want, atol=1e-6)
    np.testing.assert_allclose(np.asarray(result.outcome_advantages), [1.0, -1.0], atol=1e-6)
    np.testing.assert_allclose(np.asarray(result.per_turn), [[0.5, 0.25, 0.0], [0.0, 0.0, 0.0]], atol=1e-7)


def test_oracle_progress_with_alpha_turn_zero_is_grpo_exactly():
    inputs = random_batch(3, with_abc=True)
    got = credit.compute_advantages("oracle_progress", inputs, alpha_turn=0.0).token_advantages
    want = credit.compute_advantages("grpo", inputs).token_advantages
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_oracle_progress_mixes_exactly_as_trace_mixes_its_turn_term():
    inputs = random_batch(4, with_abc=True)
    outcome = credit.grouped_outcome_advantages(inputs.rewards, inputs.group_id, inputs.rewards.shape[0])
    gains = credit.progress_turn_credit(inputs.progress_gains, inputs.num_turns)
    want = credit.token_advantages(inputs.turn_index, inputs.loss_mask, gains, outcome, inputs.num_turns,
                                   alpha_out=0.7, alpha_turn=0.3)
    got = credit.compute_advantages("oracle_progress", inputs, alpha_out=0.7, alpha_turn=0.3).token_advantages
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_padded_turns_carry_no_progress_credit():
    padded = GAINS.at[0, 2].set(100.0).at[1, 1:].set(-50.0)
    a = credit.compute_advantages("oracle_progress", _inputs()).token_advantages
    b = credit.compute_advantages("oracle_progress", _inputs(padded)).token_advantages
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_oracle_progress_without_gains_names_the_missing_input():
    with pytest.raises(ValueError, match="progress_gains"):
        credit.compute_advantages("oracle_progress", _inputs(None), check=True)
    with pytest.raises(ValueError, match=r"progress_gains has shape \(2, 1\)"):
        credit.compute_advantages("oracle_progress", _inputs(GAINS[:, :1]), check=True)
