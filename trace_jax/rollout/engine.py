"""The paged, continuously batched rollout engine: rows advance on their own, tools run while others decode.

The rollout engine behind `agent.run_episodes` (its `Rollout` of `EpisodeRecord`s and a `TrajectoryBatch`, under the
episode rules of `rollout.agent`), on the paged KV cache of `rollout.paged`:

    page pool  `PagedConfig.num_pages` (`RolloutConfig.paged`) pages of `page_size` tokens (from
               `RolloutConfig.kv_budget_gib` when set),
               shared by `slots` rows in flight; a row holds the pages of the tokens it has cached, no more. On a
               mesh whose batch axes split the pool, each row's pages come from one batch shard's block (the kernel
               path runs a row on the shard holding its pages); a row is admitted to the shard with the fewest rows
               among those with room (`_place`). A prompt's samples admitted together on one shard hold its full
               pages once (`_sibling_pages`, refcounted by `PageAllocator.share`); each holds its last partial page
               and its generated tokens alone.
    row states QUEUED -> PREFILL -> DECODE -> TOOL -> PREFILL -> DECODE ... -> DONE
      QUEUED   waiting for a slot and the pages of its tokens (a new episode, or a preempted row to recompute);
               admitted in row order as soon as both are free (no round barrier).
      PREFILL  its uncached tokens (a prompt, an observation, or a whole row being recomputed) go into its pages in
               chunks of `prefill_chunk` tokens, one chunk per engine iteration, between decode blocks, at most
               `prefill_tokens` per dispatch.
      DECODE   generates its turn, `sync_every` steps per dispatch for the decoding rows at once (padded to
               `decode_rows`); it leaves the decode batch the block it stops in (stop token, stop string, turn
               budget, full context).
      TOOL     its tool call runs on a host thread pool (`tool_workers`) while the other rows decode; the
               observation is appended and the row goes back to PREFILL.
      DONE     its pages and slot are freed at once.
    preemption when a row needs a page and none is free in its shard, the row admitted last (highest row index)
               that holds pages of that shard is paused: its pages and slot are released and it waits at the head
               of the queue; on re-admission its tokens are recomputed by PREFILL (vLLM's recompute preemption).
               Nothing of the episode is lost: its tokens, log-probs and turn state are host lists, and the rest
               of its turn is drawn with the same keys. A pool whose every shard holds one row of `max_context`
               always makes progress: the first row in row order, once admitted, is never paused (it can preempt
               every other row of its shard), and a queued head is admitted as soon as one shard has room.

Tokens: turn k of row r samples its i-th token with `fold_in(fold_in(fold_in(rng, k), row_offset + r), i)`
(`agent.row_turn_keys`), whatever the pool, the rows in flight, preemption or the tools' latencies (up to float32
summation order in attention). The turn rules (answer, max_turns, context overflow, tool errors, compaction) are
`agent.end_turn` and `agent.observe`; tests/rollout/test_paged_engine.py pins the episodes against a naive
reference (a full forward per token, no cache).

Several processes (a `mesh` over their devices, `distributed.spans_processes`): every process runs the host loop
for its own tasks (their rows, tool calls, preemptions) and every dispatch is one SPMD program over the whole mesh,
so the processes dispatch the same programs in the same order, in lock step:

    state      one global pool of `processes x num_pages` pages and `processes x slots` slots (`num_pages` and
               `slots` from the most rows any process has, agreed). Process p's rows hold only pages of its part,
               [p x num_pages, (p+1) x num_pages), and slots [p x slots, (p+1) x slots): the p-th block of the pool's
               page axis, which the data-parallel layout (pages over the batch axes, devices in process order)
               puts on process p's own devices. Each process keeps its own `PageAllocator` of its part.
    iteration  after the host work (tools collected, admissions), one agreement (`_agree`: each value's largest
               over the processes, one collective) of whether any row is left anywhere and the first prefill
               dispatch's shapes (U, W, work items, R buckets; a process's chunks go in one dispatch per chunk
               width, narrowest first), then that dispatch and the next one's shapes, until no process has one;
               then an agreement of the decode batch D, its work items, and whether any tool runs; then the decode
               dispatch if any process has a decoding row. A process with nothing to do dispatches padding
               (inactive rows, zero-token chunks) at the agreed shapes; one with no row left takes part until no
               process has one. The programs' host arguments are each process's padded arrays concatenated in
               process order (`_everyone`, one collective a dispatch): process p's rows are the p-th block of D
               (or U, R) rows, and the results are read from its block (`distributed.local_rows`).
    local      tool calls, page allocation, preemption and admission are each process's own decisions; only the
               dispatch shapes are agreed, so a row's tokens do not depend on the other processes' schedules.
               Row keys fold in `row_offset + r` (the row's global index), so 2 processes x 4 devices give the
               episodes of 1 process x 8 (tests/rl/test_spmd_processes.py).

This module knows nothing about the model's internals, credit assignment or training.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import heapq
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from trace_jax.envs.browser import Browser, tool_schemas
from trace_jax.models.chat import ChatFormat, ToolCall
from trace_jax.models.config import ModelConfig
from trace_jax.models.decoder import check_token_ids
from trace_jax.rollout import agent as agent_lib
from trace_jax.rollout import paged as paged_lib
from trace_jax.rollout import sampler as sampler_lib
from trace_jax.rollout.batch import EpisodeRecord, build_batch
from trace_jax.rollout.budget import batch_shards
from trace_jax.rollout.paged import PagedConfig
from trace_jax.train import distributed

QUEUED, PREFILL, DECODE, TOOL, DONE = "queued", "prefill", "decode", "tool", "done"


@dataclasses.dataclass
class EngineStats:
    """What the engine did. `useful_row_steps / row_steps` is the fraction of decode row-steps that generated a
    kept token; `prefill_tokens` counts tokens run through the model by prefill (a prompt's G samples once);
    `preemptions_mid_turn` counts rows paused with part of a turn generated; `kv_positions_read` counts the paged
    positions decode attention read (its work items, every step of a block)."""

    decode_dispatches: int = 0
    row_steps: int = 0
    useful_row_steps: int = 0
    prefill_dispatches: int = 0
    prefill_tokens: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0
    preemptions_mid_turn: int = 0
    kv_positions_read: int = 0
    max_pages_held: int = 0


@dataclasses.dataclass
class PagedRollout(agent_lib.Rollout):
    """A `Rollout` with the engine's statistics."""

    stats: EngineStats = dataclasses.field(default_factory=EngineStats)


@dataclasses.dataclass
class _Row:
    index: int
    segment: dict  # `agent.new_segment`: the row's current segment
    phase: str = QUEUED
    slot: int | None = None
    shard: int | None = None  # the batch shard of the pool its pages come from (while it holds a slot)
    pages: list = dataclasses.field(default_factory=list)
    cached: int = 0  # tokens of `tokens()` in its pages
    turn_open: bool = False
    turn_ids: list = dataclasses.field(default_factory=list)
    turn_lp: list = dataclasses.field(default_factory=list)
    turn_slp: list = dataclasses.field(default_factory=list)
    turn_budget: int = 0
    checked: int = 0  # turn tokens already scanned for stop strings
    key: Any = None
    future: Any = None  # the running tool call
    call_ids: list = dataclasses.field(default_factory=list)  # the turn that made it (for the response's ids)
    recompute: bool = False

    def tokens(self) -> list[int]:
        return self.segment["tokens"] + self.turn_ids


DECODE_BUCKETS_PER_OCTAVE = 4  # decode batch sizes per doubling above 8 rows (so padding stays under a fifth)


def decode_rows(n: int, slots: int, shards: int = 1) -> int:
    """The decode batch for `n` decoding rows of at most `slots`: 1, 2, 4 or 8, then a quarter of an octave apart
    (10, 12, 14, 16, 20, 24, 28, 32, 40, ...), from `shards` up a multiple of the batch shards (rows then split evenly
    over the chips), and never above `slots` (rounded up to the shards). Powers of two padded a decode batch of 17
    rows to 32; these pad it to 20: above 8 rows less than a fifth of a batch is padding, at
    `DECODE_BUCKETS_PER_OCTAVE` programs a doubling. `decode_buckets(slots)` lists them (12 for 32 slots, 24 for
    256; powers of two gave 6 and 9)."""
    if not 1 <= n <= slots:
        raise ValueError(f"decode_rows: {n} decoding rows for {slots} slots")
    if n <= 8:
        size = 1 << (n - 1).bit_length()
    else:
        step = max(1, (1 << ((n - 1).bit_length() - 1)) // DECODE_BUCKETS_PER_OCTAVE)
        size = -(-n // step) * step
    if size >= shards:
        size = -(-size // shards) * shards
    return min(size, -(-slots // shards) * shards)


def decode_buckets(slots: int, shards: int = 1) -> tuple[int, ...]:
    """Every decode batch `decode_rows` gives for 1..`slots` rows, in increasing order (what `rl.programs`
    lists)."""
    return tuple(sorted({decode_rows(n, slots, shards) for n in range(1, slots + 1)}))


def mesh_processes(mesh) -> int:
    """The processes whose devices `mesh` spans when this process runs them in lock step: `jax.process_count()` on a
    mesh over other processes' devices (`distributed.spans_processes`), else 1 (one device, or this process's)."""
    return jax.process_count() if distributed.spans_processes(mesh) else 1


def pool_shards(pages: int, *, mesh=None, rules=None, processes: int = 1) -> int:
    """The batch shards one process's part of the pool (`pages` pages; the pool holds `processes` x this) is split
    over: the engine's `PageAllocator` takes each row's pages from one of them (the kernel path runs a row on the
    shard holding its pages). The pool's batch shards (`budget.batch_shards`) shared by the processes; 1 when the
    pool does not divide over them (then it is replicated on every shard, `sampler.divisible_shardings`) or when one
    shard holds several processes' parts."""
    shards = batch_shards(mesh, rules)
    if shards == 1 or (processes * pages) % shards:
        return 1
    if shards % processes == 0:
        return shards // processes
    if processes % shards == 0:
        return 1
    raise ValueError(f"a rollout mesh of {shards} batch shards over {processes} processes: each process's part of "
                     "the page pool would straddle shards; make the batch axes' size divide the process count or "
                     "be divided by it")


def process_shards(mesh, rules, processes: int = 1) -> int:
    """The batch shards of one process's block of the global batch (its decode rows, `decode_rows`; its part of a
    default pool, `pool_pages`): the mesh's batch shards over `processes` (each process's block is its devices'),
    1 when they do not divide."""
    shards = batch_shards(mesh, rules)
    return shards // processes if shards % processes == 0 else 1


def pool_pages(config: ModelConfig, rollout: agent_lib.RolloutConfig, paged: PagedConfig, rows: int, *, mesh=None,
               rules=None, processes: int = 1) -> int:
    """Pages of one process's part of the pool (`PagedConfig.num_pages`, see there; the pool holds `processes` x
    this): `num_pages` as set, else an equal part of what `RolloutConfig.kv_budget_gib` holds per chip, else `rows`
    (this process's, the most any process has) rows of `max_context`, rounded up to whole rows a batch shard, so
    that the pool divides over the batch shards (each process's part then lives on its own devices) and every row
    fits without preemption. A row's pages lie on one batch shard (`pool_shards`), so each shard's block must hold
    one row of `max_context`."""
    needed = paged_lib.pages_for(rollout.max_context, paged.page_size)
    if paged.num_pages is not None:
        pages, source = paged.num_pages, f"PagedConfig.num_pages = {paged.num_pages}"
    elif rollout.kv_budget_gib is not None:
        pages = paged_lib.pages_within_budget(config, paged.page_size, rollout.kv_budget_gib, mesh=mesh,
                                              rules=rules) // processes
        source = f"RolloutConfig.kv_budget_gib = {rollout.kv_budget_gib}"
        if processes > 1:
            source += f" shared by {processes} processes"
    else:
        part = process_shards(mesh, rules, processes)  # the batch shards of one process's pages
        return -(-max(rows, 1) // part) * part * needed
    shards = pool_shards(pages, mesh=mesh, rules=rules, processes=processes)
    if shards == 1 and pages < needed:
        raise ValueError(f"{source} gives a pool of {pages} pages of {paged.page_size} tokens; one row of "
                         f"max_context = {rollout.max_context} needs {needed}: raise it")
    if pages // shards < needed:
        raise ValueError(f"{source} gives a pool of {pages} pages of {paged.page_size} tokens over {shards} batch "
                         f"shards, {pages // shards} a shard; a row's pages lie on one shard and one row of "
                         f"max_context = {rollout.max_context} needs {needed}: raise it (to {needed * shards} "
                         "pages at least)")
    return pages


def paged_pool_line(config: ModelConfig, rollout: agent_lib.RolloutConfig, rows: int, *, mesh=None,
                    rules=None) -> str:
    """What the paged engine holds for a call of `rows` rows (this process's), in words (the loop's log line): its
    pool's pages and tokens (`pool_pages`; every process's part on a mesh over several) and the rows in flight at
    most."""
    paged, processes = rollout.paged, mesh_processes(mesh)
    pages = processes * pool_pages(config, rollout, paged, rows, mesh=mesh, rules=rules, processes=processes)
    slots = processes * max(1, min(rows, paged.slots or rows))
    rows *= processes
    source = ("PagedConfig.num_pages" if paged.num_pages is not None else
              f"the KV budget of {rollout.kv_budget_gib:g} GiB per chip" if rollout.kv_budget_gib is not None else
              "every row's max_context (no KV budget)")
    where = f", {processes} processes' parts" if processes > 1 else ""
    return (f"rollout (paged engine): a pool of {pages} pages x {paged.page_size} tokens ({pages * paged.page_size} "
            f"tokens, from {source}{where}) for at most {slots} of {rows} rows in flight")


def run_paged_episodes(config: ModelConfig, params, chat: ChatFormat, tasks: Sequence[Any],
                       browser: Browser | Callable[[Any], Browser], rollout: agent_lib.RolloutConfig, rng: jax.Array,
                       *, paged: PagedConfig | None = None, mesh=None, rules=None, row_offset: int = 0,
                       logits_hook: Callable[[np.ndarray, int, list], np.ndarray | None] | None = None
                       ) -> PagedRollout:
    """`agent.run_episodes` (module doc): the same arguments, and `paged`: the engine's settings (default
    `rollout.paged`).

    A `mesh` over several processes' devices: every process calls this with its own tasks (any number, none
    included) and `row_offset` its first row's global index; the programs run over the whole mesh in lock step
    (module doc, "Several processes"), and the result is this process's rows (the batch on the host)."""
    return _Engine(config, params, chat, tasks, browser, rollout, rng, paged or rollout.paged, mesh, rules, row_offset,
                   logits_hook).run()


class _Engine:
    def __init__(self, config, params, chat, tasks, browser, rollout, rng, paged, mesh, rules, row_offset,
                 logits_hook):
        self.start = time.perf_counter()
        self.config, self.params, self.chat, self.rollout, self.rng = config, params, chat, rollout, rng
        self.row_offset, self.logits_hook = row_offset, logits_hook
        self.mesh, self.rules = mesh, rules
        self.timing = {"prefill": 0.0, "generate": 0.0, "env": 0.0, "agent_host": 0.0, "append": 0.0, "pack": 0.0}
        self.stats = EngineStats()
        self.max_len = rollout.max_context
        self.stop_strings = (sampler_lib.StopStrings(chat.tokenizer, chat.assistant_stop_strings)
                             if chat.assistant_stop_strings else None)
        self.schemas = tool_schemas() if rollout.with_tools else None
        self.rows: list[_Row] = []
        self.finished_segments: list[list[dict]] = []
        self.episodes: list[EpisodeRecord] = []
        self.browsers = []
        for t, task in enumerate(tasks):
            prompt = chat.prompt_ids(rollout.system_prompt, task.question, self.schemas)
            check_token_ids(config, np.asarray(prompt, np.int64), f"task {t}'s prompt")  # a tokenizer/model mismatch
            if len(prompt) >= self.max_len:
                raise ValueError(f"task {t}: the prompt has {len(prompt)} tokens but max_context={self.max_len}; "
                                 "raise RolloutConfig.max_context or shorten the system prompt")
            needed = len(prompt) + rollout.context_record_tokens + rollout.turn_token_budget
            if rollout.context_budget and needed > rollout.context_budget:
                raise ValueError(f"task {t}: a compacted context needs {needed} tokens (prompt, record, one turn), "
                                 f"more than RolloutConfig.context_budget = {rollout.context_budget}; raise it")
            for _ in range(rollout.group_size):
                self.rows.append(_Row(len(self.rows), agent_lib.new_segment(prompt, first_turn=0)))
                self.finished_segments.append([])
                self.episodes.append(agent_lib.task_episode(task, t))
                self.browsers.append(browser.fork() if isinstance(browser, Browser) else browser(task))
        n = len(self.rows)
        # Several processes (module doc): process p's part of the pool is pages [p x num_pages, (p+1) x num_pages)
        # and its slots [p x slots, (p+1) x slots) of the global state; every count is agreed, so every process
        # builds the same programs.
        self.processes = mesh_processes(mesh)
        self.process = jax.process_index() if self.processes > 1 else 0
        most = distributed.agree_max(n) if self.processes > 1 else n
        self.page_size = paged.page_size
        self.num_pages = pool_pages(config, rollout, paged, most, mesh=mesh, rules=rules, processes=self.processes)
        self.slots = max(1, min(most, paged.slots or most))
        self.page_base, self.slot_base = self.process * self.num_pages, self.process * self.slots
        self.decode_shards = process_shards(mesh, rules, self.processes)
        self.table_width = paged_lib.pages_for(self.max_len, self.page_size)
        # one items shape for every dispatch: the most pages a dispatch reads (a page has at most G holders: a
        # prompt's samples share its full pages)
        self.items_size = paged_lib.item_capacity(self.num_pages, rollout.group_size, self.slots, self.table_width)
        self.prefill_chunk, self.prefill_tokens = paged.prefill_chunk, paged.prefill_tokens
        hooked = logits_hook is not None
        # a hook is called between steps (one step a dispatch) unless it gives a block's biases at once
        self.block_hook = hooked and getattr(logits_hook, "blocks", False) and hasattr(logits_hook, "block_bias")
        stepwise = hooked and not self.block_hook
        self.with_bias = distributed.agree_any(hooked) if self.processes > 1 else hooked
        stepwise = distributed.agree_any(stepwise) if self.processes > 1 else stepwise
        self.steps = 1 if stepwise else rollout.sync_every
        # a row's pages come from one batch shard's block of this process's part (the kernel path runs the row on
        # the shard holding them); every shard holds one row of max_context (`pool_pages`)
        self.shards = pool_shards(self.num_pages, mesh=mesh, rules=rules, processes=self.processes)
        self.allocator = paged_lib.PageAllocator(self.num_pages, self.shards)
        self.state = paged_lib.init_pool_program(config, self.processes * self.num_pages, self.page_size,
                                                 self.processes * self.slots, mesh, rules)()
        self.layout = paged_lib.state_layout(self.state)
        if self.shards > 1 and paged_lib.page_shards(self.layout) != self.processes * self.shards:
            raise RuntimeError(f"paged engine: the pool's pages lie on {paged_lib.page_shards(self.layout)} shards, "
                               f"not the {self.processes * self.shards} the allocator assumes (a bug: report the mesh)")
        self.slot_row = np.full(self.slots, -1, np.int64)
        self.queue = list(range(n))  # a heap of row indices: admission (and re-admission) in row order
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=paged.tool_workers)
        self.sampling, self.sampling_rows = None, 0  # the decode batch's `RowSampling`, rebuilt when its size changes
        self.stop_arr = np.asarray(list(chat.assistant_stop_ids) or [-1], np.int32)
        self.generated_tokens = 0
        self.decode_step = 0

    # ------------------------------------------------------------------------------------------------ pages
    def _preempt(self, row: _Row) -> None:
        """Release the row's pages and slot; it is recomputed from its host tokens when re-admitted."""
        self.allocator.release(row.pages)
        row.pages, row.cached = [], 0
        self.slot_row[row.slot] = -1
        row.slot = row.shard = None
        row.recompute = True
        self.stats.preemptions += 1
        self.stats.preemptions_mid_turn += int(row.turn_open and bool(row.turn_ids))
        if row.phase in (PREFILL, DECODE):
            row.phase = QUEUED
            heapq.heappush(self.queue, row.index)

    def _ensure_pages(self, row: _Row, tokens: int) -> bool:
        """Give `row` the pages of `tokens` positions from its shard, preempting the highest-index rows holding
        pages of that shard while it is short (the row itself when it has the highest index: a lower row is never
        paused for a higher one); False when the row itself was preempted."""
        pages = paged_lib.pages_for(min(tokens, self.max_len), self.page_size)
        if not paged_lib.grow_pages(self.allocator, row, pages, self.rows, lambda r: r.index, self._preempt,
                                    shard=row.shard):
            return False
        self.stats.max_pages_held = max(self.stats.max_pages_held, self.num_pages - self.allocator.free_pages)
        return True

    def _release(self, row: _Row) -> None:
        self.allocator.release(row.pages)
        row.pages = []
        if row.slot is not None:
            self.slot_row[row.slot] = -1
            row.slot = row.shard = None

    # ------------------------------------------------------------------------------------------------ phases
    def _admit(self) -> None:
        while self.queue:
            free = np.nonzero(self.slot_row < 0)[0]
            if not len(free):
                return
            row = self.rows[self.queue[0]]
            place = self._place(row)
            if place is None:
                return  # in row order: the head waits for pages, as vLLM's admission does
            heapq.heappop(self.queue)
            row.slot, (row.shard, shared, need) = int(free[0]), place
            self.slot_row[row.slot] = row.index
            row.pages = self.allocator.share(shared) + self.allocator.alloc(need, row.shard)
            row.phase = PREFILL

    def _place(self, row: _Row) -> tuple[int, list[int], int] | None:
        """Where a queued row is admitted: (its shard, the sibling pages it shares there, the pages it takes), or
        None when no shard has room for its tokens and one decode block. Balanced: the shard with the fewest rows
        in flight among those with room; then the one where it shares a sibling's pages (fewer new pages), the most
        free pages, the lowest index. With rows spread evenly a shard holds at most ceil(rows / shards) of them, so
        the default pool (`pool_pages`: that many rows of max_context a shard) never preempts."""
        total = paged_lib.pages_for(min(len(row.tokens()) + self.steps, self.max_len), self.page_size)
        in_flight = np.bincount([r.shard for r in self.rows if r.shard is not None], minlength=self.shards)
        best = None
        for shard in range(self.shards):
            shared = self._sibling_pages(row, shard)
            need, free = total - len(shared), self.allocator.free_in(shard)
            if need <= free:
                key = (in_flight[shard], need, -free, shard)
                if best is None or key < best[0]:
                    best = (key, shard, shared, need)
        return None if best is None else best[1:]

    def _sibling_pages(self, row: _Row, shard: int) -> list[int]:
        """The full pages of `row`'s tokens held by a sample of the same prompt on shard `shard` with the same tokens
        that is not prefilled yet (a prompt's G samples, admitted together), or none. Both run through the same
        prefill dispatches as one computed row (`_prefill`), so those pages get the keys and values the row's own
        would get; the row shares them (one more holder) instead of holding copies. Its last partial page and every
        token after the prompt (decode writes only positions past what the row has cached) are its own pages. Only
        rows of one shard share: a row's pages lie on one shard."""
        tokens = row.tokens()
        full = len(tokens) // self.page_size
        group = self.rollout.group_size
        if not full or row.cached:
            return []
        first = row.index - row.index % group  # a prompt's G samples are rows [first, first + G)
        for other in self.rows[first:first + group]:
            if (other is not row and other.shard == shard and other.phase == PREFILL and not other.cached
                    and len(other.pages) >= full and other.tokens() == tokens):
                return other.pages[:full]
        return []

    def _open_turn(self, row: _Row) -> None:
        episode = self.episodes[row.index]
        row.turn_open, row.turn_ids, row.turn_lp, row.turn_slp, row.checked = True, [], [], [], 0
        row.key = np.asarray(agent_lib.row_turn_keys(self.rng, [row.index + self.row_offset],
                                                     [len(episode.turn_texts)]))[0]
        row.turn_budget = min(self.rollout.turn_token_budget, self.max_len - len(row.segment["tokens"]))

    def _plan_prefill(self) -> list[dict]:
        """This iteration's prefill chunks of this process's rows (pages given, rows preempted as needed), as one
        dispatch a chunk width (`sampler.bucket_length`), narrowest first: a 40-token observation is not padded to
        the 256 of a prompt beside it (attention, most of a prefill's work, grows with the padded width). Each
        plan has its chunks and the shapes they take; no plans when it has no chunk."""
        rows = [r for r in self.rows if r.phase == PREFILL]
        chunks = []
        computed: set[tuple] = set()  # the distinct (cached, tokens so far) this dispatch runs
        spent = 0
        for row in rows:
            if row.phase != PREFILL:  # preempted by an earlier row of this list
                continue
            pending = row.tokens()[row.cached:row.cached + self.prefill_chunk]
            key = (row.cached, tuple(row.tokens()[:row.cached + len(pending)]))
            if key not in computed and spent and spent + len(pending) > self.prefill_tokens:
                continue  # over the dispatch's token budget: next time
            if self._ensure_pages(row, row.cached + len(pending)):
                chunks.append((row, pending))
                if key not in computed:
                    computed.add(key)
                    spent += len(pending)
        chunks = [(row, pending) for row, pending in chunks if row.phase == PREFILL]
        groups: dict[int, list] = {}
        for row, pending in chunks:
            groups.setdefault(sampler_lib.bucket_length(len(pending)), []).append((row, pending))
        return [self._prefill_plan(groups[width]) for width in sorted(groups)]

    def _prefill_plan(self, chunks: list) -> dict:
        """One prefill dispatch's plan: its chunks, the distinct ones it computes and the shapes they take."""
        # Rows whose tokens so far are the same (a prompt's G samples, admitted together) run once: the first of
        # them reads its pages, and the result is written into each one's own pages.
        leaders: dict[tuple, int] = {}
        source = []
        for row, pending in chunks:
            key = (row.cached, tuple(row.tokens()[:row.cached + len(pending)]))
            source.append(leaders.setdefault(key, len(leaders)))
        unique = [chunks[source.index(u)] for u in range(len(leaders))]
        items = paged_lib.work_items([row.pages for row, _ in unique], [row.cached for row, _ in unique],
                                     self.page_size, size=self.items_size)
        shape = (sampler_lib.bucket_length(len(unique), minimum=1),
                 sampler_lib.bucket_length(max(len(p) for _, p in unique)), len(items[0]),
                 sampler_lib.bucket_length(len(chunks), minimum=1))
        return {"chunks": chunks, "unique": unique, "source": source, "items": items, "shape": shape}

    def _prefill(self, plan: dict | None, count: int, width: int, num_items: int, rows_out: int) -> None:
        """Dispatch the prefill program at the agreed shapes: `count` computed rows of `width` tokens reading
        `num_items` pages, written to `rows_out` rows, per process (this process's `plan`, padded; None: only
        padding, taking part in the other processes' dispatch)."""
        chunks, unique = (plan["chunks"], plan["unique"]) if plan else ([], [])
        tokens = np.zeros((count, width), np.int32)
        num_new = np.zeros(count, np.int32)
        cached = np.zeros(count, np.int32)
        for i, (row, pending) in enumerate(unique):
            tokens[i, :len(pending)] = pending
            num_new[i], cached[i] = len(pending), row.cached
        empty = (np.zeros(0, np.int32),) * 3
        items = self._global_items(plan["items"] if plan else empty, len(unique), count, num_items)
        out_source = np.zeros(rows_out, np.int32)
        out_source[:len(chunks)] = plan["source"] if plan else []
        out_source += self.process * count  # this process's block of the computed rows
        out_slots = np.full(rows_out, self.slots, np.int32)
        out_slots[:len(chunks)] = [row.slot for row, _ in chunks]
        out_table = self._global_table([row.pages for row, _ in chunks], rows_out)
        t0 = time.perf_counter()
        cached, tokens, num_new, *items, out_source, out_table, out_slots = self._everyone(
            [cached, tokens, num_new, *items, out_source, out_table, self._global_slots(out_slots)])
        self.state = paged_lib.prefill_program(self.config, self.max_len, self.layout)(
            self.params, self.state, cached, tokens, num_new, tuple(items), out_source, out_table, out_slots)
        self.timing["prefill"] += time.perf_counter() - t0
        self.stats.prefill_dispatches += 1
        self.stats.prefill_tokens += sum(len(pending) for _, pending in unique)
        for row, pending in chunks:
            if row.recompute:
                self.stats.recomputed_tokens += len(pending)
            row.cached += len(pending)
            if row.cached == len(row.tokens()):
                row.recompute = False
                row.phase = DECODE
                if not row.turn_open:
                    self._open_turn(row)

    def _plan_decode(self) -> dict | None:
        """This iteration's decoding rows of this process (in row order, each given the pages of the block) and
        their work items, or None when it has none."""
        for row in sorted((r for r in self.rows if r.phase == DECODE), key=lambda r: r.index):
            if row.phase == DECODE:
                self._ensure_pages(row, len(row.tokens()) + self.steps)
        rows = sorted((r for r in self.rows if r.phase == DECODE), key=lambda r: r.index)
        if not rows:
            return None
        items = paged_lib.work_items([row.pages for row in rows],
                                     [min(r.cached + self.steps - 1, self.max_len) for r in rows],
                                     self.page_size, size=self.items_size)
        return {"rows": rows, "items": items, "shape": (decode_rows(len(rows), self.slots, self.decode_shards),
                                                        len(items[0]))}

    def _decode(self, plan: dict | None, D: int, num_items: int) -> None:
        """Dispatch `sync_every` decode steps at the agreed shapes: `D` rows per process reading `num_items` pages
        (this process's `plan`, padded with inactive rows; None: only padding), then read this process's rows."""
        rows = plan["rows"] if plan else []
        slots = np.full(D, self.slots, np.int32)
        active = np.zeros(D, bool)
        lengths = np.zeros(D, np.int32)
        budget = np.zeros(D, np.int32)
        turn_step = np.zeros(D, np.int32)
        keys = np.zeros((D, 2), np.uint32)
        for i, row in enumerate(rows):
            slots[i], active[i], lengths[i] = row.slot, True, row.cached
            budget[i] = row.turn_budget - len(row.turn_ids)
            turn_step[i], keys[i] = len(row.turn_ids), row.key
        empty = (np.zeros(0, np.int32),) * 3
        items = self._global_items(plan["items"] if plan else empty, len(rows), D, num_items)
        table = self._global_table([row.pages for row in rows], D)
        host = [self._global_slots(slots), table, lengths, active, budget, keys, turn_step, *items]
        if self.with_bias:
            host.append(self._bias(rows, D))
        D_all = self.processes * D
        sampling = self.sampling if self.sampling_rows == D_all else sampler_lib.RowSampling.broadcast(
            self.rollout.sampling, D_all)
        self.sampling, self.sampling_rows = sampling, D_all
        t0 = time.perf_counter()
        slots_all, table, lengths, active, budget, keys, turn_step, *rest = self._everyone(host)
        bias = np.swapaxes(rest[3], 0, 1) if self.with_bias else None  # [D, steps, V] -> the program's [steps, D, V]
        out = paged_lib.decode_program(self.config, self.steps, self.max_len, self.layout)(
            sampling, self.params, self.state, slots_all, table, lengths, active, budget, self.stop_arr, keys,
            turn_step, np.zeros(D_all, np.int32), tuple(rest[:3]), bias)
        self.state = out[0]
        mine = slice(self.process * D, (self.process + 1) * D)
        tokens, lp, slp, was_active = (distributed.local_rows(x, mine, axis=1) for x in out[1:5])
        still, reason = (distributed.local_rows(x, mine) for x in out[5:7])
        self.timing["generate"] += time.perf_counter() - t0
        self.decode_step += self.steps
        self.stats.decode_dispatches += 1
        self.stats.row_steps += D * self.steps
        self.stats.useful_row_steps += int(was_active.sum())
        if plan:
            self.stats.kv_positions_read += int((plan["items"][0] < len(rows)).sum()) * self.page_size * self.steps
        t0 = time.perf_counter()
        for s, row in enumerate(rows):
            steps = was_active[:, s]
            row.turn_ids += tokens[steps, s].astype(int).tolist()
            row.turn_lp += lp[steps, s].tolist()
            row.turn_slp += slp[steps, s].tolist()
            row.cached += int(steps.sum())
            stop = int(reason[s]) if not still[s] else sampler_lib.RUNNING
            if self.stop_strings is not None and self.stop_strings.strings:
                stop = self._check_stop_strings(row, stop)
            if stop != sampler_lib.RUNNING:
                self._end_turn(row, stop)
        self.timing["agent_host"] += time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------------ lock step
    # With one process these are the identity; with several (a mesh over their devices) every process calls them in
    # the same order, once per decision, and each is one collective.
    def _agree(self, values: Sequence[int]) -> list[int]:
        """Each value's largest over the processes."""
        if self.processes == 1:
            return [int(v) for v in values]
        return [int(v) for v in distributed.gather_to_hosts(np.asarray(values, np.int32)).max(axis=0)]

    def _everyone(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Every process's arrays (each the same shape on every process: the agreed buckets), each concatenated
        along its first axis in process order: the host arguments of the global program, the same on every
        process. One collective for all of them (4-byte and bool values travel as int32)."""
        if self.processes == 1:
            return arrays
        flat = np.concatenate([(a.astype(np.int32) if a.dtype == np.bool_ else np.ascontiguousarray(a).view(
            np.int32)).ravel() for a in arrays])
        stacked = distributed.gather_to_hosts(flat)  # [processes, total]
        out, offset = [], 0
        for a in arrays:
            part = np.ascontiguousarray(stacked[:, offset:offset + a.size])
            offset += a.size
            part = part != 0 if a.dtype == np.bool_ else part.view(a.dtype)
            out.append(part.reshape(self.processes * a.shape[0], *a.shape[1:]))
        return out

    def _global_items(self, items, rows_here: int, rows_each: int, size: int) -> tuple[np.ndarray, ...]:
        """`work_items` of this process's `rows_here` rows as the global program reads them: `size` items, rows
        in this process's block of `rows_each`, pages in its part of the pool (padding: no process's row)."""
        row, page, start = items
        pad_row = self.processes * rows_each
        out = (np.full(size, pad_row, np.int32), np.zeros(size, np.int32), np.zeros(size, np.int32))
        live = row < rows_here
        out[0][:len(row)] = np.where(live, row + self.process * rows_each, pad_row)
        out[1][:len(row)] = np.where(live, page + self.page_base, 0)
        out[2][:len(row)] = np.where(live, start, 0)
        return out

    def _global_table(self, tables: list[list[int]], rows: int) -> np.ndarray:
        """int32 [rows, pages of max_context]: this process's rows' page tables as pages of the global pool."""
        table = paged_lib.page_table_array(tables, self.table_width, rows=rows)
        return np.where(table >= 0, table + self.page_base, -1).astype(np.int32)

    def _global_slots(self, slots: np.ndarray) -> np.ndarray:
        """This process's slots (`self.slots`: padding) as slots of the global state (padding: none of them)."""
        return np.where(slots < self.slots, slots + self.slot_base, self.processes * self.slots).astype(np.int32)

    def _bias(self, rows: list[_Row], width: int) -> np.ndarray:
        """The row-indexed test hook as a bias of the decode batch's block, float32 [width, steps, V] (see
        `agent.ScriptedPolicy`; rows first, as `_everyone` gathers them): zeros without a hook or rows (a process
        taking part in another's hooked run)."""
        out = np.zeros((width, self.steps, self.config.vocab_size), np.float32)
        if self.logits_hook is None or not rows:
            return out
        turn_of_row = np.asarray([len(e.turn_texts) for e in self.episodes], np.int64)
        by_row = [list(r.turn_ids) if r.phase == DECODE else [] for r in self.rows]
        if self.block_hook:
            bias = self.logits_hook.block_bias(turn_of_row, self.decode_step, by_row, self.steps)  # [steps, N, V]
        else:  # one step a dispatch
            bias = self.logits_hook(turn_of_row, self.decode_step, by_row)
            bias = None if bias is None else np.asarray(bias)[None]
        if bias is not None:
            out[:len(rows)] = np.swapaxes(np.asarray(bias, np.float32)[:, [r.index for r in rows]], 0, 1)
        return out

    def _check_stop_strings(self, row: _Row, stop: int) -> int:
        """The stop-string rule on the row's turn so far: a completed stop string ends the turn
        and the tokens after it are dropped (and uncached)."""
        ids = row.turn_ids
        if stop == sampler_lib.STOP_TOKEN and row.checked >= len(ids):
            return stop
        hit = self.stop_strings.first_stop(ids, start=row.checked)
        row.checked = len(ids)
        if hit is None or (stop == sampler_lib.STOP_TOKEN and hit >= len(ids) - 1):
            return stop
        keep = hit + 1
        del row.turn_ids[keep:], row.turn_lp[keep:], row.turn_slp[keep:]
        row.cached = len(row.tokens())
        return sampler_lib.STOP_STRING

    # ------------------------------------------------------------------------------------------------ turns
    def _finish(self, row: _Row, status: str) -> None:
        row.segment["status"] = self.episodes[row.index].status = status
        row.phase = DONE
        self._release(row)

    def _end_turn(self, row: _Row, stop: int) -> None:
        """The end of an assistant turn (`agent.end_turn`'s rule): the episode ends, or its tool call runs on the
        pool (an unparsable call's error observation is given back at once)."""
        ids = list(row.turn_ids)
        self.generated_tokens += len(ids)
        call = agent_lib.end_turn(self.chat, self.rollout, row.segment, self.episodes[row.index], ids, row.turn_lp,
                                  row.turn_slp, stop)
        row.turn_open, row.turn_ids, row.turn_lp, row.turn_slp = False, [], [], []
        if call is None:
            self._finish(row, row.segment["status"])
            return
        row.phase = TOOL
        if isinstance(call, ToolCall):
            row.future = self.executor.submit(_timed, self.browsers[row.index].execute, call.name, call.arguments)
            row.call_ids = ids
        else:
            self._observe(row, call, ids)

    def _collect_tools(self, wait: bool) -> bool:
        pending = [r for r in self.rows if r.phase == TOOL and r.future is not None]
        if not pending:
            return False
        if wait:
            concurrent.futures.wait([r.future for r in pending], return_when=concurrent.futures.FIRST_COMPLETED)
        done = False
        for row in pending:
            if row.future.done():
                observation, seconds = row.future.result()
                ids, row.future, row.call_ids = row.call_ids, None, []
                self.timing["env"] += seconds
                self._observe(row, observation, ids)
                done = True
        return done

    def _observe(self, row: _Row, observation: str, ids: list[int]) -> None:
        """Give the observation to the row (`agent.observe`'s rule: appended, or the context compacted into a new
        segment that starts over in fresh pages); the row then waits for its prefill (in its slot, or in the queue
        when it was preempted while its tool ran)."""
        segment = agent_lib.observe(self.chat, self.rollout, self.schemas, row.segment, self.episodes[row.index],
                                    observation, ids)
        if segment is None:
            self._finish(row, "context_overflow")
            return
        if segment is not row.segment:  # compacted: the new segment starts over in the row's pages
            self.finished_segments[row.index].append(row.segment)
            row.segment = segment
            self.allocator.release(row.pages)
            row.pages, row.cached = [], 0
        if row.slot is None:
            row.phase = QUEUED
            heapq.heappush(self.queue, row.index)
        else:
            row.phase = PREFILL

    # ------------------------------------------------------------------------------------------------ loop
    def run(self) -> PagedRollout:
        idle = 0
        try:
            while True:
                self._collect_tools(wait=False)
                self._admit()
                plans = self._plan_prefill()
                alive = any(r.phase != DONE for r in self.rows)
                # one agreement a dispatch: whether any process has a row left (the first), then the shapes of the
                # next prefill dispatch (R = 0: no process has one), then those of the decode
                none = (0, 0, 0, 0)
                alive, *shape = self._agree([alive, *(plans[0]["shape"] if plans else none)])
                if not alive:
                    break
                prefilled = bool(shape[3])
                while shape[3]:
                    self._prefill(plans.pop(0) if plans else None, *shape)
                    shape = self._agree(plans[0]["shape"] if plans else none)
                plan = self._plan_decode()
                rows, num_items, waiting = self._agree([*(plan["shape"] if plan else (0, 0)),
                                                        any(r.future is not None for r in self.rows)])
                if rows:
                    self._decode(plan, rows, num_items)
                # nothing ran anywhere: wait for a tool (each process for its own); an iteration that only preempted
                # runs again (admission next). `idle` is the same on every process (agreed values only).
                if prefilled or rows:
                    idle = 0
                else:
                    self._collect_tools(wait=True)
                    idle = 0 if waiting else idle + 1
                if idle > 1:
                    raise RuntimeError("paged engine: no row can advance (a bug: report the config)")
        finally:
            self.executor.shutdown(wait=True, cancel_futures=True)
        return self._pack()

    def _pack(self) -> PagedRollout:
        t0 = time.perf_counter()
        pad_id = self.chat.end_of_text_id if self.chat.end_of_text_id is not None else 0
        segment_rows, episode_of, first_turn = [], [], []
        for r, row in enumerate(self.rows):
            last = row.segment
            for segment in self.finished_segments[r] + [last]:
                segment["status"], segment["reward"] = last["status"], last["reward"]
                segment_rows.append(segment)
                episode_of.append(r)
                first_turn.append(segment["first_turn"])
        # over several processes the batch stays on the host (this process's rows), as `run_episodes` keeps it
        batch = build_batch(segment_rows, max_len=self.max_len, max_turns=self.rollout.max_turns,
                            group_id=np.asarray(episode_of) // self.rollout.group_size, pad_id=pad_id,
                            episode=episode_of, first_turn=first_turn,
                            placement=agent_lib.batch_placement(self.mesh, self.rules))
        self.timing["pack"] = time.perf_counter() - t0
        self.timing["total"] = time.perf_counter() - self.start
        pool_bytes = max(sum(shard.data.nbytes for leaf in (self.state.k, self.state.v)
                             for shard in leaf.addressable_shards if shard.device == device)
                         for device in {s.device for s in self.state.k.addressable_shards})
        return PagedRollout(batch=batch, episodes=self.episodes, timing=self.timing,
                            generated_tokens=self.generated_tokens, rows_at_once=self.processes * self.slots,
                            kv_cache_bytes=pool_bytes, stats=self.stats)


def _timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start
