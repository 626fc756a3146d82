"""The LM head at the trained positions only (`LossBatch.trained_index`): the same loss, metrics and update as the
head over every position, for every loss mode; `trained_positions` builds the index from the mask."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trace_jax import models, train
from trace_jax.train.loss import LossBatch, policy_logprobs, trained_positions
from trace_jax.train.synthetic import synthetic_batch

ROWS, LENGTH = 4, 40


@pytest.fixture(scope="module")
def model():
    config = models.get_preset("tiny-qwen3", num_hidden_layers=1)
    return config, models.init_params(config, jax.random.PRNGKey(0))


def _ragged_batch(vocab_size, seed, **kwargs):
    """Rows with a prompt, generated spans and observation holes (mask 0 between trained spans), one row with no
    trained token at all."""
    batch = synthetic_batch(vocab_size, ROWS, LENGTH, seed=seed, **kwargs)
    rs = np.random.RandomState(seed + 100)
    holes = rs.rand(ROWS, LENGTH) < 0.3
    mask = np.asarray(batch.loss_mask) * ~holes
    mask[-1] = 0
    return batch.replace(loss_mask=jnp.asarray(mask, jnp.float32))



def assert_same_update(first, second):
    """Two train steps' `(params, metrics)` agree: every metric and every parameter leaf."""
    (params_a, metrics_a), (params_b, metrics_b) = first, second
    for name, value in metrics_a.items():
        np.testing.assert_allclose(metrics_b[name], value, rtol=2e-5, atol=2e-6, err_msg=name)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params_a), jax.tree_util.tree_leaves(params_b)):
        np.testing.assert_allclose(b, a, atol=2e-6, rtol=1e-4, err_msg=jax.tree_util.keystr(path))

