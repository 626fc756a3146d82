"""`decoder.prefix_attend`: flash-style tiled attention with per-query key prefixes, against a float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_jax import models
from trace_jax.models import attention, decoder


def reference_attention(q, k, v, mask):
    """float64 numpy: q [B, Q, H, Dh], k/v [B, T, K, Dh], mask bool [B, Q, T]; fully masked rows -> uniform."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Q, H, Dh = q.shape
    group = H // k.shape[2]
    out = np.zeros((B, Q, H, Dh))
    for b in range(B):
        for h in range(H):
            scores = q[b, :, h] @ k[b, :, h // group].T / np.sqrt(Dh)  # [Q, T]
            scores = np.where(mask[b], scores, -1e30)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[b, :, h] = (weights / weights.sum(axis=1, keepdims=True)) @ v[b, :, h // group]
    return out


def random_qkv(rng, B, Q, T, H, K, Dh):
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    return normal(B, Q, H, Dh), normal(B, T, K, Dh), normal(B, T, K, Dh)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 2), Q=st.integers(1, 40), T=st.integers(1, 50),
       heads=st.sampled_from([(1, 1), (4, 2), (6, 3)]), q_block=st.sampled_from([1, 8, 16, 64]),
       k_block=st.sampled_from([1, 8, 32]), with_extra=st.booleans(), band=st.sampled_from([None, 1, 3, 7]))
def test_prefix_attend_equals_float64_reference(seed, B, Q, T, heads, q_block, k_block, with_extra, band):
    """Random key prefixes (including empty ones), ragged tiles, GQA, with and without banded in-block keys."""
    rng = np.random.default_rng(seed)
    H, K = heads
    q, k, v = random_qkv(rng, B, Q, T, H, K, 4)
    key_end = rng.integers(0, T + 1, (B, Q))
    mask = np.arange(T)[None, None, :] < key_end[:, :, None]
    extra, keys, values = None, k, v
    if with_extra:
        _, k2, v2 = random_qkv(rng, B, 1, Q, H, K, 4)
        index = np.arange(Q)
        mask2 = (rng.random((B, Q, Q)) < 0.6) | np.eye(Q, dtype=bool)[None]  # every query sees itself
        if band is not None:
            mask2 &= (np.abs(index[:, None] - index[None, :]) < band)[None]
        extra = (k2, v2, jnp.asarray(mask2))
        keys, values = jnp.concatenate([k, k2], axis=1), jnp.concatenate([v, v2], axis=1)
        mask = np.concatenate([mask, mask2], axis=2)
    else:
        band = None
    out = decoder.prefix_attend(q, k, v, jnp.asarray(key_end), extra=extra, extra_band=band, q_block=q_block,
                                k_block=k_block)
    expected = reference_attention(q, keys, values, mask)
    visible = mask.any(axis=2)  # rows with no visible key are meaningless by contract
    np.testing.assert_allclose(np.asarray(out)[visible], expected[visible], atol=2e-6)
    assert np.isfinite(np.asarray(out)).all()


def test_key_tiles_past_every_limit_are_never_read():
    """Values in tiles beyond a query block's largest key_end are NaN: any read would poison the output."""
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 2, 48, 256, 4, 2, 8)
    key_end = np.minimum(np.arange(1, 49) * 2, 64)[None].repeat(2, 0)  # all limits <= 64 = two 32-key tiles
    v = v.at[:, 64:].set(jnp.nan)
    k = k.at[:, 64:].set(jnp.nan)
    out = np.asarray(decoder.prefix_attend(q, k, v, jnp.asarray(key_end), q_block=16, k_block=32))
    assert np.isfinite(out).all()
    mask = np.arange(256)[None, None, :] < key_end[:, :, None]
    np.testing.assert_allclose(out, reference_attention(q, np.nan_to_num(k), np.nan_to_num(v), mask), atol=2e-6)


def test_prefix_attend_gradient_equals_dense_attention():
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 2, 40, 70, 4, 2, 8)
    key_end = jnp.asarray(rng.integers(1, 71, (2, 40)))
    mask = jnp.arange(70)[None, None, :] < key_end[:, :, None]
    weights = jnp.asarray(rng.normal(size=(2, 40, 4, 8)), jnp.float32)

    def loss(attention):
        return lambda q, k, v: jnp.sum(attention(q, k, v) * weights)

    tiled = jax.grad(loss(lambda q, k, v: decoder.prefix_attend(q, k, v, key_end, q_block=16, k_block=16)),
                     argnums=(0, 1, 2))(q, k, v)
    dense = jax.grad(loss(lambda q, k, v: attention.dense_attention(q, k, v, mask)), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(tiled, dense):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_prefix_attend_bfloat16_inputs_keep_float32_statistics():
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 1, 30, 90, 4, 2, 8)
    key_end = rng.integers(1, 91, (1, 30))
    mask = np.arange(90)[None, None, :] < key_end[:, :, None]
    out = decoder.prefix_attend(*(x.astype(jnp.bfloat16) for x in (q, k, v)), jnp.asarray(key_end), k_block=16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), reference_attention(q, k, v, mask), atol=3e-2)


def test_extra_band_needs_a_square_extra_block():
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1, 8, 16, 2, 1, 4)
    with pytest.raises(ValueError, match="extra_band needs as many extra keys as queries"):
        decoder.prefix_attend(q, k, v, jnp.ones((1, 8), jnp.int32), extra=(k, v, jnp.ones((1, 8, 16), bool)),
                              extra_band=2)


@pytest.mark.parametrize("query_chunk", [0, 48])
def test_long_causal_forward_takes_the_tiled_path_and_matches_the_masked_one(query_chunk):
    """A long purely causal forward on the tiled kernel (query tiles of the chunk when set) equals the dense
    reference implementation."""
    config = models.get_preset("tiny-qwen3", attention_query_chunk=query_chunk)
    params = models.init_params(config, jax.random.PRNGKey(0))
    length = 1024 + 37
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (2, length)))
    tiled = models.forward_hidden(config, params, tokens)
    masked = models.forward_hidden(config.replace(attention_impl="dense"), params, tokens)
    np.testing.assert_allclose(np.asarray(tiled), np.asarray(masked), atol=2e-5)
