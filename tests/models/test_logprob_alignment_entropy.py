"""The token-aligned log-prob convention and the chunked entropy of the predicted distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import models


@pytest.fixture(scope="module")
def model():
    config = models.get_preset("tiny-qwen3")
    return config, models.init_params(config, jax.random.PRNGKey(3))


def _float64_reference(config, params, tokens):
    """Next-token log-probs and entropies from full float64 logits."""
    hidden = np.asarray(models.forward_hidden(config, params, tokens), np.float64)
    logits = hidden @ np.asarray(params["embed"], np.float64).T
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    entropy = -(np.exp(logp) * logp).sum(-1)
    picked = np.take_along_axis(logp[:, :-1], np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    return picked, entropy[:, :-1]


def test_to_token_aligned_puts_log_p_of_token_t_at_index_t_and_zero_first():
    next_aligned = jnp.asarray([[-1.0, -2.0, -3.0, 0.0]])
    np.testing.assert_array_equal(models.to_token_aligned(next_aligned), [[0.0, -1.0, -2.0, -3.0]])


def test_alignment_conversions_are_inverse_on_their_defined_entries():
    x = jnp.asarray(np.random.RandomState(0).randn(3, 7)).at[:, 0].set(0.0)
    np.testing.assert_array_equal(models.to_token_aligned(models.to_next_token_aligned(x)), x)


def test_token_logprobs_entropy_equals_a_float64_reference_in_chunks(model):
    config, params = model
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, config.vocab_size, (3, 21)))
    logp, entropy = models.token_logprobs(config, params, tokens, chunk_size=8, with_entropy=True)
    ref_logp, ref_entropy = _float64_reference(config, params, tokens)
    np.testing.assert_allclose(logp[:, :-1], ref_logp, atol=2e-5)
    np.testing.assert_allclose(entropy[:, :-1], ref_entropy, atol=2e-5)
    assert np.all(np.asarray(entropy[:, -1]) == 0.0)
    np.testing.assert_array_equal(logp, models.token_logprobs(config, params, tokens, chunk_size=8))


def test_entropy_gradient_matches_full_logits_gradient(model):
    config, params = model
    tokens = jnp.asarray(np.random.RandomState(2).randint(0, config.vocab_size, (2, 9)))

    def chunked(p):
        return models.token_logprobs(config, p, tokens, chunk_size=4, with_entropy=True)[1].sum()

    def naive(p):
        logp = jax.nn.log_softmax(models.forward(config, p, tokens)[:, :-1], -1)
        return -(jnp.exp(logp) * logp).sum()

    g1, g2 = jax.grad(chunked)(params), jax.grad(naive)(params)
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
