"""Paged KV (`rollout.paged`): ragged paged attention against a float64 loop, the page allocator, and the paged
prefill/decode programs against the dense cache (`models.cache.extend`) on the tiny model."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import models
from trace_jax.models import cache as cache_lib
from trace_jax.rollout import paged
from trace_jax.rollout import sampler as sampler_lib


def _padded(chunks, width):
    tokens = np.zeros((len(chunks), width), np.int32)
    for row, chunk in enumerate(chunks):
        tokens[row, :len(chunk)] = chunk
    return tokens, np.asarray([len(c) for c in chunks], np.int32)


def _naive_attention(q, k_pages, v_pages, tables, key_len, k2, v2, mask2):
    """float64 loop: row b's keys are its pages' positions < key_len[b], then its block keys under mask2."""
    q, k_pages, v_pages, k2, v2 = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages, k2, v2))
    B, n, H, Dh = q.shape
    page_size, K = k_pages.shape[1], k_pages.shape[2]
    out = np.zeros((B, n, H, Dh))
    for b in range(B):
        positions = np.arange(key_len[b])
        keys = k_pages[[tables[b][p // page_size] for p in positions], positions % page_size]  # [T, K, Dh]
        values = v_pages[[tables[b][p // page_size] for p in positions], positions % page_size]
        for i in range(n):
            for h in range(H):
                g = h // (H // K)
                s = [keys[t, g] @ q[b, i, h] / np.sqrt(Dh) for t in range(len(keys))]
                vals = [values[t, g] for t in range(len(keys))]
                for j in range(k2.shape[1]):
                    if mask2[b, i, j]:
                        s.append(k2[b, j, g] @ q[b, i, h] / np.sqrt(Dh))
                        vals.append(v2[b, j, g])
                if not s:
                    continue
                s = np.asarray(s)
                p = np.exp(s - s.max())
                out[b, i, h] = (p / p.sum()) @ np.asarray(vals)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_attention_matches_a_float64_loop_on_random_page_tables_and_ragged_lengths(seed):
    rng = np.random.default_rng(seed)
    B, n, H, K, Dh, page_size, num_pages = 4, 3, 4, 2, 8, 4, 24
    key_len = rng.integers(0, 15, size=B)
    key_len[rng.integers(B)] = 0  # a row with no cached key reads only its block
    order = rng.permutation(num_pages).tolist()  # pages handed out in random order: tables are not contiguous
    tables = [[order.pop() for _ in range(paged.pages_for(length, page_size) + int(rng.integers(0, 2)))]
              for length in key_len]
    q = rng.normal(size=(B, n, H, Dh)).astype(np.float32)
    k_pages, v_pages = (rng.normal(size=(num_pages, page_size, K, Dh)).astype(np.float32) for _ in range(2))
    k2, v2 = (rng.normal(size=(B, n, K, Dh)).astype(np.float32) for _ in range(2))
    mask2 = np.tril(np.ones((n, n), bool))[None] & (rng.random((B, 1, n)) < 0.8)
    mask2[:, :, 0] |= True
    items = paged.work_items(tables, key_len, page_size)
    pool_k, pool_v = np.moveaxis(k_pages, 2, 0), np.moveaxis(v_pages, 2, 0)  # the pool's [K, pages, page, Dh]
    out = jax.jit(paged.paged_attention)(q, pool_k, pool_v, key_len.astype(np.int32), items,
                                         block=(k2, v2, mask2))
    expected = _naive_attention(q, k_pages, v_pages, tables, key_len, k2, v2, mask2)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("seed", [3, 4])
def test_paged_attention_loops_over_item_chunks_and_never_reads_the_padding(seed, monkeypatch):
    """Many pages in chunks of 16 items (a small ITEM_PAIRS), the items padded to one fixed size whose chunks
    after the last live one point at a poisoned page: the online softmax over the chunks gives the float64 loop's
    answer, and the poison is never read."""
    monkeypatch.setattr(paged, "ITEM_PAIRS", 16)
    rng = np.random.default_rng(seed)
    B, n, H, K, Dh, page_size, num_pages = 3, 1, 4, 2, 8, 2, 100
    key_len = rng.integers(40, 60, size=B)
    order = rng.permutation(num_pages - 1).tolist()  # page num_pages - 1 is never held
    tables = [[order.pop() for _ in range(paged.pages_for(length, page_size))] for length in key_len]
    q = rng.normal(size=(B, n, H, Dh)).astype(np.float32)
    k_pages, v_pages = (rng.normal(size=(num_pages, page_size, K, Dh)).astype(np.float32) for _ in range(2))
    k_pages[-1], v_pages[-1] = np.nan, np.nan
    k2, v2 = (rng.normal(size=(B, n, K, Dh)).astype(np.float32) for _ in range(2))
    mask2 = np.ones((B, n, n), bool)
    rows, pages, starts = paged.work_items(tables, key_len, page_size, size=paged.item_capacity(num_pages))
    assert len(rows) == 128 and paged.item_chunk(n, len(rows)) == 16 and (rows < B).sum() > 3 * 16
    live = int((rows < B).sum())
    pages[-(-live // 16) * 16:] = num_pages - 1
    pool_k, pool_v = np.moveaxis(k_pages, 2, 0), np.moveaxis(v_pages, 2, 0)  # the pool's [K, pages, page, Dh]
    out = jax.jit(paged.paged_attention)(q, pool_k, pool_v, key_len.astype(np.int32), (rows, pages, starts),
                                         block=(k2, v2, mask2))
    expected = _naive_attention(q, k_pages, v_pages, tables, key_len, k2, v2, mask2)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=2e-6, rtol=1e-5)


def _prefill_case(seed, B, n, page_size, num_pages, key_len, poison=True):
    """Random queries, chunk keys and a pool whose last page is NaN and never held (a read of it would show)."""
    rng = np.random.default_rng(seed)
    H, K, Dh = 4, 2, 8
    order = rng.permutation(num_pages - 1).tolist()
    tables = [[order.pop() for _ in range(paged.pages_for(length, page_size) + int(rng.integers(0, 2)))]
              for length in key_len]
    q = rng.normal(size=(B, n, H, Dh)).astype(np.float32)
    k_pages, v_pages = (rng.normal(size=(num_pages, page_size, K, Dh)).astype(np.float32) for _ in range(2))
    if poison:
        k_pages[-1], v_pages[-1] = np.nan, np.nan
    k2, v2 = (rng.normal(size=(B, n, K, Dh)).astype(np.float32) for _ in range(2))
    num_new = rng.integers(1, n + 1, size=B)
    mask2 = np.tril(np.ones((n, n), bool))[None] & (np.arange(n)[None, None, :] < num_new[:, None, None])
    pool = [np.moveaxis(x, 2, 0)[:, None] for x in (k_pages, v_pages)]  # [K, layers = 1, pages, page, Dh]
    return q, k_pages, v_pages, pool, tables, k2, v2, mask2


@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_attention_matches_a_float64_loop_over_blocks_of_pages(seed, monkeypatch):
    """A chunk of queries per row over ragged cached lengths (one row with none), read in blocks of 4 pages, 2
    blocks a step (small PREFILL_BLOCK_TOKENS / PREFILL_PAIRS: several steps, rows spanning several blocks, a
    last partial block), the chunk's own keys in 3 causal tiles of 2 queries, items padded to one fixed size: the
    float64 loop's answer, the NaN page never read."""
    monkeypatch.setattr(paged, "PREFILL_BLOCK_TOKENS", 8)
    monkeypatch.setattr(paged, "PREFILL_PAIRS", 2 * 6 * 8)
    monkeypatch.setattr(paged, "PREFILL_QUERY_TILE", 2)
    B, n, page_size, num_pages, max_len = 4, 6, 2, 64, 40
    key_len = np.asarray([17, 0, 30, 3] if seed == 0 else [1, 33, 8, 9])
    q, k_pages, v_pages, pool, tables, k2, v2, mask2 = _prefill_case(seed, B, n, page_size, num_pages, key_len)
    width = paged.pages_for(max_len, page_size)
    assert paged.prefill_blocks(n, width, page_size) == (4, 2)
    items = paged.work_items(tables, key_len, page_size, size=paged.item_capacity(num_pages))
    attend = jax.jit(functools.partial(paged.prefill_attention, width=width))
    out = attend(q, *pool, np.int32(0), key_len.astype(np.int32), items, (k2, v2, mask2))
    expected = _naive_attention(q, k_pages, v_pages, tables, key_len, k2, v2, mask2)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=2e-6, rtol=1e-5)


