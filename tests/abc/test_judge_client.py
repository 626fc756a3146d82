"""The judge's HTTP client against a hostile fake endpoint on 127.0.0.1 (`fake_endpoint.FakeEndpoint`): error and
reply bodies of any shape become `EndpointError`, one deadline bounds a whole request, replies are size-capped,
`Retry-After` is read and honoured, and no message or summary shows credentials."""

import random
import time

import pytest

from fake_endpoint import FakeEndpoint, Reply, ok
from judge_cases import CLUES, GOLD, QUESTION, trajectories
from trace_jax.abc.judge import JudgeConfig, LLMJudgeStepScorer
from trace_jax.abc.retry import retry_delay
from trace_jax.serve.client import ChatClient, EndpointConfig, EndpointError, parse_retry_after, redact_url

MESSAGES = [{"role": "user", "content": "hi"}]
DEEP = b"[" * 100_000 + b"]" * 100_000


def _client(url, **fields):
    return ChatClient(EndpointConfig(base_url=url, model="m", **{"timeout_s": 5.0, **fields}))


def _guess_steps():
    return next(t for t in trajectories() if t[0] == "guess")[1]


@pytest.mark.parametrize("body", [
    b"[1, 2]", b'"overloaded"', b"42", b"null", b'{"error": [1]}', b'{"error": "busy"}',
    b'{"error": {"message": {"nested": true}}}', b'{"detail": {"loc": [1]}}', DEEP, b"<html>502</html>", b"",
    b"\xff\xfe not utf-8"])
def test_error_bodies_of_any_shape_become_endpoint_errors(body):
    with FakeEndpoint([Reply(status=503, body=body)]) as fake, _client(fake.url) as client:
        with pytest.raises(EndpointError) as caught:
            client.chat(MESSAGES)
    assert caught.value.status == 503 and caught.value.retryable and "HTTP 503" in str(caught.value)
    assert len(str(caught.value)) < 500  # a short reason, never the whole body


@pytest.mark.parametrize("body", [
    b"[]", b'"text"', b"3.5", b'{"choices": "none"}', b'{"choices": []}', b'{"choices": [{"message": "hi"}]}',
    b'{"choices": [{"message": [1]}]}', DEEP, b"not json at all"])
def test_reply_bodies_of_any_shape_become_endpoint_errors(body):
    with FakeEndpoint([Reply(body=body)]) as fake, _client(fake.url) as client:
        with pytest.raises(EndpointError):
            client.chat(MESSAGES)


@pytest.mark.parametrize("body", [b"[]", b'{"data": 3}', b"not json", DEEP])
def test_a_models_listing_of_any_shape_is_an_endpoint_error(body):
    with FakeEndpoint([Reply(body=body)]) as fake, _client(fake.url) as client:
        with pytest.raises(EndpointError):
            client.models()


def test_one_deadline_bounds_a_reply_that_drips_forever():
    with FakeEndpoint([Reply(body=b" " * 1000, drip_s=0.05)]) as fake, _client(fake.url, timeout_s=0.5) as client:
        started = time.monotonic()
        with pytest.raises(EndpointError, match="no complete reply within 0.5 s") as caught:
            client.chat(MESSAGES)
        assert time.monotonic() - started < 5.0  # per-read timeouts alone would wait 50 s (loose: a loaded CI)
    assert caught.value.retryable


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "no-length"])
def test_a_reply_over_the_size_limit_is_refused(chunked):
    big = ok("x" * 5000)
    big.chunked = chunked
    with FakeEndpoint([big]) as fake, _client(fake.url, max_response_bytes=1024) as client:
        with pytest.raises(EndpointError, match="larger than 1024 bytes") as caught:
            client.chat(MESSAGES)
    assert not caught.value.retryable


def test_retry_after_is_read_as_seconds_or_an_http_date():
    assert parse_retry_after("2") == 2.0 and parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == pytest.approx(10.0)
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None and parse_retry_after("nan") is None
    assert parse_retry_after("-3") == 0.0


def test_retry_delays_are_jittered_exponential_and_never_below_retry_after():
    rng = random.Random(0)
    delays = [retry_delay(3, backoff_s=1.0, backoff_max_s=8.0, rng=rng) for _ in range(50)]
    assert all(2.0 <= d <= 4.0 for d in delays) and len(set(delays)) == 50
    assert all(4.0 <= retry_delay(9, backoff_s=1.0, backoff_max_s=8.0, rng=rng) <= 8.0 for _ in range(20))
    assert retry_delay(1, backoff_s=0.1, backoff_max_s=8.0, retry_after=30.0) == 30.0


