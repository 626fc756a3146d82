"""The RL step (trace_jax/rl/pipeline.py) on a very small config: every estimator, GRPO equivalence, metrics."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.credit.config import CreditConfig
from trace_jax.rl.gin_setup import parse
from trace_jax.rl.loop import build_environment
from trace_jax.rl.pipeline import RLPipeline, UpdateConfig, check_compatible
from trace_jax.rollout import kv_bytes_per_row
from trace_jax.rollout.budget import GIB
from trace_jax.train.config import LossConfig
from trace_jax.train.optimizer import make_optimizer
from trace_jax.train.state import init_train_state
from trace_jax.train.step import make_train_step

# The RL tests' small run. sync_every = 16: each turn's 16 tokens in one decode dispatch (the same tokens as two
# of 8), so a batch shape compiles one decode program instead of two attention buckets.
SMALL = """
include 'configs/tiny.gin'
model_preset.hidden_size = 32
model_preset.intermediate_size = 64
model_preset.num_hidden_layers = 1
model_preset.num_attention_heads = 2
model_preset.num_key_value_heads = 1
model_preset.head_dim = 16
DataConfig.num_train_tasks = 8
DataConfig.num_eval_tasks = 2
EvalConfig.num_tasks = 2
RolloutConfig.group_size = 2
RolloutConfig.max_turns = 2
RolloutConfig.max_context = 512
RolloutConfig.turn_token_budget = 16
RolloutConfig.sync_every = 16
WarmStartConfig.steps = 0
TrainConfig.steps = 3
TrainConfig.prompts_per_step = 2
TrainConfig.receipts = 0
CheckpointConfig.every_steps = 1
OptimizerConfig.learning_rate = 1e-3
"""

# SMALL's 16-token turns are shorter than any oracle demonstration turn (the warm start drops demonstrations the
# rollout would cut): runs that warm-start add this (a turn in one decode dispatch, as SMALL's 16 are)
WARM_START_TURNS = "RolloutConfig.turn_token_budget = 64\nRolloutConfig.sync_every = 64\n"

PROMPTS = 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_pipeline")
    gin_file = root / "small.gin"
    gin_file.write_text(SMALL)
    config = parse([str(gin_file)])
    environment = build_environment(config, root)
    return config, environment


_STEPS: dict = {}  # (LossConfig, OptimizerConfig) -> (optimizer, train step): one compile per pair across the tests


def _pipeline(config, environment, credit: CreditConfig, loss: LossConfig, update=UpdateConfig(), rollout=None,
              optimizer_config=None):
    key = (loss, optimizer_config or config.optimizer)
    if key not in _STEPS:
        optimizer = make_optimizer(key[1])
        _STEPS[key] = optimizer, make_train_step(environment.model_config, loss, optimizer)
    optimizer, train_step = _STEPS[key]
    pipeline = RLPipeline(environment.model_config, environment.chat, environment.browser,
                          rollout or config.rollout, credit, loss, update, optimizer, train_step=train_step)
    state = init_train_state(environment.model_config, optimizer, environment.params, jax.random.PRNGKey(0))
    return pipeline, state


ESTIMATORS = {
    "grpo": {}, "gspo": {"ratio_level": "sequence", "aggregation": "seq-mean-token-mean"}, "trace": {},
    "trace_raw_delta": {}, "trace_linear_gap": {},
    "gigpo": {}, "abc_grpo": {}, "abc_sft_online": {"mode": "sft"}, "oracle_progress": {}, "grpo_scaled": {},
}


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_every_estimator_runs_three_steps_without_nan(setup, estimator):
    config, environment = setup
    credit = dataclasses.replace(config.credit, estimator=estimator)
    loss = dataclasses.replace(config.loss, **ESTIMATORS[estimator])
    check_compatible(credit, loss, UpdateConfig(), PROMPTS * config.rollout.group_size)
    pipeline, state = _pipeline(config, environment, credit, loss)
    reference = environment.params
    tasks = environment.train_tasks
    before = jax.tree_util.tree_leaves(state.params)[0].copy()
    for step in range(3):
        rollout = pipeline.collect(state.params, tasks[2 * step:2 * step + PROMPTS], jax.random.PRNGKey(step))
        prepared = pipeline.prepare(rollout, reference, num_prompts=PROMPTS)
        state, metrics = pipeline.update(state, prepared, reference, seed=step)
        values = {**prepared.metrics, **metrics}
        bad = {k: v for k, v in values.items() if not np.isfinite(v)}
        assert not bad, f"{estimator} step {step}: non-finite metrics {bad}"
        assert np.all(np.isfinite(np.asarray(prepared.loss_batch.advantages)))
    leaves = jax.tree_util.tree_leaves(state.params)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in leaves)
    if estimator.startswith("trace"):  # turn credit is non-zero even when every reward is 0, so params move
        assert prepared.answer_scores is not None and "credit/mean_abs_turn_credit" in values
        assert not np.array_equal(np.asarray(leaves[0]), np.asarray(before)), "three updates left the params unchanged"
    if estimator in ("abc_grpo", "abc_sft_online"):
        assert prepared.step_rewards is not None
    if estimator == "grpo_scaled":  # scaled to TRACE's size on the same batch: the reference scored it
        assert prepared.answer_scores is not None


def test_grpo_scaled_trains_grpos_direction_at_traces_size_on_the_same_rollout(setup):
    config, environment = setup
    loss = config.loss
    pipelines = {name: _pipeline(config, environment, CreditConfig(estimator=name, alpha_turn=1.0), loss)[0]
                 for name in ("grpo", "trace", "grpo_scaled")}
    rollout = pipelines["grpo"].collect(environment.params, environment.train_tasks[:PROMPTS], jax.random.PRNGKey(3))
    # the untrained policy solves nothing: give each group one success, so GRPO has a sign to keep
    group_id = np.asarray(rollout.batch.group_id)
    rewards = np.zeros(group_id.shape, np.float32)
    rewards[np.unique(group_id, return_index=True)[1]] = 1.0
    rewards = jnp.asarray(rewards, rollout.batch.reward.dtype)
    rollout = dataclasses.replace(rollout, batch=dataclasses.replace(rollout.batch, reward=rewards))
    prepared = {name: p.prepare(rollout, environment.params, num_prompts=PROMPTS) for name, p in pipelines.items()}
    scaled, grpo = (np.asarray(prepared[n].loss_batch.advantages, np.float64) for n in ("grpo_scaled", "grpo"))
    np.testing.assert_array_equal(np.sign(scaled), np.sign(grpo))
    assert np.any(grpo != 0) and not np.allclose(scaled, grpo)
    size = {n: prepared[n].metrics["credit/mean_abs_token_advantage"] for n in prepared}
    assert size["grpo_scaled"] == pytest.approx(size["trace"], rel=1e-5)


def test_alpha_turn_zero_reproduces_grpo_update_exactly(setup):
    config, environment = setup
    loss = config.loss
    grpo, state_grpo = _pipeline(config, environment, CreditConfig(estimator="grpo"), loss)
    trace0, state_trace0 = _pipeline(config, environment, CreditConfig(estimator="trace", alpha_turn=0.0), loss)
    trace, state_trace = _pipeline(config, environment, CreditConfig(estimator="trace", alpha_turn=0.2), loss)
    rollout = grpo.collect(state_grpo.params, environment.train_tasks[:PROMPTS], jax.random.PRNGKey(7))
    reference = environment.params
    results = []
    for pipeline, state in ((grpo, state_grpo), (trace0, state_trace0), (trace, state_trace)):
        prepared = pipeline.prepare(rollout, reference, num_prompts=PROMPTS)
        state, _ = pipeline.update(state, prepared, reference)
        results.append((np.asarray(prepared.loss_batch.advantages), jax.device_get(state.params)))
    (adv_grpo, params_grpo), (adv_zero, params_zero), (adv_trace, params_trace) = results
    np.testing.assert_array_equal(adv_zero, adv_grpo)
    for a, b in zip(jax.tree_util.tree_leaves(params_zero), jax.tree_util.tree_leaves(params_grpo)):
        np.testing.assert_array_equal(a, b)
    # the check can fail: with turn credit the advantages (and so the update) differ
    assert not np.array_equal(adv_trace, adv_grpo)


def test_mini_batches_and_epochs_count_updates_and_gap_starts_near_zero(setup):
    config, environment = setup
    update = UpdateConfig(epochs=2, mini_batches=2)
    pipeline, state = _pipeline(config, environment, CreditConfig(estimator="grpo"), config.loss, update)
    rollout = pipeline.collect(state.params, environment.train_tasks[:PROMPTS], jax.random.PRNGKey(3))
    prepared = pipeline.prepare(rollout, environment.params, num_prompts=PROMPTS)
    rows, width = prepared.loss_batch.shape
    assert rows == PROMPTS * config.rollout.group_size and width % update.length_multiple == 0
    assert width >= int(np.asarray(rollout.batch.lengths).max())
    state, metrics = pipeline.update(state, prepared, seed=1)
    assert metrics["updates"] == 4
    # the sampler's log-probs are the trainer's up to float noise before the first update
    assert metrics["sampler_trainer_gap"] < 1e-3


def test_a_kv_budget_of_a_row_and_a_half_bounds_the_page_pool_and_the_step_says_so_in_its_metrics(setup):
    config, environment = setup
    row_gib = kv_bytes_per_row(environment.model_config, config.rollout.max_context) / GIB
    rollout = dataclasses.replace(config.rollout, kv_budget_gib=1.5 * row_gib)
    pipeline, state = _pipeline(config, environment, CreditConfig(estimator="grpo"), config.loss, rollout=rollout)
    collected = pipeline.collect(state.params, environment.train_tasks[:PROMPTS], jax.random.PRNGKey(3))
    metrics = pipeline.prepare(collected, environment.params, num_prompts=PROMPTS).metrics
    rows = PROMPTS * rollout.group_size
    assert metrics["rows_at_once"] == rows and collected.batch.tokens.shape[0] == rows  # every row shares the pool
    assert row_gib < metrics["kv_cache_gib"] <= rollout.kv_budget_gib  # the pool: a row and a half's pages
    assert metrics["rollout_preemptions"] >= 0 and 0 < metrics["rollout_useful_row_steps"] <= 1


def test_an_abc_sft_mini_batch_whose_rows_are_all_dropped_takes_no_optimizer_step(setup):
    config, environment = setup
    update = UpdateConfig(mini_batches=2)
    loss = dataclasses.replace(config.loss, mode="sft")
    pipeline, state = _pipeline(config, environment, CreditConfig(estimator="abc_sft_online"), loss, update)
    rollout = pipeline.collect(state.params, environment.train_tasks[:PROMPTS], jax.random.PRNGKey(5))
    prepared = pipeline.prepare(rollout, environment.params, num_prompts=PROMPTS)
    rows = prepared.loss_batch.shape[0]
    order = np.random.default_rng([0, 0]).permutation(rows)  # `update`'s mini-batch order for seed 0, epoch 0
    kept, dropped = order[:rows // 2], order[rows // 2:]
    mask = np.asarray(rollout.batch.loss_mask)[:, :prepared.loss_batch.shape[1]].astype(np.float32)
    mask[dropped] = 0.0  # the second mini-batch's rows all dropped (as ABC-SFT drops wrong answers)
    prepared.loss_batch = prepared.loss_batch.replace(loss_mask=jnp.asarray(mask))
    prepared.credit = prepared.credit._replace(row_mask=jnp.asarray(mask.any(axis=1)))
    _, alone = _pipeline(config, environment, CreditConfig(estimator="abc_sft_online"), loss, update)
    mini = jax.tree_util.tree_map(lambda x: x[jnp.asarray(kept)], prepared.loss_batch)
    alone, _ = pipeline.train_step(alone, mini, None)  # one optimizer step on the kept mini-batch
    state, metrics = pipeline.update(state, prepared, seed=0)
    assert metrics["updates"] == 1 and metrics["skipped_mini_batches"] == 1
    for got, want in zip(jax.tree_util.tree_leaves(jax.device_get(state)), jax.tree_util.tree_leaves(
            jax.device_get(alone)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_incompatible_estimator_and_loss_fail_naming_the_binding():
    with pytest.raises(ValueError, match="LossConfig.ratio_level = 'sequence'"):
        check_compatible(CreditConfig(estimator="gspo"), LossConfig(), UpdateConfig(), 4)
    with pytest.raises(ValueError, match="LossConfig.mode = 'sft'"):
        check_compatible(CreditConfig(estimator="abc_sft_online"), LossConfig(), UpdateConfig(), 4)
    with pytest.raises(ValueError, match="UpdateConfig.mini_batches"):
        check_compatible(CreditConfig(estimator="grpo"), LossConfig(), UpdateConfig(mini_batches=3), 4)