def test_prefill_attention_of_chunks_at_position_zero_reads_no_page():
    """Rows with nothing cached (a prompt's first chunk): every page of the pool is NaN, the answer is the chunk's
    own causal attention (the float64 loop's)."""
    B, n, page_size, num_pages = 3, 6, 4, 8
    key_len = np.zeros(B, np.int64)
    q, k_pages, v_pages, pool, tables, k2, v2, mask2 = _prefill_case(5, B, n, page_size, num_pages, key_len)
    pool = [np.full_like(x, np.nan) for x in pool]
    items = paged.work_items([[]] * B, key_len, page_size, size=16)
    out = jax.jit(functools.partial(paged.prefill_attention, width=4))(
        q, *pool, np.int32(0), key_len.astype(np.int32), items, (k2, v2, mask2))
    expected = _naive_attention(q, k_pages, v_pages, [[]] * B, key_len, k2, v2, mask2)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=2e-6, rtol=1e-5)


def test_work_items_list_only_the_pages_of_cached_positions_padded_to_a_bucket():
    rows, pages, starts = paged.work_items([[7, 3, 9], [], [5]], [9, 0, 1], 4)
    assert rows.tolist()[:4] == [0, 0, 0, 2] and pages.tolist()[:4] == [7, 3, 9, 5]
    assert starts.tolist()[:4] == [0, 4, 8, 0]
    assert len(rows) == 4  # a power of two: shapes repeat
    assert paged.work_items([[1]], [1], 4, minimum=8)[0].tolist() == [0] + [1] * 7  # padding rows are out of range
    assert len(paged.work_items([[1, 2, 3, 4, 5]], [20], 4, maximum=6)[0]) == 6  # no more items than pool pages
    with pytest.raises(ValueError, match="row 0 caches 5 tokens but holds 1 pages"):
        paged.work_items([[1]], [5], 4)
    assert len(paged.work_items([[1, 2]], [8], 4, size=paged.item_capacity(3))[0]) == 16  # one fixed size
    assert paged.item_capacity(1000, 8) == 8192 and paged.item_capacity(1000, 8, rows=4, table_width=64) == 256
    with pytest.raises(ValueError, match="3 pages to read, more than size=2"):
        paged.work_items([[1, 2, 3]], [12], 4, size=2)


