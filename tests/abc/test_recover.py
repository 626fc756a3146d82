"""The clue-recovery agent against a scripted agent served on 127.0.0.1: tool calls run on the local browser, the
reported clues are checked against the corpus, and failures are flagged rather than raised."""

import json

import pytest

from judge_cases import CLUES, DOCS, scripted_recovery_reply
from trace_jax.abc.recover import ClueRecoveryAgent, RecoveryConfig, parse_clue_reply, verify_clues
from trace_jax.envs.corpus import Corpus
from trace_jax.serve import ScriptedBackend, ServeConfig, ServerThread, create_app
from trace_jax.serve.client import ChatClient, EndpointConfig


def _serve(respond):
    return ServerThread(create_app(ScriptedBackend(respond, name="agent"), ServeConfig()))


def _agent(url, **config):
    client = ChatClient(EndpointConfig(base_url=url + "/v1", model="agent", timeout_s=10))
    return ClueRecoveryAgent(client, Corpus.from_records(DOCS), RecoveryConfig(**config))


def test_agent_recovers_the_support_chain_and_drops_an_unverifiable_clue():
    with _serve(scripted_recovery_reply) as server:
        result = _agent(server.url).recover("Which city does the river that Beta city lies on flow through?",
                                            "Paris")
    assert not result.flagged
    assert list(result.clues) == [CLUES[1], CLUES[0]]  # chain order as reported; entity = the page's title
    (dropped,) = result.dropped
    assert dropped["clue"]["value"] == "Lina Voss" and "does not occur on page d3" in dropped["reason"]
    tools = [m for m in result.transcript if m["role"] == "tool"]
    assert len(tools) == 4 and tools[1]["content"].startswith("[1] Alpha river")  # the browser really ran


def test_agent_that_never_reports_is_flagged_after_max_turns():
    search = '<tool_call>\n{"name": "search", "arguments": {"query": "Paris"}}\n</tool_call>'
    with _serve(lambda request: search) as server:
        result = _agent(server.url, max_turns=3).recover("q?", "Paris")
    assert result.flagged and "within 3 turns" in result.note and not result.clues


def test_malformed_clue_list_is_flagged():
    with _serve(lambda request: "The answer is Paris, see the Alpha river page.") as server:
        result = _agent(server.url).recover("q?", "Paris")
    assert result.flagged and "malformed clue list" in result.note


@pytest.mark.parametrize("text", ["", "clues: none", "[]", '{"chain": []}'])
def test_parse_clue_reply_needs_an_object_with_a_clue_list(text):
    with pytest.raises(ValueError):
        parse_clue_reply(text)


def test_verify_clues_checks_page_value_and_kind():
    corpus = Corpus.from_records(DOCS)
    clues, dropped = verify_clues([
        {"docid": "d1", "relation": "r", "value": "Paris"},
        {"url": "https://wiki.example/none", "value": "Paris"},
        {"docid": "d1", "value": ""},
        {"docid": "d3", "value": "a company", "kind": "maybe"},
        "not an object",
        {"docid": "d1", "relation": "r", "value": "Paris"},  # duplicate: kept once
    ], corpus)
    assert [(c.docid, c.entity, c.value) for c in clues] == [("d1", "Alpha river", "Paris")]
    assert len(dropped) == 4
    assert json.dumps(dropped)  # the reasons are serialisable for clues.jsonl


@pytest.mark.parametrize("tool_calls", ["search", {"function": {"name": "search"}}, [5], [{"function": "oops"}]])
def test_malformed_tool_calls_from_the_agent_are_flagged_not_raised(tool_calls):
    from fake_endpoint import FakeEndpoint, Reply

    reply = Reply(body={"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": tool_calls}}]})
    with FakeEndpoint([reply]) as fake:
        client = ChatClient(EndpointConfig(base_url=fake.url, model="agent", timeout_s=5))
        result = ClueRecoveryAgent(client, Corpus.from_records(DOCS)).recover("q?", "Paris")
    assert result.flagged and "tool_calls are not a list" in result.note
