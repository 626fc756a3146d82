"""Paged KV cache: one pool of fixed-size pages shared by every row, host page tables, ragged paged attention, and
the device programs of the paged engine (`rollout.engine`).

The pool (`PagedState`) holds `k, v [kv_heads, layers, num_pages, page_size, head_dim]` (kv heads first and layers
next to pages: the layout of JAX's Pallas TPU paged attention kernel, whose `k_pages [kv_heads, pages, page_size,
head_dim]` are the pool with layers and pages merged, a free reshape) and each slot's pending next-token logits
`[slots, V]`. A row's token at position `p` lives in page `page_table[row][p // page_size]` at
offset `p % page_size`. Page tables, the rows' cached lengths and which pages they hold are host state
(`PageAllocator`, the engine), passed into every program as small int32 arrays: memory held is proportional to the
tokens held, not to `max_context`, and a row that is freed or paused leaves nothing on the device to clean up.

Ragged attention, two paths chosen by the target the program is compiled for (`attention_path(config)`: the
model's resolved `attention_impl`, which `plan` sets from the topology it compiles for):
  * "pallas_tpu" (a TPU, head_dim a multiple of 128): decode steps run JAX's Pallas TPU paged attention kernel
    (`jax.experimental.pallas.ops.tpu.paged_attention`, `paged_attention_kernel`): each step's keys and values are
    written into the row's page first, then the kernel reads each row's pages up to its length by DMA, under
    `jax.shard_map` on a mesh. Prefill stays on the XLA path: that kernel takes one query per row (the ragged
    kernel that takes query chunks, `ragged_paged_attention`, does not run in this jax's Pallas interpret mode,
    so it could not be checked on a CPU host).
  * "xla" (CPU, GPU, and TPU prefill): `paged_attention`, below. The keys a program reads are a list of *work
items* `(row, page, first position)` built on the host from the page tables (`work_items`): only the pages the
rows hold, padded to a bucket of items (`sampler.bucket_length`) so shapes repeat. Each item scores the queries of
its row against its page; a segment max / sum over items (`jax.ops.segment_*`) joins each row's pages into one
float32 softmax, together with the row's new tokens (the `block` keys, as `models.cache.extend` passes them). Work
is about the sum of the rows' own lengths, not the batch maximum times the rows, and freed slots read nothing.
A prefill chunk (many queries a row) reads the same pages in blocks of its row's table (`prefill_attention`): the
queries are gathered once a block, not once a page, and its own keys are scored in causal tiles.

Programs (one public builder each, cached per static arguments; `compiled_programs(kind)` counts executables):
  * `init_pool_program`: the empty pool, created inside jit with `out_shardings` (pages over the batch axes, kv heads
    over `tensor`). On the kernel path each row's pages must lie on one batch shard (`PageAllocator` with
    `shards`: one block of the pool a shard).
  * `prefill_program`: a chunk of up to W tokens for each of U distinct rows run through the model and written into
    the pages of every row holding those tokens (a prompt's G samples run once), each row's last logits stored in
    its slot: admission, observations, and recompute after preemption are this one program.
  * `decode_program`: `num_steps` decode steps of the rows that generate (gathered from their slots): sample
    from the pending logits with per-row keys `fold_in(key[row], turn_step[row])` (`sampler.sample_from_logits`),
    write the token's keys/values into the row's page, update the stop state (stop token, full row, budget).

On a mesh the programs run under `jax.set_mesh` (`sampler.MeshProgram`); the output state is pinned to `layout`.

This module knows nothing about chat formats, tools, episodes or scheduling (see `rollout.engine`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from trace_jax.models import decoder as dec
from trace_jax.models.config import ModelConfig
from trace_jax.models.sharding import logical_to_sharding
from trace_jax.rollout import sampler as sampler_lib
from trace_jax.rollout.budget import GIB, batch_shards

_NEG_INF = -1e30  # finite, so a row with no visible key stays finite


@dataclasses.dataclass(frozen=True)
class PagedConfig:
    """Settings of the paged engine (`rollout.engine`; `RolloutConfig.paged`).

    Attributes:
      page_size: tokens per page.
      num_pages: pages in the pool. None: what `RolloutConfig.kv_budget_gib` holds per chip
        (`paged.pages_within_budget`), or, without a budget, every row's `max_context`. A row's pages lie on one
        batch shard of the pool, so on a mesh whose batch axes split it each shard's part must hold one row of
        `max_context` (`engine.pool_pages`).
      slots: rows in flight at most (the decode batch). None: every row of the call.
      prefill_chunk: most tokens of one row written by one prefill dispatch (longer inputs take several).
      prefill_tokens: most tokens one prefill dispatch runs through the model (rows with the same tokens count
        once); the rows beyond wait for the next dispatch, after a decode block, so that a wave of admissions or
        observations does not stall the rows that generate. At least one row's chunk always runs.
      tool_workers: host threads running tool calls.
    """

    page_size: int = 16
    num_pages: int | None = None
    slots: int | None = None
    prefill_chunk: int = 256
    prefill_tokens: int = 8192
    tool_workers: int = 4

    def __post_init__(self):
        for name in ("page_size", "prefill_chunk", "prefill_tokens", "tool_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PagedConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("num_pages", "slots"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"PagedConfig.{name} must be an int >= 1 or None, got {value!r}")


@struct.dataclass
class PagedState:
    """The paged engine's device state.

    Attributes:
      k, v: [kv_heads, layers, num_pages, page_size, head_dim], the page pool (any page may belong to any row; page
        `p` of layer `l` is `k[:, l, p]`, the kernel's page `l * num_pages + p`).
      logits: float32 [slots, V], each slot's logits after its last cached token (valid after a prefill to it or
        a decode step in which it was active).
    """

    k: jax.Array
    v: jax.Array
    logits: jax.Array

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def slots(self) -> int:
        return self.logits.shape[0]


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` positions."""
    return -(-int(tokens) // page_size)


class PageAllocator:
    """Host free list of the pool's pages, with a holder count per page, split into `shards` contiguous blocks.

    With `shards` > 1 the pool's pages are split over that many batch shards (block s, pages
    `[s * num_pages / shards, (s + 1) * num_pages / shards)`, is the part shard s holds) and every allocation names
    its shard: a row takes all its pages from one block, so the kernel path (`_kernel_layer`) runs it on the shard
    holding them. Within a block, pages are handed out lowest id first and a freed page can go to any row of that
    shard. A page may have several holders (`share`: the full pages of a prompt its G samples hold together, rows
    of one shard); it is free again when its last holder releases it.

    Allocation never fails silently: `alloc` raises when fewer pages are free in the shard than asked (callers
    check `free_in(shard)` first and preempt a row of that shard when it is full)."""

    def __init__(self, num_pages: int, shards: int = 1):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"PageAllocator: num_pages must be an int >= 1, got {num_pages!r}")
        if not isinstance(shards, int) or shards < 1 or num_pages % shards:
            raise ValueError(f"PageAllocator: shards must be an int >= 1 dividing num_pages = {num_pages}, got "
                             f"{shards!r}")
        self.num_pages, self.shards = num_pages, shards
        self.shard_pages = num_pages // shards
        # one stack a shard: pop() gives its lowest free id
        self._free = [list(range((s + 1) * self.shard_pages - 1, s * self.shard_pages - 1, -1)) for s in range(shards)]
        self._holders = np.zeros(num_pages, np.int64)

    @property
    def free_pages(self) -> int:
        """Free pages in every shard together."""
        return sum(len(free) for free in self._free)

    def free_in(self, shard: int) -> int:
        """Free pages of shard `shard`."""
        return len(self._free[shard])

    def shard_of(self, page: int) -> int:
        """The shard holding `page`."""
        return int(page) // self.shard_pages

    def alloc(self, count: int, shard: int = 0) -> list[int]:
        """`count` free pages of shard `shard`, lowest first; one holder each."""
        free = self._free[shard]
        if count > len(free):
            where = f" in shard {shard}" if self.shards > 1 else ""
            raise RuntimeError(f"PageAllocator.alloc: {count} pages asked, {len(free)} free{where}")
        pages = [free.pop() for _ in range(count)]
        self._holders[pages] = 1
        return pages

    def share(self, pages: Sequence[int]) -> list[int]:
        """One more holder of each of `pages` (held pages: a row reading another row's pages); returns them."""
        pages = list(pages)
        if pages and not (self._holders[pages] > 0).all():
            raise RuntimeError(f"PageAllocator.share: pages {pages} are not all held")
        np.add.at(self._holders, pages, 1)
        return pages

    def holders(self, page: int) -> int:
        return int(self._holders[page])

    def release(self, pages: Sequence[int]) -> None:
        """One holder fewer of each of `pages`; those left without a holder are free."""
        pages = list(pages)
        if len(set(pages)) != len(pages) or (pages and not (self._holders[pages] > 0).all()):
            raise RuntimeError(f"PageAllocator.release: pages {pages} are not all held (double free)")
        self._holders[pages] -= 1
        touched = set()
        for page in pages:
            if self._holders[page] == 0:
                shard = self.shard_of(page)
                self._free[shard].append(page)
                touched.add(shard)
        for shard in touched:
            self._free[shard].sort(reverse=True)


