"""`models.attention` with block keys: a cache (per-query key limits) plus a block's own keys under a boolean mask,
in one softmax (what `extend` and `attend_cached_block` run), against a float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.models.test_attention import assert_matches, reference
from trace_jax import models
from trace_jax.models import attention


def random_qkv(rng, B, Q, T, H, K, Dh):
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    return normal(B, Q, H, Dh), normal(B, T, K, Dh), normal(B, T, K, Dh)


def block_case(rng, B, Q, T, H, K, band):
    """Random cache limits (some empty), a random block mask in which every query sees itself (banded if asked)."""
    q, k, v = random_qkv(rng, B, Q, T, H, K, 4)
    _, k2, v2 = random_qkv(rng, B, 1, Q, H, K, 4)
    key_end = rng.integers(0, T + 1, (B, Q))
    index = np.arange(Q)
    mask2 = (rng.random((B, Q, Q)) < 0.6) | np.eye(Q, dtype=bool)[None]
    if band:
        mask2 &= (np.abs(index[:, None] - index[None, :]) < band)[None]
    mask = np.concatenate([np.arange(T)[None, None, :] < key_end[:, :, None], mask2], axis=2)
    ranges = attention.KeyRanges(key_end=jnp.asarray(key_end, jnp.int32))
    return q, k, v, k2, v2, jnp.asarray(mask2), ranges, mask


@pytest.mark.slow  # every example compiles its own shapes
@settings(max_examples=6, deadline=None)  # each example compiles; the float64 reference pins values
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 2), Q=st.integers(1, 40), T=st.integers(1, 50),
       heads=st.sampled_from([(1, 1), (4, 2), (6, 3)]), q_block=st.sampled_from([1, 8, 16, 64]),
       k_block=st.sampled_from([1, 8, 32]), band=st.sampled_from([None, 1, 3, 7]))
def test_tiled_block_attention_and_its_gradients_equal_float64_reference(seed, B, Q, T, heads, q_block, k_block,
                                                                         band):
    """Values and gradients for q, the cache's k/v and the block's k/v; ragged tiles, GQA, banded or not."""
    rng = np.random.default_rng(seed)
    q, k, v, k2, v2, mask2, ranges, mask = block_case(rng, B, Q, T, *heads, band)
    d_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    out, vjp = jax.vjp(lambda q, k, v, k2, v2: attention.flash_attention(
        q, k, v, ranges, q_block=q_block, k_block=k_block, block=(k2, v2, mask2), block_band=band), q, k, v, k2, v2)
    dq, dk, dv, dk2, dv2 = vjp(d_out)
    r_out, r_dq, r_dk, r_dv = reference(q, jnp.concatenate([k, k2], 1), jnp.concatenate([v, v2], 1), mask, d_out)
    assert_matches((out, dq, dk, dv), (r_out, r_dq, r_dk[:, :T], r_dv[:, :T]), atol=2e-5)
    np.testing.assert_allclose(dk2, r_dk[:, T:], atol=2e-5, err_msg="dk2")
    np.testing.assert_allclose(dv2, r_dv[:, T:], atol=2e-5, err_msg="dv2")


@pytest.mark.parametrize("Q", [1, 2, 5])
def test_dense_block_attention_equals_float64_reference(Q):
    """The dense path (decode: few queries, including the multiply-reduce form for Q <= 2) with block keys."""
    rng = np.random.default_rng(Q)
    q, k, v, k2, v2, mask2, ranges, mask = block_case(rng, 2, Q, 37, 6, 3, None)
    out = attention.attention(q, k, v, ranges, impl="xla", block=(k2, v2, mask2))
    expected = reference(q, jnp.concatenate([k, k2], 1), jnp.concatenate([v, v2], 1), mask, np.zeros(q.shape))[0]
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=2e-6)


def test_key_tiles_past_every_limit_are_never_read():
    """Cache values in tiles beyond a query block's largest key_end are NaN: any read would poison the output."""
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 2, 48, 256, 4, 2, 8)
    key_end = np.minimum(np.arange(1, 49) * 2, 64)[None].repeat(2, 0)  # all limits <= 64 = two 32-key tiles
    v = v.at[:, 64:].set(jnp.nan)
    k = k.at[:, 64:].set(jnp.nan)
    ranges = attention.KeyRanges(key_end=jnp.asarray(key_end, jnp.int32))
    out = np.asarray(attention.flash_attention(q, k, v, ranges, q_block=16, k_block=32))
    assert np.isfinite(out).all()
    mask = np.arange(256)[None, None, :] < key_end[:, :, None]
    expected = reference(q, np.nan_to_num(k), np.nan_to_num(v), mask, np.zeros(q.shape))[0]
    np.testing.assert_allclose(out, expected, atol=2e-6)


def test_block_attention_bfloat16_inputs_keep_float32_statistics():
    rng = np.random.default_rng(2)
    q, k, v, k2, v2, mask2, ranges, mask = block_case(rng, 1, 30, 90, 4, 2, 3)
    bf = lambda x: x.astype(jnp.bfloat16)
    out = attention.flash_attention(bf(q), bf(k), bf(v), ranges, k_block=16, block=(bf(k2), bf(v2), mask2),
                                    block_band=3)
    assert out.dtype == jnp.bfloat16
    expected = reference(q, jnp.concatenate([k, k2], 1), jnp.concatenate([v, v2], 1), mask, np.zeros(q.shape))[0]
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=3e-2)


def test_block_band_needs_a_square_block():
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1, 8, 16, 2, 1, 4)
    with pytest.raises(ValueError, match="block_band needs as many block keys as queries"):
        attention.flash_attention(q, k, v, attention.KeyRanges(jnp.ones((1, 8), jnp.int32)),
                                  block=(k, v, jnp.ones((1, 8, 16), bool)), block_band=2)


@pytest.mark.parametrize("query_chunk", [0, 48])
def test_long_causal_forward_takes_the_tiled_path_and_matches_the_dense_one(query_chunk):
    """A long purely causal forward on the tiled kernel (query tiles of the chunk when set) equals the dense
    reference implementation."""
    config = models.get_preset("tiny-qwen3", attention_query_chunk=query_chunk)
    params = models.init_params(config, jax.random.PRNGKey(0))
    length = 1024 + 37
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (2, length)))
    tiled = models.forward_hidden(config, params, tokens)
    dense = models.forward_hidden(config.replace(attention_impl="dense"), params, tokens)
    np.testing.assert_allclose(np.asarray(tiled), np.asarray(dense), atol=2e-5)
