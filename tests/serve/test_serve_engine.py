"""The engine: a full queue refuses, an oversize request is refused before queueing, the HTTP layer turns a full
queue into a 429 that says so; on a tiny model, requests admitted into a running batch decode as if alone, and a
failed prefill fails its requests without taking the server down."""

import dataclasses
import time

import httpx
import pytest

from trace_jax.rollout.sampler import SamplingConfig
from trace_jax.serve import Engine, EngineConfig, QueueFull, ScriptedBackend, ServeConfig, ServerThread, create_app
from trace_jax.serve.engine import GenerationRequest

from serve_helpers import greedy_ids, reference_ids


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
                                          ("slice_tokens", 0), ("batch_wait_s", -0.1), ("page_size", 0),
                                          ("prefill_chunk", 0), ("num_pages", 0), ("kv_budget_gib", -1.0)])
def test_engine_config_rejects_impossible_values(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_a_pool_smaller_than_one_row_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="num_pages = 3 pages of 16 tokens hold less than one row of max_context = "
                                         "64 .4 pages.: raise num_pages"):
        EngineConfig(max_context=64, page_size=16, num_pages=3)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(num_pages=200, kv_budget_gib=1.0)


def test_a_kv_budget_below_one_row_is_refused_when_the_engine_is_built(tiny_model):
    config, params = tiny_model
    with pytest.raises(ValueError, match="kv_budget_gib = 1e-06 GiB holds 0 pages"):
        Engine(config, params, _IdsTokenizer(), stop_ids=(), engine=_engine_config(kv_budget_gib=1e-6))
    roomy = Engine(config, params, _IdsTokenizer(), stop_ids=(), engine=_engine_config(kv_budget_gib=0.01))
    assert roomy.num_pages >= roomy.config.row_pages


def test_choices_that_cannot_start_in_the_pool_are_refused_before_queueing():
    engine = Engine(None, None, None, stop_ids=(0,), engine=EngineConfig(max_batch=4, max_context=64, page_size=16,
                                                                          num_pages=6))
    with pytest.raises(ValueError, match="n=3 choices of a 40-token prompt need 9 pages"):
        engine.submit(_request(n=3, prompt=range(40), max_tokens=4))
    engine.submit(_request(n=2, prompt=range(40), max_tokens=4))  # 6 pages: fits


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


# One engine shape (4 rows, 320 cache slots, slices of 4) for every model test but the warm-up's: a program compiles
# once per shape and cache-read bucket, so the tests share their programs; 320 slots hold the stop-string test's
# 300 tokens. The greedy references (`greedy_ids`, batch 1) use the same context.
CONTEXT = 320


def _engine_config(**fields):
    return EngineConfig(**{"max_batch": 4, "max_context": CONTEXT, "slice_tokens": 4, "batch_wait_s": 0.0, **fields})


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


def _collect():
    return _Collect()


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
    engine = Engine(config, params, _IdsTokenizer(), stop_ids=(), engine=_engine_config()).start()
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
    assert unstreamed[0].token_ids == greedy_ids(config, params, (5, 9, 17, 33), 14, CONTEXT)
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
    engine = Engine(config, params, _IdsTokenizer(), stop_ids=(), engine=_engine_config()).start()
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
        expected = greedy_ids(config, params, prompt, max_tokens, CONTEXT)
        for event in finished:
            assert event.token_ids == expected and event.reason == "length", (prompt, event)


def _seeded(engine, prompt, max_tokens, n=1, seed=0, temperature=0.9, top_p=0.9):
    collect = _Collect()
    engine.submit(GenerationRequest(prompt_ids=list(prompt), max_tokens=max_tokens, n=n, emit=collect, seed=seed,
                                    sampling=SamplingConfig(temperature=temperature, top_p=top_p)))
    return collect


def _reference(config, params, prompt, max_tokens, seed=None, choice=0, sampling=None, width=CONTEXT):
    """The choice's tokens by the cache-free reference: greedy, or drawn with the engine's key rule."""
    import jax

    from trace_jax.serve.engine import seed_key

    key = None if seed is None else jax.random.fold_in(seed_key(seed), choice)
    return reference_ids(config, params, prompt, max_tokens, width, sampling=sampling, key=key, slice_tokens=4)


def _finished(collect):
    from trace_jax.serve.engine import Finished

    return sorted((e for e in collect.events if isinstance(e, Finished)), key=lambda e: e.choice)