def _judge(url, tmp_path=None, **fields):
    endpoint = EndpointConfig(base_url=url, model="m", timeout_s=fields.pop("timeout_s", 5.0))
    return LLMJudgeStepScorer(JudgeConfig(endpoint=endpoint, concurrency=1, **fields))


def test_the_judge_waits_as_long_as_retry_after_says():
    replies = [Reply(status=429, body=b'{"error": {"message": "slow down"}}', headers={"Retry-After": "0.4"}),
               ok('{"n_found": 0, "n_excluded": 0, "n_rejected": 0}')]
    with FakeEndpoint(replies) as fake:
        started = time.monotonic()
        (counts,) = _judge(fake.url, backoff_s=0.0).score(question=QUESTION, gold=GOLD, clues=CLUES,
                                                          steps=_guess_steps())
        waited = time.monotonic() - started
    assert not counts.flagged and len(fake.requests) == 2 and waited >= 0.4


def test_a_retry_after_beyond_the_deadline_ends_the_retries_at_once():
    with FakeEndpoint([Reply(status=503, headers={"Retry-After": "120"})]) as fake:
        started = time.monotonic()
        (counts,) = _judge(fake.url, backoff_s=0.0, deadline_s=2.0).score(question=QUESTION, gold=GOLD,
                                                                          clues=CLUES, steps=_guess_steps())
        assert time.monotonic() - started < 5.0  # the server asked for 120 s
    assert counts.flagged and "pass the 2 s deadline" in counts.note and len(fake.requests) == 1


def test_the_step_deadline_bounds_every_attempt_and_wait_together():
    with FakeEndpoint([Reply(status=503, body=b"[]")]) as fake:
        started = time.monotonic()
        (counts,) = _judge(fake.url, max_attempts=1000, backoff_s=0.05, backoff_max_s=0.1,
                           deadline_s=0.8).score(question=QUESTION, gold=GOLD, clues=CLUES, steps=_guess_steps())
        elapsed = time.monotonic() - started
    assert counts.flagged and "deadline" in counts.note and 1 < len(fake.requests) < 1000
    assert elapsed < 5.0  # 1000 attempts with their waits would take minutes


def test_a_request_gets_only_what_is_left_of_the_step_deadline():
    with FakeEndpoint([Reply(body=b" " * 1000, drip_s=0.05)]) as fake:
        started = time.monotonic()
        (counts,) = _judge(fake.url, timeout_s=30.0, max_attempts=1, deadline_s=0.5).score(
            question=QUESTION, gold=GOLD, clues=CLUES, steps=_guess_steps())
        assert time.monotonic() - started < 5.0  # the endpoint's own 30 s would be spent otherwise
    assert counts.flagged and "no complete reply within" in counts.note


def test_urls_are_shown_without_credentials():
    assert redact_url("https://alice:s3cret@judge.example/v1") == "https://judge.example/v1"
    assert redact_url("http://h:8/v1?api_key=s3cret&x=1&token=t") == "http://h:8/v1?api_key=REDACTED&x=1&token=REDACTED"
    endpoint = EndpointConfig(base_url="http://alice:s3cret@127.0.0.1:9/v1", model="m")
    assert endpoint.public_url == "http://127.0.0.1:9/v1"


def test_endpoint_errors_never_show_the_password_of_the_url():
    with FakeEndpoint([Reply(status=500, body=b'{"error": {"message": "see http://alice:s3cret@x/v1"}}')]) as fake:
        url = fake.url.replace("http://", "http://alice:s3cret@")
        with _client(url) as client, pytest.raises(EndpointError) as caught:
            client.chat(MESSAGES)
    assert "s3cret" not in str(caught.value) and fake.requests[0][2]["Authorization"].startswith("Basic ")


@pytest.mark.parametrize("status, body, over_context", [
    (400, b'{"error": {"message": "This model\'s maximum context length is 4096 tokens."}}', True),
    (400, b'{"error": {"message": "the prompt is 900 tokens; this model\'s context is 512 tokens"}}', True),
    (413, b"", True), (400, b'{"error": {"message": "unknown field"}}', False), (500, b"context", False)])
def test_a_refusal_for_length_is_told_apart_from_other_errors(status, body, over_context):
    with FakeEndpoint([Reply(status=status, body=body)]) as fake, _client(fake.url) as client:
        with pytest.raises(EndpointError) as caught:
            client.chat(MESSAGES)
    assert caught.value.over_context is over_context


@pytest.mark.parametrize("content", ["\ud800 lone surrogate", float("nan")])
def test_a_payload_json_cannot_carry_is_an_endpoint_error(content):
    with FakeEndpoint([ok("{}")]) as fake, _client(fake.url) as client:
        with pytest.raises(EndpointError, match="the request could not be made") as caught:
            client.chat([{"role": "user", "content": content}])
    assert not caught.value.retryable and not fake.requests