def grow_pages(allocator: PageAllocator, row, pages: int, rows, newest: Callable, preempt: Callable, *,
               shard: int = 0) -> bool:
    """Give `row` (anything with a `pages` list) `pages` pages in all from shard `shard` (the row's: where its
    pages are), preempting the newest (largest `newest(r)`) of `rows` holding pages of that shard while it is short
    (`preempt(victim)` releases its pages): the row itself when it is the newest, so an older row is never paused
    for a newer one, and a row of another shard never (its pages would not help). False when the row itself was
    preempted. The one rule of both schedulers over the pool, the rollout engine and the serve engine (one shard).
    A shard that holds one row of `max_context` always lets its oldest row finish."""
    need = pages - len(row.pages)
    while need > allocator.free_in(shard):
        victim = max((r for r in rows if (r.pages and allocator.shard_of(r.pages[0]) == shard) or r is row),
                     key=newest)
        preempt(victim)
        if victim is row:
            return False
    if need > 0:
        row.pages += allocator.alloc(need, shard)
    return True


def page_bytes(config: ModelConfig, page_size: int, *, mesh=None, dtype=None, rules=None) -> int:
    """Bytes one page (k and v, every layer) takes on one chip: its kv heads are split over `tensor` when the rules
    split them (`budget.kv_bytes_per_row`'s rule)."""
    from trace_jax.rollout.budget import kv_bytes_per_row

    return kv_bytes_per_row(config, page_size, mesh=mesh, dtype=dtype, rules=rules) - jnp.dtype(jnp.int32).itemsize


