"""Warm start: oracle trajectories rendered for SFT are exactly what the agent loop produces for the same turns."""

import dataclasses
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from trace_jax import models
from trace_jax.envs.oracle import make_browser, trajectory_vocabulary
from trace_jax.envs.tasks import TaskConfig, generate_tasks
from trace_jax.envs.world import WorldConfig, build_world
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
from trace_jax.rollout import RolloutConfig, ScriptedPolicy, SamplingConfig, run_episodes
from trace_jax.train.config import OptimizerConfig
from trace_jax.rl.warmstart import (
    DroppedDemonstrations,
    WarmStartConfig,
    oracle_assistant_turns,
    oracle_trajectories,
    replay_row,
    sft_arrays,
)

ROLLOUT = RolloutConfig(group_size=1, max_turns=8, max_context=2048, turn_token_budget=64,
                        max_observation_chars=300, sampling=SamplingConfig(greedy=True), sync_every=4)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    world = build_world(WorldConfig(seed=0, deep_fact_prob=0.0, noise_docs=5))
    tasks = generate_tasks(world, 2, seed=0, config=TaskConfig(min_hops=1, max_hops=1))
    tokenizer = load_tokenizer(build_word_tokenizer(trajectory_vocabulary(), tmp_path_factory.mktemp("tok")))
    chat = ChatFormat(tokenizer)
    browser = make_browser(world, view_lines=6, snippet_chars=60)
    return world, tasks, chat, browser


@pytest.mark.slow  # ~20 s idle: a scripted rollout of multi-turn episodes through the tiny model
def test_oracle_replay_equals_scripted_rollout_token_for_token_and_mask_for_mask(env):
    _, tasks, chat, browser = env
    results = oracle_trajectories(tasks, browser, WarmStartConfig(num_trajectories=len(tasks), detour_prob=0.5))
    arrays = sft_arrays(chat, ROLLOUT, browser, results, length_multiple=64)
    assert arrays.task_ids == tuple(r.task.task_id for r in results)  # none dropped: rows align
    scripts = [oracle_assistant_turns(chat, r) for r in results]
    assert max(len(s) for s in scripts) >= 3  # at least one episode with two tool calls and the answer
    config = models.get_preset("tiny-qwen3", vocab_size=len(chat.tokenizer))
    params = models.init_params(config, jax.random.PRNGKey(0))
    rollout = run_episodes(config, params, chat, [r.task for r in results], browser, ROLLOUT, jax.random.PRNGKey(0),
                           logits_hook=ScriptedPolicy(scripts, config.vocab_size))
    assert [e.status for e in rollout.episodes] == ["answered"] * len(results)
    np.testing.assert_array_equal(rollout.batch.reward, 1.0)
    for row in range(len(results)):
        length = int(rollout.batch.lengths[row])
        assert int(arrays.lengths[row]) == length
        np.testing.assert_array_equal(arrays.tokens[row, :length], rollout.batch.tokens[row, :length])
        np.testing.assert_array_equal(arrays.loss_mask[row, :length], rollout.batch.loss_mask[row, :length])
        np.testing.assert_array_equal(arrays.turn_index[row, :length], rollout.batch.turn_index[row, :length])
        assert not arrays.loss_mask[row, length:].any()


def test_observations_are_cut_as_the_rollout_cuts_them(env):
    _, tasks, chat, browser = env
    (result,) = oracle_trajectories(tasks[:1], browser, WarmStartConfig(num_trajectories=1))
    turns = oracle_assistant_turns(chat, result)
    long_obs = replay_row(chat, dataclasses.replace(ROLLOUT, max_observation_chars=0), tasks[0].question, turns,
                          browser)
    cut = replay_row(chat, ROLLOUT, tasks[0].question, turns, browser)
    assert len(cut["tokens"]) < len(long_obs["tokens"])
    assert " ..." in chat.tokenizer.decode(cut["tokens"])


def test_prompt_uses_the_rollout_system_prompt_and_tools(env):
    _, tasks, chat, browser = env
    (result,) = oracle_trajectories(tasks[:1], browser, WarmStartConfig(num_trajectories=1))
    turns = oracle_assistant_turns(chat, result)
    with_tools = replay_row(chat, ROLLOUT, tasks[0].question, turns, browser)
    plain = replay_row(chat, dataclasses.replace(ROLLOUT, with_tools=False, system_prompt="Be brief."),
                       tasks[0].question, turns, browser)
    text = chat.tokenizer.decode(with_tools["tokens"][:with_tools["boundaries"][0]])
    assert ROLLOUT.system_prompt in text and "<tools>" in text
    assert chat.tokenizer.decode(plain["tokens"][:plain["boundaries"][0]]).count("Be brief.") == 1


