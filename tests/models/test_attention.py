"""`models.attention`: the tiled kernel (values and flash-style gradients) against a float64 loop reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_jax import models
from trace_jax.models import attention


def reference(q, k, v, mask, d_out):
    """float64 numpy attention and its gradients. q [B, Q, H, Dh], k/v [B, T, K, Dh], mask bool [B, Q, T] with no
    empty row, d_out [B, Q, H, Dh]. Returns (out, dq, dk, dv)."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    B, Q, H, Dh = q.shape
    group = H // k.shape[2]
    out, dq, dk, dv = np.zeros_like(q), np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    c = 1 / np.sqrt(Dh)
    for b in range(B):
        for h in range(H):
            kh, vh = k[b, :, h // group], v[b, :, h // group]
            s = np.where(mask[b], q[b, :, h] @ kh.T * c, -np.inf)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[b, :, h] = p @ vh
            dp = d_out[b, :, h] @ vh.T
            ds = p * (dp - np.sum(dp * p, axis=1, keepdims=True))
            dq[b, :, h] = ds @ kh * c
            dk[b, :, h // group] += ds.T @ q[b, :, h] * c
            dv[b, :, h // group] += p.T @ d_out[b, :, h]
    return out, dq, dk, dv


def value_and_grads(q, k, v, ranges, d_out, **tiles):
    out, vjp = jax.vjp(lambda q, k, v: attention.flash_attention(q, k, v, ranges, **tiles), q, k, v)
    return (out, *vjp(d_out.astype(out.dtype)))


def normal(rng, *shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


def assert_matches(got, expected, atol):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        np.testing.assert_allclose(np.asarray(a, np.float64), b, atol=atol, rtol=0, err_msg=name)


@pytest.mark.slow  # every example compiles its own shapes
@settings(max_examples=8, deadline=None)  # each example compiles; the float64 reference pins values
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 2), Q=st.integers(1, 40), T=st.integers(1, 50),
       heads=st.sampled_from([(1, 1), (4, 2), (6, 3), (4, 1)]), q_block=st.sampled_from([1, 8, 16, 64]),
       k_block=st.sampled_from([1, 8, 32, 128]))
def test_tiled_attention_and_its_gradients_equal_float64_reference(seed, B, Q, T, heads, q_block, k_block):
    """Random non-empty key ranges per query (ragged cached prefixes, windows), GQA, ragged tiles."""
    rng = np.random.default_rng(seed)
    H, K = heads
    q, k, v, d_out = normal(rng, B, Q, H, 8), normal(rng, B, T, K, 8), normal(rng, B, T, K, 8), normal(rng, B, Q, H, 8)
    start = rng.integers(0, T, (B, Q))
    end = start + 1 + rng.integers(0, T - start)
    ranges = attention.KeyRanges(key_end=jnp.asarray(end, jnp.int32), key_start=jnp.asarray(start, jnp.int32))
    got = value_and_grads(q, k, v, ranges, d_out, q_block=q_block, k_block=k_block)
    assert_matches(got, reference(q, k, v, np.asarray(ranges.dense(T)), d_out), atol=2e-5)


@pytest.mark.parametrize("segments", [
    [[0] * 9 + [1] * 14 + [2] * 10, [5] * 33],            # packed, contiguous: tiles before a segment are skipped
    [[0, 1] * 16 + [0], [3] * 10 + [4] * 12 + [3] * 11],  # interleaved ids: no skipping, still exact
])
def test_packed_segments_match_reference(segments):
    rng = np.random.default_rng(0)
    q, k = normal(rng, 2, 33, 4, 8), normal(rng, 2, 33, 2, 8)
    v, d_out = normal(rng, 2, 33, 2, 8), normal(rng, 2, 33, 4, 8)
    ranges = attention.causal_ranges(2, 33, segment_ids=jnp.asarray(segments))
    mask = np.tril(np.ones((33, 33), bool))[None] & (np.asarray(segments)[:, :, None] == np.asarray(segments)[:, None])
    got = value_and_grads(q, k, v, ranges, d_out, q_block=8, k_block=8)
    assert_matches(got, reference(q, k, v, mask, d_out), atol=2e-5)


def test_key_validity_mask_matches_reference():
    """A Hugging Face [B, S] mask (left padding of row 0) is a segment test on keys."""
    rng = np.random.default_rng(1)
    valid = np.ones((2, 20), bool)
    valid[0, :5] = False
    q, k = normal(rng, 2, 20, 2, 8), normal(rng, 2, 20, 2, 8)
    v, d_out = normal(rng, 2, 20, 2, 8), normal(rng, 2, 20, 2, 8)
    ranges = attention.causal_ranges(2, 20, key_valid=jnp.asarray(valid))
    mask = np.tril(np.ones((20, 20), bool))[None] & valid[:, None, :]
    real = slice(5, None)  # row 0's padded queries see no key: their output is meaningless
    out = np.asarray(attention.flash_attention(q, k, v, ranges, q_block=4, k_block=8))
    ref = reference(q, k, v, np.where(mask.any(-1, keepdims=True), mask, True), d_out)[0]
    np.testing.assert_allclose(out[0, real], ref[0, real], atol=2e-5)
    np.testing.assert_allclose(out[1], ref[1], atol=2e-5)


def test_bfloat16_inputs_keep_float32_statistics():
    rng = np.random.default_rng(2)
    q, k = normal(rng, 1, 40, 4, 16), normal(rng, 1, 40, 2, 16)
    v, d_out = normal(rng, 1, 40, 2, 16), normal(rng, 1, 40, 4, 16)
    ranges = attention.causal_ranges(1, 40)
    got = value_and_grads(*(x.astype(jnp.bfloat16) for x in (q, k, v)), ranges, d_out, q_block=16, k_block=16)
    assert all(x.dtype == jnp.bfloat16 for x in got)
    assert_matches(got, reference(q, k, v, np.asarray(ranges.dense(40)), d_out), atol=6e-2)


def test_tiles_outside_every_range_are_never_read_forward_or_backward():
    """Keys before every query's start and past every query's end hold NaN: nothing may turn NaN."""
    rng = np.random.default_rng(3)
    q, d_out = normal(rng, 1, 16, 2, 8), normal(rng, 1, 16, 2, 8)
    k, v = np.array(normal(rng, 1, 96, 2, 8)), np.array(normal(rng, 1, 96, 2, 8))
    k[:, :32], v[:, :32], k[:, 64:], v[:, 64:] = np.nan, np.nan, np.nan, np.nan
    ranges = attention.KeyRanges(key_end=jnp.full((1, 16), 64, jnp.int32), key_start=jnp.full((1, 16), 32, jnp.int32))
    got = value_and_grads(q, jnp.asarray(k), jnp.asarray(v), ranges, d_out, q_block=8, k_block=32)
    assert all(np.isfinite(np.asarray(x)[:, 32:64] if i > 1 else np.asarray(x)).all() for i, x in enumerate(got))


def test_single_token_decode_sees_its_row_up_to_itself():
    rng = np.random.default_rng(4)
    q, k, v = normal(rng, 3, 1, 4, 8), normal(rng, 3, 300, 2, 8), normal(rng, 3, 300, 2, 8)
    lengths = np.asarray([0, 17, 299])
    ranges = attention.KeyRanges(key_end=jnp.asarray(lengths[:, None] + 1, jnp.int32))
    out = attention.flash_attention(q, k, v, ranges)
    ref = reference(q, k, v, np.asarray(ranges.dense(300)), np.zeros((3, 1, 4, 8)))[0]
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5)


@pytest.mark.parametrize("Q, heads, kv_heads", [(1, 9, 3), (2, 4, 2), (1, 4, 4), (2, 8, 1)])
def test_few_query_decode_path_with_a_block_equals_float64_reference(Q, heads, kv_heads):
    """The decode path (`_dense_block_few`: every query head against every KV head's keys, then each head's own
    block) on fresh random inputs, cached keys plus a block of new keys in one softmax, against float64."""
    rng = np.random.default_rng(100 + Q * heads + kv_heads)
    B, T, T2, Dh = 3, 70, Q, 16
    q = normal(rng, B, Q, heads, Dh)
    k, v = normal(rng, B, T, kv_heads, Dh), normal(rng, B, T, kv_heads, Dh)
    k2, v2 = normal(rng, B, T2, kv_heads, Dh), normal(rng, B, T2, kv_heads, Dh)
    lengths = np.asarray([1, 33, 70])
    mask = np.broadcast_to(np.arange(T)[None, None, :] < lengths[:, None, None], (B, Q, T))
    mask2 = np.broadcast_to(np.tril(np.ones((Q, T2), bool))[None], (B, Q, T2))
    out = attention.dense_attention(q, k, v, jnp.asarray(mask), block=(k2, v2, jnp.asarray(mask2)))
    ref = reference(q, np.concatenate([k, k2], 1), np.concatenate([v, v2], 1), np.concatenate([mask, mask2], 2),
                    np.zeros((B, Q, heads, Dh)))[0]
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=2e-5, rtol=0)
    low = attention.dense_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                                    jnp.asarray(mask), block=(k2.astype(jnp.bfloat16), v2.astype(jnp.bfloat16),
                                                              jnp.asarray(mask2)))
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(low, np.float64), ref, atol=5e-2, rtol=0)