def test_seeded_choices_draw_the_tokens_of_the_documented_keys(tiny_model):
    """Choice c of a seeded request draws token t with `fold_in(fold_in(fold_in(key(seed), c), t0), t - t0)` (t0 the
    first token of its slice): the cache-free reference gives the same tokens, as it gave the dense engine's before
    the paged port (checked then), so seeded output did not change."""
    config, params = tiny_model
    engine = Engine(config, params, _IdsTokenizer(), stop_ids=(), engine=_engine_config()).start()
    try:
        collect = _seeded(engine, (44, 45), 10, n=2, seed=2 ** 63 - 1, temperature=1.5, top_p=0.8)
        assert collect.done.wait(120)
        while len(_finished(collect)) < 2:
            time.sleep(0.01)
    finally:
        engine.close()
    sampling = SamplingConfig(temperature=1.5, top_p=0.8)
    assert [e.token_ids for e in _finished(collect)] == [
        _reference(config, params, (44, 45), 10, 2 ** 63 - 1, c, sampling) for c in range(2)]


def test_a_prompt_longer_than_a_chunk_is_prefilled_in_pieces_and_decodes_as_if_alone(tiny_model):
    """`prefill_chunk=8`: a 30-token prompt (n=2, one computation for both choices) goes into its pages in four
    dispatches while a short request decodes; both give the greedy tokens of the cache-free reference."""
    config, params = tiny_model
    engine = Engine(config, params, _IdsTokenizer(), stop_ids=(), engine=_engine_config(prefill_chunk=8))
    short, long = _submit(engine, (5, 9), 12), _submit(engine, tuple(range(60, 90)), 7, n=2)
    engine.start()
    try:
        assert short.done.wait(300) and long.done.wait(300)
        while len(_finished(long)) < 2:
            time.sleep(0.01)
    finally:
        engine.close()
    assert engine.stats["prefill_dispatches"] >= 4 and engine.stats["prefill_tokens"] == 2 + 30
    assert [e.token_ids for e in _finished(short)] == [greedy_ids(config, params, (5, 9), 12, CONTEXT)]
    assert [e.token_ids for e in _finished(long)] == [greedy_ids(config, params, tuple(range(60, 90)), 7, CONTEXT)] * 2


def test_a_pool_too_small_for_every_request_preempts_and_returns_exact_tokens(tiny_model):
    """Four requests of 4 pages each at their end on a pool of 8 pages (one row of the context): all four start (2
    pages each), the newest rows are preempted as the older ones grow, recomputed when pages free up, and every
    choice, greedy or seeded, ends with the tokens of the cache-free reference."""
    config, params = tiny_model
    engine = Engine(config, params, _IdsTokenizer(), stop_ids=(), engine=_engine_config(max_context=128,
                                                                                         num_pages=8))
    jobs = [(tuple(range(60, 80)), 40, None), (tuple(range(10, 30)), 40, 7), (tuple(range(100, 120)), 40, None),
            (tuple(range(200, 220)), 40, 9)]
    sampling = SamplingConfig(temperature=0.9, top_p=0.9)
    pending = [_seeded(engine, p, m, seed=seed) if seed is not None else _submit(engine, p, m)
               for p, m, seed in jobs]  # queued before the start: admitted together
    engine.start()
    try:
        assert all(collect.done.wait(300) for collect in pending)
    finally:
        engine.close()
    assert engine.stats["preemptions"] > 0 and engine.stats["recomputed_tokens"] > 0
    assert engine.stats["max_pages_held"] <= 8
    for (prompt, max_tokens, seed), collect in zip(jobs, pending):
        (finished,) = _finished(collect)
        expected = _reference(config, params, prompt, max_tokens, seed, 0, None if seed is None else sampling, 128)
        assert finished.token_ids == expected and finished.reason == "length", (prompt, seed)


@pytest.mark.parametrize("donated", [False, True], ids=["before-the-device", "state-lost"])
def test_a_failed_prefill_fails_its_requests_and_the_server_goes_on(tiny_model, donated):
    """A prefill that raises fails the requests it admitted; if the donated pool was lost with it, the running
    rows are recomputed into a new pool from their host tokens (never decoded from garbage) and finish with their
    exact tokens; later requests are served correctly."""
    from trace_jax.serve.engine import Failed, Finished

    config, params = tiny_model
    engine = Engine(config, params, _IdsTokenizer(), stop_ids=(), engine=_engine_config())
    real_prefill, calls = engine._prefill, []

    def flaky(chunks):
        calls.append(len(chunks))
        if len(calls) == 2:
            if donated:
                engine._state.k.delete()
            raise RuntimeError("device fell over")
        return real_prefill(chunks)

    engine._prefill = flaky
    engine.start()
    try:
        running = _submit(engine, (5, 9, 17, 33), 48)  # 12 slices: still running when `broken` comes
        while engine.stats["slices"] == 0:
            running.done.wait(0.005)
        broken = _submit(engine, (100, 3), 6)
        assert broken.done.wait(120) and running.done.wait(120)
        later = _submit(engine, (7, 8), 5)
        assert later.done.wait(120)
    finally:
        engine.close()
    assert isinstance(broken.events[-1], Failed) and "device fell over" in broken.events[-1].message
    assert running.events[-1] == Finished(0, "length", running.events[-1].text,
                                          greedy_ids(config, params, (5, 9, 17, 33), 48, CONTEXT))
    assert (engine.stats["recomputed_tokens"] > 0) == donated
    assert later.events[-1].token_ids == greedy_ids(config, params, (7, 8), 5, CONTEXT)


