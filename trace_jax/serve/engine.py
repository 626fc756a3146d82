"""The batching generation engine behind `trace-jax serve`: many requests decoded together by the project's sampler.

One worker thread owns a `SamplerState` of `max_batch` rows (the KV cache) and runs the sampler in *slices* of
`slice_tokens` decode steps (`trace_jax.rollout.sampler.generate` with a per-row budget). Between slices it retires
rows that finished and admits waiting requests into free rows (`sampler.prefill_rows`: only the new prompts run
through the model and are written into their rows), so a long request never holds a short one back for more than
one slice (continuous batching at slice granularity). A request with `n > 1` takes `n` rows and one prefill.

The sampler's sampling settings are one static configuration per decode step and its random key is one per step
for the whole batch, so:
  * requests share the running batch only when their `SamplingConfig` equals the batch's (greedy requests batch
    with greedy ones, and so on); a request that differs waits until the batch drains (FIFO, no overtaking);
  * a request with a `seed` runs alone (its `n` rows only), with keys `fold_in(PRNGKey(seed), slice)`, so the
    same request with the same seed gives the same tokens.
Greedy output does not depend on the batch: a served greedy request equals the sampler's greedy output for the same
prompt.

Results stream out as events through the request's `emit` callback (called on the worker thread; the HTTP layer
hands them to its event loop): `TextDelta` (new text, with stop strings and incomplete UTF-8 held back),
`Finished` (per choice) and `Failed` (the whole request).

This module knows nothing about HTTP, JSON, chat formats or tools: prompts are token ids, results are text.
"""

from __future__ import annotations

import collections
import dataclasses
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
        a compile (0 = compile on first use; other sampling settings compile their slices on first use).
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

    def __post_init__(self):
        if (not isinstance(self.warmup_tokens, int) or isinstance(self.warmup_tokens, bool)
                or not 0 <= self.warmup_tokens <= self.max_context):
            raise ValueError(f"EngineConfig.warmup_tokens must be an int in [0, max_context={self.max_context}], got "
                             f"{self.warmup_tokens!r}")
        for name in ("max_batch", "max_queue", "max_context", "slice_tokens", "sync_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")
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


# `jax.random.fold_in` as one compiled program: called eagerly it dispatches several primitives, each with
# its own host overhead, and the engine derives a key for every slice.
_fold_in = jax.jit(jax.random.fold_in)


class QueueFull(RuntimeError):
    """The engine's queue holds `max_queue` requests; the client should retry later."""


