"""The engine: a full queue refuses, an oversize request is refused before queueing, the HTTP layer turns a full
queue into a 429 that says so; on a tiny model, requests admitted into a running batch decode as if alone, and a
failed prefill fails its requests without taking the server down."""

import httpx
import pytest

from trace_jax.rollout.sampler import SamplingConfig
from trace_jax.serve import Engine, EngineConfig, QueueFull, ScriptedBackend, ServeConfig, ServerThread, create_app
from trace_jax.serve.engine import GenerationRequest

from serve_helpers import greedy_ids


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


class _IdsTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)


@pytest.fixture(scope="module")
def tiny_model():
    import jax

    from trace_jax import models

    config = models.get_preset("tiny-qwen3")
    return config, models.init_params(config, jax.random.PRNGKey(0))


class _Collect:
    def __init__(self):
        import threading

        self.events, self.done = [], threading.Event()

    def __call__(self, event):
        from trace_jax.serve.engine import Failed, Finished

        self.events.append(event)
        if isinstance(event, Failed) or isinstance(event, Finished):
            self.done.set()


def _submit(engine, prompt, max_tokens, n=1, **fields):
    collect = _Collect()
    engine.submit(GenerationRequest(prompt_ids=list(prompt), max_tokens=max_tokens, n=n, emit=collect,
                                    sampling=SamplingConfig(greedy=True), **fields))
    return collect


def test_unstreamed_requests_get_only_the_finished_text_which_equals_the_streamed_one(tiny_model):
    """`stream=False`: no TextDelta, one Finished per choice, the same text and ids as the streamed request (whose
    deltas concatenate to that text), stop strings included."""
    from trace_jax.serve.engine import Finished, TextDelta

    config, params = tiny_model
    engine = Engine(config, params, _IdsTokenizer(), stop_ids=(), engine=EngineConfig(
        max_batch=4, max_context=64, slice_tokens=4, batch_wait_s=0.0)).start()
    try:
        results = {}
        for stream in (True, False):
            collect = _submit(engine, (5, 9, 17, 33), 14, stream=stream)
            assert collect.done.wait(120)
            results[stream] = collect.events
        streamed_text = results[True][-1].text
        stop = " ".join(streamed_text.split(" ")[5:7])  # two tokens of the second slice
        for stream in (True, False):
            collect = _submit(engine, (5, 9, 17, 33), 14, stream=stream, stop=(stop,))
            assert collect.done.wait(120)
            results[stream, "stop"] = collect.events
    finally:
        engine.close()
    streamed, unstreamed = results[True], results[False]
    assert len([e for e in streamed if isinstance(e, TextDelta)]) > 1
    assert "".join(e.text for e in streamed if isinstance(e, TextDelta)) == streamed[-1].text
    assert unstreamed == [streamed[-1]] and isinstance(unstreamed[0], Finished)
    assert unstreamed[0].token_ids == greedy_ids(config, params, (5, 9, 17, 33), 14, 64)
    cut = streamed_text[:streamed_text.find(stop)]
    assert results[False, "stop"] == [results[True, "stop"][-1]] == [Finished(0, "stop", cut,
                                                                               results[True, "stop"][-1].token_ids)]


def test_requests_admitted_into_a_running_batch_decode_as_if_alone(tiny_model):
    """Continuous batching: requests that arrive while others decode are prefilled into free rows of the running
    batch (and `n` choices of one prompt share a prefill); every one's greedy tokens equal its prompt decoded alone."""
    import time

    from trace_jax.serve.engine import Finished

    config, params = tiny_model
    jobs = [((5, 9, 17, 33), 40, 1), ((100, 3), 6, 1), ((44, 45, 46, 47, 48, 49, 50), 9, 2), ((7,), 13, 1),
            ((100, 3), 5, 1), (tuple(range(60, 90)), 7, 1)]
    engine = Engine(config, params, _IdsTokenizer(), stop_ids=(), engine=EngineConfig(
        max_batch=4, max_context=64, slice_tokens=4, batch_wait_s=0.0)).start()
    try:
        pending = []
        for prompt, max_tokens, n in jobs:
            pending.append(_submit(engine, prompt, max_tokens, n))
            time.sleep(0.02)
        for collect in pending:
            assert collect.done.wait(120)
            time.sleep(0.01)
    finally:
        engine.close()
    assert engine.stats["max_rows"] > 1
    for (prompt, max_tokens, n), collect in zip(jobs, pending):
        finished = sorted((e for e in collect.events if isinstance(e, Finished)), key=lambda e: e.choice)
        assert [e.choice for e in finished] == list(range(n)), collect.events
        expected = greedy_ids(config, params, prompt, max_tokens, 64)
        for event in finished:
            assert event.token_ids == expected and event.reason == "length", (prompt, event)