def pages_within_budget(config: ModelConfig, page_size: int, budget_gib: float, *, mesh=None, dtype=None,
                        rules=None) -> int:
    """Pages of a pool that fits `budget_gib` GiB per chip: pages are split over the batch shards of `mesh`, so the
    pool holds `batch_shards` times what one chip's budget holds, rounded down to a multiple of the shards."""
    shards = batch_shards(mesh, rules)
    per_chip = int(budget_gib * GIB // page_bytes(config, page_size, mesh=mesh, dtype=dtype, rules=rules))
    return per_chip * shards


def item_capacity(num_pages: int, holders: int = 1, rows: int | None = None, table_width: int | None = None) -> int:
    """The one items size of a pool's programs (`work_items(..., size=)`): the most pages one dispatch can read,
    rounded up to a power of two (>= 16). That is the pool's `num_pages` times the most `holders` of one page (a
    prompt's G samples share its full pages), and at most `rows` (the rows in flight) times a page table's
    `table_width`. `paged_attention` stops after the last live item, so the padding costs host bytes, not device
    work."""
    most = num_pages * holders
    if rows is not None and table_width is not None:
        most = min(most, rows * table_width)
    return max(16, 1 << max(most - 1, 0).bit_length())


def work_items(page_tables: Sequence[Sequence[int]], cached: Sequence[int], page_size: int, *,
               minimum: int = 1, maximum: int | None = None, size: int | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The keys a program reads: for each row i, the pages holding its positions `< cached[i]`, as items
    `(row int32 [I], page int32 [I], first position int32 [I])`, padded to a power of two >= `minimum` items, at
    most `maximum` (the engine's: the pool's page count times the most rows that hold one page), so that few shapes
    compile whatever the rows' lengths (padding: row = number of rows, which no query belongs to). `size`
    (`item_capacity`) pads to exactly that many items instead: one shape for every dispatch."""
    rows, pages, starts = [], [], []
    for row, (table, length) in enumerate(zip(page_tables, cached)):
        count = pages_for(length, page_size)
        if count > len(table):
            raise ValueError(f"work_items: row {row} caches {length} tokens but holds {len(table)} pages of "
                             f"{page_size}")
        rows += [row] * count
        pages += list(table[:count])
        starts += [j * page_size for j in range(count)]
    if size is not None:
        if len(rows) > size:
            raise ValueError(f"work_items: {len(rows)} pages to read, more than size={size}")
    else:
        size = max(minimum, 1 << max(len(rows) - 1, 0).bit_length())
        if maximum is not None:
            size = max(min(size, maximum), len(rows))
    pad = size - len(rows)
    return (np.asarray(rows + [len(page_tables)] * pad, np.int32), np.asarray(pages + [0] * pad, np.int32),
            np.asarray(starts + [0] * pad, np.int32))


def page_table_array(page_tables: Sequence[Sequence[int]], width: int, rows: int | None = None) -> np.ndarray:
    """int32 [rows, width] page tables (row i's pages first; -1 after: a write there is dropped)."""
    out = np.full((len(page_tables) if rows is None else rows, width), -1, np.int32)
    for row, table in enumerate(page_tables):
        if len(table) > width:
            raise ValueError(f"page_table_array: row {row} holds {len(table)} pages, more than the width {width}")
        out[row, :len(table)] = table
    return out


# ---------------------------------------------------------------------------------------------------- attention
ITEM_PAIRS = 16384  # query x page pairs one step of `paged_attention`'s loop scores (see `item_chunk`)


def item_chunk(queries: int, items: int) -> int:
    """Work items one step of `paged_attention`'s loop reads for `queries` queries a row: a power of two near
    `ITEM_PAIRS / queries` (16..1024), at most `items` rounded up to a power of two. Fixed per program shape; the
    last live chunk's padding is the waste, so chunks stay well under a large pool's items."""
    size = 16
    while size < 1024 and size * 2 * queries <= ITEM_PAIRS:
        size *= 2
    return min(size, 1 << max(items - 1, 0).bit_length())


def _segment_softmax_step(carry, s, vis, r, num_rows: int, weigh_values):
    """One step of the online softmax over work items: the items' scores `s` (masked by `vis`, last axis the keys)
    join their rows' running max, denominator and weighted values (`carry`) by segment max / sum over `r`, the
    items' rows; `weigh_values(p)` is the items' probabilities times their values, per item."""
    top, denom, out = carry
    s = jnp.where(vis, s, _NEG_INF)
    new_top = jnp.maximum(top, jax.ops.segment_max(jnp.max(s, axis=-1), r, num_segments=num_rows))
    scale = jnp.exp(top - new_top)
    p = jnp.where(vis, jnp.exp(s - new_top[r][..., None]), 0.0)
    denom = denom * scale + jax.ops.segment_sum(jnp.sum(p, axis=-1), r, num_segments=num_rows)
    out = out * scale[..., None] + jax.ops.segment_sum(weigh_values(p), r, num_segments=num_rows)
    return new_top, denom, out


def paged_attention(q, k_pages, v_pages, key_len, items, *, layer=None, block=None):
    """Grouped-query attention of each row's queries over its own pages (and optional block keys): the XLA path.

    The program loops over `items` in chunks of `item_chunk` items with an online float32 softmax and stops after
    the chunk of the last live item (row < B; `work_items` lists the live items first): the work
    follows the pages the rows hold, while the items array keeps one size (`item_capacity`), so a program compiles
    once whatever the rows' lengths.

    Args:
      q: [B, n, H, Dh] queries (unscaled).
      k_pages, v_pages: [K, num_pages, page_size, Dh], one layer of the pool; or, with `layer` (an int32 scalar),
        the whole pool [K, layers, num_pages, page_size, Dh], of which layer `layer` is read (one gather of the
        items' pages: no layer of the pool is copied).
      key_len: int [B]: every query of row b sees the paged keys at positions `< key_len[b]`.
      items: `(row [I], page [I], start [I])` (`work_items`): row `row[i]`'s positions `start[i] .. start[i] +
        page_size - 1` live in page `page[i]`; items with `row >= B` are padding, after the live ones.
      block: optional `(k2 [B, n2, K, Dh], v2, mask2 bool [B, n, n2])`, keys of each row beside its pages (the new
        tokens of an extend), in the same softmax.

    Returns [B, n, H, Dh] in v's dtype. Softmax statistics are float32; a query with no visible key gets 0.
    """
    B, n, H, Dh = q.shape
    K, page_size = k_pages.shape[0], k_pages.shape[-2]
    G = H // K
    row, page, start = (jnp.asarray(x) for x in items)
    key_len = jnp.asarray(key_len)
    chunk = item_chunk(n, row.shape[0])
    pad = -row.shape[0] % chunk
    if pad:
        row = jnp.concatenate([row, jnp.full((pad,), B, row.dtype)])
        page = jnp.concatenate([page, jnp.zeros((pad,), page.dtype)])
        start = jnp.concatenate([start, jnp.zeros((pad,), start.dtype)])
    qg = (q * jnp.asarray(Dh ** -0.5, q.dtype)).reshape(B, n, K, G, Dh)
    top = jnp.full((B, n, K, G), _NEG_INF, jnp.float32)
    denom = jnp.zeros((B, n, K, G), jnp.float32)
    out = jnp.zeros((B, n, K, G, Dh), jnp.float32)
    if block is not None:
        k2, v2, mask2 = block
        sb = jnp.einsum("bnkgd,bjkd->bnkgj", qg, k2.astype(q.dtype), preferred_element_type=jnp.float32)
        sb = jnp.where(mask2[:, :, None, None, :], sb, _NEG_INF)
        top = jnp.maximum(top, jnp.max(sb, axis=-1))
        pb = jnp.where(mask2[:, :, None, None, :], jnp.exp(sb - top[..., None]), 0.0)
        denom = jnp.sum(pb, axis=-1)
        out = jnp.einsum("bnkgj,bjkd->bnkgd", pb.astype(v2.dtype), v2.astype(q.dtype),
                         preferred_element_type=jnp.float32)

    def step(i, carry):
        top, denom, out = carry
        rows = jax.lax.dynamic_slice_in_dim(row, i * chunk, chunk)
        pages = jax.lax.dynamic_slice_in_dim(page, i * chunk, chunk)
        starts = jax.lax.dynamic_slice_in_dim(start, i * chunk, chunk)
        live = rows < B
        r = jnp.where(live, rows, 0)
        if layer is None:
            kp, vp = k_pages[:, pages], v_pages[:, pages]  # [K, chunk, page, Dh]
        else:
            kp, vp = k_pages[:, layer, pages], v_pages[:, layer, pages]
        kp, vp = kp.astype(q.dtype), vp.astype(q.dtype)
        s = jnp.einsum("inkgd,kitd->inkgt", qg[r], kp, preferred_element_type=jnp.float32)
        pos = starts[:, None] + jnp.arange(page_size, dtype=jnp.int32)[None, :]
        vis = (live[:, None] & (pos < key_len[r][:, None]))[:, None, None, None, :]  # [chunk, 1, 1, 1, page]
        return _segment_softmax_step((top, denom, out), s, vis, r, B, lambda p: jnp.einsum(
            "inkgt,kitd->inkgd", p.astype(vp.dtype), vp, preferred_element_type=jnp.float32))

    # the chunks up to the last live item: trailing padding is never read (live items usually come first; over
    # several processes each process's block of items has its own padding, so count to the last live one)
    last = jnp.max(jnp.where(row < B, jnp.arange(row.shape[0], dtype=jnp.int32) + 1, 0))
    chunks = (last + chunk - 1) // chunk
    top, denom, out = jax.lax.fori_loop(0, chunks, step, (top, denom, out))
    out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.reshape(B, n, H, Dh).astype(v_pages.dtype)


PREFILL_BLOCK_TOKENS = 256  # cached keys one prefill work block reads: `prefill_attention`'s pages per block
PREFILL_QUERY_TILE = 128  # queries per tile of a chunk's causal attention to its own keys
PREFILL_PAIRS = 262144  # query x key pairs one step of `prefill_attention`'s loop scores (4 blocks of 256 x 256)


def prefill_blocks(queries: int, width: int, page_size: int) -> tuple[int, int]:
    """(pages per block, blocks per step) of `prefill_attention` for `queries` queries a row and page tables of
    `width` pages: blocks of about `PREFILL_BLOCK_TOKENS` keys (at most the table), and as many blocks a step as
    `PREFILL_PAIRS` query x key pairs hold (a power of two, at least 1). Fixed per program shape."""
    pages = max(1, min(width, PREFILL_BLOCK_TOKENS // page_size))
    per_step = 1
    while per_step * 2 * queries * pages * page_size <= PREFILL_PAIRS:
        per_step *= 2
    return pages, per_step


def prefill_attention(q, k_pool, v_pool, layer, key_len, items, block, *, width: int):
    """`paged_attention` for a prefill chunk (many queries a row): the same softmax over the same keys, read in
    blocks of a row's pages instead of page by page.

    Page by page, each (row, page) item scores all of the row's queries against 16 keys: the queries are gathered
    once per page (a chunk of 256 queries copies about 4x the page's keys and values for every page) and the
    partial outputs are summed per row over the pages. Here the work items are (row, block of
    `prefill_blocks(...)[0]` consecutive pages of its table): the queries are gathered once per block and each
    step is a batched matmul over a few hundred keys. Blocks past a row's cached length are not read (live blocks
    come first and the loop stops after the last), so a chunk that starts at position 0 reads no page at all.

    Args:
      q: [B, n, H, Dh] queries (unscaled); k_pool, v_pool: the pool [K, layers, num_pages, page_size, Dh];
      layer: int32 scalar; key_len: int [B], the paged keys row b sees (positions `< key_len[b]`);
      items: `work_items` of the rows' pages (the program's argument): row b's table is rebuilt from them;
      block: `(k2 [B, n, K, Dh], v2, mask2 bool [B, n, n])`, the chunk's own keys; `mask2` must be causal (no
        query sees a later key, as `extend_rows`'s): they are scored in tiles of `PREFILL_QUERY_TILE` queries
        against the keys up to the tile's last query only;
      width: the pages of a row's table (static: `pages_for(max_len, page_size)`).

    Returns [B, n, H, Dh] in v's dtype; float32 softmax statistics.
    """
    B, n, H, Dh = q.shape
    K, page_size = k_pool.shape[0], k_pool.shape[3]
    G = H // K
    M = n * G  # a kv head's queries: (token, head of its group)
    block_pages, per_step = prefill_blocks(n, width, page_size)
    span = block_pages * page_size
    num_blocks = -(-width // block_pages)
    row, page, start = (jnp.asarray(x) for x in items)
    # row b's table, position j * page_size in page table[b, j] (padding items, row >= B, are dropped)
    table = jnp.zeros((B, num_blocks * block_pages), jnp.int32).at[row, start // page_size].set(page, mode="drop")
    key_len = jnp.asarray(key_len)
    # work items: (row, block) pairs that hold a cached key, live ones first in row order
    pair_row = jnp.repeat(jnp.arange(B, dtype=jnp.int32), num_blocks)
    pair_block = jnp.tile(jnp.arange(num_blocks, dtype=jnp.int32), B)
    live = pair_block * span < key_len[pair_row]
    order = jnp.argsort(~live, stable=True)
    count = B * num_blocks
    pad = -count % per_step
    work_row = jnp.concatenate([jnp.where(live[order], pair_row[order], B), jnp.full((pad,), B, jnp.int32)])
    work_block = jnp.concatenate([pair_block[order], jnp.zeros((pad,), jnp.int32)])

    def grouped(x):  # [B, n, K, G, ...] -> [B, K, n * G, ...]
        return jnp.moveaxis(x, 2, 1).reshape(x.shape[0], K, M, *x.shape[4:])

    qg = grouped((q * jnp.asarray(Dh ** -0.5, q.dtype)).reshape(B, n, K, G, Dh))  # [B, K, M, Dh]
    k2, v2, mask2 = block
    k2, v2 = k2.astype(q.dtype), v2.astype(q.dtype)
    mask = jnp.repeat(mask2, G, axis=1)[:, None]  # [B, 1, M, n]: query (i, g) sees the chunk's keys j <= i
    # the chunk's own keys, in tiles of queries: tile t sees keys < its end only (causal), not all n
    tile = PREFILL_QUERY_TILE if n % PREFILL_QUERY_TILE == 0 else n
    parts = []
    for first in range(0, n, tile):
        end = first + tile
        rows_m = slice(first * G, end * G)
        sb = jnp.einsum("bkmd,bjkd->bkmj", qg[:, :, rows_m], k2[:, :end], preferred_element_type=jnp.float32)
        seen = mask[:, :, rows_m, :end]
        sb = jnp.where(seen, sb, _NEG_INF)
        top_t = jnp.max(sb, axis=-1)  # [B, K, tile * G]
        pb = jnp.where(seen, jnp.exp(sb - top_t[..., None]), 0.0)
        parts.append((top_t, jnp.sum(pb, axis=-1), jnp.einsum("bkmj,bjkd->bkmd", pb.astype(v2.dtype), v2[:, :end],
                                                               preferred_element_type=jnp.float32)))
    top, denom, out = (jnp.concatenate(x, axis=2) for x in zip(*parts))
    k_layer, v_layer = k_pool[:, layer], v_pool[:, layer]  # [K, num_pages, page_size, Dh]
    offsets = jnp.arange(block_pages, dtype=jnp.int32)
    key_offsets = jnp.arange(span, dtype=jnp.int32)

    def step(i, carry):
        top, denom, out = carry
        rows = jax.lax.dynamic_slice_in_dim(work_row, i * per_step, per_step)
        blocks = jax.lax.dynamic_slice_in_dim(work_block, i * per_step, per_step)
        alive = rows < B
        r = jnp.where(alive, rows, 0)
        pages = table[r[:, None], blocks[:, None] * block_pages + offsets[None, :]]  # [S, block_pages]
        kp = k_layer[:, pages].reshape(K, per_step, span, Dh).astype(q.dtype)
        vp = v_layer[:, pages].reshape(K, per_step, span, Dh).astype(q.dtype)
        s = jnp.einsum("skmd,kstd->skmt", qg[r], kp, preferred_element_type=jnp.float32)  # [S, K, M, span]
        vis = (alive[:, None] & (blocks[:, None] * span + key_offsets[None, :] < key_len[r][:, None]))
        vis = vis[:, None, None, :]
        return _segment_softmax_step((top, denom, out), s, vis, r, B, lambda p: jnp.einsum(
            "skmt,kstd->skmd", p.astype(vp.dtype), vp, preferred_element_type=jnp.float32))

    steps = (jnp.sum(live) + per_step - 1) // per_step
    top, denom, out = jax.lax.fori_loop(0, steps, step, (top, denom, out))
    out = out / jnp.where(denom > 0, denom, 1.0)[..., None]  # [B, K, M, Dh]
    return jnp.moveaxis(out.reshape(B, K, n, G, Dh), 1, 2).reshape(B, n, H, Dh).astype(v_pool.dtype)


KERNEL_HEAD_DIM = 128  # the TPU kernel's lane width: head_dim must be a multiple of it


def attention_path(config: ModelConfig) -> str:
    """Which paged attention a decode program of `config` compiles: "pallas_tpu" (JAX's Pallas TPU paged attention
    kernel) when the model's `attention_impl` resolves to "pallas_tpu" (`models.attention.resolve_impl`: "auto" on
    a TPU backend, and what `plan` sets when it compiles for a TPU topology from a CPU host) and head_dim is a
    multiple of `KERNEL_HEAD_DIM`; else "xla" (`paged_attention`)."""
    from trace_jax.models.attention import resolve_impl

    kernel = resolve_impl(config.attention_impl) == "pallas_tpu" and config.head_dim % KERNEL_HEAD_DIM == 0
    return "pallas_tpu" if kernel else "xla"


def kernel_block_pages(width: int, page_size: int) -> int:
    """Pages the kernel reads per compute block: the largest divisor of the page-table width (the kernel requires
    one) holding at most 512 tokens (about the tuned blocks of JAX's ragged kernel on v6e: 128-512 tokens)."""
    most = max(1, 512 // page_size)
    return max(d for d in range(1, min(width, most) + 1) if width % d == 0)


# The kernel prefetches its page indices [rows x page-table width] int32 into SMEM, which is 1 MiB a core (libtpu
# 0.0.52 on v6e refused 128 rows x 3072 pages = 1.5 MiB for Qwen3-4B at 48K tokens in pages of 16): a decode batch
# is split into calls of at most this many bytes of indices.
KERNEL_INDEX_BYTES = 512 * 1024


def kernel_rows_per_call(width: int) -> int:
    """Rows of one kernel call: the most whose page indices (`width` int32 each) fit `KERNEL_INDEX_BYTES`, a power
    of two (decode batches are powers of two, so the calls split them evenly)."""
    most = max(1, KERNEL_INDEX_BYTES // (4 * width))
    return 1 << (most.bit_length() - 1)


def paged_attention_kernel(q, k_pool, v_pool, layer, page_table, key_len, *, block_pages: int,
                           rows_per_call: int | None = None):
    """One layer of decode attention with JAX's Pallas TPU paged attention kernel, on one device's pool.

    Args:
      q: [B, H, Dh], one query per row (unscaled).
      k_pool, v_pool: [K, layers, num_pages, page_size, Dh], the pool holding every key the rows see.
      layer: int32 scalar; page_table: int32 [B, width] (-1: none); key_len: int32 [B] >= 1, the keys row b sees
        (positions `< key_len[b]` of its pages).
      block_pages: pages per compute block (`kernel_block_pages`).
      rows_per_call: rows per kernel call (default `kernel_rows_per_call(width)`); a batch of more rows is run as
        several calls, each reading its own rows' pages.

    The kernel takes `k_pages [K, total_pages, page_size, Dh]`: the pool with layers and pages merged (a free
    reshape), the row's pages of this layer at `layer * num_pages + page`. The kernel reads keys and values in
    bfloat16 (whatever the pool's dtype) with float32 softmax statistics. Returns [B, H, Dh] in q's dtype.
    """
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention

    K, L, num_pages, page_size, Dh = k_pool.shape
    merged = (K, L * num_pages, page_size, Dh)
    indices = layer * num_pages + jnp.clip(page_table, 0, num_pages - 1)
    scaled = q * jnp.asarray(Dh ** -0.5, q.dtype)  # the kernel does not scale
    k_pages, v_pages = k_pool.reshape(merged), v_pool.reshape(merged)
    rows = rows_per_call or kernel_rows_per_call(page_table.shape[1])
    indices, key_len = indices.astype(jnp.int32), key_len.astype(jnp.int32)
    return jnp.concatenate([
        tpu_paged_attention(scaled[i:i + rows], k_pages, v_pages, key_len[i:i + rows], indices[i:i + rows],
                            pages_per_compute_block=block_pages) for i in range(0, q.shape[0], rows)])


def extend_rows(config: ModelConfig, params, k_pool, v_pool, cached, tokens, num_new, items, *,
                table_width: int | None = None):
    """Run each row's first `num_new[b]` tokens through the model at positions `cached[b] + i`, attending to the
    row's cached pages (`items`) and its own earlier new tokens (traced, not jitted). Nothing is written.

    Args:
      k_pool, v_pool: [K, layers, num_pages, page_size, Dh].
      cached: int32 [B], tokens already in the row's pages (the new ones attend to all of them).
      tokens: int32 [B, n]; num_new: int32 [B] in [0, n] (0: nothing of the row is kept).
      items: `work_items` over the rows' cached pages.
      table_width: the pages of a row's table (`pages_for(max_len, page_size)`); given (the prefill program), the
        pages are read in blocks of the row's table (`prefill_attention`), else page by page (`paged_attention`,
        the decode steps: one query a row).

    Returns (last logits float32 [B, V] of each row's last new token, new keys and values
    [layers, B, n, K, Dh] each, in the pool's dtype).
    """
    B, n = tokens.shape
    offsets = jnp.arange(n, dtype=jnp.int32)
    positions = cached[:, None] + offsets[None, :]
    new = offsets[None, :] < num_new[:, None]
    in_block = (offsets[:, None] >= offsets[None, :])[None] & new[:, None, :]

    def layer(h, xs):
        lp, index = xs

        def attend(q, k, v):
            if table_width is None:
                out = paged_attention(q, k_pool, v_pool, cached, items, layer=index, block=(k, v, in_block))
            else:
                out = prefill_attention(q, k_pool, v_pool, index, cached, items, (k, v, in_block),
                                        width=table_width)
            return out, (k.astype(k_pool.dtype), v.astype(v_pool.dtype))

        h, kv, _ = dec.decoder_layer(config, lp, h, positions, attend)
        return h, kv

    layers = jnp.arange(k_pool.shape[1], dtype=jnp.int32)
    h, (k_new, v_new) = jax.lax.scan(layer, dec.embed_tokens(config, params, tokens), (params["layers"], layers),
                                     unroll=config.scan_unroll)
    last = h[jnp.arange(B), jnp.clip(num_new - 1, 0, n - 1)]
    logits = dec.logits_from_hidden(config, params, dec.final_norm(config, params, last))
    return logits, k_new, v_new


def write_pages(pool, new, page_table, cached, num_new, max_len: int):
    """`pool [K, layers, num_pages, page_size, Dh]` with row b's new entries `new[:, b, i]` (`new [layers, B, n, K,
    Dh]`, i < num_new[b]) written at position `cached[b] + i` of its pages (`page_table [B, max_pages]`, -1 = none:
    dropped, as are positions >= max_len). One scatter for every layer, each (kv head, layer, row, token) its own
    index and head_dim its only window: with the kv heads in the window (until 2026-12-06) XLA:TPU laid the pool out
    heads-minor for the scatter and copied it whole there and back (in every decode layer on the kernel path: 14.14
    GiB of temporaries and ~497 GB a step for Qwen3-4B's 6.8 GiB pool on v6e-8; twice per prefill dispatch)."""
    L, num_pages, page_size = pool.shape[1:4]
    n = new.shape[2]
    offsets = jnp.arange(n, dtype=jnp.int32)
    positions = cached[:, None] + offsets[None, :]
    stored = (offsets[None, :] < num_new[:, None]) & (positions < max_len)
    page = jnp.take_along_axis(page_table, jnp.clip(positions // page_size, 0, page_table.shape[1] - 1), axis=1)
    page = jnp.where(stored & (page >= 0), page, num_pages)  # out of range: dropped
    heads = jnp.arange(pool.shape[0], dtype=jnp.int32)[:, None, None, None]
    layers = jnp.arange(L, dtype=jnp.int32)[None, :, None, None]
    values = jnp.moveaxis(new, 3, 0).astype(pool.dtype)  # [K, L, B, n, Dh]
    return pool.at[heads, layers, page[None, None], (positions % page_size)[None, None]].set(values, mode="drop")


def paged_extend(config: ModelConfig, params, k_pool, v_pool, page_table, cached, tokens, num_new, items,
                 max_len: int):
    """`extend_rows`, then the new keys/values written into each row's own pages (`write_pages`): one decode step
    or one chunk of a row. Returns (last logits float32 [B, V], k_pool, v_pool)."""
    logits, k_new, v_new = extend_rows(config, params, k_pool, v_pool, cached, tokens, num_new, items)
    return (logits, write_pages(k_pool, k_new, page_table, cached, num_new, max_len),
            write_pages(v_pool, v_new, page_table, cached, num_new, max_len))


def _write_token(pool, new, layer, page, offset):
    """`pool [K, layers, num_pages, page_size, Dh]` with row b's `new [B, K, Dh]` written at (`layer`, `page[b]`,
    `offset[b]`) (a page out of range: dropped): the kernel path's write of one layer before the kernel reads it.
    Each (kv head, row) is its own scatter index, as in `write_pages`."""
    heads = jnp.arange(pool.shape[0], dtype=jnp.int32)[:, None]
    return pool.at[heads, layer, page[None], offset[None]].set(jnp.moveaxis(new, 1, 0).astype(pool.dtype),
                                                               mode="drop")


def _kernel_layer(q, k, v, k_pool, v_pool, layer, page_table, lengths, write, key_len, *, block_pages, spec,
                  mesh):
    """One decode layer on the kernel path: each row's new key/value (k, v [B, K, Dh]) written at position
    `lengths[b]` of its page (where `write`), then the kernel over its pages up to `key_len`. On a mesh it runs in
    `jax.shard_map` with the pool's own sharding `spec` (kv heads over its head axes, pages over its page axes):
    each device writes and reads the rows whose pages it holds, with local page ids (a row's first page says which
    shard: its pages must all lie on that one, as the engine's `PageAllocator` keeps them); the rows come to every
    shard (the decode batch is in row order, not grouped by shard), those of other shards read one page and give 0,
    and the outputs are summed over the page axes."""
    page_size = k_pool.shape[3]

    def local(q, k, v, k_pool, v_pool, layer, page_table, lengths, write, key_len):
        num_pages = k_pool.shape[2]
        shard = 0 if page_axes is None else jax.lax.axis_index(page_axes)
        table = jnp.where(page_table >= 0, page_table - shard * num_pages, -1)
        owned = (table[:, 0] >= 0) & (table[:, 0] < num_pages) if page_axes is not None else jnp.ones_like(write)
        table = jnp.where((table >= 0) & (table < num_pages), table, -1)
        page = jnp.take_along_axis(table, jnp.clip(lengths // page_size, 0, table.shape[1] - 1)[:, None], axis=1)[:, 0]
        page = jnp.where(write & owned & (page >= 0), page, num_pages)  # out of range: dropped
        k_pool, v_pool = (_write_token(pool, new, layer, page, lengths % page_size)
                          for pool, new in ((k_pool, k), (v_pool, v)))
        out = paged_attention_kernel(q, k_pool, v_pool, layer, table, jnp.where(owned, key_len, 1),
                                     block_pages=block_pages)
        if page_axes is not None:
            out = jax.lax.psum(jnp.where(owned[:, None, None], out, jnp.zeros_like(out)), page_axes)
        return out, k_pool, v_pool

    if mesh is None:
        page_axes = None
        return local(q, k, v, k_pool, v_pool, layer, page_table, lengths, write, key_len)
    heads, page_axes = spec[0], spec[2]
    rows = P(None, heads, None)
    pool = P(*spec)
    return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, pool, pool, P(), P(), P(), P(), P()),
                         out_specs=(rows, pool, pool), check_vma=False)(
        q, k, v, k_pool, v_pool, layer, page_table, lengths, write, key_len)


def kernel_decode_extend(config: ModelConfig, params, k_pool, v_pool, page_table, lengths, tokens, active,
                         max_len: int, layout=None):
    """One decode step on the kernel path: token `tokens[b]` of each active row run through the model at position
    `lengths[b]`, its keys/values written into the row's page layer by layer (the kernel reads them back with the
    row's cached ones). Inactive rows write nothing (their outputs are meaningless). Returns (logits float32
    [B, V], k_pool, v_pool); `paged_extend` with one token is the same on the XLA path."""
    width, page_size = page_table.shape[1], k_pool.shape[3]
    write = active & (lengths < max_len)
    key_len = jnp.clip(lengths + 1, 1, width * page_size)  # >= 1: an empty row would leave the kernel 0 / 0
    block_pages = kernel_block_pages(width, page_size)
    spec, mesh = (None, None) if layout is None else (layout.k.spec, layout.k.mesh)
    if mesh is not None and len(spec) < 5:
        spec = P(*spec, *([None] * (5 - len(spec))))

    def layer(carry, xs):
        h, kp, vp = carry
        lp, index = xs

        def attend(q, k, v):
            out, kp2, vp2 = _kernel_layer(q[:, 0], k[:, 0], v[:, 0], kp, vp, index, page_table, lengths, write,
                                          key_len, block_pages=block_pages, spec=spec, mesh=mesh)
            return out[:, None].astype(v.dtype), (kp2, vp2)

        h, (kp, vp), _ = dec.decoder_layer(config, lp, h, lengths[:, None], attend)
        return (h, kp, vp), None

    layers = jnp.arange(k_pool.shape[1], dtype=jnp.int32)
    (h, k_pool, v_pool), _ = jax.lax.scan(layer, (dec.embed_tokens(config, params, tokens[:, None]), k_pool, v_pool),
                                          (params["layers"], layers), unroll=config.scan_unroll)
    logits = dec.logits_from_hidden(config, params, dec.final_norm(config, params, h[:, 0]))
    return logits, k_pool, v_pool


# ---------------------------------------------------------------------------------------------------- programs
_PROGRAMS: dict[tuple, Callable] = {}
_KINDS = ("paged_init", "paged_prefill", "paged_decode")


def _program(kind: str, key: tuple, build: Callable):
    program = _PROGRAMS.get((kind, *key))
    if program is None:
        program = _PROGRAMS[(kind, *key)] = build()
    return program


def compiled_programs(kind: str) -> int:
    """Executables compiled so far by one builder: "paged_init", "paged_prefill" or "paged_decode"."""
    if kind not in _KINDS:
        raise ValueError(f"paged.compiled_programs: kind must be one of {_KINDS}, got {kind!r}")
    return sum(program.jitted._cache_size() for key, program in _PROGRAMS.items() if key[0] == kind)


def state_shardings(mesh, rules=None) -> PagedState:
    """`NamedSharding`s of a `PagedState` on `mesh`: pages over the batch axes, kv heads over `tensor` (the dense
    cache's logical axes with pages in the place of rows), the slots' logits over the batch axes."""
    pool = P("kv_heads", "layers", "batch", "length", "head_dim")
    return PagedState(k=logical_to_sharding(pool, mesh, rules), v=logical_to_sharding(pool, mesh, rules),
                      logits=logical_to_sharding(P("batch", "vocab"), mesh, rules))


def abstract_state(config: ModelConfig, num_pages: int, page_size: int, slots: int, *, mesh=None, rules=None,
                   cache_dtype=None) -> PagedState:
    """The `ShapeDtypeStruct`s (with shardings) of an empty pool; nothing is allocated."""
    dtype = jnp.dtype(cache_dtype or config.dtype)
    shape = (config.num_key_value_heads, config.num_hidden_layers, num_pages, page_size, config.head_dim)
    shapes = PagedState(k=jax.ShapeDtypeStruct(shape, dtype), v=jax.ShapeDtypeStruct(shape, dtype),
                        logits=jax.ShapeDtypeStruct((slots, config.vocab_size), jnp.float32))
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree_util.tree_map(lambda _: device, shapes)
    else:
        shardings = sampler_lib.divisible_shardings(shapes, state_shardings(mesh, rules))
    return jax.tree_util.tree_map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                                  shapes, shardings)


def _empty_pool(config, num_pages, page_size, slots, dtype) -> PagedState:
    shape = (config.num_key_value_heads, config.num_hidden_layers, num_pages, page_size, config.head_dim)
    return PagedState(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                      logits=jnp.zeros((slots, config.vocab_size), jnp.float32))


def init_pool_program(config: ModelConfig, num_pages: int, page_size: int, slots: int, mesh=None, rules=None, *,
                      cache_dtype=None) -> sampler_lib.MeshProgram:
    """The paged engine's state initialiser `program() -> PagedState` (zeros), created by one jitted program with
    `out_shardings` (`abstract_state`): each device writes its own pages; the pool never exists whole on one chip."""
    for name, value in (("num_pages", num_pages), ("page_size", page_size), ("slots", slots)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"init_pool_program: {name} must be an int >= 1, got {value!r}")
    dtype = jnp.dtype(cache_dtype or config.dtype)
    rules = None if rules is None else tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in rules)

    def build():
        layout = jax.tree_util.tree_map(lambda s: s.sharding, abstract_state(
            config, num_pages, page_size, slots, mesh=mesh, rules=rules, cache_dtype=dtype))
        return sampler_lib.MeshProgram(jax.jit(functools.partial(_empty_pool, config, num_pages, page_size, slots,
                                                                 dtype), out_shardings=layout), mesh)

    return _program("paged_init", (config, num_pages, page_size, slots, mesh, rules, dtype), build)


def state_layout(state: PagedState):
    """The canonical `NamedSharding`s of a state on a mesh (hashable), or None on one device."""
    return sampler_lib.state_layout(state)


def _keep(state, layout):
    return state if layout is None else jax.lax.with_sharding_constraint(state, layout)


def _layout_mesh(layout):
    return None if layout is None else layout.k.mesh


def _prefill(config, max_len, layout, params, state: PagedState, cached, tokens, num_new, items, out_source,
             out_table, out_slots):
    logits, k_new, v_new = extend_rows(config, params, state.k, state.v, cached, tokens, num_new, items,
                                       table_width=pages_for(max_len, state.page_size))
    # every output row takes its computed row's tokens: rows with the same tokens (a prompt's G samples) share one
    k_new, v_new = k_new[:, out_source], v_new[:, out_source]
    cached_out, num_out = cached[out_source], num_new[out_source]
    k = write_pages(state.k, k_new, out_table, cached_out, num_out, max_len)
    v = write_pages(state.v, v_new, out_table, cached_out, num_out, max_len)
    target = jnp.where(num_out > 0, out_slots, state.slots)  # padding rows keep their slot's logits
    return _keep(PagedState(k=k, v=v, logits=state.logits.at[target].set(logits[out_source], mode="drop")), layout)


def prefill_program(config: ModelConfig, max_len: int, layout=None) -> sampler_lib.MeshProgram:
    """The paged engine's chunk program:

        program(params, state, cached int32 [U], tokens int32 [U, W], num_new int32 [U], items,
                out_source int32 [R], out_table int32 [R, max_pages], out_slots int32 [R]) -> state

    Computed row u runs its first `num_new[u]` tokens at positions `cached[u]..`, reading the cached pages `items`
    list for it. Output row r writes the keys/values of computed row `out_source[r]` into its own pages
    (`out_table[r]`) and its last logits into slot `out_slots[r]` (a slot >= the state's slots, or a computed row
    without tokens, is padding). Rows whose tokens so far are the same (a prompt's G samples) run once and are
    written G times. Compiles once per (U, W, items, R) bucket. The state is donated."""
    return _program("paged_prefill", (config, max_len, layout), lambda: sampler_lib.MeshProgram(
        jax.jit(functools.partial(_prefill, config, max_len, layout), donate_argnums=1), _layout_mesh(layout)))


def _decode_steps(config, num_steps, max_len, layout, sampling, params, state: PagedState, slots, page_table,
                  lengths, active, budget_left, stop_ids, keys, turn_step, reason, items, logit_bias):
    # The decode batch is the rows that generate, gathered from their slots; their logits go back at the end.
    slot = jnp.clip(slots, 0, state.slots - 1)
    kernel = attention_path(config) == "pallas_tpu"  # on every layout of the pool (`_kernel_layer`)

    def body(carry, bias):
        k, v, logits, lengths, active, budget_left, reason, turn_step = carry
        biased = logits if bias is None else logits + bias
        step_keys = jax.vmap(jax.random.fold_in)(keys, turn_step.astype(jnp.uint32))
        tokens, lp, slp = sampler_lib.sample_from_logits(biased, step_keys, sampling)
        tokens = jnp.where(active, tokens, 0)
        if kernel:
            new_logits, k, v = kernel_decode_extend(config, params, k, v, page_table, lengths, tokens, active,
                                                    max_len, layout)
        else:
            new_logits, k, v = paged_extend(config, params, k, v, page_table, lengths, tokens[:, None],
                                            active.astype(jnp.int32), items, max_len)
        step = active.astype(jnp.int32)
        lengths, budget_left, turn_step = lengths + step, budget_left - step, turn_step + step
        # the stop rule (`sampler.STOP_REASONS`): stop token, then a full row, then the budget
        hit_stop = jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1)
        step_reason = jnp.where(hit_stop, sampler_lib.STOP_TOKEN, jnp.where(
            lengths >= max_len, sampler_lib.CONTEXT_FULL,
            jnp.where(budget_left <= 0, sampler_lib.BUDGET, sampler_lib.RUNNING)))
        reason = jnp.where(active, step_reason, reason)
        logits = jnp.where(active[:, None], new_logits, logits)
        still = active & (step_reason == sampler_lib.RUNNING)
        return (k, v, logits, lengths, still, budget_left, reason, turn_step), (tokens, lp, slp, active)

    carry = (state.k, state.v, state.logits[slot], lengths, active, budget_left, reason, turn_step)
    (k, v, logits, lengths, active, budget_left, reason, turn_step), (tokens, lp, slp, was_active) = jax.lax.scan(
        body, carry, logit_bias, length=num_steps)  # a bias per step (the test hook), or none
    state = _keep(PagedState(k=k, v=v, logits=state.logits.at[slots].set(logits, mode="drop")), layout)
    return state, tokens, lp, slp, was_active, active, reason, budget_left, lengths


def decode_program(config: ModelConfig, num_steps: int, max_len: int, layout=None) -> sampler_lib.MeshProgram:
    """The paged engine's decode program, `num_steps` steps of D decoding rows in one dispatch:

        program(sampling: RowSampling [D], params, state, slots int32 [D], page_table int32 [D, max_pages],
                lengths int32 [D], active bool [D], budget_left int32 [D], stop_ids int32 [n_stop],
                keys uint32 [D, 2], turn_step int32 [D], reason int32 [D], items,
                logit_bias float32 [steps, D, V] (step s adds logit_bias[s]: the test hook) or None)
          -> (state, tokens [steps, D], logprobs [steps, D], sampling_logprobs [steps, D], active before each step
              [steps, D], active after [D], reason [D], budget_left [D], lengths [D])

    Row i reads its pending logits from slot `slots[i]` and writes them back there (a slot >= the state's slots is
    padding: nothing is kept). Only the rows that generate run: the host passes the decoding rows, padded to a
    bucket (the rollout engine's `decode_rows`), not every slot. Row i's token at its turn step t is drawn with
    `fold_in(keys[i], t)`, so its tokens depend on its key alone. The host must have given each active row the pages
    of its positions `< lengths + num_steps`, and `items` must cover its cached pages up to
    `lengths + num_steps - 1`. The state is donated. A row stops at a stop id, then at `max_len`, then at its budget
    (`reason`: `sampler.STOP_REASONS`); log-probs as `sampler.sample_from_logits` gives them.

    Attention: `attention_path(config)`, on one device or a mesh, whatever the pool's batch shards (on a pool over
    several, the kernel runs each row on the shard holding its pages, `_kernel_layer`: the engine's
    `PageAllocator` keeps a row's pages on one shard). On the kernel path `items` is not read (the kernel walks
    each row's page table)."""
    return _program("paged_decode", (config, num_steps, max_len, layout), lambda: sampler_lib.MeshProgram(
        jax.jit(functools.partial(_decode_steps, config, num_steps, max_len, layout), donate_argnums=2),
        _layout_mesh(layout)))


def page_shards(layout) -> int:
    """How many shards the pool's pages are split over (1 on one device, or when the pool's page count does not
    divide over the batch shards and the pool is replicated over them: `sampler.divisible_shardings`)."""
    if layout is None:
        return 1
    axes = layout.k.spec[2] if len(layout.k.spec) > 2 else None
    sizes = dict(layout.k.mesh.shape)
    return int(np.prod([sizes[a] for a in ((axes,) if isinstance(axes, str) else axes or ())], dtype=np.int64))
