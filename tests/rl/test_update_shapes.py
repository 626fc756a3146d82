"""The update's shapes come from the run config (`pipeline.update_shapes`), so a run compiles its update once; a step
that does not fit a width the config lowered falls back to the width that fits, with a warning naming the field."""

from __future__ import annotations

import dataclasses

import jax
import jax.monitoring
import numpy as np
import pytest

from tests.rl.test_rl_pipeline import SMALL
from trace_jax.credit.config import CreditConfig
from trace_jax.rl.gin_setup import parse
from trace_jax.rl.loop import RLBatch, RLState, build_environment, make_rl_step, rollout_key
from trace_jax.rl.pipeline import RLPipeline, UpdateConfig, UpdateShapes, UpdateShapeWarning, update_shapes
from trace_jax.rollout import ScriptedPolicy, run_episodes
from trace_jax.train.config import LossConfig
from trace_jax.train.optimizer import make_optimizer
from trace_jax.train.state import init_train_state

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _config(tmp_path, text, *params):
    gin_file = tmp_path / "run.gin"
    gin_file.write_text(text)
    return parse([str(gin_file)], list(params))


def test_the_update_shapes_are_the_configs_bucketed_by_the_length_multiple(tmp_path):
    study = parse(["configs/study.gin"])
    rows = study.train.prompts_per_step * study.rollout.group_size
    # UpdateConfig.max_length = 2048 (study.gin; max_context is 3072); (14 tool turns + the answer) x 80 tokens =
    # 1,200 trained tokens -> 1,216
    assert update_shapes(study.rollout, study.update, rows) == UpdateShapes(rows=48, length=2048, head_width=1216)
    default = update_shapes(study.rollout, UpdateConfig(), rows)
    assert default.length == study.rollout.max_context == 3072
    tiny = parse(["configs/tiny.gin"])
    assert update_shapes(tiny.rollout, tiny.update, 64) == UpdateShapes(rows=64, length=768, head_width=192)
    lowered = UpdateConfig(max_length=2000, max_trained_tokens=300)
    assert update_shapes(study.rollout, lowered, rows) == UpdateShapes(rows=48, length=2048, head_width=320)
    # the trained-token width never exceeds the token width
    assert update_shapes(study.rollout, UpdateConfig(max_length=500), rows).head_width == 512


def test_rows_per_episode_sizes_the_update_only_with_context_management(tmp_path):
    tiny = parse(["configs/tiny.gin"])
    update = UpdateConfig(rows_per_episode=3)
    assert update_shapes(tiny.rollout, update, 16).rows == 16
    compacting = dataclasses.replace(tiny.rollout, context_budget=400, context_record_tokens=64)
    assert update_shapes(compacting, update, 16).rows == 48


def test_update_widths_must_be_non_negative_ints():
    with pytest.raises(ValueError, match="UpdateConfig.max_length must be an int >= 0"):
        UpdateConfig(max_length=-1)
    with pytest.raises(ValueError, match="UpdateConfig.rows_per_episode must be an int >= 1"):
        UpdateConfig(rows_per_episode=0)


# ---------------------------------------------------------------------------------------------- fallbacks
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("update_shapes")
    config = _config(root, SMALL)
    return config, build_environment(config, root)


def _prepare(config, environment, update: UpdateConfig):
    optimizer = make_optimizer(config.optimizer)
    pipeline = RLPipeline(environment.model_config, environment.chat, environment.browser, config.rollout,
                          CreditConfig(estimator="grpo"), LossConfig(), update, optimizer)
    tasks = environment.train_tasks[:2]
    rollout = pipeline.collect(environment.params, tasks, jax.random.PRNGKey(0))
    return pipeline.prepare(rollout, environment.params, num_prompts=len(tasks))


def test_a_step_batch_is_padded_to_the_configured_shapes(small):
    config, environment = small
    prepared = _prepare(config, environment, UpdateConfig())
    batch = prepared.loss_batch
    # (2 tool turns + the answer) x 16 tokens = 48 trained tokens at most, rounded up to 64
    assert batch.shape == (4, config.rollout.max_context) and batch.head_width == 64
    assert prepared.width < config.rollout.max_context  # scoring and credit ran on the step's own bucket
    assert not np.asarray(batch.loss_mask)[:, prepared.width:].any()
    assert not np.asarray(batch.token_mask)[:, prepared.width:].any()