def test_the_allocator_hands_out_free_pages_lowest_first_and_refuses_a_double_free():
    pool = paged.PageAllocator(5)
    assert pool.alloc(2) == [0, 1] and pool.free_pages == 3
    pool.release([0])
    assert pool.alloc(2) == [0, 2]
    with pytest.raises(RuntimeError, match="double free"):
        pool.release([4])
    with pytest.raises(RuntimeError, match="3 pages asked, 2 free"):
        pool.alloc(3)


def test_a_shared_page_is_free_again_only_when_its_last_holder_releases_it():
    pool = paged.PageAllocator(4)
    first = pool.alloc(2)
    assert pool.share(first) == first and pool.holders(first[0]) == 2 and pool.free_pages == 2
    pool.release(first)  # one holder left: still held
    assert pool.free_pages == 2 and pool.holders(first[1]) == 1
    pool.release(first)
    assert pool.free_pages == 4 and pool.alloc(1) == [0]
    with pytest.raises(RuntimeError, match="not all held"):
        pool.share([3])
    with pytest.raises(RuntimeError, match="double free"):
        pool.release([0, 0])


def test_a_sharded_allocator_hands_out_each_shards_own_block_lowest_first():
    """12 pages over 3 shards: shard s owns pages [4s, 4s + 4); a page freed goes back to its own shard."""
    pool = paged.PageAllocator(12, shards=3)
    assert pool.alloc(2, 1) == [4, 5] and pool.alloc(1, 2) == [8] and pool.alloc(3, 0) == [0, 1, 2]
    assert [pool.free_in(s) for s in range(3)] == [1, 2, 3] and pool.free_pages == 6
    assert [pool.shard_of(p) for p in (3, 4, 11)] == [0, 1, 2]
    pool.release([5, 0])
    assert pool.alloc(2, 1) == [5, 6] and pool.alloc(2, 0) == [0, 3]
    with pytest.raises(RuntimeError, match="2 pages asked, 1 free in shard 1"):
        pool.alloc(2, 1)
    with pytest.raises(ValueError, match="shards must be an int >= 1 dividing num_pages = 10"):
        paged.PageAllocator(10, shards=4)


