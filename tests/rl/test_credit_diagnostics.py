"""Credit diagnostics (trace_jax/rl/credit_diagnostics.py) against hand-computed examples."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.credit import CreditInputs, compute_advantages
from trace_jax.envs.tasks import Clue
from trace_jax.rollout.batch import EpisodeRecord
from trace_jax.rl.credit_diagnostics import (
    credit_diagnostics,
    path_marks,
    spearman,
    turn_credit,
    zero_signal_taught,
)

CHAIN = (Clue("company-1", "Tuda Trading", "headquartered_in", "Kirda"),
         Clue("city-1", "Kirda", "population", "2871935"))
SEARCH_RESULTS = "[0] Search results for `{q}`\n**viewing lines [0 - 0] of 1**\n\nL0: 【0†{q}†wiki.local】"
PAGE = "[{i}] {title} (https://wiki.local/{slug})\n**viewing lines [0 - 0] of 1**\n\nL0: {text}"


def _episode(clues=CHAIN) -> EpisodeRecord:
    """search on the chain, a wrong page, the chain's first page (reveals Kirda), an off-chain search, a call that
    did not parse, then the answer."""
    calls = [("search", {"query": "Tuda Trading"}), ("open", {"id": 6}), ("open", {"id": 0, "cursor": 0}),
             ("search", {"query": "weather report"}), "Error: no <tool_call> in the reply"]
    observations = [SEARCH_RESULTS.format(q="Tuda Trading"),
                    PAGE.format(i=1, title="Kirta Rubo", slug="Kirta_Rubo", text="Kirta Rubo was born in Veta."),
                    PAGE.format(i=2, title="Tuda Trading", slug="Tuda_Trading",
                                text="Tuda Trading is based in the city of Kirda."),
                    SEARCH_RESULTS.format(q="weather report"), "Error: no <tool_call> in the reply"]
    return EpisodeRecord(task_id="t", question="q?", gold=("Kirda",), status="answered", answer="Kirda",
                         turn_texts=["s", "o", "o", "s", "x", "<answer>Kirda</answer>"], tool_calls=calls,
                         observations=observations, clues=clues)


# one row: turns 0-4 get two trained tokens each, the answer turn (5) one; prompt and observation tokens untrained
TURN_INDEX = np.array([[-1, 0, 0, -1, 1, 1, -1, 2, 2, -1, 3, 3, -1, 4, 4, -1, 5]])
ADVANTAGES = np.array([[0, 1.0, 1.0, 0, 0.2, 0.4, 0, 2.0, 2.0, 0, -1.0, -1.0, 0, 0.5, 0.5, 0, 9.0]])
LOSS_MASK = (TURN_INDEX >= 0).astype(np.float32)


def test_searches_naming_the_chain_and_pages_of_the_chain_are_on_the_path_everything_else_is_a_detour():
    on_path, _ = path_marks(_episode())
    assert on_path.tolist() == [True, False, True, False, False]


def test_progress_gain_is_the_share_of_the_chain_a_turn_reveals_first():
    _, gain = path_marks(_episode())
    assert gain.tolist() == [0.0, 0.0, 0.5, 0.0, 0.0]


def test_a_task_without_a_chain_of_entities_is_not_judged():
    assert path_marks(_episode(clues=())) is None
    assert path_marks(_episode(clues=(Clue("doc-1", "", "gold_doc", ""),))) is None


def test_turn_credit_is_the_mean_advantage_over_the_turns_trained_tokens():
    credit = turn_credit(ADVANTAGES, LOSS_MASK, TURN_INDEX, 7)
    np.testing.assert_allclose(credit[0, :6], [1.0, 0.3, 2.0, -1.0, 0.5, 9.0])
    assert math.isnan(credit[0, 6])  # a turn without trained tokens


def test_spearman_uses_average_ranks_for_ties():
    # ranks of x: [1.5, 1.5, 4, 1.5, 1.5]; of y: [3, 1, 4, 0, 2]; covariance 5, variances 5 and 10
    assert spearman([0, 0, 0.5, 0, 0], [1.0, 0.3, 2.0, -1.0, 0.5]) == pytest.approx(5 / math.sqrt(50))
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)


def test_spearman_of_a_constant_or_single_sample_is_nan():
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    assert math.isnan(spearman([1], [2]))


def test_zero_signal_taught_counts_groups_with_equal_rewards_and_a_nonzero_trained_advantage():
    rewards = np.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # groups [1, 1] (flat), [0, 1], [0, 0] (flat)
    advantages = np.zeros((6, 3))
    mask = np.ones((6, 3))
    advantages[0, 2], mask[0, 2] = 0.7, 0.0  # flat group 0: a non-zero advantage on an untrained token only
    advantages[5, 1] = -0.1                  # flat group 2: taught
    advantages[2, 0] = 1.0                   # group 1 has signal: not counted
    assert zero_signal_taught(rewards, advantages, mask, 3, 1e-6) == (pytest.approx(2 / 3), 0.5)
    assert math.isnan(zero_signal_taught(np.array([0.0, 1.0]), np.ones((2, 1)), np.ones((2, 1)), 1, 1e-6)[1])


@pytest.mark.parametrize("estimator, taught", [("grpo", 0.0), ("trace", 1.0)])
def test_trace_still_teaches_a_flat_group_where_grpo_gives_nothing(estimator, taught):
    inputs = CreditInputs(rewards=jnp.array([0.0, 0.0]), group_id=jnp.array([0, 0]),
                          loss_mask=jnp.array([[1, 1, 0, 1], [1, 1, 0, 1]]),
                          turn_index=jnp.array([[0, 0, -1, 1], [0, 0, -1, 1]]), num_turns=jnp.array([1, 1]),
                          answer_scores=jnp.array([[-3.0, -0.5], [-3.0, -2.9]]))
    result = compute_advantages(estimator, inputs)
    zero, share = zero_signal_taught(np.zeros(2), np.asarray(result.token_advantages), np.asarray(inputs.loss_mask),
                                     1, 1e-6)
    assert (zero, share) == (1.0, taught)


def test_step_diagnostics_average_credit_over_detour_and_on_path_turns():
    episodes = [_episode(), _episode(clues=())]  # the second row's task has no chain: not judged
    advantages = np.concatenate([ADVANTAGES, np.full_like(ADVANTAGES, 5.0)])
    out = credit_diagnostics(episodes, advantages, np.concatenate([LOSS_MASK] * 2),
                             np.concatenate([TURN_INDEX] * 2), np.array([1.0, 0.0]), num_prompts=1,
                             num_turns_max=6, std_eps=1e-6)
    assert out["credit/on_path_turn_credit"] == pytest.approx((1.0 + 2.0) / 2)
    assert out["credit/detour_turn_credit"] == pytest.approx((0.3 - 1.0 + 0.5) / 3)
    assert out["credit/detour_turn_share"] == pytest.approx(3 / 5)
    assert out["credit/progress_spearman"] == pytest.approx(5 / math.sqrt(50))
    # no flat group in this step: the share of flat groups taught is undefined, so it is not logged
    assert out["zero_signal_groups"] == 0.0 and "zero_signal_groups_with_turn_credit" not in out
