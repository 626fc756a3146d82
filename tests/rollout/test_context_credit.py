"""Credit of segmented episodes (context management): each episode counted once, whatever its rows.

Four episodes in two groups; episode 0 (four tool calls) is split into three segment rows. Every estimator run on
the episodes' `turn_layout` and broadcast onto the rows gives each token exactly the advantage it gets when the
episode is one row."""

import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import credit
from trace_jax.credit import CreditInputs, episode_states, segment_token_advantages, turn_layout

GROUP = np.array([0, 0, 1, 1])
REWARD = np.array([1.0, 0.0, 0.0, 1.0], np.float32)
NUM_TURNS = np.array([4, 1, 2, 0])
SLOTS = 5  # max_turns + 1
SEGMENTS = [(0, 0, 1), (0, 2, 3), (0, 4, 4), (1, 0, 1), (2, 0, 2), (3, 0, 0)]  # (episode, first turn, last turn)
ESTIMATORS = ("grpo", "gspo", "trace", "abc_grpo", "abc_sft_online", "gigpo")


def row_layout(turns):
    """Tokens of a row holding `turns`: an observation token (-1), then two generated tokens per turn."""
    turn_index = [-1]
    for k in turns:
        turn_index += [k, k, -1]
    return turn_index


def padded(rows, width=16):
    index = np.full((len(rows), width), -1, np.int32)
    for n, row in enumerate(rows):
        index[n, :len(row)] = row
    return index, (index >= 0).astype(np.float32)


def extras(rng):
    scores = np.log(rng.uniform(0.05, 0.95, (4, SLOTS))).astype(np.float32)
    steps = rng.normal(size=(4, SLOTS)).astype(np.float32)
    keys = rng.integers(0, 3, (4, SLOTS)).astype(np.int32)
    return {"answer_scores": jnp.asarray(scores), "step_rewards": jnp.asarray(steps),
            "num_steps": jnp.asarray(NUM_TURNS + 1), "anchor_keys": jnp.asarray(keys),
            "correct": jnp.asarray(REWARD > 0)}


def test_turn_layout_is_one_pseudo_token_per_turn():
    index, mask = turn_layout(jnp.asarray([2, 0]), 4)
    np.testing.assert_array_equal(index, [[0, 1, 2, -1], [0, -1, -1, -1]])
    np.testing.assert_array_equal(mask, [[1, 1, 1, 0], [1, 0, 0, 0]])


def test_episode_states_places_each_rows_states_at_the_episodes_numbers():
    row_scores = np.arange(1, 3 * SLOTS + 1, dtype=np.float32).reshape(3, SLOTS)
    out = episode_states(row_scores, np.array([0, 0, 1]), np.array([0, 2, 0]), np.array([2, 3, 1]), 2)
    np.testing.assert_array_equal(out, [[1, 2, 6, 7, 8], [11, 0, 0, 0, 0]])


@pytest.mark.parametrize("name", ESTIMATORS)
def test_segmented_episode_gets_the_advantages_of_one_row(name):
    inputs = extras(np.random.default_rng(0))
    whole_index, whole_mask = padded([row_layout(range(t + 1)) for t in NUM_TURNS])
    whole = credit.compute_advantages(name, CreditInputs(
        rewards=jnp.asarray(REWARD), group_id=jnp.asarray(GROUP), loss_mask=jnp.asarray(whole_mask),
        turn_index=jnp.asarray(whole_index), num_turns=jnp.asarray(NUM_TURNS), **inputs), num_groups=2, check=True)

    layout_index, layout_mask = turn_layout(jnp.asarray(NUM_TURNS), SLOTS)
    per_episode = credit.compute_advantages(name, CreditInputs(
        rewards=jnp.asarray(REWARD), group_id=jnp.asarray(GROUP), loss_mask=layout_mask, turn_index=layout_index,
        num_turns=jnp.asarray(NUM_TURNS), **inputs), num_groups=2, check=True)
    seg_index, seg_mask = padded([row_layout(range(first, last + 1)) for _, first, last in SEGMENTS])
    episode = np.array([e for e, _, _ in SEGMENTS])
    rows = np.asarray(segment_token_advantages(per_episode.token_advantages, episode, seg_index, seg_mask))

    expected = np.asarray(whole.token_advantages)
    for n, (e, _, _) in enumerate(SEGMENTS):
        for t in np.nonzero(seg_mask[n])[0]:
            k = seg_index[n, t]
            assert rows[n, t] == expected[e][whole_index[e] == k][0], (name, n, k)
        assert (rows[n][seg_mask[n] == 0] == 0).all()
    if whole.outcome_advantages is not None:  # one reward per episode in its group's mean and std
        np.testing.assert_array_equal(per_episode.outcome_advantages, whole.outcome_advantages)


def test_rows_as_episodes_would_count_a_split_episode_three_times():
    """The trap the episode layout avoids: z-scoring the rows weighs episode 0's reward by its three rows."""
    by_row = credit.grouped_outcome_advantages(jnp.asarray(REWARD[[0, 0, 0, 1, 2, 3]]),
                                               jnp.asarray(GROUP[[0, 0, 0, 1, 2, 3]]), 2)
    by_episode = credit.grouped_outcome_advantages(jnp.asarray(REWARD), jnp.asarray(GROUP), 2)
    assert not np.allclose(np.asarray(by_row)[[0, 3]], np.asarray(by_episode)[:2])
