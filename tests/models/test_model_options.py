"""Numerics options: bfloat16 compute/params and rematerialisation policies."""

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import models


def test_bfloat16_forward_tracks_float32():
    config = models.get_preset("tiny-llama")
    params = models.init_params(config, jax.random.PRNGKey(0))
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (2, 16)))
    ref = np.asarray(models.forward(config, params, tokens))
    bf16 = config.replace(dtype="bfloat16", param_dtype="bfloat16")
    params16 = models.init_params(bf16, jax.random.PRNGKey(0))
    assert params16["embed"].dtype == jnp.bfloat16
    out = models.forward(bf16, params16, tokens)
    assert out.dtype == jnp.float32  # logits are float32 whatever the compute dtype
    np.testing.assert_allclose(np.asarray(out), ref, atol=0.02)
    lp = models.token_logprobs(bf16, params16, tokens)
    assert lp.dtype == jnp.float32 and np.isfinite(np.asarray(lp)).all()


def test_remat_policy_does_not_change_gradients():
    config = models.get_preset("tiny-qwen3-moe")
    params = models.init_params(config, jax.random.PRNGKey(1))
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 512, (2, 8)))

    def grads(cfg):
        return jax.grad(lambda p: models.token_logprobs(cfg, p, tokens).sum())(params)

    plain, remat = grads(config), grads(config.replace(remat="full"))
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), plain, remat)
