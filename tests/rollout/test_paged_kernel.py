"""The paged engine's TPU kernel path (`rollout.paged`, JAX's Pallas TPU paged attention kernel), run on CPU in
Pallas' TPU interpret mode: against a float64 loop and the XLA path on random page tables, lengths and GQA
ratios, and a whole decode program against the XLA path's, on one device and on a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from trace_jax import models
from trace_jax.rollout import paged
from trace_jax.rollout import sampler as sampler_lib


def _float64_decode_attention(q, k_pool, v_pool, layer, tables, key_len):
    """float64 loop: row b's one query per head over its pages' positions < key_len[b] (pool [K, L, P, page, Dh])."""
    q, k_pool, v_pool = (np.asarray(x, np.float64) for x in (q, k_pool, v_pool))
    B, H, Dh = q.shape
    K, page_size = k_pool.shape[0], k_pool.shape[3]
    out = np.zeros((B, H, Dh))
    for b in range(B):
        positions = np.arange(key_len[b])
        pages = [tables[b][p // page_size] for p in positions]
        for h in range(H):
            g = h // (H // K)
            keys = k_pool[g, layer, pages, positions % page_size]  # [T, Dh]
            values = v_pool[g, layer, pages, positions % page_size]
            s = keys @ q[b, h] / np.sqrt(Dh)
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ values
    return out


@pytest.mark.parametrize("seed,heads,kv_heads,rows_per_call", [(0, 4, 4, None), (1, 4, 2, 2), (2, 8, 1, 1)])
def test_the_kernel_matches_a_float64_loop_and_the_xla_path_on_random_page_tables(seed, heads, kv_heads,
                                                                                   rows_per_call):
    """Also when the rows are split over several kernel calls (`rows_per_call`: 3 rows in calls of 2 and of 1)."""
    rng = np.random.default_rng(seed)
    B, Dh, page_size, num_pages, layers, width = 3, 128, 4, 24, 2, 6
    key_len = rng.integers(1, width * page_size + 1, size=B).astype(np.int32)
    order = rng.permutation(num_pages).tolist()  # pages in random order: tables are not contiguous
    tables = [[order.pop() for _ in range(paged.pages_for(n, page_size))] for n in key_len]
    table = paged.page_table_array(tables, width)
    q = rng.normal(size=(B, heads, Dh)).astype(np.float32)
    # the kernel reads keys and values in bfloat16, so the pool is bfloat16 (as a TPU run's) and the reference
    # reads the same rounded values
    k_pool, v_pool = (jnp.asarray(rng.normal(size=(kv_heads, layers, num_pages, page_size, Dh)), jnp.bfloat16)
                      for _ in range(2))
    layer = 1
    with pltpu.force_tpu_interpret_mode():
        out = jax.jit(paged.paged_attention_kernel, static_argnames=("block_pages", "rows_per_call"))(
            q, k_pool, v_pool, jnp.int32(layer), table, key_len,
            block_pages=paged.kernel_block_pages(width, page_size), rows_per_call=rows_per_call)
    expected = _float64_decode_attention(q, k_pool, v_pool, layer, tables, key_len)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=2e-5, rtol=1e-4)
    items = paged.work_items(tables, key_len, page_size)
    xla = paged.paged_attention(q[:, None], k_pool.astype(jnp.float32), v_pool.astype(jnp.float32), key_len, items,
                                layer=jnp.int32(layer))[:, 0]
    np.testing.assert_allclose(np.asarray(out), np.asarray(xla), atol=2e-5, rtol=1e-4)


def test_the_kernel_block_divides_the_page_table_and_holds_at_most_512_tokens():
    assert paged.kernel_block_pages(3072, 16) == 32
    assert paged.kernel_block_pages(6, 4) == 6
    assert paged.kernel_block_pages(7, 128) == 1  # 7 is prime: one page a block
    assert paged.kernel_block_pages(12, 64) == 6


def test_a_kernel_call_holds_at_most_512_kib_of_page_indices_in_a_power_of_two_of_rows():
    assert paged.kernel_rows_per_call(3072) == 32  # Qwen3-4B at 48K tokens in pages of 16: 128 rows in 4 calls
    assert paged.kernel_rows_per_call(6) == 16384
    assert paged.kernel_rows_per_call(10**6) == 1


def test_the_kernel_path_is_chosen_by_the_resolved_attention_impl_and_the_head_dim():
    config = models.get_preset("tiny-qwen3")
    assert paged.attention_path(config.replace(attention_impl="xla", head_dim=128)) == "xla"
    assert paged.attention_path(config.replace(attention_impl="pallas_tpu", head_dim=128)) == "pallas_tpu"
    assert paged.attention_path(config.replace(attention_impl="pallas_tpu")) == "xla"  # head_dim 16: no kernel
    assert paged.attention_path(config.replace(attention_impl="auto", head_dim=128)) == "xla"  # a CPU backend


def _decode_run(config, params, mesh, tables, lengths, active, steps, *, interpret):
    """`steps` single-step greedy decode dispatches of a paged decode program from one random pool; returns the
    tokens and the final state's logits."""
    rng = np.random.default_rng(7)
    B, page_size, num_pages = len(tables), 4, 16
    width = 4
    state = paged.init_pool_program(config, num_pages, page_size, B, mesh)()
    shapes = state.k.shape
    fill = {name: jax.device_put(jnp.asarray(rng.normal(size=shapes), state.k.dtype), getattr(state, name).sharding)
            for name in ("k", "v")}
    logits = jax.device_put(jnp.asarray(rng.normal(size=state.logits.shape), jnp.float32), state.logits.sharding)
    state = state.replace(k=fill["k"], v=fill["v"], logits=logits)
    layout = paged.state_layout(state)
    program = paged.decode_program(config, 1, width * page_size, layout)
    table = paged.page_table_array(tables, width)
    sampling = sampler_lib.RowSampling.of([sampler_lib.SamplingConfig(greedy=True)] * B)
    keys = np.asarray(jax.random.split(jax.random.PRNGKey(0), B))
    lengths = np.asarray(lengths, np.int32)
    out_tokens = []
    for _ in range(steps):
        items = paged.work_items(tables, lengths, page_size)
        args = (sampling, params, state, np.arange(B, dtype=np.int32), table, lengths, active,
                np.full(B, 100, np.int32), np.asarray([-1], np.int32), keys, np.zeros(B, np.int32),
                np.zeros(B, np.int32), items, None)
        if interpret:
            with pltpu.force_tpu_interpret_mode():
                out = program(*args)
        else:
            out = program(*args)
        state, lengths = out[0], np.asarray(out[8])
        out_tokens.append(np.asarray(out[1])[0])
    return np.stack(out_tokens), np.asarray(state.logits)