def test_a_row_longer_than_a_lowered_max_length_pads_to_max_context_with_a_warning_naming_the_field(small):
    config, environment = small
    with pytest.warns(UpdateShapeWarning, match=r"raise UpdateConfig.max_length to \d+"):
        prepared = _prepare(config, environment, UpdateConfig(max_length=64))
    assert prepared.loss_batch.shape[1] == config.rollout.max_context


def test_a_row_over_a_lowered_trained_token_width_falls_back_to_the_bound_with_a_warning(small):
    config, environment = small
    with pytest.warns(UpdateShapeWarning, match=r"raise UpdateConfig.max_trained_tokens to \d+"):
        prepared = _prepare(config, environment, UpdateConfig(max_trained_tokens=1, length_multiple=1))
    assert prepared.loss_batch.head_width == 3 * 16


# ---------------------------------------------------------------------------------------------- one compile
# configs/study.gin as the study runs it (its rollouts, widths and mini-batches), shrunk to one prompt of two samples
# a step on one device, with a smaller model, without its 960-step warm start, and GRPO (no reference scoring): none
# of these changes the update's shapes. A scripted policy makes every step's rows differ in length.
STUDY_PARAMS = ("TrainConfig.prompts_per_step = 1", "RolloutConfig.group_size = 2", "WarmStartConfig.steps = 0",
                "DataConfig.num_train_tasks = 8", "DataConfig.num_eval_tasks = 2", "EvalConfig.num_tasks = 2",
                "TrainConfig.receipts = 0", "CreditConfig.estimator = 'grpo'", "RolloutConfig.sync_every = 64",
                "MeshConfig.devices = 1", "model_preset.hidden_size = 32", "model_preset.intermediate_size = 64",
                "model_preset.num_hidden_layers = 1", "model_preset.num_attention_heads = 2",
                "model_preset.num_key_value_heads = 1", "model_preset.head_dim = 16")


def _scripts(chat, step: int, rows: int):
    """Row r of step s: `(s + r) % 3` searches (each a different query, so observations differ), then an answer."""
    answer = chat.assistant_content_ids("<answer>nobody</answer>") + [chat.im_end_id]
    words = ["river", "city", "company", "university", "mayor", "founded", "born"]
    scripts = []
    for row in range(rows):
        calls = [chat.assistant_content_ids(None, [{"name": "search", "arguments": {"query": words[(step + k) % 7]}}])
                 for k in range((step + row) % 3)]
        scripts.append(calls + [answer])
    return scripts


@pytest.mark.slow
def test_the_update_compiles_once_over_five_rl_steps_of_the_study_config(tmp_path):
    config = parse(["configs/study.gin"], list(STUDY_PARAMS))
    environment = build_environment(config, tmp_path)
    rl = make_rl_step(config, environment)
    rows = config.train.prompts_per_step * config.rollout.group_size
    pipeline, chat, vocab = rl.pipeline, environment.chat, environment.model_config.vocab_size
    step_of_call = [0]

    def scripted_collect(params, tasks, rng):
        return run_episodes(pipeline.model_config, params, chat, tasks, pipeline.browser, pipeline.rollout, rng,
                            mesh=pipeline.mesh, rules=pipeline.rollout_rules,
                            logits_hook=ScriptedPolicy(_scripts(chat, step_of_call[0], rows), vocab))

    pipeline.collect = scripted_collect
    params = rl.placement.policy(environment.params)
    state = RLState(init_train_state(environment.model_config, rl.optimizer, params, jax.random.PRNGKey(0),
                                     mesh=rl.placement.mesh, rules=rl.placement.rules), rl.placement.frozen(params))
    compiled: list[tuple[str, float]] = []

    def listen(event, duration, **kwargs):
        if event == _BACKEND_COMPILE:
            compiled.append((str(kwargs.get("fun_name")), duration))

    jax.monitoring.register_event_duration_secs_listener(listen)
    buckets = set()
    try:
        for step in range(1, 6):
            step_of_call[0] = step
            tasks = tuple(environment.train_tasks[step - 1:step])
            state, metrics = rl(state, RLBatch(step, tasks, rollout_key(config.train.seed, step)))
            buckets.add(metrics["length_bucket"])
            assert metrics["updates"] == 2.0  # the study's two mini-batches
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(buckets) >= 3  # the rows' lengths differ from step to step ...
    updates = [name for name, _ in compiled if name == "jit(update)"]
    assert len(updates) == 1, sorted(compiled, key=lambda c: -c[1])[:12]  # ... and the update compiled once
