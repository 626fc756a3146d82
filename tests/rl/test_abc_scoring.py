"""ABC step scoring of the RL step (`trace_jax.rl.abc_scoring`): the scorer options `no_answer` and `error_step`
reach both scorers, and in a group where every episode fails, running to the turn cap no longer earns more summed
ABC-GRPO advantage than answering wrongly (issue 46; credit-spec section 3, "Episodes that end without an answer").

Episodes are `EpisodeRecord`s written by hand (what `run_episodes` records): a cap episode makes `T` tool calls and
its last generated turn is one more tool call that the rollout stopped (no observation); a wrong one makes `T` calls
and answers wrongly. Advantages come from the real ABC-GRPO credit (`grouped_abc_grpo_advantages`).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import credit
from trace_jax.abc.judge import scripted_rubric_reply
from trace_jax.envs.tasks import Clue
from trace_jax.rl.abc_scoring import ABCScorerConfig, ABCStepScoring, step_rewards_from_counts
from trace_jax.rollout.batch import EpisodeRecord
from trace_jax.serve import ScriptedBackend, ServeConfig, ServerThread, create_app

CLUES = (Clue("person-1", "Halbo Selni", "born_in", "Kaol"),)
SEARCH = ("search", {"query": "Halbo Selni"})
RESULTS = ("[0] Search results for `Halbo Selni`\n**viewing lines [0 - 0] of 1**\n\n"
           "L0: 【0†Halbo Selni†wiki.local】")
ERROR = "Error: Cursor `5` is out of range. Available cursor indices: [0 - 4]."
CALL = '<tool_call>{"name": "search", "arguments": {"query": "Halbo Selni"}}</tool_call>'


def _episode(observations, final_text):
    return EpisodeRecord(task_id="t", question="Where was Halbo Selni born?", gold=("Kaol",), clues=CLUES,
                         turn_texts=[CALL] * len(observations) + [final_text],
                         tool_calls=[SEARCH] * len(observations), observations=list(observations))


def cap_episode(num_calls, errors=0):
    """`num_calls` tool calls (the last `errors` of them failed), then a tool call the turn cap cut off."""
    return _episode([RESULTS] * (num_calls - errors) + [ERROR] * errors, CALL)


def wrong_episode(num_calls):
    return _episode([RESULTS] * num_calls, "It is Selru.\n<answer>Selru</answer>")


def summed_advantages(episodes, config):
    counts, _ = ABCStepScoring(config).score(episodes)
    rewards, num_steps = step_rewards_from_counts(counts, [len(e.observations) for e in episodes])
    advantages = credit.grouped_abc_grpo_advantages(jnp.asarray(rewards), jnp.asarray(num_steps),
                                                    jnp.zeros(len(episodes), jnp.int32), 1)
    return np.asarray(advantages, np.float64).sum(axis=1)


@pytest.mark.parametrize("num_calls", [2, 4, 8])
def test_in_an_all_failure_group_running_to_the_cap_earns_no_more_than_answering_wrong(num_calls):
    group = [cap_episode(num_calls)] * 4 + [wrong_episode(num_calls)] * 4
    summed = summed_advantages(group, ABCScorerConfig())
    assert summed[0] <= summed[-1] + 1e-6


def test_with_no_answer_zero_running_to_the_cap_earns_more_than_answering_wrong():
    # the behaviour issue 46 reports: the neutral reading pays the policy for never answering
    group = [cap_episode(4)] * 4 + [wrong_episode(4)] * 4
    summed = summed_advantages(group, ABCScorerConfig(no_answer=0))
    assert summed[0] > 0.5 and summed[-1] < -0.5


def test_in_an_all_failure_group_failed_tool_calls_cost_a_cap_episode_advantage():
    group = [cap_episode(8, errors=3)] * 4 + [wrong_episode(4)] * 4
    floor = summed_advantages(group, ABCScorerConfig())
    neutral = summed_advantages(group, ABCScorerConfig(error_step="neutral"))
    assert floor[0] < floor[-1] and floor[0] < neutral[0]


def test_step_rewards_of_a_cap_episode_follow_both_options():
    episode = cap_episode(3, errors=1)
    expected = {(-1, 0): [1.0, 1.0, 0.0], (0, 0): [1.0, 1.0, 0.0], (-1, "neutral"): [1.0, 1.0, 0.0],
                (0, "neutral"): [1.0, 1.0, 1.0]}
    for (no_answer, error_step), rewards in expected.items():
        counts, _ = ABCStepScoring(ABCScorerConfig(no_answer=no_answer, error_step=error_step)).score([episode])
        got, num_steps = step_rewards_from_counts(counts, [3])
        assert int(num_steps[0]) == 3
        np.testing.assert_allclose(got[0, :3], rewards, err_msg=f"no_answer={no_answer}, error_step={error_step}")


@pytest.fixture(scope="module")
def judge_url():
    with ServerThread(create_app(ScriptedBackend(scripted_rubric_reply, name="rubric-judge"), ServeConfig())) as s:
        yield s.url + "/v1"


@pytest.mark.parametrize("no_answer, error_step", [(-1, 0), (0, "neutral")])
def test_the_judge_scorer_gets_the_options_from_the_scorer_config(judge_url, no_answer, error_step):
    config = ABCScorerConfig(scorer="judge", judge_url=judge_url, judge_model="rubric-judge", recover_clues=False,
                             no_answer=no_answer, error_step=error_step, backoff_s=0.0)
    scoring = ABCStepScoring(config)
    try:
        (counts,), _ = scoring.score([cap_episode(2, errors=1)])
    finally:
        scoring.close()
    assert [c.ans for c in counts] == [0, 0, no_answer]
    assert [c.tool_error for c in counts] == [False, error_step == 0, False]


def test_the_scorer_config_names_a_bad_option():
    with pytest.raises(ValueError, match="ABCScorerConfig.error_step"):
        ABCScorerConfig(error_step="skip")