def test_warmup_compiles_every_prefill_shape_the_requests_then_meet(tiny_model):
    """With `warmup_tokens`, `start` compiles the prefill for every count of distinct prompts and rows written and
    every width bucket up to that many tokens and the greedy and the sampling slice for every (decode rows, pages
    read) bucket: greedy and sampled
    requests of those shapes then compile neither (and greedy ones still decode as if alone)."""
    from trace_jax.rollout import paged
    from trace_jax.serve.engine import Finished

    config, params = tiny_model
    engine = Engine(config, params, _IdsTokenizer(), stop_ids=(), engine=EngineConfig(  # shapes no other test meets
        max_batch=3, max_context=32, slice_tokens=4, batch_wait_s=0.05, warmup_tokens=20)).start()
    try:
        compiled = paged.compiled_programs("paged_prefill"), paged.compiled_programs("paged_decode")
        jobs = [((3,) * 19, 3, 1), ((4, 5), 3, 1), ((6,) * 9, 3, 2)]  # 3 distinct prompts of 2-19 tokens together
        pending = [_submit(engine, prompt, max_tokens, n) for prompt, max_tokens, n in jobs]
        assert all(collect.done.wait(120) for collect in pending)
        later = _submit(engine, (9,) * 17, 4)
        sampled = _Collect()
        engine.submit(GenerationRequest(prompt_ids=[9] * 5, max_tokens=6, emit=sampled, seed=3,
                                        sampling=SamplingConfig(temperature=0.9, top_p=0.9)))
        assert later.done.wait(120) and sampled.done.wait(120)
    finally:
        engine.close()
    assert (paged.compiled_programs("paged_prefill"), paged.compiled_programs("paged_decode")) == compiled
    for (prompt, max_tokens, n), collect in zip(jobs + [((9,) * 17, 4, 1)], pending + [later]):
        finished = [e for e in collect.events if isinstance(e, Finished)]
        # the reference's cache size does not change its greedy tokens: CONTEXT's programs are the other tests'
        assert len(finished) == n and all(e.token_ids == greedy_ids(config, params, prompt, max_tokens, CONTEXT)
                                          for e in finished)
    with pytest.raises(ValueError, match="warmup_tokens"):
        EngineConfig(max_context=64, warmup_tokens=65)


def test_a_failed_warmup_is_raised_by_start(tiny_model):
    config, _ = tiny_model
    engine = Engine(config, {}, _IdsTokenizer(), stop_ids=(), engine=_engine_config(warmup_tokens=8))
    with pytest.raises(RuntimeError, match="warm-up failed"):
        engine.start()


class _CountingIdsTokenizer(_IdsTokenizer):
    def __init__(self):
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=False):
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens)


def test_requests_of_different_sampling_values_share_a_batch_and_draw_as_if_alone(tiny_model):
    """Per-row sampling values and keys: a seeded request batched with one of another temperature and top-p gives
    the tokens it gives alone; both were decoded in the same slices."""
    from trace_jax.serve.engine import Finished

    config, params = tiny_model
    engine = Engine(config, params, _IdsTokenizer(), stop_ids=(), engine=_engine_config())
    cool = dict(sampling=SamplingConfig(temperature=0.7), seed=5)
    hot = dict(sampling=SamplingConfig(temperature=1.5, top_p=0.8), seed=2 ** 63 - 1)
    first, second = _collect(), _collect()  # queued before the engine starts: admitted into one batch
    engine.submit(GenerationRequest(prompt_ids=[5, 9, 17], max_tokens=10, emit=first, **cool))
    engine.submit(GenerationRequest(prompt_ids=[44, 45], max_tokens=10, emit=second, n=2, **hot))
    engine.start()
    try:
        assert first.done.wait(120) and second.done.wait(120)
        assert engine.stats["max_rows"] == 3
        alone = _collect()
        engine.submit(GenerationRequest(prompt_ids=[5, 9, 17], max_tokens=10, emit=alone, **cool))
        assert alone.done.wait(120)
    finally:
        engine.close()
    batched = [e for e in first.events if isinstance(e, Finished)]
    assert batched == [e for e in alone.events if isinstance(e, Finished)]
    assert batched[0].token_ids != greedy_ids(config, params, (5, 9, 17), 10, CONTEXT)  # it really sampled
    choices = [e.token_ids for e in second.events if isinstance(e, Finished)]
    assert len(choices) == 2 and choices[0] != choices[1]  # n choices draw from different keys