def test_loss_mask_covers_every_generated_turn_and_its_stop_token(env):
    _, tasks, chat, browser = env
    results = oracle_trajectories(tasks, browser, WarmStartConfig(num_trajectories=len(tasks)))
    arrays = sft_arrays(chat, ROLLOUT, browser, results)
    for row, result in enumerate(results):
        turns = oracle_assistant_turns(chat, result)
        generated = arrays.tokens[row][arrays.loss_mask[row] > 0].tolist()
        assert generated == [i for turn in turns for i in turn]
        assert generated[-1] == chat.im_end_id
    np.testing.assert_array_equal(arrays.weights, arrays.loss_mask)
    assert arrays.tokens.shape[1] % 64 == 0


def test_turn_weights_scale_each_turn_for_weighted_sft(env):
    _, tasks, chat, browser = env
    results = oracle_trajectories(tasks[:1], browser, WarmStartConfig(num_trajectories=1))
    arrays = sft_arrays(chat, ROLLOUT, browser, results, turn_weights=lambda row, turn: 0.5 + turn)
    mask = arrays.loss_mask[0] > 0
    np.testing.assert_array_equal(arrays.weights[0][mask], 0.5 + arrays.turn_index[0][mask])
    assert not arrays.weights[0][~mask].any()


def test_answer_weight_scales_only_the_final_answer_turn(env):
    _, tasks, chat, browser = env
    results = oracle_trajectories(tasks[:2], browser, WarmStartConfig(num_trajectories=2))
    plain = sft_arrays(chat, ROLLOUT, browser, results)
    weighted = sft_arrays(chat, ROLLOUT, browser, results, turn_weights=lambda row, turn: 0.5 + turn, answer_weight=4.0)
    for row in range(len(plain)):
        mask = plain.loss_mask[row] > 0
        turns = plain.turn_index[row]
        last = turns == turns.max()
        assert last.any() and (mask & ~last).any()
        np.testing.assert_array_equal(weighted.weights[row][mask & last], 4.0 * (0.5 + turns[mask & last]))
        np.testing.assert_array_equal(weighted.weights[row][mask & ~last], 0.5 + turns[mask & ~last])
        assert not weighted.weights[row][~mask].any()
        # the answer turn ends with the stop token and holds the answer text
        answer_ids = plain.tokens[row][mask & last].tolist()
        assert answer_ids[-1] == chat.im_end_id
        assert results[row].answer in chat.tokenizer.decode(answer_ids, skip_special_tokens=False)


def test_episodes_the_rollout_could_not_produce_are_dropped_with_the_reason(env):
    _, tasks, chat, browser = env
    results = oracle_trajectories(tasks, browser, WarmStartConfig(num_trajectories=len(tasks)))
    with pytest.raises(ValueError, match="max_turns"):
        sft_arrays(chat, dataclasses.replace(ROLLOUT, max_turns=0), browser, results)
    with pytest.raises(ValueError, match="WarmStartConfig.max_length"):
        sft_arrays(chat, ROLLOUT, browser, results, max_length=10)


