"""ABC as the trainer uses it (credit-spec section 3): the answer turn is part of the last step, and ABC-SFT trains
only on trajectories whose answer is verified correct."""

import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import credit
from trace_jax.abc import StepCounts, counts_to_arrays


def _arrays(per_trajectory):
    arrays = counts_to_arrays([[StepCounts(*c) for c in row] for row in per_trajectory], num_steps_max=4)
    return [jnp.asarray(arrays[k]) for k in ("n_found", "n_excluded", "n_rejected", "ans")], \
        jnp.asarray(arrays["num_steps"])


# (n_found, n_excluded, n_rejected, ans) per generated turn, as a scorer returns them, and T_g (tool calls)
SEARCH, OPEN_CLUE, OPEN_EXCLUDE = (0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0)
CASES = [
    ([SEARCH, OPEN_CLUE, (0, 0, 0, 1)], 2),          # finds the clue, answers right
    ([SEARCH, OPEN_CLUE, (0, 0, 1, -1)], 2),         # reads the answer, answers something else
    ([SEARCH, OPEN_EXCLUDE], 2),                     # cut off after two calls: no answer turn
    ([(0, 0, 0, -1)], 0),                            # answers at once: the answer is the only step
]


def test_the_answer_turn_is_part_of_the_last_tool_step_by_default():
    counts, num_steps = _arrays([c for c, _ in CASES])
    num_turns = jnp.asarray([t for _, t in CASES])
    *folded, folded_steps = credit.fold_answer_steps(*counts, num_steps, num_turns)
    rewards = np.asarray(credit.abc_step_rewards(*folded))
    assert np.asarray(folded_steps).tolist() == [2, 2, 2, 1]
    # r = clip(1 + 0.8 found + 0.4 excluded - 0.8 rejected + ans, 0, 2) of each *folded* step
    np.testing.assert_allclose(rewards[0, :2], [1.0, 2.0])      # open + right answer: 1 + 0.8 + 1 -> 2
    np.testing.assert_allclose(rewards[1, :2], [1.0, 0.0])      # open + rejected + wrong: 1 + 0.8 - 0.8 - 1 = 0
    np.testing.assert_allclose(rewards[2, :2], [1.0, 1.4])      # unchanged: no answer turn to fold
    np.testing.assert_allclose(rewards[3, :1], [0.0])           # unchanged: T = 0
    for array in folded:  # nothing is left past a row's last step
        assert np.all(np.asarray(array)[np.arange(4)[None, :] >= np.asarray(folded_steps)[:, None]] == 0)


def test_separate_answer_steps_keep_one_step_per_generated_turn():
    counts, num_steps = _arrays([CASES[0][0]])
    rewards = np.asarray(credit.abc_step_rewards(*counts))
    np.testing.assert_allclose(rewards[0, :3], [1.0, 1.8, 2.0])
    assert int(num_steps[0]) == 3


def test_answer_tokens_get_the_last_steps_value_when_folded():
    # tokens: prompt, turn 0 (2 tokens), obs, turn 1 (2 tokens), obs, answer turn 2 (2 tokens)
    turn_index = jnp.asarray([[-1, 0, 0, -1, 1, 1, -1, 2, 2]])
    loss_mask = (turn_index >= 0).astype(jnp.int32)
    values = jnp.asarray([[0.5, 1.5, 9.0]])
    folded = np.asarray(credit.step_values_to_tokens(values, turn_index, loss_mask, jnp.asarray([2])))
    separate = np.asarray(credit.step_values_to_tokens(values, turn_index, loss_mask, jnp.asarray([3])))
    np.testing.assert_allclose(folded[0], [0, 0.5, 0.5, 0, 1.5, 1.5, 0, 1.5, 1.5])
    np.testing.assert_allclose(separate[0], [0, 0.5, 0.5, 0, 1.5, 1.5, 0, 9.0, 9.0])


def _sft_inputs(correct):
    turn_index = jnp.asarray([[-1, 0, 0, -1, 1, 1]] * len(correct))
    return credit.CreditInputs(
        rewards=jnp.asarray(np.asarray(correct, np.float32)), group_id=jnp.zeros(len(correct), jnp.int32),
        loss_mask=(turn_index >= 0).astype(jnp.float32), turn_index=turn_index,
        num_turns=jnp.ones(len(correct), jnp.int32), step_rewards=jnp.full((len(correct), 2), 1.4),
        num_steps=jnp.ones(len(correct), jnp.int32), correct=jnp.asarray(correct))


def test_abc_sft_online_drops_incorrect_trajectories_by_default():
    result = credit.compute_advantages("abc_sft_online", _sft_inputs([True, False, True]))
    np.testing.assert_array_equal(np.asarray(result.row_mask), [1.0, 0.0, 1.0])
    tokens = np.asarray(result.token_advantages)
    np.testing.assert_allclose(tokens[1], 0.0)
    np.testing.assert_allclose(tokens[0][tokens[0] != 0], 2 / (1 + np.exp(-2 * 0.4)), rtol=1e-6)  # w(1.4)


def test_abc_sft_online_admits_every_trajectory_with_the_flag():
    config = credit.CreditConfig(estimator="abc_sft_online", abc_sft_correct_only=False)
    result = credit.compute_advantages(config, _sft_inputs([True, False, True]))
    np.testing.assert_array_equal(np.asarray(result.row_mask), [1.0, 1.0, 1.0])
    trained = np.asarray(_sft_inputs([True]).loss_mask)[0] > 0
    assert np.all(np.asarray(result.token_advantages)[1][trained] > 0)


def test_abc_sft_online_without_the_correctness_flags_is_named():
    inputs = _sft_inputs([True])._replace(correct=None)
    with pytest.raises(ValueError, match="CreditInputs.correct"):
        credit.validate_credit_inputs("abc_sft_online", inputs)


def test_the_old_name_abc_sft_is_an_error_that_says_the_new_name():
    with pytest.raises(ValueError, match="CreditConfig.estimator: 'abc_sft' was renamed 'abc_sft_online'"):
        credit.CreditConfig(estimator="abc_sft")
    with pytest.raises(ValueError, match="renamed 'abc_sft_online'.*WarmStartConfig.weighting = 'abc'"):
        credit.compute_advantages("abc_sft", _sft_inputs([True]))


@pytest.mark.parametrize("field, value", [("abc_answer_step", "merge"), ("abc_sft_correct_only", 1),
                                          ("gigpo_anchor", "state")])
def test_new_credit_options_reject_illegal_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"CreditConfig.{field}"):
        credit.CreditConfig(**{field: value})