def test_dense_implementation_is_the_reference():
    rng = np.random.default_rng(5)
    q, k, v = normal(rng, 2, 24, 4, 8), normal(rng, 2, 24, 2, 8), normal(rng, 2, 24, 2, 8)
    ranges = attention.causal_ranges(2, 24, segment_ids=jnp.asarray([[0] * 10 + [1] * 14] * 2))
    ref = reference(q, k, v, np.asarray(ranges.dense(24)), np.zeros((2, 24, 4, 8)))[0]
    for impl in ("dense", "xla", "auto"):
        np.testing.assert_allclose(np.asarray(attention.attention(q, k, v, ranges, impl=impl)), ref, atol=2e-5)


def test_auto_picks_the_tiled_kernel_on_cpu_and_platform_kernels_elsewhere():
    assert attention.resolve_impl("auto", "cpu") == "xla"
    assert attention.resolve_impl("auto", "gpu") == "cudnn"
    assert attention.resolve_impl("auto", "tpu") == "pallas_tpu"
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        attention.resolve_impl("flash")
    with pytest.raises(models.ConfigError, match="attention_impl"):
        models.get_preset("tiny-qwen3", attention_impl="flash")


@pytest.mark.slow  # two whole-model gradient compiles
def test_model_gradients_on_the_tiled_kernel_equal_the_dense_path():
    """The whole model, differentiated, with packed segments and a key mask: 'xla' (tiles of 16) and 'dense' give
    the same log-prob gradients."""
    config = models.get_preset("tiny-qwen3", attention_q_block=16, attention_k_block=16)
    params = models.init_params(config, jax.random.PRNGKey(0))
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (2, 50)))
    masks = {"segment_ids": jnp.asarray([[0] * 20 + [1] * 30, [0] * 50]),
             "attention_mask": jnp.asarray([[True] * 50, [True] * 41 + [False] * 9])}

    def grads(impl):
        cfg = config.replace(attention_impl=impl)
        return jax.grad(lambda p: models.token_logprobs(cfg, p, tokens, **masks)[:, :40].sum())(params)

    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), grads("xla"), grads("dense"))
