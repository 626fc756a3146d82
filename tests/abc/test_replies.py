"""The one JSON-reply parser of the judge and clue recovery (`trace_jax.abc.replies`): an object bare or in one
fenced block, prose allowed only around a fence; everything else refused with a message."""

import pytest

from trace_jax.abc.judge import MalformedJudgement, parse_counts
from trace_jax.abc.recover import parse_clue_reply
from trace_jax.abc.replies import MalformedReply, parse_json_object
from trace_jax.envs.tasks import Clue

OBJECT = {"a": 1, "b": "x"}


@pytest.mark.parametrize("text", [
    '{"a": 1, "b": "x"}',
    '  \n{"a": 1, "b": "x"}\n ',
    '```json\n{"a": 1, "b": "x"}\n```',
    '```JSON\n{"a": 1, "b": "x"}```',
    '```\n{"a": 1, "b": "x"}\n```',
    'Here is my verdict:\n```json\n{"a": 1, "b": "x"}\n```\nHope this helps.',
])
def test_an_object_bare_or_in_one_fence_is_read(text):
    assert parse_json_object(text) == OBJECT


def test_a_fence_quoted_inside_a_json_string_does_not_cut_the_block():
    text = '```json\n{"a": 1, "b": "see ```code``` here"}\n```'
    assert parse_json_object(text) == {"a": 1, "b": "see ```code``` here"}


@pytest.mark.parametrize("text, problem", [
    (None, "empty"),
    ("   ", "empty"),
    ('Sure! {"a": 1}', "not one JSON object"),
    ('{"a": 1} and that is all', "not one JSON object"),
    ('```json\n{"a": 1}', "never closes"),
    ('```python\n{"a": 1}\n```', "```python block"),
    ('```json\n{"a": 1}\n```\nor\n```json\n{"a": 2}\n```', "not one JSON object"),
    ('```json\n{"a": 1,\n```', "not one JSON object"),
    ("[1, 2]", "JSON list, not an object"),
    ("42", "JSON int, not an object"),
])
def test_anything_else_is_malformed_with_a_message_saying_why(text, problem):
    with pytest.raises(MalformedReply, match=problem) as caught:
        parse_json_object(text, "the final message")
    assert "the final message" in str(caught.value)


CLUES = [Clue("d1", "Alpha", "flows through", "Paris")]


def test_judge_and_recovery_apply_the_same_fence_rule():
    counts = '{"n_found": 1, "n_excluded": 0, "n_rejected": 0}'
    clues = '{"clues": [{"url": "u", "relation": "r", "value": "v", "kind": "support"}]}'
    for wrap in ("{}", "```json\n{}\n```", "Answer:\n```\n{}\n```\n"):
        assert parse_counts(wrap.replace("{}", counts), CLUES) == (1, 0, 0)
        assert parse_clue_reply(wrap.replace("{}", clues))[0]["value"] == "v"
    for wrap in ("So: {}", "```json\n{}"):
        with pytest.raises(MalformedJudgement):
            parse_counts(wrap.replace("{}", counts), CLUES)
        with pytest.raises(MalformedReply):
            parse_clue_reply(wrap.replace("{}", clues))
