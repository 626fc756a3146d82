"""The batching generation engine behind `trace-jax serve`: many requests decoded together on the paged KV cache.

One worker thread owns a page pool (`trace_jax.rollout.paged`: `EngineConfig.num_pages` pages of `page_size`
tokens, or what `kv_budget_gib` holds, shared by `max_batch` slots) and the host page tables of the choices it
serves. Each turn of its loop:

  * admits waiting requests, in arrival order, while a slot per choice and the pages of each choice's prompt and
    first slice are free (a request with `n > 1` takes `n` slots, and its choices' prompt runs through the model
    once: `paged.prefill_program` writes it into each choice's pages);
  * prefills the admitted prompts, `prefill_chunk` tokens of each per turn (at most `prefill_tokens` in one
    dispatch), so a long prompt does not hold the running rows back;
  * decodes the rows that generate, and only those, one slice of `slice_tokens` steps (`paged.decode_program`),
    each row given the pages of its slice first; a row whose choice finished (stop token, stop string, budget) or
    whose request failed or was cancelled gives its pages and slot back at once.

A long request never holds a short one back for more than one slice (continuous batching at slice granularity).
Memory held is what the choices' tokens take, not `max_batch` times `max_context`. When a row needs a page and
none is free, the newest row holding pages (the one admitted last) is preempted: its pages and slot go back, and
it is admitted again, before any new request, as soon as they are free, its prompt and generated tokens recomputed
into new pages (vLLM's recompute preemption). Nothing is lost or altered: a choice's tokens are host lists, and its
next token is drawn with the same key. A pool that holds one row of `max_context` always makes progress (the
oldest row can preempt every other); a device failure that took the pool recomputes the rows it did not fail.

Sampling values are per row and traced (`sampler.RowSampling`): requests of any temperature, top-p or seed share
the running batch, and a new temperature compiles nothing. Every row has its own key: choice `c` of a request with
`seed` uses `fold_in(key(seed), c)` (unseeded requests: a key from the engine's `seed` and the request's serial
number), and the slice that starts at the row's `t`-th generated token folds in `t` (its step s then `s`), so a
row's tokens do not depend on what it was batched with, nor on preemption, and the same seeded request gives the
same tokens (the dense engine's tokens before the paged port). Greedy output does not depend on the batch: a served
greedy request equals the model's greedy continuation of the prompt.

Results stream out as events through the request's `emit` callback (called on the worker thread; the HTTP layer
hands them to its event loop): `TextDelta` (new text, with stop strings and incomplete UTF-8 held back),
`Finished` (per choice) and `Failed` (the whole request). Text is decoded incrementally (a window of the last
tokens per slice) and stop strings are looked for only in the text not yet sent, so a choice costs time linear in
its length.

Failures stay with their request: an error while admitting, prefilling, decoding or emitting one request fails
that request (a device failure fails the requests of the dispatch that raised); the worker thread goes on. It
stamps a heartbeat on every turn of its loop; `health()` reports whether it is alive (the HTTP layer's `/health`).

This module knows nothing about HTTP, JSON, chat formats or tools: prompts are token ids, results are text.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import threading
import time
from typing import Callable, Sequence

import jax
import numpy as np

from trace_jax.rollout import paged as paged_lib
from trace_jax.rollout import sampler as sampler_lib
from trace_jax.rollout.sampler import SamplingConfig


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine batches.

    Attributes:
      max_batch: rows decoded together (the concurrency limit; a request with `n` choices takes `n` rows).
      max_queue: requests waiting for rows before new ones are refused (`QueueFull`, HTTP 429).
      max_context: tokens per row: prompt + generated tokens of one choice never exceed it.
      slice_tokens: decode steps between admissions of waiting requests, run as one device program (one host read
        of the stop flags per slice: host round trips dominate small models).
      batching: False serves one request at a time (the baseline of benchmarks/serve_bench.py).
      seed: key of the unseeded requests' sampling.
      batch_wait_s: when the engine is idle and a request arrives, wait up to this long for more to arrive before
        starting, so a burst of arrivals forms one batch instead of a one-row slice followed by the rest (a
        dynamic batcher's queue delay; it never delays a request that can join a running batch).
      warmup_tokens: at `start`, before serving, compile the prefill of every count of distinct prompts and of
        rows written (1, 2, 4, .. up to max_batch) at every width bucket up to this many prompt tokens (at most
        `prefill_chunk`), and the greedy and the sampling decode slice at every (decode rows, pages read) bucket
        up to the whole pool, so the first requests of each shape do not stall the batch for a compile (0 =
        compile on first use). Both slice programs are compiled: all rows greedy, and any row sampling (every
        temperature, top-p and seed shares it). The later chunks of prompts over `prefill_chunk` and recomputes
        after a preemption compile when first met.
      heartbeat_timeout_s: `health()` reports the engine dead when its loop has not turned for this long (a
        compile of a big model's program takes a while; the thread having exited is reported at once).
      page_size: tokens per page of the pool.
      num_pages: pages in the pool; at least one row of `max_context`. None: what `kv_budget_gib` holds, or, without
        a budget, `max_batch` rows of `max_context` (every row its whole context: no preemption).
      kv_budget_gib: GiB of the device the pool may take (`paged.pages_within_budget`); not with `num_pages`.
      prefill_chunk: prompt tokens of one row written by one prefill dispatch (longer prompts take several turns).
      prefill_tokens: tokens one prefill dispatch runs through the model at most (a prompt shared by `n` choices
        counts once); at least one row's chunk always runs.
    """

    max_batch: int = 16
    max_queue: int = 256
    max_context: int = 2048
    slice_tokens: int = 16
    batching: bool = True
    seed: int = 0
    batch_wait_s: float = 0.005
    warmup_tokens: int = 0
    heartbeat_timeout_s: float = 300.0
    page_size: int = 16
    num_pages: int | None = None
    kv_budget_gib: float | None = None
    prefill_chunk: int = 256
    prefill_tokens: int = 8192

    def __post_init__(self):
        if (not isinstance(self.warmup_tokens, int) or isinstance(self.warmup_tokens, bool)
                or not 0 <= self.warmup_tokens <= self.max_context):
            raise ValueError(f"EngineConfig.warmup_tokens must be an int in [0, max_context={self.max_context}], got "
                             f"{self.warmup_tokens!r}")
        for name in ("max_batch", "max_queue", "max_context", "slice_tokens", "page_size", "prefill_chunk",
                     "prefill_tokens"):
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
        if self.num_pages is not None and self.kv_budget_gib is not None:
            raise ValueError("EngineConfig: give num_pages or kv_budget_gib, not both (num_pages sizes the pool "
                             "itself)")
        if self.num_pages is not None:
            if not isinstance(self.num_pages, int) or isinstance(self.num_pages, bool) or self.num_pages < 1:
                raise ValueError(f"EngineConfig.num_pages must be an int >= 1 or None, got {self.num_pages!r}")
            if self.num_pages < self.row_pages:
                raise ValueError(f"EngineConfig.num_pages = {self.num_pages} pages of {self.page_size} tokens hold "
                                 f"less than one row of max_context = {self.max_context} ({self.row_pages} pages): "
                                 "raise num_pages or lower max_context")
        if self.kv_budget_gib is not None and not (isinstance(self.kv_budget_gib, (int, float))
                                                   and 0 < self.kv_budget_gib < math.inf):
            raise ValueError(f"EngineConfig.kv_budget_gib must be a positive number of GiB or None, got "
                             f"{self.kv_budget_gib!r}")

    @property
    def row_pages(self) -> int:
        """Pages of one row of `max_context` tokens."""
        return paged_lib.pages_for(self.max_context, self.page_size)

    def pool_pages(self, model_config) -> int:
        """The pool's page count for `model_config` (see `num_pages`); raises when a `kv_budget_gib` holds less
        than one row of `max_context`."""
        if self.num_pages is not None:
            return self.num_pages
        if self.kv_budget_gib is None:
            return self.max_batch * self.row_pages
        pages = paged_lib.pages_within_budget(model_config, self.page_size, self.kv_budget_gib)
        if pages < self.row_pages:
            raise ValueError(f"EngineConfig.kv_budget_gib = {self.kv_budget_gib:g} GiB holds {pages} pages of "
                             f"{self.page_size} tokens of this model, less than one row of max_context = "
                             f"{self.max_context} ({self.row_pages} pages): raise kv_budget_gib or lower "
                             "max_context")
        return pages


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
# A row's phases: WAITING for a slot and pages (preempted, or its state lost), PREFILL (tokens not yet in its
# pages), DECODE (generating).
WAITING, PREFILL, DECODE = "waiting", "prefill", "decode"


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


