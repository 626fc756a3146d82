"""The batching generation engine behind `trace-jax serve`: many requests decoded together by the project's sampler.

One worker thread owns a `SamplerState` of `max_batch` rows (the KV cache) and runs the sampler in *slices* of
`slice_tokens` decode steps (`trace_jax.rollout.sampler.generate` with a per-row budget). Between slices it retires
rows that finished and admits waiting requests into free rows (`sampler.prefill_rows`: only the new prompts run
through the model and are written into their rows), so a long request never holds a short one back for more than
one slice (continuous batching at slice granularity). A request with `n > 1` takes `n` rows and one prefill.

Sampling values are per row and traced (`sampler.RowSampling`): requests of any temperature, top-p or seed share
the running batch, and a new temperature compiles nothing. Every row has its own key: choice `c` of a request with
`seed` uses `fold_in(key(seed), c)` (unseeded requests: a key from the engine's `seed` and the request's serial
number), and the slice that starts at the row's `t`-th generated token folds in `t`, so a row's tokens do not depend
on what it was batched with, and the same seeded request gives the same tokens. Greedy output does not depend on
the batch: a served greedy request equals the sampler's greedy output for the same prompt.

Results stream out as events through the request's `emit` callback (called on the worker thread; the HTTP layer
hands them to its event loop): `TextDelta` (new text, with stop strings and incomplete UTF-8 held back),
`Finished` (per choice) and `Failed` (the whole request). Text is decoded incrementally (a window of the last
tokens per slice) and stop strings are looked for only in the text not yet sent, so a choice costs time linear in
its length.

Failures stay with their request: an error while admitting, decoding or emitting one request fails that request
(a device failure fails the rows whose cache it took); the worker thread goes on. It stamps a heartbeat on every
turn of its loop; `health()` reports whether it is alive (the HTTP layer's `/health`).

This module knows nothing about HTTP, JSON, chat formats or tools: prompts are token ids, results are text.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable, Sequence

import jax
import numpy as np

from trace_jax.rollout import sampler as sampler_lib
from trace_jax.rollout.sampler import SamplingConfig


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine batches.

    Attributes:
      max_batch: rows decoded together (the concurrency limit; a request with `n` choices takes `n` rows).
      max_queue: requests waiting for rows before new ones are refused (`QueueFull`, HTTP 429).
      max_context: cache slots per row: prompt + generated tokens of one choice never exceed it.
      slice_tokens: decode steps between admissions of waiting requests.
      batching: False serves one request at a time (the baseline of benchmarks/serve_bench.py).
      sync_every: decode steps between host reads of the stop flags inside a slice (see `sampler.generate`); the
        default, one read per slice, keeps host round trips (which dominate small models) to one per slice.
      seed: key of the unseeded requests' sampling.
      batch_wait_s: when the engine is idle and a request arrives, wait up to this long for more to arrive before
        starting, so a burst of arrivals forms one batch instead of a one-row slice followed by the rest (a
        dynamic batcher's queue delay; it never delays a request that can join a running batch).
      warmup_tokens: at `start`, before serving, compile the prefill of every count of distinct prompts (1, 2, 4,
        .. up to max_batch) at every length bucket up to this many prompt tokens, and the greedy decode slice at
        every cache-read bucket up to max_context, so the first requests of each shape do not stall the batch for
        a compile (0 = compile on first use). Both slice programs are compiled: all rows greedy, and any row
        sampling (every temperature, top-p and seed shares it).
      heartbeat_timeout_s: `health()` reports the engine dead when its loop has not turned for this long (a
        compile of a big model's program takes a while; the thread having exited is reported at once).
    """

    max_batch: int = 16
    max_queue: int = 256
    max_context: int = 2048
    slice_tokens: int = 16
    batching: bool = True
    sync_every: int = 16
    seed: int = 0
    batch_wait_s: float = 0.005
    warmup_tokens: int = 0
    heartbeat_timeout_s: float = 300.0

    def __post_init__(self):
        if (not isinstance(self.warmup_tokens, int) or isinstance(self.warmup_tokens, bool)
                or not 0 <= self.warmup_tokens <= self.max_context):
            raise ValueError(f"EngineConfig.warmup_tokens must be an int in [0, max_context={self.max_context}], got "
                             f"{self.warmup_tokens!r}")
        for name in ("max_batch", "max_queue", "max_context", "slice_tokens", "sync_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")
        if not 0 < self.heartbeat_timeout_s < float("inf"):
            raise ValueError(f"EngineConfig.heartbeat_timeout_s must be a positive number of seconds, got "
                             f"{self.heartbeat_timeout_s!r}")
        if not 0 <= self.batch_wait_s <= 10:
            raise ValueError(f"EngineConfig.batch_wait_s must be in [0, 10] seconds, got {self.batch_wait_s!r}")
        if self.max_context < 2:
            raise ValueError(f"EngineConfig.max_context must be >= 2 (a prompt token and a generated one), got "
                             f"{self.max_context}")