def test_an_error_in_one_request_fails_only_that_request(tiny_model):
    """A request whose handling raises on the engine's thread (here its event callback) gets `Failed`; the request
    batched with it finishes with its exact greedy tokens and the engine stays alive."""
    from trace_jax.serve.engine import Failed, TextDelta

    config, params = tiny_model
    engine = Engine(config, params, _IdsTokenizer(), stop_ids=(), engine=_engine_config())
    broken, healthy = _collect(), _Collect()

    def explode(event):
        broken(event)
        if isinstance(event, TextDelta):
            raise RuntimeError("bug in one request's handling")

    engine.submit(GenerationRequest(prompt_ids=[5, 9, 17], max_tokens=12, emit=explode,
                                    sampling=SamplingConfig(greedy=True)))
    engine.submit(GenerationRequest(prompt_ids=[7, 8], max_tokens=12, emit=healthy,
                                    sampling=SamplingConfig(greedy=True)))
    engine.start()
    try:
        assert healthy.done.wait(120)
        assert engine.health()["alive"] and engine.stats["failed"] == 1
    finally:
        engine.close()
    assert healthy.events[-1].token_ids == greedy_ids(config, params, (7, 8), 12, CONTEXT)
    assert isinstance(broken.events[-1], Failed) and "bug in one request" in broken.events[-1].message


def test_out_of_range_seeds_and_bad_fields_are_refused_before_the_worker(tiny_model):
    engine = Engine(None, None, None, stop_ids=(0,), engine=EngineConfig(max_context=16))  # not started
    for fields in (dict(seed=2 ** 63), dict(seed=-(2 ** 63) - 1), dict(max_tokens=0), dict(n=0), dict(stop=("",))):
        with pytest.raises(ValueError):
            engine.submit(dataclasses.replace(_request(), **fields))
    assert not engine._pending


def test_health_reports_a_stalled_and_a_dead_engine(tiny_model):
    """The heartbeat: a loop that has not turned for heartbeat_timeout_s is reported; a worker that stopped is
    reported at once, and new requests are refused instead of queueing for nobody."""
    import threading

    from trace_jax.serve.engine import EngineDead

    config, params = tiny_model
    engine = Engine(config, params, _IdsTokenizer(), stop_ids=(), engine=_engine_config(heartbeat_timeout_s=0.3))
    release, prefill = threading.Event(), engine._prefill

    def stuck(chunks):
        release.wait(60)
        return prefill(chunks)

    engine._prefill = stuck
    engine.start()
    try:
        assert engine.health()["alive"]
        waiting = _submit(engine, (5, 9), 3)
        time.sleep(0.6)
        health = engine.health()
        assert not health["alive"] and "has not turned" in health["reason"]
        release.set()
        assert waiting.done.wait(120)
        # alive again once the loop turns (the step that finished the request, its decode compile included, may
        # itself have taken longer than the 0.3 s timeout on a busy machine)
        deadline = time.monotonic() + 30
        while not engine.health()["alive"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.health()["alive"], engine.health()

        def die(rows):
            raise SystemExit("simulated bug in the loop")

        engine._admit_locked = die
        doomed = _submit(engine, (5, 9), 3)
        assert doomed.done.wait(60)  # failed, not left waiting
        engine._thread.join(60)
        health = engine.health()
        assert not health["alive"] and "SystemExit" in health["reason"]
        with pytest.raises(EngineDead, match="stopped"):
            _submit(engine, (5, 9), 3)
    finally:
        engine.close()


def test_stop_string_scanning_is_linear_in_the_text(tiny_model):
    """With a stop string to look for every slice, the ids decoded stay a few times those generated (the whole text
    decoded every slice would be ~300^2 / 2 / 4 = 11k for 300 tokens in slices of 4)."""
    from trace_jax.serve.engine import Finished

    config, params = tiny_model
    tokenizer = _CountingIdsTokenizer()
    engine = Engine(config, params, tokenizer, stop_ids=(), engine=_engine_config()).start()
    try:
        collect = _submit(engine, (5, 9, 17), 300, stop=("never appears",), stream=True)
        assert collect.done.wait(300)
    finally:
        engine.close()
    (finished,) = [e for e in collect.events if isinstance(e, Finished)]
    assert len(finished.token_ids) == 300 and finished.text == _IdsTokenizer().decode(finished.token_ids)
    assert tokenizer.decoded <= 4 * 300 + 64, tokenizer.decoded
