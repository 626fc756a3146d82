"""Warm-start rendering: the demonstrations' turn budget (`WarmStartConfig.max_turns`) and batches cut to their
own longest row (`SFTArrays.batch(..., length_multiple)`)."""

import dataclasses

import numpy as np
import pytest

from trace_jax.envs.oracle import make_browser, trajectory_vocabulary
from trace_jax.envs.tasks import TaskConfig, generate_tasks
from trace_jax.envs.world import WorldConfig, build_world
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
from trace_jax.rl.warmstart import WarmStartConfig, oracle_trajectories, sft_arrays
from trace_jax.rollout import RolloutConfig, SamplingConfig

ROLLOUT = RolloutConfig(group_size=1, max_turns=2, max_context=2048, turn_token_budget=64,
                        max_observation_chars=300, sampling=SamplingConfig(greedy=True), with_tools=False)


@pytest.fixture(scope="module")
def detour_demos(tmp_path_factory):
    world = build_world(WorldConfig(seed=0, deep_fact_prob=0.0, noise_docs=5))
    tasks = generate_tasks(world, 24, seed=0, config=TaskConfig(min_hops=1, max_hops=1))
    chat = ChatFormat(load_tokenizer(build_word_tokenizer(trajectory_vocabulary(), tmp_path_factory.mktemp("tok"))))
    browser = make_browser(world, view_lines=6, snippet_chars=60)
    config = WarmStartConfig(num_trajectories=len(tasks), detour_prob=0.5, oracle_topn=2)
    results = oracle_trajectories(tasks, browser, config)
    return chat, browser, config, results


def test_demonstration_budget_keeps_the_detours_the_rollout_budget_drops(detour_demos):
    chat, browser, config, results = detour_demos
    own = sft_arrays(chat, config.render_rollout(ROLLOUT), browser, results)
    wider_config = dataclasses.replace(config, max_turns=3)
    assert config.render_rollout(ROLLOUT) is ROLLOUT
    assert wider_config.render_rollout(ROLLOUT).max_turns == 3
    wider = sft_arrays(chat, wider_config.render_rollout(ROLLOUT), browser, results)
    def turns(arrays):  # assistant turns per row
        return np.array([len(np.unique(arrays.turn_index[n][arrays.loss_mask[n] > 0])) for n in range(len(arrays))])

    turns_own, turns_wider = turns(own), turns(wider)
    assert turns_own.max() <= 3  # two tool calls (search, open) and the answer: nothing over the budget
    assert (turns_wider == 4).sum() >= 3, turns_wider  # the detours (search, wrong open, back, answer) are kept
    assert len(wider) > len(own)
    assert set(own.task_ids) <= set(wider.task_ids)
    with pytest.raises(ValueError, match="max_turns"):
        WarmStartConfig(max_turns=-1)


def test_batches_cut_to_their_longest_row_lose_no_token(detour_demos):
    chat, browser, config, results = detour_demos
    arrays = sft_arrays(chat, dataclasses.replace(ROLLOUT, max_turns=3), browser, results, length_multiple=64)
    order = np.argsort(arrays.lengths)
    short, full = arrays.batch(order[:4], length_multiple=64), arrays.batch(order[:4])
    width = short["tokens"].shape[1]
    assert width % 64 == 0 and arrays.lengths[order[:4]].max() <= width < full["tokens"].shape[1]
    for name in ("tokens", "positions", "loss_mask", "weights"):
        np.testing.assert_array_equal(short[name], full[name][:, :width])
        if name in ("loss_mask", "weights"):  # everything cut off is padding
            assert not full[name][:, width:].any()
