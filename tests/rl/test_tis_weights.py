"""Rollout correction (`LossConfig.tis`): truncated importance weights between a bfloat16 sampler's and a float32
trainer's log-probs of the same tokens equal a float64 reference, at token and at sequence level, and the pipeline
recomputes pi_old with the trainer when TIS is on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import models, train
from trace_jax.train.loss import LossBatch, objective_from_logprobs, tis_weights, trained_positions

N, L = 4, 24


@pytest.fixture(scope="module")
def logprobs():
    """The same tokens scored by the same params as a bfloat16 sampler and as the float32 trainer."""
    trainer_config = models.get_preset("tiny-qwen3", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    sampler_config = trainer_config.replace(dtype="bfloat16")
    params = models.init_params(trainer_config, jax.random.PRNGKey(0))
    rs = np.random.RandomState(0)
    tokens = jnp.asarray(rs.randint(0, trainer_config.vocab_size, (N, L)), jnp.int32)
    trainer = train.policy_logprobs(trainer_config, params, tokens, chunk_size=8)[0]
    sampler = train.policy_logprobs(sampler_config, params, tokens, chunk_size=8)[0]
    lengths = np.array([L, L - 5, L - 9, 7])
    mask = ((np.arange(L)[None, :] < lengths[:, None]) & (np.arange(L)[None, :] >= 3)).astype(np.float32)
    return np.asarray(trainer), np.asarray(sampler), mask


def _reference(trainer, sampler, mask, level, cap):
    """float64, one row and one token at a time."""
    out = np.zeros((N, L))
    for n in range(N):
        log_ratios = [float(trainer[n, t]) - float(sampler[n, t]) for t in range(L) if mask[n, t]]
        for t in range(L):
            if not mask[n, t]:
                continue
            log_w = sum(log_ratios) if level == "sequence" else float(trainer[n, t]) - float(sampler[n, t])
            out[n, t] = min(np.exp(log_w), cap)
    return out


def test_the_bf16_sampler_and_the_fp32_trainer_disagree(logprobs):
    trainer, sampler, mask = logprobs
    gap = np.abs(trainer - sampler)[mask > 0]
    assert gap.max() > 1e-3  # the mismatch TIS corrects is real at these dtypes


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_weights_equal_a_float64_reference(logprobs, level):
    trainer, sampler, mask = logprobs
    uncapped = _reference(trainer, sampler, mask, level, np.inf)
    cap = float(np.median(uncapped[mask > 0]))  # a cap that binds on about half the weights
    cap = max(cap, 1.0 + 1e-6)
    weights, capped = tis_weights(jnp.asarray(trainer), jnp.asarray(sampler), jnp.asarray(mask), level, cap)
    expected = _reference(trainer, sampler, mask, level, cap)
    np.testing.assert_allclose(np.asarray(weights), expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(capped) > 0, (uncapped > cap) & (mask > 0))
    assert np.any(np.asarray(capped) > 0) and np.any(expected[mask > 0] < cap)


def test_the_loss_weighs_each_tokens_policy_gradient_and_reports_the_weights(logprobs):
    trainer, sampler, mask = logprobs
    cfg = train.LossConfig(tis="token", tis_cap=1.002, entropy_metric=False)
    rs = np.random.RandomState(1)
    logp = jnp.asarray(trainer + 0.01 * rs.randn(N, L), jnp.float32)
    advantages = jnp.asarray(rs.randn(N, 1) * np.ones((1, L)), jnp.float32)
    batch = LossBatch(tokens=jnp.zeros((N, L), jnp.int32), positions=jnp.zeros((N, L), jnp.int32),
                      loss_mask=jnp.asarray(mask), advantages=advantages, behaviour_logprobs=jnp.asarray(trainer),
                      sampler_logprobs=jnp.asarray(sampler))
    weighted, sums = objective_from_logprobs(cfg, logp, None, batch)
    plain, _ = objective_from_logprobs(train.LossConfig(entropy_metric=False), logp, None, batch)
    weights = _reference(trainer, sampler, mask, "token", 1.002)
    per_token, _ = train.clipped_surrogate(logp, jnp.asarray(trainer), advantages, jnp.asarray(mask))
    np.testing.assert_allclose(float(weighted), float(np.sum(np.asarray(per_token, np.float64) * weights)),
                               rtol=1e-5)
    assert float(weighted) != pytest.approx(float(plain))
    total, count = sums["tis_weight_mean"]
    np.testing.assert_allclose(float(total / count), weights[mask > 0].mean(), rtol=1e-5)


def test_tis_without_sampler_logprobs_is_refused_naming_the_field():
    batch = LossBatch(tokens=jnp.zeros((2, 4), jnp.int32), positions=jnp.zeros((2, 4), jnp.int32),
                      loss_mask=jnp.ones((2, 4)), advantages=jnp.ones((2, 4)), behaviour_logprobs=jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="LossBatch.sampler_logprobs"):
        batch.validate(train.LossConfig(tis="sequence"))


def test_with_tis_the_pipeline_recomputes_pi_old_with_the_trainer_before_updating(logprobs):
    from trace_jax.credit.config import CreditConfig
    from trace_jax.rollout import RolloutConfig
    from trace_jax.train.optimizer import make_optimizer
    from trace_jax.rl.pipeline import Prepared, RLPipeline, UpdateConfig
    from trace_jax.train.state import init_train_state

    config = models.get_preset("tiny-qwen3", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    params = models.init_params(config, jax.random.PRNGKey(2))
    rs = np.random.RandomState(2)
    tokens = jnp.asarray(rs.randint(0, config.vocab_size, (N, L)), jnp.int32)
    _, sampler, mask = logprobs
    loss = train.LossConfig(tis="sequence", tis_cap=2.0, micro_batches=1)
    optimizer = make_optimizer(train.OptimizerConfig(learning_rate=1e-3))
    pipeline = RLPipeline(config, None, None, RolloutConfig(), CreditConfig(estimator="grpo"), loss,
                          UpdateConfig(mini_batches=2), optimizer)
    batch = LossBatch(tokens=tokens, positions=jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (N, L)),
                      loss_mask=jnp.asarray(mask),
                      advantages=jnp.asarray(rs.randn(N, 1) * np.ones((1, L)), jnp.float32),
                      behaviour_logprobs=jnp.asarray(sampler), sampler_logprobs=jnp.asarray(sampler),
                      trained_index=jnp.asarray(trained_positions(mask, 8)))
    recomputed, gap = pipeline.with_trainer_behaviour(params, batch)
    trainer = np.asarray(train.policy_logprobs(config, params, tokens, chunk_size=8)[0])
    np.testing.assert_allclose(np.asarray(recomputed.behaviour_logprobs)[mask > 0], trainer[mask > 0], atol=2e-5)
    np.testing.assert_allclose(gap, np.abs(trainer - sampler)[mask > 0].mean(), rtol=1e-4)
    state = init_train_state(config, optimizer, params, jax.random.PRNGKey(0))
    prepared = Prepared(rollout=None, loss_batch=batch, credit=None, answer_scores=None, step_rewards=None,
                        metrics={}, timing={})
    _, metrics = pipeline.update(state, prepared, seed=0)
    assert metrics["updates"] == 2 and metrics["sampler_trainer_gap"] == pytest.approx(gap)
    assert 0 < metrics["tis_weight_mean"] <= 2.0