@dataclasses.dataclass(frozen=True)
class TextDelta:
    choice: int
    text: str


@dataclasses.dataclass(frozen=True)
class Finished:
    """One choice is complete. `reason` is "stop" (stop token or stop string) or "length" (budget or context)."""

    choice: int
    reason: str
    text: str
    token_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Failed:
    message: str


Event = TextDelta | Finished | Failed


_GREEDY = SamplingConfig(greedy=True)
# `jax.random.fold_in` as one compiled program: called eagerly it dispatches several primitives, each with
# its own host overhead. `_fold_in_rows` derives every row's key of a slice in one dispatch.
_fold_in = jax.jit(jax.random.fold_in)
_fold_in_rows = jax.jit(jax.vmap(jax.random.fold_in))

SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # OpenAI's `seed` is an int64
# Incremental decoding decodes the tokens since the last stable point; an id sequence that never decodes to
# complete characters (a random model can write lone UTF-8 continuation bytes) is accepted as it is after this many
# tokens, so the window stays bounded.
MAX_DECODE_WINDOW = 64


class QueueFull(RuntimeError):
    """The engine's queue holds `max_queue` requests; the client should retry later."""


class EngineDead(RuntimeError):
    """The engine's worker thread is not running (it failed or the server is shutting down)."""


def seed_key(seed: int) -> np.ndarray:
    """The raw key of a request's `seed` (any int64), as a host array: both 32-bit halves folded into a key, so no
    seed overflows the 32-bit integers JAX uses by default."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ValueError(f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {seed!r}")
    seed %= 1 << 64
    key = _fold_in(jax.random.PRNGKey(0), np.uint32(seed & 0xFFFFFFFF))
    return np.asarray(_fold_in(key, np.uint32(seed >> 32)))


@dataclasses.dataclass
class GenerationRequest:
    """One request: `n` choices continuing `prompt_ids`.

    Attributes:
      prompt_ids: the prompt's token ids (non-empty; the caller checks it fits the context).
      max_tokens: generated tokens per choice at most (>= 1).
      sampling: how tokens are drawn.
      n: choices.
      stop: stop strings; the text ends before the first one (not included).
      seed: any int64; its choices draw from keys derived from it alone (the same tokens whatever the batch);
        None: keys from the engine's `seed` and the request's arrival.
      emit: called with every `Event` of this request, on the engine's thread.
      stream: send `TextDelta`s as text arrives; False sends only `Finished` (and `Failed`), and the engine then
        decodes a choice's text once, when it finishes, unless stop strings need checking every slice.
    """

    prompt_ids: Sequence[int]
    max_tokens: int
    sampling: SamplingConfig
    emit: Callable[[Event], None]
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = True
    cancelled: bool = False  # set by the caller (client went away): rows are freed at the next slice


@dataclasses.dataclass
class _Row:
    """A choice in a row. Its text so far is `pieces` (sent) + `pending` (held back: a possible start of a stop
    string or an incomplete character); `prefix_offset`/`read_offset` delimit the ids decoded last time."""

    request: GenerationRequest
    choice: int
    generated: list
    budget_left: int
    key: np.ndarray
    pieces: list = dataclasses.field(default_factory=list)
    pending: str = ""
    prefix_offset: int = 0
    read_offset: int = 0


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` may still become part of a stop string or a multi-byte character."""
    hold = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                hold = max(hold, size)
                break
    if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence decodes as U+FFFD until its last byte arrives
        hold = max(hold, len(text) - len(text.rstrip("\ufffd")))
    return hold


