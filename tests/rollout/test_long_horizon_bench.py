"""benchmarks/long_horizon_bench.py: its workload is the episodes it draws (turn lengths, tool calls, answers), and
its accounting (the ragged minimum of KV reads, the dense engine's row-steps) counts what it says."""

import importlib.util
import os
import random
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

from trace_jax import models
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
from trace_jax.rollout import RolloutConfig, SamplingConfig, ScriptedPolicy
from trace_jax.rollout import engine as engine_lib

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "long_horizon_bench.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("long_horizon_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def chat(bench):
    return ChatFormat(load_tokenizer(build_word_tokenizer(bench.WORDS, Path(tempfile.mkdtemp()))))


def test_every_drawn_turn_length_is_a_scripted_turn_of_that_many_tokens(bench, chat):
    draw = random.Random(3)
    for length in range(10, 401):
        call = bench._call(chat, length, draw)
        assert len(call) == length and call[-1] in chat.assistant_stop_ids
        answer = bench._answer(chat, length)
        assert len(answer) == length and answer[-1] == chat.im_end_id
    assert "<tool_call>" in chat.tokenizer.decode(bench._call(chat, 200, draw), skip_special_tokens=False)


def test_the_ragged_minimum_is_one_plus_each_generated_tokens_position_counted_two_ways(bench):
    # row 0: prompt of 2, a turn of 2 (positions 2, 3), an observation of 1, a turn of 1 (position 5)
    # row 1: prompt of 3, a turn of 3 (positions 3, 4, 5)
    mask = np.asarray([[0, 0, 1, 1, 0, 1], [0, 0, 0, 1, 1, 1]])
    expected = (3 + 4 + 6) + (4 + 5 + 6)
    assert bench.ragged_minimum(mask) == expected
    boundaries = np.asarray([[2, 5], [3, 3]])
    assert bench.ragged_minimum_from_turns(boundaries, np.asarray([1, 0]), [[2, 1], [3]]) == expected


def test_the_dense_engine_runs_every_cache_row_until_each_rounds_longest_turn(bench):
    lengths = [[3, 5], [4]]  # round 0: turns of 3 and 4 tokens; round 1: one of 5
    assert bench.dense_row_steps(lengths, slots=2, sync=1) == 2 * 4 + 2 * 5
    assert bench.dense_row_steps(lengths, slots=2, sync=4) == 2 * 4 + 2 * 8


def test_the_engine_plays_the_workload_and_its_counts_add_up(bench, chat):
    """A small workload (4 rows, <= 4 turns of 10-60 tokens, 1-3 ms tools) through the engine with the block hook:
    every row's generated runs are its drawn turns, the ragged minimum agrees both ways and with the batch, each
    useful row-step is a kept token, and the engine reads at least the ragged minimum."""
    bench.SleepyTools.latency_ms = (1, 3)
    work = bench.build_workload(chat, 4, 4, (10, 60), 0, rollout_cls=RolloutConfig, sampling_cls=SamplingConfig,
                                sync_every=4)
    config = models.get_preset("tiny-qwen3", vocab_size=len(chat.tokenizer), num_hidden_layers=1)
    params = models.init_params(config, jax.random.PRNGKey(0))
    hook = ScriptedPolicy(work.scripts, config.vocab_size, blocks=True)
    result = engine_lib.run_paged_episodes(config, params, chat, work.tasks, bench.SleepyTools, work.rollout,
                                           jax.random.PRNGKey(0), paged=engine_lib.PagedConfig(page_size=8),
                                           logits_hook=hook)
    assert {e.status for e in result.episodes} == {"answered"}
    mask = np.asarray(result.batch.loss_mask)
    for row, lengths in enumerate(work.lengths):
        edges = np.diff(np.concatenate([[0], mask[row], [0]]))
        runs = np.nonzero(edges == -1)[0] - np.nonzero(edges == 1)[0]
        assert runs.tolist() == lengths  # (an observation always separates two turns)
        assert len(result.episodes[row].turn_texts) == len(lengths)
    minimum = bench.ragged_minimum(mask)
    assert minimum == bench.ragged_minimum_from_turns(np.asarray(result.batch.boundaries),
                                                      np.asarray(result.batch.num_turns), work.lengths)
    assert result.stats.useful_row_steps == result.generated_tokens == sum(map(sum, work.lengths))
    assert minimum <= result.stats.kv_positions_read
    assert work.rollout.max_context >= int(np.asarray(result.batch.lengths).max())