def test_growing_a_row_preempts_the_newest_rows_of_its_own_shard_only():
    """Shard 0 full: row 2 grows by pausing row 3 (shard 0, newer), never row 4 (shard 1, the newest); on a full
    shard 1 the newest of its rows, row 4, pauses itself rather than the older row 3."""
    pool = paged.PageAllocator(8, shards=2)
    rows = [types.SimpleNamespace(index=i, pages=[]) for i in range(5)]
    rows[2].pages, rows[3].pages, rows[4].pages = pool.alloc(2, 0), pool.alloc(2, 0), pool.alloc(1, 1)
    paused = []

    def preempt(row):
        pool.release(row.pages)
        row.pages = []
        paused.append(row.index)

    def grow(row, pages, shard):
        return paged.grow_pages(pool, row, pages, rows, lambda r: r.index, preempt, shard=shard)

    assert grow(rows[2], 4, 0) and paused == [3] and rows[2].pages == [0, 1, 2, 3] and rows[4].pages == [4]
    rows[3].pages = pool.alloc(1, 1)
    assert grow(rows[3], 3, 1) and rows[3].pages == [5, 6, 7] and paused == [3]  # room: nobody paused
    assert not grow(rows[4], 2, 1) and paused == [3, 4] and rows[3].pages == [5, 6, 7]


@pytest.fixture(scope="module")
def tiny():
    config = models.get_preset("tiny-qwen3")
    params = models.init_params(config, jax.random.PRNGKey(3))
    return config, params


def test_paged_prefill_and_decode_give_the_dense_cache_logits(tiny):
    """Random prompts of ragged lengths (rows 0 and 2 the same: computed once, written into both rows' pages),
    prefilled in two chunks into randomly ordered pages, then three single-token steps: each step's logits equal
    `models.cache.extend` on a dense cache to 1e-5 (float32)."""
    config, params = tiny
    rng = np.random.default_rng(0)
    page_size, max_len, num_pages = 4, 40, 40
    prompts = [rng.integers(0, config.vocab_size, size=n).tolist() for n in (9, 1, 9, 14)]
    prompts[2] = list(prompts[0])
    B = len(prompts)
    order = rng.permutation(num_pages).tolist()
    tables = [[order.pop() for _ in range(paged.pages_for(max_len, page_size))] for _ in range(B)]
    table_arr = paged.page_table_array(tables, paged.pages_for(max_len, page_size))
    state = paged.init_pool_program(config, num_pages, page_size, B)()

    dense = cache_lib.init_cache(config, B, max_len)
    tokens, num_new = _padded(prompts, 16)
    dense_logits, dense = cache_lib.extend(config, params, dense, tokens, num_new)

    prefill = paged.prefill_program(config, max_len)
    computed = [0, 1, 3]  # row 2 takes row 0's computation
    source = np.asarray([0, 1, 0, 2], np.int32)
    cached = np.zeros(B, np.int32)
    for chunk in (6, 16):  # first 6 tokens of each prompt, then the rest: a chunked prefill
        part = [prompts[r][cached[r]:cached[r] + chunk] for r in computed]
        tok, num = _padded(part, 16)
        items = paged.work_items([tables[r] for r in computed], cached[computed], page_size)
        state = prefill(params, state, cached[computed], tok, num, items, source, table_arr,
                        np.arange(B, dtype=np.int32))
        cached = cached + num[source]
    np.testing.assert_allclose(np.asarray(state.logits), np.asarray(dense_logits), atol=1e-5, rtol=1e-5)

    decode = paged.decode_program(config, 1, max_len)
    rows = sampler_lib.RowSampling.of([sampler_lib.SamplingConfig(greedy=True)] * B)
    active = np.asarray([True, False, True, True])  # row 2 decodes from the pages row 0's computation wrote
    lengths_now = cached.astype(np.int32)
    keys = np.asarray(jax.random.split(jax.random.PRNGKey(0), B))
    for _ in range(3):
        expected_tokens = np.argmax(np.asarray(state.logits), axis=-1)
        items = paged.work_items(tables, lengths_now, page_size)
        out = decode(rows, params, state, np.arange(B, dtype=np.int32), table_arr, lengths_now, active,
                     np.full(B, 100, np.int32), np.asarray([-1], np.int32), keys, np.zeros(B, np.int32),
                     np.zeros(B, np.int32), items, None)
        state, tokens, lengths_now = out[0], np.asarray(out[1])[0], np.asarray(out[8])
        np.testing.assert_array_equal(tokens, np.where(active, expected_tokens, 0))
        dense_logits, dense = cache_lib.extend(config, params, dense, tokens[:, None].astype(np.int32),
                                               active.astype(np.int32))
        np.testing.assert_allclose(np.asarray(state.logits)[active], np.asarray(dense_logits)[active], atol=1e-5,
                                   rtol=1e-5)
    np.testing.assert_array_equal(lengths_now, np.asarray(dense.lengths))


