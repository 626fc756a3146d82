"""The paper's setting as shipped (issue 29.7, credit-spec "Published settings"): 16 prompts x 8 samples, up to 60
tool turns in training and 80 at evaluation, 4096 tokens per generation, 48K context, several mini-batches per
step; and the evaluation really runs with its own turn budget."""

import types

import numpy as np
import pytest

from trace_jax import models
from trace_jax.rl import evaluate as evaluate_module
from trace_jax.rl.evaluate import EvalConfig, evaluate
from trace_jax.rl.gin_setup import parse
from trace_jax.rollout import RolloutConfig
from trace_jax.rollout.batch import EpisodeRecord


@pytest.mark.parametrize("name", ["qwen3_4b.gin", "qwen3_30b_a3b.gin"])
def test_paper_configs_carry_the_papers_numbers(name):
    config = parse([f"configs/{name}"])
    assert (config.train.prompts_per_step, config.rollout.group_size) == (16, 8)
    assert config.rollout.max_turns == 60 and config.eval.max_turns == 80
    assert config.rollout.turn_token_budget == 4096 and config.rollout.max_context == 48 * 1024
    assert config.update.mini_batches > 1
    rows_per_update = 16 * 8 // config.update.mini_batches
    assert rows_per_update % config.loss.micro_batches == 0


@pytest.mark.parametrize("name, preset", [("qwen3_4b.gin", "qwen3-4b"), ("qwen3_30b_a3b.gin", "qwen3-30b-a3b")])
def test_paper_configs_extend_the_32k_model_to_48k_with_yarn(name, preset):
    config = parse([f"configs/{name}"])
    model = config.train.policy_model(models.get_preset(preset))
    assert (model.rope_type, model.rope_original_max_position, model.rope_scaling_factor) == ("yarn", 32768, 1.5)
    assert model.max_position_embeddings == config.rollout.max_context == 48 * 1024


@pytest.mark.parametrize("name", ["qwen3_4b.gin", "qwen3_30b_a3b.gin"])
def test_paper_configs_sample_and_score_in_bfloat16_with_tis(name):
    config = parse([f"configs/{name}"])
    assert (config.train.rollout_dtype, config.train.reference_dtype) == ("bfloat16", "bfloat16")
    assert config.loss.tis == "token"


@pytest.mark.parametrize("name, preset", [("qwen3_4b.gin", "qwen3-4b"), ("qwen3_30b_a3b.gin", "qwen3-30b-a3b")])
def test_paper_configs_compute_in_bfloat16_with_full_remat_and_a_kv_budget(name, preset):
    # what `trace-jax plan` needs to say FIT without flags (docs/scaling.md)
    config = parse([f"configs/{name}"])
    model = config.train.policy_model(models.get_preset(preset))
    assert (model.dtype, model.remat, model.param_dtype) == ("bfloat16", "full", "float32")
    assert config.rollout.kv_budget_gib > 0 and config.update.scoring_batch > 0


def test_the_4b_mesh_fits_both_v6e_8_and_v5p_8_by_its_minus_one_axis():
    mesh = parse(["configs/qwen3_4b.gin"]).mesh
    assert mesh.axis_sizes(8)["fsdp"] == 4 and mesh.axis_sizes(4)["fsdp"] == 2
    assert mesh.axis_sizes(8)["tensor"] == mesh.axis_sizes(4)["tensor"] == 2


@pytest.mark.parametrize("binding, field", [("TrainConfig.compute_dtype = 'float16'", "TrainConfig.compute_dtype"),
                                            ("TrainConfig.remat = 'some'", "TrainConfig.remat")])
def test_a_bad_policy_dtype_or_remat_is_an_error_naming_the_field(binding, field):
    with pytest.raises(Exception, match=field):
        parse(["configs/qwen3_4b.gin"], [binding])


def test_eval_max_turns_defaults_to_the_rollouts():
    assert EvalConfig().max_turns is None
    with pytest.raises(ValueError, match="EvalConfig.max_turns"):
        EvalConfig(max_turns=-1)


@pytest.mark.parametrize("eval_turns, expected", [(None, 3), (7, 7)])
def test_evaluation_episodes_run_with_the_evaluation_turn_budget(monkeypatch, eval_turns, expected):
    seen = []

    def fake_run_episodes(model_config, params, chat, tasks, browser, rollout, rng, **kwargs):
        seen.append(rollout.max_turns)
        episodes = [EpisodeRecord(task_id=str(i), question="q", gold=("a",)) for i in range(len(tasks))]
        n = len(tasks)  # one row per episode, as an uncompacted rollout gives
        batch = types.SimpleNamespace(reward=np.zeros(n), episode=np.arange(n), first_turn=np.zeros(n, np.int32),
                                      num_turns=np.ones(n, np.int32), group_id=np.arange(n), status=np.zeros(n))
        return types.SimpleNamespace(episodes=episodes, batch=batch)

    monkeypatch.setattr(evaluate_module, "run_episodes", fake_run_episodes)
    evaluate(None, None, None, [object()], None, RolloutConfig(max_turns=3), EvalConfig(max_turns=eval_turns))
    assert seen == [expected]
