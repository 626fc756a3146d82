"""Test-only driver of the paged engine's device programs without its scheduler: each row in its own slot with
the pages of a whole `max_len`, one `paged.prefill_program` dispatch for the prompts, then `paged.decode_program`
dispatches of `sync_every` steps until every row stops, with the host bookkeeping the engine does between them
(lengths, budgets, turn steps, work items) restated plainly. The sampling-rule tests use it to run rows through the
programs the engine runs, and compare them with tests/rollout/naive_reference.py's no-cache reference; the engine
itself (admission, preemption, tools, stop strings) is tested in test_paged_engine.py.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Sequence

import numpy as np

from trace_jax.rollout import paged
from trace_jax.rollout import sampler as sampler_lib

PAGE_SIZE = 8


@dataclasses.dataclass
class Pool:
    """A pool and its rows after `prefill`: row r in slot r, holding pages `tables[r]`, `lengths[r]` tokens cached.
    `state` is donated by every program: use the pool `decode` returns."""

    state: paged.PagedState
    layout: object
    tables: list
    lengths: np.ndarray
    max_len: int
    page_size: int

    @property
    def table(self) -> np.ndarray:
        return paged.page_table_array(self.tables, len(self.tables[0]))

    @property
    def items_size(self) -> int:
        return paged.item_capacity(len(self.tables) * len(self.tables[0]))


def prefill(config, params, prompts: Sequence[Sequence[int]], *, max_len: int, page_size: int = PAGE_SIZE,
            mesh=None) -> Pool:
    """A fresh pool with `prompts[r]` prefilled into row r (one `paged.prefill_program` dispatch)."""
    rows = len(prompts)
    width = paged.pages_for(max_len, page_size)
    tables = [list(range(r * width, (r + 1) * width)) for r in range(rows)]
    state = paged.init_pool_program(config, rows * width, page_size, rows, mesh)()
    pool = Pool(state=state, layout=paged.state_layout(state), tables=tables,
                lengths=np.asarray([len(p) for p in prompts], np.int32), max_len=max_len, page_size=page_size)
    tokens = np.zeros((rows, sampler_lib.bucket_length(max(len(p) for p in prompts))), np.int32)
    for r, prompt in enumerate(prompts):
        tokens[r, :len(prompt)] = prompt
    cached = np.zeros(rows, np.int32)
    index = np.arange(rows, dtype=np.int32)
    items = paged.work_items(tables, cached, page_size, size=pool.items_size)
    pool.state = paged.prefill_program(config, max_len, pool.layout)(
        params, state, cached, tokens, pool.lengths.copy(), items, index, pool.table, index)
    return pool


def decode(config, params, pool: Pool, *, keys, sampling, budget, stop_ids: Sequence[int] = (),
           sync_every: int = 4) -> tuple[Pool, types.SimpleNamespace]:
    """Decode every row of `pool` until it stops (a stop id, a full row, its budget), `sync_every` steps a dispatch.
    Row r's t-th token is drawn with `fold_in(keys[r], t)`. Returns the pool after it and, per row (host numpy):
    `tokens`, `logprobs`, `sampling_logprobs` (lists of [n_r] arrays), `stop_reason` [B] (`sampler.STOP_REASONS`)
    and `dispatches`."""
    rows = len(pool.lengths)
    sampling = sampler_lib.RowSampling.broadcast(sampling, rows)
    lengths = pool.lengths.copy()
    budget_left = np.broadcast_to(np.asarray(budget, np.int32), (rows,)).copy()
    active = (budget_left > 0) & (lengths < pool.max_len)
    turn_step = np.zeros(rows, np.int32)
    reason = np.full(rows, sampler_lib.RUNNING, np.int32)
    stop_arr = np.asarray(list(stop_ids) or [-1], np.int32)
    keys = np.asarray(keys, np.uint32)
    slots = np.arange(rows, dtype=np.int32)
    program = paged.decode_program(config, sync_every, pool.max_len, pool.layout)
    out_tokens, out_lp, out_slp = ([[] for _ in range(rows)] for _ in range(3))
    state, dispatches = pool.state, 0
    while active.any():
        # the pages attention reads: every position cached before the block's last step
        items = paged.work_items(pool.tables, np.minimum(lengths + sync_every - 1, pool.max_len), pool.page_size,
                                 size=pool.items_size)
        out = program(sampling, params, state, slots, pool.table, lengths, active, budget_left, stop_arr, keys,
                      turn_step, reason, items, None)
        state, dispatches = out[0], dispatches + 1
        tokens, lp, slp, was_active = (np.asarray(x) for x in out[1:5])
        active, reason, budget_left, lengths = (np.array(x) for x in out[5:9])
        turn_step = turn_step + was_active.sum(axis=0).astype(np.int32)
        for r in range(rows):
            steps = was_active[:, r]
            out_tokens[r] += tokens[steps, r].tolist()
            out_lp[r] += lp[steps, r].tolist()
            out_slp[r] += slp[steps, r].tolist()
    pool = dataclasses.replace(pool, state=state, lengths=lengths)
    return pool, types.SimpleNamespace(tokens=[np.asarray(t, np.int32) for t in out_tokens],
                                       logprobs=[np.asarray(t, np.float32) for t in out_lp],
                                       sampling_logprobs=[np.asarray(t, np.float32) for t in out_slp],
                                       stop_reason=reason, dispatches=dispatches)


def run_rows(config, params, prompts: Sequence[Sequence[int]], *, max_len: int, keys, sampling, budget,
             stop_ids: Sequence[int] = (), sync_every: int = 4, mesh=None):
    """`prefill` then `decode`: (the pool after, the rows' generation)."""
    pool = prefill(config, params, prompts, max_len=max_len, mesh=mesh)
    return decode(config, params, pool, keys=keys, sampling=sampling, budget=budget, stop_ids=stop_ids,
                  sync_every=sync_every)
