"""The LLM judge, served the scripted rubric judge, agrees with the rule-based scorer on hand-made trajectories.

The two share no code: the judge gets the rubric as a prompt and the case as JSON, the scripted judge applies the
rubric to the clue chain in that JSON, and `RuleBasedStepScorer` counts from the observations directly.
"""

import pytest

from judge_cases import CLUES, GOLD, QUESTION, as_tuples, trajectories
from trace_jax.abc.judge import JudgeConfig, LLMJudgeStepScorer, scripted_rubric_reply
from trace_jax.serve import ScriptedBackend, ServeConfig, ServerThread, create_app
from trace_jax.serve.client import EndpointConfig


@pytest.fixture(scope="module")
def judge():
    backend = ScriptedBackend(scripted_rubric_reply, name="rubric-judge")
    with ServerThread(create_app(backend, ServeConfig())) as server:
        yield LLMJudgeStepScorer(JudgeConfig(endpoint=EndpointConfig(base_url=server.url + "/v1",
                                                                     model="rubric-judge", timeout_s=10)))


@pytest.mark.parametrize("name", ["correct", "rejected", "cut_off", "guess"])
def test_judge_scores_equal_the_rule_based_scorers(judge, name):
    from trace_jax.abc.rules import RuleBasedStepScorer  # here, so the rest of the suite runs without it

    _, steps, expected = next(t for t in trajectories() if t[0] == name)
    by_judge = judge.score(question=QUESTION, gold=GOLD, clues=CLUES, steps=steps)
    by_rules = RuleBasedStepScorer().score(question=QUESTION, gold=GOLD, clues=CLUES, steps=steps)
    assert as_tuples(by_judge) == as_tuples(by_rules) == expected
