"""The jitted train step: micro-batches and sharding reproduce the single-device full-batch update."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trace_jax import models, train
from trace_jax.train.synthetic import synthetic_batch

ROWS, LENGTH = 8, 16
# Tests whose one-device step is the same program share its compilation (the persistent compilation cache): the
# one-device side of the fsdp x tensor step is the reference test's step from reference params, and the float32
# side of the bfloat16 test is the token-mean full batch of the micro-batch test.
KL_LOSS = train.LossConfig(micro_batches=2, kl_coef=0.1, kl_estimator="k3")


def _sgd_update(config, loss_config, batch, *, mesh=None, rules=None, params=None, reference=None):
    """params_after - params_before under SGD(lr=1): minus the step's gradient."""
    params = models.init_params(config, jax.random.PRNGKey(0)) if params is None else params
    optimizer = optax.sgd(1.0)
    state = train.init_train_state(config, optimizer, params, jax.random.PRNGKey(1), mesh=mesh, rules=rules)
    step = train.make_train_step(config, loss_config, optimizer, mesh=mesh, rules=rules)
    new_state, metrics = step(state, batch, reference)
    delta = jax.tree_util.tree_map(lambda a, b: np.asarray(a) - np.asarray(b), new_state.params, params)
    return delta, {k: float(v) for k, v in metrics.items()}, new_state


def _assert_trees_close(a, b, atol):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(x, y, atol=atol, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def dense():
    return models.get_preset("tiny-qwen3", num_hidden_layers=1)


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", train.config.AGGREGATIONS)
def test_micro_batches_give_the_full_batch_update_for_every_aggregation(dense, aggregation):
    batch = synthetic_batch(dense.vocab_size, ROWS, LENGTH, seed=1)
    full, full_metrics, _ = _sgd_update(dense, train.LossConfig(aggregation=aggregation), batch)
    for micro in (2, 4):
        delta, metrics, _ = _sgd_update(dense, train.LossConfig(aggregation=aggregation, micro_batches=micro), batch)
        _assert_trees_close(delta, full, atol=2e-6)
        for name in ("loss", "pg_loss", "entropy", "clip_frac_low", "clip_frac_high", "ratio_mean", "tokens"):
            np.testing.assert_allclose(metrics[name], full_metrics[name], rtol=2e-5, err_msg=name)


def test_one_step_on_fsdp_x_tensor_equals_one_device(dense):
    batch = synthetic_batch(dense.vocab_size, ROWS, LENGTH, seed=2)
    cfg = KL_LOSS
    single, single_metrics, _ = _sgd_update(dense, cfg, batch, reference=models.init_params(dense,
                                                                                            jax.random.PRNGKey(7)))
    mesh = models.make_mesh({"fsdp": 2, "tensor": 4})
    reference = models.shard_params(models.init_params(dense, jax.random.PRNGKey(7)), dense, mesh)
    sharded, sharded_metrics, state = _sgd_update(dense, cfg, batch, mesh=mesh, reference=reference)
    _assert_trees_close(sharded, single, atol=1e-5)
    np.testing.assert_allclose(sharded_metrics["loss"], single_metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(sharded_metrics["kl"], single_metrics["kl"], rtol=1e-5)
    # the new params keep the rule-derived shardings (embed over fsdp, vocab over tensor)
    assert state.params["embed"].sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")


def test_adam_moments_are_sharded_like_their_parameters(dense):
    mesh = models.make_mesh({"fsdp": 2, "tensor": 4})
    optimizer = train.make_optimizer(train.OptimizerConfig())
    shardings = train.state_shardings(dense, optimizer, mesh)
    params_sh = models.param_shardings(dense, mesh)
    adam = shardings.opt_state[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
    assert adam.mu["layers"]["mlp"]["up_proj"] == params_sh["layers"]["mlp"]["up_proj"]
    assert adam.nu["embed"] == params_sh["embed"]
    assert adam.count.spec == jax.sharding.PartitionSpec()


@pytest.mark.slow
def test_moe_step_on_fsdp_x_expert_equals_one_device():
    config = models.get_preset("tiny-qwen3-moe", num_hidden_layers=1)
    batch = synthetic_batch(config.vocab_size, ROWS, LENGTH, seed=3)
    cfg = train.LossConfig()
    single, single_metrics, _ = _sgd_update(config, cfg, batch)
    mesh = models.make_mesh({"fsdp": 2, "expert": 4})
    sharded, sharded_metrics, state = _sgd_update(config, cfg, batch, mesh=mesh)
    _assert_trees_close(sharded, single, atol=1e-5)
    np.testing.assert_allclose(sharded_metrics["loss"], single_metrics["loss"], rtol=1e-5)
    assert "expert" in str(state.params["layers"]["moe"]["up_proj"].sharding.spec)


def test_reference_logprobs_from_reference_params_equal_the_batch_supplied_ones(dense):
    reference = models.init_params(dense, jax.random.PRNGKey(5))
    batch = synthetic_batch(dense.vocab_size, ROWS, LENGTH, seed=4)
    ref_lp = train.policy_logprobs(dense, reference, batch.tokens)[0]
    cfg = KL_LOSS
    from_params, m1, _ = _sgd_update(dense, cfg, batch, reference=reference)
    from_batch, m2, _ = _sgd_update(dense, cfg, batch.replace(reference_logprobs=ref_lp), reference=None)
    _assert_trees_close(from_params, from_batch, atol=1e-6)
    np.testing.assert_allclose(m1["kl"], m2["kl"], rtol=1e-5)
    assert m1["kl"] > 0


def test_the_donated_state_leaves_the_initial_params_and_reference_usable(dense):
    params = models.init_params(dense, jax.random.PRNGKey(0))
    reference = train.copy_params(params)
    optimizer = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-3))
    state = train.init_train_state(dense, optimizer, params, jax.random.PRNGKey(1))
    step = train.make_train_step(dense, train.LossConfig(kl_coef=0.1), optimizer)
    batch = synthetic_batch(dense.vocab_size, 4, LENGTH, seed=5)
    for _ in range(2):
        state, metrics = step(state, batch, reference)
    assert int(state.step) == 2 and np.isfinite(float(metrics["loss"]))
    np.testing.assert_array_equal(np.asarray(params["embed"]), np.asarray(reference["embed"]))
    assert not np.array_equal(np.asarray(state.params["embed"]), np.asarray(params["embed"]))


def test_bfloat16_compute_keeps_float32_master_weights_and_tracks_the_float32_loss(dense):
    batch = synthetic_batch(dense.vocab_size, ROWS, LENGTH, seed=6)
    _, m32, _ = _sgd_update(dense, train.LossConfig(), batch)
    _, m16, state = _sgd_update(dense.replace(dtype="bfloat16"), train.LossConfig(), batch)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(state.params))
    np.testing.assert_allclose(m16["loss"], m32["loss"], rtol=0.05, atol=0.02)