class Engine:
    """Owns the model, the sampler state and the worker thread. `submit` is thread-safe.

    Args:
      config, params: the model (`trace_jax.models`).
      tokenizer: decodes generated ids.
      stop_ids: token ids that end a choice (e.g. `<|im_end|>` and eos); the stop token is not part of the text.
      engine: batching settings.
    """

    def __init__(self, config, params, tokenizer, stop_ids: Sequence[int], engine: EngineConfig = EngineConfig()):
        self.model_config = config
        self.params = params
        self.tokenizer = tokenizer
        self.stop_ids = tuple(int(i) for i in stop_ids)
        self.config = engine
        self._pending: collections.deque[GenerationRequest] = collections.deque()
        self._wake = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._heartbeat = time.monotonic()
        self._death: str | None = None
        self.stats = {"slices": 0, "requests": 0, "tokens": 0, "max_rows": 0, "failed": 0, "cancelled_rows": 0}

    # -- public --------------------------------------------------------------------------------------------------
    def start(self) -> "Engine":
        """Start the worker; returns once it is ready to serve (after the warm-up, whose errors it raises)."""
        if self._thread is None:
            self._ready.clear()
            self._thread = threading.Thread(target=self._run, name="trace-jax-serve-engine", daemon=True)
            self._thread.start()
            self._ready.wait()
            if self._startup_error is not None:
                self._thread.join()
                self._thread = None
                raise RuntimeError(f"the engine's warm-up failed: {self._startup_error}") from self._startup_error
        return self

    def health(self) -> dict:
        """`{"alive": bool, "heartbeat_age_s": float, "reason": str | None}`: alive while the worker thread runs
        and its loop turned within `heartbeat_timeout_s`."""
        age = time.monotonic() - self._heartbeat
        reason = None
        if self._thread is None or not self._thread.is_alive():
            reason = self._death or "the engine is not running"
        elif age > self.config.heartbeat_timeout_s:
            reason = (f"the engine's loop has not turned for {age:.0f} s (more than heartbeat_timeout_s="
                      f"{self.config.heartbeat_timeout_s:g})")
        return {"alive": reason is None, "heartbeat_age_s": round(age, 3), "reason": reason}

    def close(self, timeout: float = 30.0) -> None:
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; its events arrive through `request.emit`. Raises `QueueFull`, `EngineDead` or
        `ValueError` (a request the engine cannot serve as given)."""
        for name in ("n", "max_tokens"):
            value = getattr(request, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if request.seed is not None:
            seed_key(request.seed)  # raises for a seed out of range, here rather than on the worker thread
        if not isinstance(request.sampling, SamplingConfig) or request.sampling.top_k:
            raise ValueError("sampling must be a SamplingConfig without top_k (the served batch shares one top_k)")
        if any(not isinstance(stop, str) or not stop for stop in request.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {request.stop!r}")
        if request.n > self.config.max_batch:
            raise ValueError(f"n={request.n} is more than the server's batch of {self.config.max_batch} rows; "
                             f"ask for at most {self.config.max_batch} choices")
        if len(request.prompt_ids) + request.max_tokens > self.config.max_context:
            raise ValueError(f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_tokens}) is more "
                             f"than the context of {self.config.max_context} tokens")
        with self._wake:
            if self._closing:
                raise EngineDead("the server is shutting down")
            if self._death is not None:
                raise EngineDead(self._death)
            if len(self._pending) >= self.config.max_queue:
                raise QueueFull(f"{len(self._pending)} requests are already waiting (the queue holds "
                                f"{self.config.max_queue}); retry later")
            self._pending.append(request)
            self._wake.notify_all()

    # -- worker --------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            state = self._fresh_state()
            if self.config.warmup_tokens:
                state = self._warmup(state)
        except BaseException as error:  # reported by start()
            self._startup_error = error
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve(state)
        except BaseException as error:  # a bug in the loop itself: say so in /health, refuse new requests
            self._death = f"the engine stopped: {type(error).__name__}: {error}"
            logging.getLogger(__name__).critical(self._death, exc_info=True)
            with self._wake:
                failed = list(self._pending)
                self._pending.clear()
            self._fail(failed, error)

    def _serve(self, state) -> None:
        batch = self.config.max_batch
        rows: list[_Row | None] = [None] * batch
        base_key = jax.random.PRNGKey(self.config.seed)
        no_key = np.zeros_like(np.asarray(base_key))  # the key of an empty row (it draws nothing)
        serial = 0  # requests admitted: the key of an unseeded request
        while True:
            self._heartbeat = time.monotonic()
            with self._wake:
                if self._closing:
                    break
                running = any(r is not None for r in rows)
                if not running and not self._pending:
                    self._wake.wait(min(0.5, self.config.heartbeat_timeout_s / 4))  # idle, but the heartbeat goes on
                    continue
                if not running and self.config.batching and self.config.batch_wait_s > 0:
                    deadline = time.monotonic() + self.config.batch_wait_s
                    while (not self._closing and sum(r.n for r in self._pending) < batch
                           and time.monotonic() < deadline):
                        self._wake.wait(max(0.0, deadline - time.monotonic()))
                requests = self._admit_locked(rows)
            admitted = []
            free = [i for i, r in enumerate(rows) if r is None]
            for request in requests:
                try:
                    if request.seed is not None:
                        key = seed_key(request.seed)
                    else:
                        key = np.asarray(_fold_in(base_key, np.uint32(serial & 0xFFFFFFFF)))
                    serial += 1
                    choices = [_Row(request, choice, [], request.max_tokens,
                                    np.asarray(_fold_in(key, np.uint32(choice)))) for choice in range(request.n)]
                    admitted += [(free.pop(0), row) for row in choices]
                except Exception as error:  # this request only
                    self._fail([request], error)
            if admitted:
                try:
                    state = self._prefill(state, admitted)
                except Exception as error:  # a device failure must fail the requests, not kill the server
                    failed = [r for _, r in admitted]
                    if state.cache.k.is_deleted():  # the donated state is gone: so are the running rows' caches
                        failed += [r for r in rows if r is not None]
                        rows = [None] * batch
                        state = self._fresh_state()
                    self._fail({id(r.request): r.request for r in failed}.values(), error)
                    continue
                for row_index, row in admitted:
                    rows[row_index] = row
            for index, row in enumerate(rows):
                if row is not None and row.request.cancelled:
                    rows[index] = None
                    self.stats["cancelled_rows"] += 1
            if not any(r is not None for r in rows):
                continue
            active = np.array([r is not None for r in rows])
            budgets = np.array([min(self.config.slice_tokens, r.budget_left) if r else 0 for r in rows], np.int32)
            try:
                sampling, keys = self._slice_sampling([r.request.sampling if r else _GREEDY for r in rows],
                                                      [r.key if r else no_key for r in rows],
                                                      [len(r.generated) if r else 0 for r in rows])
                # A slice has at most slice_tokens steps: reading the stop flags later than that would dispatch
                # steps in which every row is already out of budget.
                state, generation = sampler_lib.generate(
                    self.model_config, self.params, state, rng=keys, active=active, max_new_tokens=budgets,
                    stop_ids=self.stop_ids, sampling=sampling,
                    sync_every=min(self.config.sync_every, self.config.slice_tokens))
            except Exception as error:
                self._fail({id(r.request): r.request for r in rows if r}.values(), error)
                rows = [None] * batch
                state = self._fresh_state()
                continue
            self.stats["slices"] += 1
            self.stats["max_rows"] = max(self.stats["max_rows"], int(active.sum()))
            for index, row in enumerate(rows):
                if row is None:
                    continue
                try:
                    tokens = [int(t) for t in generation.tokens[index]]
                    self.stats["tokens"] += len(tokens)
                    row.generated += tokens
                    row.budget_left -= len(tokens)
                    reason = int(generation.stop_reason[index])
                    done = None
                    if reason == sampler_lib.STOP_TOKEN:
                        done = "stop"
                    elif reason == sampler_lib.CONTEXT_FULL or row.budget_left <= 0:
                        done = "length"
                    finished = self._emit_progress(row, done)
                except Exception as error:  # this request only: its other rows go at the next slice
                    self._fail([row.request], error)
                    row.request.cancelled = finished = True
                if finished:
                    rows[index] = None

    def _admit_locked(self, rows) -> list[GenerationRequest]:
        """Take waiting requests, in arrival order, while their choices fit the free rows."""
        admitted: list[GenerationRequest] = []
        free = sum(r is None for r in rows)
        running = free < len(rows)
        while self._pending:
            request = self._pending[0]
            if request.cancelled:
                self._pending.popleft()
                continue
            if not self.config.batching and (running or admitted):
                break
            if request.n > free:
                break
            self._pending.popleft()
            self.stats["requests"] += 1
            free -= request.n
            admitted.append(request)
        return admitted

    def _fresh_state(self):
        """An empty sampler state, created on its device by the sampler's initialiser (`init_state_program`) and
        so committed to it, as every program's outputs then are: a program compiles once per placement of its
        arguments, so a state of uncommitted arrays would compile some shapes twice."""
        return sampler_lib.init_state(self.model_config, self.config.max_batch, self.config.max_context)

    def _set_lengths(self, state, value: int):
        lengths = jax.device_put(np.full(self.config.max_batch, value, np.int32), state.cache.lengths.sharding)
        return state.replace(cache=state.cache.replace(lengths=lengths))

    def _warmup(self, state):
        """Run (and so compile) every prefill shape up to `warmup_tokens` prompt tokens, and the greedy and the
        sampling slice at every cache-read bucket; returns the state with every row empty again."""
        batch, context, bucket = self.config.max_batch, self.config.max_context, sampler_lib.bucket_length
        # The shapes `prefill_rows` pads to: prompt widths, and counts of distinct prompts (each count's bucket
        # is met by passing that many prompts, at most the batch).
        widths = sorted({min(bucket(n), context) for n in range(1, self.config.warmup_tokens + 1)})
        counts = sorted({min(bucket(n, minimum=1), batch) for n in range(1, batch + 1)})
        for width in widths:
            length = min(width, context - 1)  # leave a slot to decode into
            for count in counts:
                prompts = [[(i + 1) % self.model_config.vocab_size] * length for i in range(count)]
                state = sampler_lib.prefill_rows(self.model_config, self.params, state, list(range(count)), prompts)
        # A slice reads `bucket(longest row + steps)` cache slots (`sampler.generate`): one program per bucket up
        # to the whole cache. Rows are set to the shortest length that reads each bucket (the cache holds warm-up
        # garbage; only the programs matter).
        steps = min(self.config.sync_every, self.config.slice_tokens)
        lengths: dict[int, int] = {}
        for length in range(1, context - steps + 1):
            lengths.setdefault(min(bucket(length + steps), context), length)
        budgets = np.full(batch, self.config.slice_tokens, np.int32)
        keys = [np.zeros_like(np.asarray(jax.random.PRNGKey(0)))] * batch
        for length in lengths.values():
            for setting in (_GREEDY, SamplingConfig()):
                sampling, rng = self._slice_sampling([setting] * batch, keys, [0] * batch)
                state = self._set_lengths(state, length)
                state, _ = sampler_lib.generate(self.model_config, self.params, state, rng=rng,
                                                active=np.ones(batch, bool), max_new_tokens=budgets,
                                                stop_ids=self.stop_ids, sampling=sampling, sync_every=steps)
        return self._set_lengths(state, 0)

    @staticmethod
    def _slice_sampling(settings, keys, generated):
        """The per-row sampling values and keys of a slice: row b's key folds in its count of generated tokens,
        so its draws do not depend on the slices it shared. Two programs per cache-read bucket, whatever the
        values: all rows greedy, or any row sampling (then with the top-p filter)."""
        sampling = sampler_lib.RowSampling.of(settings)
        sampling = sampling.replace(filter_top_p=sampling.sample)
        return sampling, _fold_in_rows(np.stack(keys), np.asarray(generated, np.uint32))

    def _prefill(self, state, admitted):
        """Put the admitted rows' prompts into their rows (their old tokens are dropped; other rows are untouched)."""
        return sampler_lib.prefill_rows(self.model_config, self.params, state, [index for index, _ in admitted],
                                        [row.request.prompt_ids for _, row in admitted])

    def _new_text(self, row: _Row, ids: Sequence[int], final: bool) -> str:
        """The text `ids` (the row's generated ids) add since the last call, decoding only the ids since the
        previous stable point (incremental detokenization, as in vLLM): the decoded window's text minus the text of
        the ids already read. Waits while the window ends in an incomplete character, unless `final` or the window
        is `MAX_DECODE_WINDOW` tokens long."""
        if len(ids) <= row.read_offset and not final:
            return ""
        decode = self.tokenizer.decode
        window = decode(ids[row.prefix_offset:], skip_special_tokens=False)
        if window.endswith("\ufffd") and not final and len(ids) - row.prefix_offset < MAX_DECODE_WINDOW:
            return ""
        known = decode(ids[row.prefix_offset:row.read_offset], skip_special_tokens=False)
        row.prefix_offset, row.read_offset = row.read_offset, len(ids)
        return window[len(known):]

    def _emit_progress(self, row: _Row, done: str | None) -> bool:
        """Send the row's new text; returns True when the choice is finished (its row is free). Stop strings are
        looked for only in the text not sent yet (what was sent cannot start one: `_held_back`)."""
        stops = row.request.stop
        incremental = row.request.stream or bool(stops)
        if done is None and not incremental:
            return False  # nothing to send before the end and no stop string to look for
        ids = row.generated
        if done == "stop" and ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        if not incremental:  # decoded once, when it finishes
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            row.request.emit(Finished(row.choice, done, text, tuple(ids)))
            return True
        unsent = row.pending + self._new_text(row, ids, final=done is not None)
        if stops:
            cut = min((unsent.find(s) for s in stops if s in unsent), default=-1)
            if cut >= 0:
                unsent, done = unsent[:cut], "stop"
        hold = 0 if done is not None else _held_back(unsent, stops)
        ready, row.pending = unsent[:len(unsent) - hold], unsent[len(unsent) - hold:]
        if ready:
            row.pieces.append(ready)
            if row.request.stream:
                row.request.emit(TextDelta(row.choice, ready))
        if done is not None:
            row.request.emit(Finished(row.choice, done, "".join(row.pieces), tuple(ids)))
        return done is not None

    def _fail(self, requests, error: BaseException) -> None:
        """Send `Failed` to each request (once) and drop its rows at the next slice."""
        for request in requests:
            if request.cancelled:
                continue
            request.cancelled = True
            self.stats["failed"] += 1
            try:
                request.emit(Failed(f"generation failed: {type(error).__name__}: {error}"))
            except Exception:
                pass