def test_a_demonstration_with_a_turn_the_rollout_would_cut_is_dropped_with_a_warning(env):
    """The rollout ends a turn at `turn_token_budget` tokens (a cut tool call is an error observation); a warm start
    that taught such turns taught the policy errors (the first study's fault: docs/results.md)."""
    world, _, chat, browser = env
    tasks = generate_tasks(world, 8, seed=1, config=TaskConfig(min_hops=1, max_hops=2))
    results = oracle_trajectories(tasks, browser, WarmStartConfig(num_trajectories=len(tasks), detour_prob=0.5))
    rollout = dataclasses.replace(ROLLOUT, max_turns=16, max_context=4096)  # every detour fits but for its turns
    longest = np.array([max(len(t) for t in oracle_assistant_turns(chat, r)) for r in results])
    budget = int(np.sort(longest)[len(longest) // 2 - 1])
    over = longest > budget
    assert 0 < over.sum() < len(results), longest  # some demonstrations have a turn longer than the budget
    assert not sft_arrays(chat, dataclasses.replace(rollout, turn_token_budget=int(longest.max())), browser,
                          results).dropped
    with pytest.warns(DroppedDemonstrations, match=rf"{over.sum()} of {len(results)} oracle demonstrations dropped, "
                                                   rf"the rollout could not produce them \({over.sum()}: "
                                                   r"turn_token_budget; the first: turn \d+ of the trajectory has "
                                                   rf"\d+ tokens but RolloutConfig\.turn_token_budget={budget}"):
        arrays = sft_arrays(chat, dataclasses.replace(rollout, turn_token_budget=budget), browser, results)
    assert arrays.task_ids == tuple(r.task.task_id for r, o in zip(results, over) if not o)
    assert len(arrays.dropped) == over.sum()
    with pytest.raises(ValueError, match=r"RolloutConfig\.turn_token_budget=8 \(the rollout cuts a turn there\); "
                                         "raise turn_token_budget"):
        sft_arrays(chat, dataclasses.replace(rollout, turn_token_budget=8), browser, results)


def test_warm_start_config_names_the_bad_field():
    with pytest.raises(ValueError, match="WarmStartConfig.answer_weight"):
        WarmStartConfig(answer_weight=0.0)
    with pytest.raises(ValueError, match="WarmStartConfig.batch_size"):
        WarmStartConfig(batch_size=0)
    with pytest.raises(ValueError, match="WarmStartConfig.detour_prob"):
        WarmStartConfig(detour_prob=2.0)


def test_warm_start_optimizer_is_built_from_its_config_fields():
    optimizer = WarmStartConfig(steps=100, learning_rate=1e-3, warmup_steps=5, schedule="linear", end_lr_ratio=0.2,
                                weight_decay=0.05, clip_norm=None).optimizer
    assert optimizer == OptimizerConfig(learning_rate=1e-3, schedule="linear", warmup_steps=5, total_steps=100,
                                        end_lr_ratio=0.2, weight_decay=0.05, clip_norm=None)


def test_warm_start_optimizer_defaults_are_adamw_cosine_to_a_tenth_without_weight_decay():
    optimizer = WarmStartConfig(steps=450).optimizer
    assert (optimizer.learning_rate, optimizer.schedule, optimizer.warmup_steps, optimizer.total_steps) == \
        (3e-3, "cosine", 20, 450)
    assert (optimizer.end_lr_ratio, optimizer.weight_decay, optimizer.clip_norm) == (0.1, 0.0, 1.0)


def test_warm_start_optimizer_field_errors_name_the_warm_start_field():
    with pytest.raises(ValueError, match=r"WarmStartConfig\.schedule"):
        WarmStartConfig(schedule="step")
    with pytest.raises(ValueError, match=r"WarmStartConfig\.end_lr_ratio"):
        WarmStartConfig(end_lr_ratio=2.0)


def test_the_loop_warm_starts_with_the_configured_optimizer(env, monkeypatch):
    from trace_jax.rl import loop

    class Built(Exception):
        pass

    def record(config):
        raise Built(config)

    monkeypatch.setattr(loop, "make_optimizer", record)
    ws = WarmStartConfig(steps=3, num_trajectories=2, batch_size=2, oracle_topn=2, weight_decay=0.3)
    _, tasks, chat, browser = env
    run_config = SimpleNamespace(warmstart=ws, rollout=ROLLOUT, train=SimpleNamespace(seed=0))
    environment = SimpleNamespace(train_tasks=tasks, browser=browser, chat=chat, model_config=None)
    with pytest.raises(Built) as built:
        loop.warm_start(run_config, environment, params=None)
    assert built.value.args[0] == ws.optimizer


def test_the_oracle_seed_changes_where_the_demonstrations_detour(env):
    world, _, _, browser = env
    tasks = generate_tasks(world, 6, seed=0, config=TaskConfig(min_hops=1, max_hops=2))

    def demonstrations(oracle_seed):
        config = WarmStartConfig(num_trajectories=len(tasks), detour_prob=0.5, oracle_seed=oracle_seed)
        assert config.oracle.seed == oracle_seed
        return [r.messages for r in oracle_trajectories(tasks, browser, config)]

    assert demonstrations(0) == demonstrations(0)
    assert demonstrations(0) != demonstrations(1)
    with pytest.raises(ValueError, match="WarmStartConfig.oracle_seed"):
        WarmStartConfig(oracle_seed=-1)