@pytest.fixture(scope="module")
def wide():
    """tiny-qwen3 with the kernel's head_dim (128) and a bfloat16 cache, as on a TPU."""
    config = models.get_preset("tiny-qwen3").replace(head_dim=128, dtype="bfloat16")
    params = models.init_params(config, jax.random.PRNGKey(3))
    return config, params


@pytest.mark.parametrize("axes", [None, {"fsdp": 2, "tensor": 2}])  # pages over 2 shards, heads over 2
def test_the_kernel_decode_program_gives_the_xla_programs_tokens_and_logits(wide, axes):
    """Rows of ragged lengths (one inactive) decode three greedy steps on the kernel path (interpret mode) and on
    the XLA path from the same pool: the same tokens, logits within bfloat16 rounding. On a mesh the kv heads are
    split over the tensor shards and the pool's 16 pages over the fsdp shards (8 a shard), each row's pages on
    one of them (rows 0 and 2 on shard 0, row 1 on the last half, row 3 on the last quarter), as the engine's
    `PageAllocator` places them: each shard runs its rows with local page ids."""
    config, params = wide
    devices = int(np.prod(list(axes.values()))) if axes else 1
    mesh = None if axes is None else models.make_mesh(axes, jax.devices()[:devices])
    tables = [[0, 1, 2], [9, 8], [3], [12, 13, 14, 15]]
    lengths, active = [9, 5, 2, 10], np.asarray([True, True, False, True])
    kernel_config = config.replace(attention_impl="pallas_tpu")
    if mesh is not None:
        layout = paged.state_layout(paged.init_pool_program(kernel_config, 16, 4, 4, mesh)())
        assert paged.page_shards(layout) == (axes or {}).get("fsdp", 1)
        assert paged.attention_path(kernel_config) == "pallas_tpu"  # the decode program's, on every layout
    kernel = _decode_run(kernel_config, params, mesh, tables, lengths, active, 3, interpret=True)
    xla = _decode_run(config.replace(attention_impl="xla"), params, mesh, tables, lengths, active, 3,
                      interpret=False)
    np.testing.assert_array_equal(kernel[0], xla[0])
    np.testing.assert_allclose(kernel[1][active], xla[1][active], atol=3e-2, rtol=3e-2)
