"""Attention semantics of the decoder: packing, boolean masks, chunked attention, chunked token log-probs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import models


@pytest.fixture(scope="module")
def model():
    """Masking is family-independent (families are covered by the parity tests), so one tiny model suffices."""
    config = models.get_preset("tiny-qwen3")
    return config, models.init_params(config, jax.random.PRNGKey(0))


def run_forward(config, params, tokens, **kwargs):
    return np.asarray(models.forward(config, params, tokens, **kwargs))


def tokens_of(shape, seed=0, vocab=512):
    return jnp.asarray(np.random.RandomState(seed).randint(0, vocab, shape))


def test_segment_packing_equals_separate_sequences(model):
    config, params = model
    a, b = tokens_of((1, 7), 1), tokens_of((1, 5), 2)
    packed = jnp.concatenate([a, b], axis=1)
    segments = jnp.asarray([[0] * 7 + [1] * 5])
    positions = jnp.asarray([list(range(7)) + list(range(5))])
    out = run_forward(config, params, packed, positions=positions, segment_ids=segments)
    np.testing.assert_allclose(out[:, :7], run_forward(config, params, a), atol=1e-5)
    np.testing.assert_allclose(out[:, 7:], run_forward(config, params, b), atol=1e-5)


def test_boolean_mask_is_anded_with_causality(model):
    config, params = model
    tokens = tokens_of((2, 9))
    full = jnp.ones((2, 9, 9), bool)
    np.testing.assert_allclose(run_forward(config, params, tokens, attention_mask=full),
                               run_forward(config, params, tokens), atol=1e-6)


def test_boolean_mask_hiding_a_key_equals_deleting_it(model):
    """Query t sees keys [0..2] and [4..t]: same as the sequence with token 3 removed (positions kept)."""
    config, params = model
    tokens = tokens_of((1, 8))
    mask = jnp.ones((1, 8, 8), bool).at[:, :, 3].set(False).at[:, 3, 3].set(True)
    out = run_forward(config, params, tokens, attention_mask=mask)
    kept = jnp.asarray([0, 1, 2, 4, 5, 6, 7])
    ref = run_forward(config, params, tokens[:, kept], positions=kept[None])
    np.testing.assert_allclose(out[:, kept[3:]], ref[:, 3:], atol=1e-5)


def test_key_padding_mask_2d(model):
    config, params = model
    tokens = tokens_of((1, 6))
    key_valid = jnp.asarray([[True] * 4 + [False] * 2])
    out = run_forward(config, params, tokens, attention_mask=key_valid)
    np.testing.assert_allclose(out[:, :4], run_forward(config, params, tokens[:, :4]), atol=1e-6)


def test_query_chunked_attention_matches_unchunked():
    config = models.get_preset("tiny-qwen3")
    params = models.init_params(config, jax.random.PRNGKey(1))
    tokens = tokens_of((2, 32))
    segments = jnp.asarray([[0] * 20 + [1] * 12, [0] * 32])
    ref = run_forward(config, params, tokens, segment_ids=segments)
    chunked = run_forward(config.replace(attention_query_chunk=8), params, tokens, segment_ids=segments)
    np.testing.assert_allclose(chunked, ref, atol=1e-5)
    mask = jnp.asarray(np.random.RandomState(0).rand(2, 32, 32) < 0.7)
    chunked = run_forward(config.replace(attention_query_chunk=8), params, tokens, attention_mask=mask)
    np.testing.assert_allclose(chunked, run_forward(config, params, tokens, attention_mask=mask), atol=1e-5)


def test_query_chunked_attention_bounds_score_memory():
    """S=8192, 8 heads: the full float32 score tensor of one layer is 2.1 GB; chunks of 512 must stay far below."""
    config = models.ModelConfig(model_type="qwen3", vocab_size=1000, hidden_size=64, intermediate_size=32,
                                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                qk_norm=True, tie_word_embeddings=True, attention_query_chunk=512)
    params = jax.eval_shape(lambda: models.init_params(config, jax.random.PRNGKey(0)))
    tokens = jax.ShapeDtypeStruct((1, 8192), jnp.int32)
    segments = jax.ShapeDtypeStruct((1, 8192), jnp.int32)
    compiled = models.forward_hidden.lower(config, params, tokens, segment_ids=segments).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 8 * 8192 * 8192 * 4 / 5


def naive_logprobs(config, params, tokens, targets):
    logits = models.forward(config, params, tokens)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]


def test_token_logprobs_default_targets_are_next_tokens(model):
    config, params = model
    tokens = tokens_of((3, 21))
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    expected = naive_logprobs(config, params, tokens, shifted).at[:, -1].set(0.0)
    got = models.token_logprobs(config, params, tokens, chunk_size=8)  # 21 = 2 full chunks + padded tail
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert got.dtype == jnp.float32


def test_token_logprobs_explicit_targets_score_every_position(model):
    config, params = model
    tokens, targets = tokens_of((2, 16), 3), tokens_of((2, 16), 4)
    np.testing.assert_allclose(models.token_logprobs(config, params, tokens, targets=targets, chunk_size=4),
                               naive_logprobs(config, params, tokens, targets), atol=1e-5)


def test_token_logprobs_gradient_matches_naive():
    config = models.get_preset("tiny-qwen3")
    params = models.init_params(config, jax.random.PRNGKey(2))
    tokens, targets = tokens_of((2, 12)), tokens_of((2, 12), 5)
    g_chunked = jax.grad(lambda p: models.token_logprobs(config, p, tokens, targets=targets, chunk_size=5).sum())(
        params)
    g_naive = jax.grad(lambda p: naive_logprobs(config, p, tokens, targets).sum())(params)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), g_chunked, g_naive)


def test_token_logprobs_never_materialises_full_logits():
    """B=8, S=4096, vocab=151936: compiled temp memory must be far below float32[B, S, V] (19.9 GB)."""
    config = models.ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=16, intermediate_size=32,
                                num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                                qk_norm=True, tie_word_embeddings=True, attention_query_chunk=512)
    params = jax.eval_shape(lambda: models.init_params(config, jax.random.PRNGKey(0)))
    tokens = jax.ShapeDtypeStruct((8, 4096), jnp.int32)
    compiled = models.token_logprobs.lower(config, params, tokens, chunk_size=128).compile()
    full_logits_bytes = 8 * 4096 * 151936 * 4
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < full_logits_bytes / 10, (temp, full_logits_bytes)
