"""Specification of parse_tool_call / parse_tool_calls: robust parsing of generated tool calls, never raising."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trace_jax.models.chat import ToolCall, ToolCallError, format_tool_call, parse_tool_call, parse_tool_calls


def test_parses_qwen3_tool_call_with_surrounding_text():
    text = 'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"query": "Paris"}}\n</tool_call>'
    assert parse_tool_call(text) == ToolCall("search", {"query": "Paris"})


def test_round_trips_the_rendered_format():
    assert parse_tool_call(format_tool_call("open", {"id": 3, "q": "é"})) == ToolCall("open", {"id": 3, "q": "é"})


def test_arguments_given_as_a_json_string_are_decoded():
    text = '<tool_call>{"name": "open", "arguments": "{\\"id\\": 3}"}</tool_call>'
    assert parse_tool_call(text) == ToolCall("open", {"id": 3})


def test_missing_arguments_mean_no_arguments():
    assert parse_tool_call('<tool_call>{"name": "list"}</tool_call>') == ToolCall("list", {})


@pytest.mark.parametrize(
    "text, reason",
    [
        ("no call here", "no <tool_call>"),
        ('<tool_call>{"name": "search", "arguments": {}}', "not closed"),
        ("<tool_call>{name: search}</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', '"name"'),
        ('<tool_call>{"name": 3}</tool_call>', '"name"'),
        ('<tool_call>["search"]</tool_call>', "JSON object"),
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "a", "arguments": "{oops"}</tool_call>', "string that is not valid JSON"),
        ('<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>', "2 tool calls"),
        ("<tool_call>" + "[" * 100000 + "</tool_call>", "not valid JSON"),
    ],
)
def test_malformed_generations_give_an_error_with_the_reason(text, reason):
    result = parse_tool_call(text)
    assert isinstance(result, ToolCallError)
    assert reason in result.message


def test_parse_tool_calls_returns_every_call_in_order():
    text = format_tool_call("a", {}) + "\n" + format_tool_call("b", {"x": 1})
    assert parse_tool_calls(text) == [ToolCall("a", {}), ToolCall("b", {"x": 1})]


def test_an_unclosed_call_followed_by_a_complete_one_reports_both():
    results = parse_tool_calls('<tool_call>{"name": "a"\n' + format_tool_call("b", {}))
    assert isinstance(results[0], ToolCallError) and results[1] == ToolCall("b", {})


def test_non_string_input_is_an_error_not_an_exception():
    assert isinstance(parse_tool_call(None), ToolCallError)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=8,
)


@given(st.text(max_size=200))
def test_never_raises_on_arbitrary_text(text):
    assert isinstance(parse_tool_call(text), (ToolCall, ToolCallError))


@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"arguments"', '"x"', " ",
                                 "\n", "[", "]", ",", '"{}"', "null"]), max_size=30))
def test_never_raises_on_tag_and_json_soup(pieces):
    assert isinstance(parse_tool_call("".join(pieces)), (ToolCall, ToolCallError))


@given(st.text(min_size=1, max_size=10).filter(str.strip), st.dictionaries(st.text(max_size=5), json_values, max_size=4))
def test_any_well_formed_call_parses_back(name, arguments):
    payload = json.dumps({"name": name, "arguments": arguments})
    result = parse_tool_call(f"<tool_call>\n{payload}\n</tool_call>")
    if "<tool_call>" in payload or "</tool_call>" in payload:
        return  # tags inside the JSON strings make it ambiguous by construction
    assert result == ToolCall(name.strip(), arguments)