def test_trained_positions_lists_each_rows_trained_tokens_in_order_then_zeros():
    mask = np.zeros((3, 10), np.float32)
    mask[0, [2, 3, 7]] = 1
    mask[1, 1:10] = 1
    index = trained_positions(mask, multiple=4)
    assert index.dtype == np.int32 and index.shape == (3, 10)  # 9 trained tokens -> 12, capped at L = 10
    np.testing.assert_array_equal(index[0], [2, 3, 7, 0, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(index[1], list(range(1, 10)) + [0])
    np.testing.assert_array_equal(index[2], 0)
    assert trained_positions(mask[:1], multiple=4).shape == (1, 4)
    with pytest.raises(ValueError, match="token 0"):
        trained_positions(np.ones((1, 4)))


def test_logprobs_at_the_trained_positions_equal_the_full_head_there_and_are_zero_elsewhere(model):
    config, params = model
    batch = _ragged_batch(config.vocab_size, seed=3)
    index = jnp.asarray(trained_positions(batch.loss_mask, multiple=8))
    full_lp, full_ent, _ = policy_logprobs(config, params, batch.tokens, positions=batch.positions, chunk_size=16,
                                           with_entropy=True)
    lp, ent, _ = policy_logprobs(config, params, batch.tokens, positions=batch.positions, chunk_size=16,
                                 with_entropy=True, trained_index=index)
    mask = np.asarray(batch.loss_mask) > 0
    np.testing.assert_allclose(np.asarray(lp)[mask], np.asarray(full_lp)[mask], atol=2e-6)
    np.testing.assert_allclose(np.asarray(ent)[mask], np.asarray(full_ent)[mask], atol=2e-6)
    assert not np.asarray(lp)[~mask].any() and not np.asarray(ent)[~mask].any()


@pytest.mark.parametrize("loss_config", [
    train.LossConfig(),
    train.LossConfig(aggregation="seq-mean-token-sum", entropy_coef=0.01, kl_coef=0.1),
    train.LossConfig(ratio_level="sequence", eps_low=3e-4, eps_high=4e-4),
    train.LossConfig(mode="sft"),
], ids=["grpo", "entropy+kl", "gspo", "sft"])
def test_the_update_with_trained_index_equals_the_full_head_update(model, loss_config):
    config, params = model
    batch = _ragged_batch(config.vocab_size, seed=5, with_reference=True)
    if loss_config.kl_coef == 0:
        batch = batch.replace(reference_logprobs=None)
    indexed = batch.replace(trained_index=jnp.asarray(trained_positions(batch.loss_mask, multiple=8)))
    results = []
    for b in (batch, indexed):
        optimizer = optax.sgd(1.0)
        state = train.init_train_state(config, optimizer, params, jax.random.PRNGKey(1))
        step = train.make_train_step(config, loss_config, optimizer, donate=False)
        new_state, metrics = step(state, b, None)
        results.append((new_state.params, {k: float(v) for k, v in metrics.items()}))
    assert set(results[0][1]) == set(results[1][1])
    assert_same_update(*results)


def test_a_trained_index_of_the_wrong_shape_is_refused():
    batch = synthetic_batch(64, 2, 8)
    with pytest.raises(ValueError, match="trained_index"):
        batch.replace(trained_index=jnp.zeros((3, 4), jnp.int32)).validate()
    with pytest.raises(ValueError, match="trained_index"):
        batch.replace(trained_index=jnp.zeros((2, 9), jnp.int32)).validate()


def test_trained_positions_with_a_head_width_pad_every_row_to_it_and_refuse_a_row_over_it():
    mask = np.zeros((2, 10), np.float32)
    mask[0, [2, 3, 7]] = 1
    index = trained_positions(mask, head_width=6)
    assert index.shape == (2, 6)
    np.testing.assert_array_equal(index[0], [2, 3, 7, 0, 0, 0])
    with pytest.raises(ValueError, match="head_width=2 must hold the most trained tokens of a row"):
        trained_positions(mask, head_width=2)


@pytest.mark.parametrize("loss_config", [
    train.LossConfig(),
    train.LossConfig(aggregation="seq-mean-token-sum", entropy_coef=0.01, kl_coef=0.1),
    train.LossConfig(ratio_level="sequence", aggregation="seq-mean-token-mean", eps_low=3e-4, eps_high=4e-4),
    train.LossConfig(mode="sft"),
], ids=["grpo", "entropy+kl", "gspo", "sft"])
def test_an_update_on_a_batch_padded_with_untrained_rows_and_columns_equals_the_update_on_the_batch(model,
                                                                                                  loss_config):
    config, params = model
    batch = _ragged_batch(config.vocab_size, seed=7, with_reference=True)
    if loss_config.kl_coef == 0:
        batch = batch.replace(reference_logprobs=None)
    batch = batch.replace(trained_index=jnp.asarray(trained_positions(batch.loss_mask, multiple=8)))
    padded = batch.padded(ROWS + 2, LENGTH + 24, 48)
    assert padded.shape == (ROWS + 2, LENGTH + 24) and padded.head_width == 48
    np.testing.assert_array_equal(np.asarray(padded.token_mask)[:ROWS, :LENGTH], 1.0)
    assert not np.asarray(padded.token_mask)[ROWS:].any() and not np.asarray(padded.token_mask)[:, LENGTH:].any()
    results = []
    for b in (batch, padded):
        optimizer = optax.sgd(1.0)
        state = train.init_train_state(config, optimizer, params, jax.random.PRNGKey(1))
        new_state, metrics = train.make_train_step(config, loss_config, optimizer, donate=False)(state, b, None)
        results.append((new_state.params, {k: float(v) for k, v in metrics.items()}))
    assert_same_update(*results)


def test_padding_only_grows_a_batch():
    batch = synthetic_batch(64, 2, 8)
    with pytest.raises(ValueError, match="padding only grows a batch"):
        batch.padded(1, 8)
    with pytest.raises(ValueError, match="head_width"):
        batch.padded(2, 8, 4)  # no trained_index to widen