def test_the_pool_is_created_sharded_pages_over_batch_axes_heads_over_tensor(tiny):
    config, _ = tiny
    mesh = models.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    state = paged.init_pool_program(config, 16, 4, 8, mesh)()
    assert state.k.sharding.spec[2] == ("data", "fsdp") and state.k.sharding.spec[0] == "tensor"
    assert {s.data.shape for s in state.k.addressable_shards} == {(1, config.num_hidden_layers, 4, 4,
                                                                   config.head_dim)}
    assert paged.init_pool_program(config, 16, 4, 8, mesh) is paged.init_pool_program(config, 16, 4, 8, mesh)


def test_the_decode_programs_draws_follow_the_filtered_softmax(tiny):
    """4096 rows with one pending distribution and their own keys: one decode step's tokens pass a chi-square test
    against the tempered, top-p filtered softmax (`sampler.sampling_logits`)."""
    from scipy import stats

    config, params = tiny
    rows, page_size, max_len = 4096, 4, 8
    logits = np.asarray(jax.random.normal(jax.random.PRNGKey(4), (config.vocab_size,))) * 3.0
    state = paged.init_pool_program(config, 2, page_size, 1)()
    state = state.replace(logits=jnp.asarray(logits[None], jnp.float32))
    setting = sampler_lib.SamplingConfig(temperature=0.7, top_p=0.9)
    sampling = sampler_lib.RowSampling.of([setting] * rows)
    keys = np.asarray(jax.random.split(jax.random.PRNGKey(11), rows))
    tables = np.full((rows, 2), -1, np.int32)  # no pages: the step's keys/values are dropped, only its draw counts
    items = paged.work_items([[]] * rows, [0] * rows, page_size)
    out = paged.decode_program(config, 1, max_len)(
        sampling, params, state, np.zeros(rows, np.int32), tables, np.zeros(rows, np.int32), np.ones(rows, bool),
        np.full(rows, 4, np.int32), np.asarray([-1], np.int32), keys, np.zeros(rows, np.int32),
        np.zeros(rows, np.int32), items, None)
    drawn = np.asarray(out[1])[0]
    probs = np.asarray(jax.nn.softmax(sampler_lib.sampling_logits(jnp.asarray(logits[None]), setting)))[0]
    kept = probs > 0
    assert set(np.unique(drawn)) <= set(np.nonzero(kept)[0])  # nothing outside the top-p set
    counts = np.bincount(drawn, minlength=config.vocab_size)[kept]
    expected = probs[kept].astype(np.float64) * rows
    big = expected >= 5  # pool the rare tokens into one cell, as the test requires
    observed, expected = counts[big], expected[big]
    if (~big).any():
        observed = np.append(observed, counts[~big].sum())
        expected = np.append(expected, probs[kept][~big].astype(np.float64).sum() * rows)
    expected *= observed.sum() / expected.sum()  # float32 probabilities: make the totals agree exactly
    assert stats.chisquare(observed, expected).pvalue > 1e-3