@dataclasses.dataclass(eq=False)  # rows are compared by identity
class _Row:
    """A choice in a row. Its text so far is `pieces` (sent) + `pending` (held back: a possible start of a stop
    string or an incomplete character); `prefix_offset`/`read_offset` delimit the ids decoded last time. Its
    tokens are `prompt + generated`, the first `cached` of them in its `pages`; `order` ranks admissions (the
    newest row is preempted first, the oldest waiting one re-admitted first)."""

    request: GenerationRequest
    choice: int
    prompt: list
    generated: list
    budget_left: int
    key: np.ndarray
    order: int
    phase: str = WAITING
    slot: int | None = None
    pages: list = dataclasses.field(default_factory=list)
    cached: int = 0
    recompute: bool = False
    pieces: list = dataclasses.field(default_factory=list)
    pending: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def tokens(self) -> list[int]:
        return self.prompt + self.generated


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
    """Owns the model, the page pool and the worker thread. `submit` is thread-safe.

    Args:
      config, params: the model (`trace_jax.models`).
      tokenizer: decodes generated ids.
      stop_ids: token ids that end a choice (e.g. `<|im_end|>` and eos); the stop token is not part of the text.
      engine: batching and pool settings.
    """

    def __init__(self, config, params, tokenizer, stop_ids: Sequence[int], engine: EngineConfig = EngineConfig()):
        self.model_config = config
        self.params = params
        self.tokenizer = tokenizer
        self.stop_ids = tuple(int(i) for i in stop_ids)
        self.config = engine
        # the pool's size, known before any request (a budget needs the model's page size in bytes)
        self.num_pages = engine.pool_pages(config) if config is not None or engine.kv_budget_gib is None else None
        self._pending: collections.deque[GenerationRequest] = collections.deque()
        self._wake = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._heartbeat = time.monotonic()
        self._death: str | None = None
        self._rows: list[_Row] = []  # admitted choices (holding a slot, or waiting to be re-admitted)
        self._state = self._allocator = self._layout = None
        self._slot_row = np.full(engine.max_batch, -1, np.int64)
        self._stop_arr = np.asarray(list(self.stop_ids) or [-1], np.int32)
        self.stats = {"slices": 0, "requests": 0, "tokens": 0, "max_rows": 0, "failed": 0, "cancelled_rows": 0,
                      "prefill_dispatches": 0, "prefill_tokens": 0, "preemptions": 0, "recomputed_tokens": 0,
                      "max_pages_held": 0}

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
        need = request.n * self._start_pages(len(request.prompt_ids), request.max_tokens)
        if self.num_pages is not None and need > self.num_pages:
            raise ValueError(f"n={request.n} choices of a {len(request.prompt_ids)}-token prompt need {need} pages of "
                             f"{self.config.page_size} tokens to start, more than the server's pool of "
                             f"{self.num_pages}; ask for fewer choices")
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
            self._reset_pool()
            if self.config.warmup_tokens:
                self._warmup()
        except BaseException as error:  # reported by start()
            self._startup_error = error
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve()
        except BaseException as error:  # a bug in the loop itself: say so in /health, refuse new requests
            self._death = f"the engine stopped: {type(error).__name__}: {error}"
            logging.getLogger(__name__).critical(self._death, exc_info=True)
            with self._wake:
                failed = list(self._pending)
                self._pending.clear()
            failed += list({id(r.request): r.request for r in self._rows}.values())
            self._rows = []
            self._fail(failed, error)

    def _serve(self) -> None:
        batch = self.config.max_batch
        base_key = jax.random.PRNGKey(self.config.seed)
        serial = 0  # requests admitted: the key of an unseeded request
        order = itertools.count()
        while True:
            self._heartbeat = time.monotonic()
            self._drop_cancelled()
            self._readmit()
            with self._wake:
                if self._closing:
                    break
                running = bool(self._rows)
                if not running and not self._pending:
                    self._wake.wait(min(0.5, self.config.heartbeat_timeout_s / 4))  # idle, but the heartbeat goes on
                    continue
                if not running and self.config.batching and self.config.batch_wait_s > 0:
                    deadline = time.monotonic() + self.config.batch_wait_s
                    while (not self._closing and sum(r.n for r in self._pending) < batch
                           and time.monotonic() < deadline):
                        self._wake.wait(max(0.0, deadline - time.monotonic()))
                requests = self._admit_locked(self._rows)
            for request in requests:
                try:
                    if request.seed is not None:
                        key = seed_key(request.seed)
                    else:
                        key = np.asarray(_fold_in(base_key, np.uint32(serial & 0xFFFFFFFF)))
                    serial += 1
                    prompt = [int(t) for t in request.prompt_ids]
                    for choice in range(request.n):  # `_admit_locked` checked that their slots and pages are free
                        self._place(_Row(request, choice, prompt, [], request.max_tokens,
                                         np.asarray(_fold_in(key, np.uint32(choice))), next(order)))
                except Exception as error:  # this request only
                    self._fail([request], error)
            worked = self._prefill_turn()
            worked = self._decode_turn() or worked
            if not worked and self._rows:  # rows that wait on nothing the engine does (a request held back)
                with self._wake:
                    self._wake.wait(0.01)

    def _admit_locked(self, rows) -> list[GenerationRequest]:
        """Take waiting requests, in arrival order, while their choices fit the free slots and pages (none while a
        preempted row waits: it goes first)."""
        admitted: list[GenerationRequest] = []
        if any(r.phase == WAITING for r in rows):
            return admitted
        free = self.config.max_batch - sum(r.slot is not None for r in rows)
        pages = self._allocator.free_pages
        running = bool(rows)
        while self._pending:
            request = self._pending[0]
            if request.cancelled:
                self._pending.popleft()
                continue
            if not self.config.batching and (running or admitted):
                break
            need = request.n * self._start_pages(len(request.prompt_ids), request.max_tokens)
            if request.n > free or need > pages:
                break
            self._pending.popleft()
            self.stats["requests"] += 1
            free -= request.n
            pages -= need
            admitted.append(request)
        return admitted

    # -- pages -----------------------------------------------------------------------------------------------------
    def _start_pages(self, tokens: int, budget_left: int) -> int:
        """Pages a row of `tokens` tokens takes to be admitted: its tokens and its next slice."""
        steps = min(self.config.slice_tokens, max(budget_left, 0))
        return paged_lib.pages_for(min(tokens + steps, self.config.max_context), self.config.page_size)

    def _reset_pool(self) -> None:
        """A new, empty pool (at start, or after a failure took the donated one): every row that held pages waits
        to be recomputed from its host tokens."""
        config = self.config
        self.num_pages = config.pool_pages(self.model_config)
        self._state = paged_lib.init_pool_program(self.model_config, self.num_pages, config.page_size,
                                                  config.max_batch)()
        self._layout = paged_lib.state_layout(self._state)
        self._allocator = paged_lib.PageAllocator(self.num_pages)
        self._slot_row[:] = -1
        for row in self._rows:
            row.pages, row.slot, row.cached, row.phase, row.recompute = [], None, 0, WAITING, True

    def _place(self, row: _Row) -> None:
        """Give `row` a free slot and the pages of its tokens and next slice (the caller checked both are free)."""
        row.slot = int(np.nonzero(self._slot_row < 0)[0][0])
        self._slot_row[row.slot] = row.order
        row.pages = self._allocator.alloc(self._start_pages(len(row.tokens()), row.budget_left))
        row.cached, row.phase = 0, PREFILL
        if row not in self._rows:
            self._rows.append(row)
        self._count_pages()

    def _count_pages(self) -> None:
        self.stats["max_pages_held"] = max(self.stats["max_pages_held"], self.num_pages - self._allocator.free_pages)

    def _release(self, row: _Row) -> None:
        self._allocator.release(row.pages)
        row.pages, row.cached = [], 0
        if row.slot is not None:
            self._slot_row[row.slot] = -1
            row.slot = None

    def _remove(self, row: _Row) -> None:
        """The row's choice is over (finished, failed or cancelled): its pages and slot are free at once."""
        self._release(row)
        self._rows.remove(row)

    def _drop_cancelled(self) -> None:
        for row in [r for r in self._rows if r.request.cancelled]:
            self._remove(row)
            self.stats["cancelled_rows"] += 1

    def _preempt(self, row: _Row) -> None:
        """Release the row's pages and slot; it waits for re-admission, then is recomputed from its tokens."""
        self._release(row)
        row.phase, row.recompute = WAITING, True
        self.stats["preemptions"] += 1

    def _ensure_pages(self, row: _Row, tokens: int) -> bool:
        """Give `row` the pages of `tokens` positions, preempting the newest rows holding pages while the pool is
        short (the row itself when it is the newest: an older row is never paused for a newer one); False when the
        row itself was preempted."""
        pages = paged_lib.pages_for(min(tokens, self.config.max_context), self.config.page_size)
        if not paged_lib.grow_pages(self._allocator, row, pages, self._rows, lambda r: r.order, self._preempt):
            return False
        self._count_pages()
        return True

    def _readmit(self) -> None:
        """Preempted rows, oldest first, as soon as a slot and the pages of their tokens and next slice are free."""
        for row in sorted((r for r in self._rows if r.phase == WAITING), key=lambda r: r.order):
            free_slot = (self._slot_row < 0).any()
            if not free_slot or self._start_pages(len(row.tokens()), row.budget_left) > self._allocator.free_pages:
                return
            self._place(row)

    def _lost_state(self, error: BaseException, failed) -> None:
        """A dispatch raised: fail its requests; if it took the donated pool with it, start a new one (the other
        rows are recomputed: their tokens are on the host)."""
        self._fail({id(r.request): r.request for r in failed}.values(), error)
        if self._state.k.is_deleted() or self._state.logits.is_deleted():
            self._reset_pool()

    # -- prefill ---------------------------------------------------------------------------------------------------
    def _prefill_turn(self) -> bool:
        """One chunk of each row whose tokens are not all in its pages, at most `prefill_tokens` in the dispatch;
        rows whose tokens so far are the same (a request's choices) run once."""
        chunks, computed, spent = [], set(), 0
        for row in sorted((r for r in self._rows if r.phase == PREFILL), key=lambda r: r.order):
            tokens = row.tokens()
            pending = tokens[row.cached:row.cached + self.config.prefill_chunk]
            key = (row.cached, tuple(tokens[:row.cached + len(pending)]))
            if key not in computed:
                if spent and spent + len(pending) > self.config.prefill_tokens:
                    continue  # over the dispatch's token budget: next turn
                computed.add(key)
                spent += len(pending)
            chunks.append((row, pending, key))
        if not chunks:
            return False
        try:
            self._prefill(chunks)
        except Exception as error:  # a device failure fails the requests it admitted, not the server
            self._lost_state(error, [row for row, _, _ in chunks])
            return True
        for row, pending, _ in chunks:
            if row.recompute:
                self.stats["recomputed_tokens"] += len(pending)
            row.cached += len(pending)
            if row.cached == len(row.tokens()):
                row.phase, row.recompute = DECODE, False
        return True

    def _prefill(self, chunks) -> None:
        """Dispatch `paged.prefill_program` for `chunks` `(row, tokens, key)`: each distinct key's tokens run
        once, written into the pages of every row holding them, each row's last logits into its slot."""
        leaders: dict[tuple, int] = {}
        source = [leaders.setdefault(key, len(leaders)) for _, _, key in chunks]
        unique = [chunks[source.index(u)] for u in range(len(leaders))]
        count = sampler_lib.bucket_length(len(unique), minimum=1)
        width = sampler_lib.bucket_length(max(len(p) for _, p, _ in unique))
        tokens = np.zeros((count, width), np.int32)
        num_new = np.zeros(count, np.int32)
        cached = np.zeros(count, np.int32)
        for i, (row, pending, _) in enumerate(unique):
            tokens[i, :len(pending)] = pending
            num_new[i], cached[i] = len(pending), row.cached
        items = paged_lib.work_items([row.pages for row, _, _ in unique], [row.cached for row, _, _ in unique],
                                     self.config.page_size, minimum=16, maximum=self.num_pages)
        rows_out = sampler_lib.bucket_length(len(chunks), minimum=1)
        out_source = np.zeros(rows_out, np.int32)
        out_source[:len(chunks)] = source
        out_slots = np.full(rows_out, self.config.max_batch, np.int32)
        out_slots[:len(chunks)] = [row.slot for row, _, _ in chunks]
        out_table = paged_lib.page_table_array([row.pages for row, _, _ in chunks], self._table_width, rows=rows_out)
        self._state = paged_lib.prefill_program(self.model_config, self.config.max_context, self._layout)(
            self.params, self._state, cached, tokens, num_new, items, out_source, out_table, out_slots)
        self.stats["prefill_dispatches"] += 1
        self.stats["prefill_tokens"] += int(num_new.sum())

    @property
    def _table_width(self) -> int:
        return self.config.row_pages

    # -- decode ----------------------------------------------------------------------------------------------------
    def _decode_turn(self) -> bool:
        """One slice of the rows that generate (oldest first for pages), then their text and ends."""
        steps = self.config.slice_tokens
        for row in sorted((r for r in self._rows if r.phase == DECODE and r.budget_left > 0),
                          key=lambda r: r.order):
            if row.phase == DECODE:  # not preempted by an older row of this loop
                self._ensure_pages(row, row.cached + min(steps, row.budget_left))
        rows = sorted((r for r in self._rows if r.phase == DECODE and r.budget_left > 0), key=lambda r: r.order)
        if not rows:
            return False
        budgets = [min(steps, r.budget_left) for r in rows]
        try:
            out = self._decode(rows, budgets)
        except Exception as error:  # the rows of the dispatch fail; the others are recomputed if the pool is gone
            self._lost_state(error, rows)
            return True
        tokens, was_active, still, reason = out
        self.stats["slices"] += 1
        self.stats["max_rows"] = max(self.stats["max_rows"], len(rows))
        for index, row in enumerate(rows):
            finished = False
            try:
                new = [int(t) for t in tokens[was_active[:, index], index]]
                self.stats["tokens"] += len(new)
                row.generated += new
                row.cached += len(new)
                row.budget_left -= len(new)
                stop = sampler_lib.RUNNING if still[index] else int(reason[index])
                done = None
                if stop == sampler_lib.STOP_TOKEN:
                    done = "stop"
                elif stop == sampler_lib.CONTEXT_FULL or row.budget_left <= 0:
                    done = "length"
                finished = self._emit_progress(row, done)
            except Exception as error:  # this request only: its other rows go at the next turn
                self._fail([row.request], error)
                finished = True
            if finished:
                self._remove(row)
        return True

    def _decode(self, rows: list[_Row], budgets: list[int]):
        """Dispatch one slice (`paged.decode_program`) of `rows`, padded to a bucket; returns host (tokens [steps,
        D], active before each step [steps, D], active after [D], stop reason [D])."""
        D = sampler_lib.bucket_length(len(rows), minimum=1)  # the decode batch: only the rows that generate
        slots = np.full(D, self.config.max_batch, np.int32)
        active = np.zeros(D, bool)
        lengths = np.zeros(D, np.int32)
        budget = np.zeros(D, np.int32)
        row_keys = np.zeros((D, 2), np.uint32)
        generated = np.zeros(D, np.uint32)
        for i, (row, left) in enumerate(zip(rows, budgets)):
            slots[i], active[i], lengths[i], budget[i] = row.slot, True, row.cached, left
            row_keys[i], generated[i] = row.key, len(row.generated)
        # the slice's key of each row folds in its count of generated tokens; the program folds in the step (padded
        # to the decode batch: one compile of the fold per bucket)
        keys = np.asarray(_fold_in_rows(row_keys, generated))
        sampling = sampler_lib.RowSampling.of([r.request.sampling for r in rows] + [_GREEDY] * (D - len(rows)))
        sampling = sampling.replace(filter_top_p=sampling.sample)  # two programs: all greedy, or any sampling
        tables = [row.pages for row in rows]
        items = paged_lib.work_items(tables, [r.cached + left - 1 for r, left in zip(rows, budgets)],
                                     self.config.page_size, minimum=16, maximum=self.num_pages)
        out = self._decode_program(sampling, slots, paged_lib.page_table_array(tables, self._table_width, rows=D),
                                   lengths, active, budget, keys, items)
        self._state = out[0]
        tokens, was_active, still, reason = (np.asarray(out[i]) for i in (1, 4, 5, 6))
        return tokens, was_active, still, reason

    def _decode_program(self, sampling, slots, table, lengths, active, budget, keys, items):
        D = len(slots)
        return paged_lib.decode_program(self.model_config, self.config.slice_tokens, self.config.max_context,
                                        self._layout)(
            sampling, self.params, self._state, slots, table, lengths, active, budget, self._stop_arr, keys,
            np.zeros(D, np.int32), np.full(D, sampler_lib.RUNNING, np.int32), items, None)

    # -- warm-up ---------------------------------------------------------------------------------------------------
    def _warmup(self) -> None:
        """Run (and so compile) the prefill of every (distinct prompts, rows written) count at every width bucket up
        to `warmup_tokens` (first chunks), and the greedy and the sampling slice at every (decode rows, work items)
        bucket; every write goes to no page (tables of -1, padding slots), so the pool stays empty."""
        config, bucket = self.config, sampler_lib.bucket_length
        counts = sorted({bucket(n, minimum=1) for n in range(1, config.max_batch + 1)})
        widths = sorted({bucket(n) for n in range(1, min(config.warmup_tokens, config.prefill_chunk) + 1)})
        no_items = paged_lib.work_items([], [], config.page_size, minimum=16, maximum=self.num_pages)
        for width in widths:
            for count in counts:
                for rows_out in (r for r in counts if r >= count):
                    self._state = paged_lib.prefill_program(self.model_config, config.max_context, self._layout)(
                        self.params, self._state, np.zeros(count, np.int32), np.ones((count, width), np.int32),
                        np.full(count, width, np.int32), no_items, np.zeros(rows_out, np.int32),
                        np.full((rows_out, self._table_width), -1, np.int32),
                        np.full(rows_out, config.max_batch, np.int32))
        for rows in counts:
            # the work-item counts a decode of `rows` rows can read (its rows' pages, at most the pool): the padded
            # size of a total is that of the power of two above it, so those totals give every size
            limit = min(self.num_pages, rows * config.row_pages)
            totals = {0, limit} | {1 << k for k in range(limit.bit_length()) if 1 << k <= limit}
            sizes = sorted({len(paged_lib.work_items([[0] * total], [total * config.page_size], config.page_size,
                                                     minimum=16, maximum=self.num_pages)[0]) for total in totals})
            for size in sizes:
                items = (np.full(size, rows, np.int32), np.zeros(size, np.int32), np.zeros(size, np.int32))
                for setting in (_GREEDY, SamplingConfig()):
                    sampling = sampler_lib.RowSampling.of([setting] * rows)
                    sampling = sampling.replace(filter_top_p=sampling.sample)
                    keys = np.asarray(_fold_in_rows(np.zeros((rows, 2), np.uint32), np.zeros(rows, np.uint32)))
                    out = self._decode_program(sampling, np.full(rows, config.max_batch, np.int32),
                                               np.full((rows, self._table_width), -1, np.int32),
                                               np.zeros(rows, np.int32), np.zeros(rows, bool),
                                               np.zeros(rows, np.int32), keys, items)
                    self._state = out[0]
        jax.block_until_ready(self._state)

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