@dataclasses.dataclass
class GenerationRequest:
    """One request: `n` choices continuing `prompt_ids`.

    Attributes:
      prompt_ids: the prompt's token ids (non-empty; the caller checks it fits the context).
      max_tokens: generated tokens per choice at most (>= 1).
      sampling: how tokens are drawn.
      n: choices.
      stop: stop strings; the text ends before the first one (not included).
      seed: run alone with this key (reproducible sampling); None shares the batch.
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
    request: GenerationRequest
    choice: int
    generated: list
    budget_left: int
    sent: str = ""


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
        self.stats = {"slices": 0, "requests": 0, "tokens": 0, "max_rows": 0}

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

    def close(self, timeout: float = 30.0) -> None:
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; its events arrive through `request.emit`. Raises `QueueFull` or `ValueError`."""
        if request.n > self.config.max_batch:
            raise ValueError(f"n={request.n} is more than the server's batch of {self.config.max_batch} rows; "
                             f"ask for at most {self.config.max_batch} choices")
        if len(request.prompt_ids) + request.max_tokens > self.config.max_context:
            raise ValueError(f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_tokens}) is more "
                             f"than the context of {self.config.max_context} tokens")
        with self._wake:
            if self._closing:
                raise QueueFull("the server is shutting down")
            if len(self._pending) >= self.config.max_queue:
                raise QueueFull(f"{len(self._pending)} requests are already waiting (the queue holds "
                                f"{self.config.max_queue}); retry later")
            self._pending.append(request)
            self._wake.notify_all()

    # -- worker --------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        batch = self.config.max_batch
        try:
            state = self._fresh_state()
            if self.config.warmup_tokens:
                state = self._warmup(state)
        except BaseException as error:  # reported by start()
            self._startup_error = error
            self._ready.set()
            return
        self._ready.set()
        rows: list[_Row | None] = [None] * batch
        sampling: SamplingConfig | None = None
        seeded = False
        base_key = jax.random.PRNGKey(self.config.seed)
        key = base_key
        tick = 0
        while True:
            with self._wake:
                if self._closing:
                    break
                running = any(r is not None for r in rows)
                if not running and not self._pending:
                    self._wake.wait(0.5)
                    continue
                if not running and self.config.batching and self.config.batch_wait_s > 0:
                    deadline = time.monotonic() + self.config.batch_wait_s
                    while (not self._closing and sum(r.n for r in self._pending) < batch
                           and time.monotonic() < deadline):
                        self._wake.wait(max(0.0, deadline - time.monotonic()))
                admitted = self._admit_locked(rows, sampling, seeded)
            if admitted:
                first = admitted[0][1].request
                if not running:
                    sampling, seeded = first.sampling, first.seed is not None
                    if seeded:
                        key, tick = jax.random.PRNGKey(first.seed), 0
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
            if not any(r is not None for r in rows):
                continue
            active = np.array([r is not None for r in rows])
            budgets = np.array([min(self.config.slice_tokens, r.budget_left) if r else 0 for r in rows], np.int32)
            if not seeded:
                key = _fold_in(base_key, self.stats["slices"])
            try:
                # A slice has at most slice_tokens steps: reading the stop flags later than that would dispatch
                # steps in which every row is already out of budget.
                state, generation = sampler_lib.generate(
                    self.model_config, self.params, state, rng=_fold_in(key, tick), active=active,
                    max_new_tokens=budgets, stop_ids=self.stop_ids, sampling=sampling,
                    sync_every=min(self.config.sync_every, self.config.slice_tokens))
            except Exception as error:
                self._fail({id(r.request): r.request for r in rows if r}.values(), error)
                rows = [None] * batch
                state = self._fresh_state()
                continue
            tick += 1
            self.stats["slices"] += 1
            self.stats["max_rows"] = max(self.stats["max_rows"], int(active.sum()))
            for index, row in enumerate(rows):
                if row is None:
                    continue
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
                if self._emit_progress(row, done):
                    rows[index] = None

    def _admit_locked(self, rows, sampling, seeded) -> list[tuple[int, _Row]]:
        """Move waiting requests into free rows, in arrival order, while they may share the batch."""
        admitted: list[tuple[int, _Row]] = []
        running = any(r is not None for r in rows)
        free = [i for i, r in enumerate(rows) if r is None]
        while self._pending:
            request = self._pending[0]
            if request.cancelled:
                self._pending.popleft()
                continue
            busy = running or bool(admitted)
            if busy:
                batch_sampling = sampling if running else admitted[0][1].request.sampling
                batch_seeded = seeded if running else admitted[0][1].request.seed is not None
                if (not self.config.batching or batch_seeded or request.seed is not None
                        or request.sampling != batch_sampling):
                    break
            if request.n > len(free):
                break
            self._pending.popleft()
            self.stats["requests"] += 1
            for choice in range(request.n):
                admitted.append((free.pop(0), _Row(request, choice, [], request.max_tokens)))
        return admitted

    def _fresh_state(self):
        """An empty sampler state with every array committed to its device, as every program's outputs then are:
        a program compiles once per placement of its arguments, so a state that mixed placements (fresh arrays
        are uncommitted, outputs of programs fed committed ones are committed) would compile some shapes twice."""
        state = sampler_lib.init_state(self.model_config, self.config.max_batch, self.config.max_context)
        return jax.tree_util.tree_map(lambda x: jax.device_put(x, x.sharding), state)

    def _set_lengths(self, state, value: int):
        lengths = jax.device_put(np.full(self.config.max_batch, value, np.int32), state.cache.lengths.sharding)
        return state.replace(cache=state.cache.replace(lengths=lengths))

    def _warmup(self, state):
        """Run (and so compile) every prefill shape up to `warmup_tokens` prompt tokens and a greedy slice at every
        cache-read bucket; returns the state with every row empty again."""
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
        for length in lengths.values():
            state = self._set_lengths(state, length)
            state, _ = sampler_lib.generate(self.model_config, self.params, state, rng=jax.random.PRNGKey(0),
                                            active=np.ones(batch, bool), max_new_tokens=budgets,
                                            stop_ids=self.stop_ids, sampling=SamplingConfig(greedy=True),
                                            sync_every=steps)
        return self._set_lengths(state, 0)

    def _prefill(self, state, admitted):
        """Put the admitted rows' prompts into their rows (their old tokens are dropped; other rows are untouched)."""
        return sampler_lib.prefill_rows(self.model_config, self.params, state, [index for index, _ in admitted],
                                        [row.request.prompt_ids for _, row in admitted])

    def _emit_progress(self, row: _Row, done: str | None) -> bool:
        """Send the row's new text; returns True when the choice is finished (its row is free)."""
        stops = row.request.stop
        if done is None and not row.request.stream and not stops:
            return False  # nothing to send before the end and no stop string to look for
        ids = row.generated
        if done == "stop" and ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if stops:
            cut = min((text.find(s) for s in stops if s and s in text), default=-1)
            if cut >= 0:
                text, done = text[:cut], "stop"
        if done is None:
            visible = text[:len(text) - _held_back(text, stops)]
        else:
            visible = text
        try:
            if row.request.stream and len(visible) > len(row.sent) and visible.startswith(row.sent):
                row.request.emit(TextDelta(row.choice, visible[len(row.sent):]))
                row.sent = visible
            if done is not None:
                row.request.emit(Finished(row.choice, done, text, tuple(ids)))
        except Exception:  # the client's side went away; its rows are freed below
            row.request.cancelled = True
            return True
        return done is not None

    def _fail(self, requests, error: Exception) -> None:
        for request in requests:
            try:
                request.emit(Failed(f"generation failed: {type(error).__name__}: {error}"))
            except Exception:
                pass