@pytest.mark.parametrize("donated", [False, True], ids=["before-the-device", "state-lost"])
def test_a_failed_prefill_fails_its_requests_and_the_server_goes_on(tiny_model, donated):
    """A prefill that raises fails the requests it admitted; if the donated state was lost with it, the running
    rows fail too (their caches are gone) instead of decoding garbage; later requests are served correctly."""
    from trace_jax.serve.engine import Failed, Finished

    config, params = tiny_model
    engine = Engine(config, params, _IdsTokenizer(), stop_ids=(), engine=EngineConfig(
        max_batch=4, max_context=64, slice_tokens=2, batch_wait_s=0.0))
    real_prefill, calls = engine._prefill, []

    def flaky(state, admitted):
        calls.append(len(admitted))
        if len(calls) == 2:
            if donated:
                state.cache.k.delete()
            raise RuntimeError("device fell over")
        return real_prefill(state, admitted)

    engine._prefill = flaky
    engine.start()
    try:
        running = _submit(engine, (5, 9, 17, 33), 40)
        while engine.stats["slices"] == 0:
            running.done.wait(0.005)
        broken = _submit(engine, (100, 3), 6)
        assert broken.done.wait(120) and running.done.wait(120)
        later = _submit(engine, (7, 8), 5)
        assert later.done.wait(120)
    finally:
        engine.close()
    assert isinstance(broken.events[-1], Failed) and "device fell over" in broken.events[-1].message
    if donated:
        assert isinstance(running.events[-1], Failed)
    else:
        assert running.events[-1] == Finished(0, "length", running.events[-1].text,
                                              greedy_ids(config, params, (5, 9, 17, 33), 40, 64))
    assert later.events[-1].token_ids == greedy_ids(config, params, (7, 8), 5, 64)


def test_warmup_compiles_every_prefill_shape_the_requests_then_meet(tiny_model):
    """With `warmup_tokens`, `start` compiles the prefill for every count of distinct prompts and length bucket up
    to that many tokens and the greedy slice for every cache-read bucket: greedy requests of those shapes then
    compile neither (and still decode as if alone)."""
    from trace_jax.rollout import sampler
    from trace_jax.serve.engine import Finished

    config, params = tiny_model
    engine = Engine(config, params, _IdsTokenizer(), stop_ids=(), engine=EngineConfig(  # shapes no other test meets
        max_batch=3, max_context=48, slice_tokens=4, batch_wait_s=0.05, warmup_tokens=20)).start()
    try:
        compiled = sampler._prefill_rows_jit._cache_size(), sampler._decode_steps_jit._cache_size()
        jobs = [((3,) * 19, 3, 1), ((4, 5), 3, 1), ((6,) * 9, 3, 2)]  # 3 distinct prompts of 2-19 tokens together
        pending = [_submit(engine, prompt, max_tokens, n) for prompt, max_tokens, n in jobs]
        assert all(collect.done.wait(120) for collect in pending)
        later = _submit(engine, (9,) * 17, 4)
        assert later.done.wait(120)
    finally:
        engine.close()
    assert (sampler._prefill_rows_jit._cache_size(), sampler._decode_steps_jit._cache_size()) == compiled
    for (prompt, max_tokens, n), collect in zip(jobs + [((9,) * 17, 4, 1)], pending + [later]):
        finished = [e for e in collect.events if isinstance(e, Finished)]
        assert len(finished) == n and all(e.token_ids == greedy_ids(config, params, prompt, max_tokens, 48)
                                          for e in finished)
    with pytest.raises(ValueError, match="warmup_tokens"):
        EngineConfig(max_context=64, warmup_tokens=65)


def test_a_failed_warmup_is_raised_by_start(tiny_model):
    config, _ = tiny_model
    engine = Engine(config, {}, _IdsTokenizer(), stop_ids=(), engine=EngineConfig(max_batch=2, max_context=32,
                                                                                   warmup_tokens=8))
    with pytest.raises(RuntimeError, match="warm-up failed"):
        engine.start()
