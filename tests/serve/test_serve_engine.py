"""The engine's bounds without a model: a full queue refuses, an oversize request is refused before queueing, and the
HTTP layer turns a full queue into a 429 that says so."""

import httpx
import pytest

from trace_jax.rollout.sampler import SamplingConfig
from trace_jax.serve import Engine, EngineConfig, QueueFull, ScriptedBackend, ServeConfig, ServerThread, create_app
from trace_jax.serve.engine import GenerationRequest


def _request(n=1, prompt=(1, 2, 3), max_tokens=4):
    return GenerationRequest(prompt_ids=list(prompt), max_tokens=max_tokens, sampling=SamplingConfig(greedy=True),
                             emit=lambda event: None, n=n)


def test_full_queue_refuses_new_requests():
    engine = Engine(None, None, None, stop_ids=(0,), engine=EngineConfig(max_queue=2, max_context=16))  # not started
    engine.submit(_request())
    engine.submit(_request())
    with pytest.raises(QueueFull, match="retry later"):
        engine.submit(_request())


def test_requests_that_cannot_fit_are_refused_before_queueing():
    engine = Engine(None, None, None, stop_ids=(0,), engine=EngineConfig(max_batch=4, max_context=16))
    with pytest.raises(ValueError, match="n=5"):
        engine.submit(_request(n=5))
    with pytest.raises(ValueError, match="context of 16"):
        engine.submit(_request(max_tokens=14))


@pytest.mark.parametrize("field, value", [("max_batch", 0), ("max_queue", -1), ("max_context", 1),
                                          ("slice_tokens", 0), ("batch_wait_s", -0.1)])
def test_engine_config_rejects_impossible_values(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_full_queue_is_a_429_with_a_message():
    class Busy(ScriptedBackend):
        def submit_chat(self, *args):
            raise QueueFull("256 requests are already waiting; retry later")

    with ServerThread(create_app(Busy(lambda request: "", name="busy"), ServeConfig())) as server:
        response = httpx.post(server.url + "/v1/chat/completions", timeout=10,
                              json={"model": "busy", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 429 and "retry later" in response.json()["error"]["message"]