def test_batch_rows_must_divide_into_micro_batches(dense):
    optimizer = optax.sgd(1.0)
    state = train.init_train_state(dense, optimizer, models.init_params(dense, jax.random.PRNGKey(0)),
                                   jax.random.PRNGKey(1))
    step = train.make_train_step(dense, train.LossConfig(micro_batches=4), optimizer)
    with pytest.raises(ValueError, match="micro_batches=4"):
        step(state, synthetic_batch(dense.vocab_size, 6, LENGTH), None)


def test_kl_without_reference_is_a_clear_error(dense):
    batch = synthetic_batch(dense.vocab_size, 4, LENGTH)
    with pytest.raises(ValueError, match="reference"):
        _sgd_update(dense, train.LossConfig(kl_coef=0.1), batch)


def test_optimizer_schedule_warms_up_then_decays():
    schedule = train.make_schedule(train.OptimizerConfig(learning_rate=1.0, schedule="cosine", warmup_steps=10,
                                                         total_steps=110, end_lr_ratio=0.1))
    np.testing.assert_allclose([float(schedule(s)) for s in (0, 5, 10, 60, 110)], [0, 0.5, 1.0, 0.55, 0.1],
                               atol=1e-6)


def test_weight_decay_skips_norms_and_biases(dense):
    mask = train.optimizer.decay_mask(models.init_params(dense, jax.random.PRNGKey(0)))
    assert mask["embed"] and mask["layers"]["attn"]["q_proj"]
    assert not mask["final_norm"] and not mask["layers"]["input_norm"] and not mask["layers"]["attn"]["q_norm"]


def test_mesh_config_fills_minus_one_and_rejects_bad_sizes():
    assert train.MeshConfig(data=2, fsdp=-1, tensor=2).axis_sizes(8) == {"data": 2, "fsdp": 2, "tensor": 2,
                                                                          "expert": 1}
    with pytest.raises(train.TrainConfigError, match="MeshConfig"):
        train.MeshConfig(data=3, fsdp=-1).axis_sizes(8)
    with pytest.raises(train.TrainConfigError, match="at most one axis"):
        train.MeshConfig(data=-1, fsdp=-1)
