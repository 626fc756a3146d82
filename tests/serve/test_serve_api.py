"""`trace-jax serve` through the official `openai` client on 127.0.0.1: tools, streaming, n, greedy parity with the
sampler, and 4xx errors that say what is wrong."""

import json

import httpx
import openai
import pytest

from serve_helpers import SEARCH_TOOL, TOOL_ARGUMENTS, TOOL_QUESTION, sampler_greedy

PLAIN = [{"role": "user", "content": "Hello world"}]


def test_models_and_health_name_the_served_model(served, client):
    url, _ = served
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"


def test_model_tool_call_comes_back_as_tool_calls(client):
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": TOOL_QUESTION}],
                                           tools=[SEARCH_TOOL], temperature=0, max_tokens=40)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "search"
    assert json.loads(call.function.arguments) == TOOL_ARGUMENTS


def test_forced_tool_choice_writes_the_named_call(client):
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": TOOL_QUESTION}], tools=[SEARCH_TOOL], temperature=0,
        max_tokens=40, tool_choice={"type": "function", "function": {"name": "search"}})
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "search" and json.loads(call.function.arguments) == TOOL_ARGUMENTS


def test_streamed_tool_call_equals_the_unstreamed_one(client):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": TOOL_QUESTION}],
                                            tools=[SEARCH_TOOL], temperature=0, max_tokens=40, stream=True)
    calls, finish, content = [], None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [c.function.name for c in calls] == ["search"]
    assert json.loads(calls[0].function.arguments) == TOOL_ARGUMENTS


def test_served_greedy_output_equals_the_sampler_greedy_output(served, client):
    _, backend = served
    reply = client.chat.completions.create(model="tiny", messages=PLAIN, temperature=0, max_tokens=24)
    prompt = backend.chat.render(PLAIN, add_generation_prompt=True).ids
    expected = sampler_greedy(backend, prompt, 24)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(prompt)
    raw = client.completions.create(model="tiny", prompt="Hello world", temperature=0, max_tokens=12)
    ids = backend.tokenizer.encode("Hello world", add_special_tokens=False)
    assert raw.choices[0].text == sampler_greedy(backend, ids, 12)


def test_streaming_concatenates_to_the_unstreamed_text(client):
    whole = client.chat.completions.create(model="tiny", messages=PLAIN, temperature=0, max_tokens=40)
    pieces = [c.choices[0].delta.content or "" for c in
              client.chat.completions.create(model="tiny", messages=PLAIN, temperature=0, max_tokens=40,
                                             stream=True)]
    if whole.usage.completion_tokens > 16:  # more than one engine slice: it must arrive in several pieces
        assert len([p for p in pieces if p]) > 1
    assert "".join(pieces) == whole.choices[0].message.content


def test_n_choices_with_a_seed_are_reproducible_and_differ(client):
    kwargs = dict(model="tiny", messages=PLAIN, temperature=1.0, max_tokens=16, n=4, seed=7)
    first = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    again = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    assert len(first) == 4 and first == again
    assert len(set(first)) > 1


def test_stop_string_ends_the_text_before_it(served, client):
    whole = client.completions.create(model="tiny", prompt="Hello world", temperature=0, max_tokens=30).choices[0]
    assert len(whole.text) > 4
    stop = whole.text[2:4]
    cut = client.completions.create(model="tiny", prompt="Hello world", temperature=0, max_tokens=30,
                                    stop=[stop]).choices[0]
    assert cut.text == whole.text[:whole.text.find(stop)] and cut.finish_reason == "stop"


def _error(call):
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value.status_code, info.value.body.get("message", "") if isinstance(info.value.body, dict) else ""


def test_bad_requests_are_4xx_with_a_message_that_names_the_problem(served, client):
    url, _ = served
    chat = client.chat.completions.create
    status, message = _error(lambda: chat(model="gpt-5", messages=PLAIN))
    assert status == 404 and "'gpt-5'" in message and "tiny" in message
    status, message = _error(lambda: chat(model="tiny", messages=PLAIN, temperature=3.5))
    assert status == 400 and "temperature" in message
    status, message = _error(lambda: chat(model="tiny", messages=PLAIN, max_tokens=10_000))
    assert status == 400 and "max_tokens" in message
    status, message = _error(lambda: chat(model="tiny", messages=[{"role": "user", "content": "Hello " * 600}]))
    assert status == 400 and "context" in message
    status, message = _error(lambda: chat(model="tiny", messages=[{"role": "robot", "content": "x"}]))
    assert status == 400 and "role" in message
    status, message = _error(lambda: chat(model="tiny", messages=PLAIN, tools=[SEARCH_TOOL],
                                          tool_choice={"type": "function", "function": {"name": "open"}}))
    assert status == 400 and "'open'" in message
    response = httpx.post(url + "/v1/chat/completions", content=b'{"model": "tiny", "messages": [', timeout=10,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = httpx.post(url + "/v1/chat/completions", json={"model": "tiny"}, timeout=10)
    assert response.status_code == 400 and "messages" in response.json()["error"]["message"]


def test_long_request_bodies_are_rendered_off_the_event_loop_with_the_same_results(served, client):
    """Bodies over OFFLOAD_BYTES are rendered on a worker thread: same greedy text, same 4xx for a prompt over the
    context, and streaming works from that path too."""
    from trace_jax.serve.app import OFFLOAD_BYTES

    _, backend = served
    padding = "x" * (OFFLOAD_BYTES + 1)  # a long `user` field: the body is long, the prompt is not
    reply = client.chat.completions.create(model="tiny", messages=PLAIN, temperature=0, max_tokens=20, user=padding)
    prompt = backend.chat.render(PLAIN, add_generation_prompt=True).ids
    assert reply.choices[0].message.content == sampler_greedy(backend, prompt, 20)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=PLAIN, temperature=0, max_tokens=20, user=padding, stream=True)]
    assert "".join(pieces) == reply.choices[0].message.content
    raw = client.completions.create(model="tiny", prompt="Hello world", temperature=0, max_tokens=12, user=padding)
    ids = backend.tokenizer.encode("Hello world", add_special_tokens=False)
    assert raw.choices[0].text == sampler_greedy(backend, ids, 12)
    status, message = _error(lambda: client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello " * 5000}]))
    assert status == 400 and "context" in message


def test_api_key_is_required_when_set(tiny_checkpoint):
    from trace_jax.serve import ScriptedBackend, ServeConfig, ServerThread, create_app

    app = create_app(ScriptedBackend(lambda request: "ok", name="echo"), ServeConfig(api_key="s3cret"))
    with ServerThread(app) as server:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=10) as api:
            with pytest.raises(openai.AuthenticationError):
                api.models.list()
        with openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0, timeout=10) as api:
            reply = api.chat.completions.create(model="echo", messages=PLAIN)
            assert reply.choices[0].message.content == "ok"
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # health stays open


def test_serve_command_rejects_a_missing_checkpoint(tmp_path, capsys):
    from trace_jax.cli import main

    assert main(["serve", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_completions_stream_concatenates_to_the_unstreamed_text(client):
    whole = client.completions.create(model="tiny", prompt="Hello world", temperature=0, max_tokens=20)
    chunks = list(client.completions.create(model="tiny", prompt="Hello world", temperature=0, max_tokens=20,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_streamed_n_choices_arrive_with_their_index(client):
    stream = client.chat.completions.create(model="tiny", messages=PLAIN, temperature=0, max_tokens=12, n=3,
                                            stream=True)
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    assert len(set(texts.values())) == 1 and texts[0]  # greedy: three equal choices
