"""Rollouts under a per-chip KV-cache budget (`RolloutConfig.kv_budget_gib`, `rollout.budget`): the cache holds only
the rows that fit, the others are admitted as rows finish, and the tokens are those of the unbounded run with the
same key, greedy or sampled, on one device and on a mesh of the 8 fake CPU devices (tests/conftest.py)."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from trace_jax import models
from trace_jax.envs.browser import Browser
from trace_jax.envs.corpus import Corpus
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
from trace_jax.rollout import RolloutConfig, SamplingConfig, ScriptedPolicy, kv_bytes_per_row, rows_within_budget
from trace_jax.rollout import agent as agent_lib
from trace_jax.rollout.budget import GIB, batch_shards, kv_bytes_per_chip

DOCS = [{"docid": "d1", "url": "https://wiki.example/alpha", "title": "Alpha river",
         "text": "The Alpha river flows through Paris."}]
WORDS = ["Alpha", "river", "flows", "through", "Paris", "search", "open", "query", "answer", "The", "is", "Error"]
TASKS = [types.SimpleNamespace(task_id="q0", question="Where does the Alpha river flow?", answer="Paris"),
         types.SimpleNamespace(task_id="q1", question="Which river flows through Paris?", answer="Alpha")]
GROUP = 4  # 2 prompts x 4 samples = 8 rows
# Few programs to compile (the cost of these tests): short turns and observations give few length buckets, and
# prompts of 60 and 72 tokens in a 128-token cache make every decode step attend the whole cache (with rows shorter
# than ~58 tokens `generate` first attends a 64-slot bucket, a second program), so each batch shape and sampling
# mode compiles one decode program.
SAMPLED = RolloutConfig(group_size=GROUP, max_turns=1, max_context=128, turn_token_budget=6, max_observation_chars=24,
                        system_prompt="Use tools. Search the river, open its page, then answer.", with_tools=False,
                        sync_every=6, sampling=SamplingConfig(temperature=1.5))
GREEDY = dataclasses.replace(SAMPLED, sampling=SamplingConfig(greedy=True))
FIELDS = ("tokens", "loss_mask", "turn_index", "boundaries", "num_turns", "status", "reward", "lengths")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokenizer = load_tokenizer(build_word_tokenizer(WORDS, tmp_path_factory.mktemp("tok")))
    chat = ChatFormat(tokenizer)
    config = models.get_preset("tiny-qwen3", vocab_size=len(tokenizer), num_hidden_layers=1)
    params = models.init_params(config, jax.random.PRNGKey(0))
    return chat, config, params, Browser(Corpus.from_records(DOCS))


def _budget(config, rollout, rows_per_chip, mesh=None):
    """A budget of `rows_per_chip` rows and a half per chip, in GiB."""
    return (rows_per_chip + 0.5) * kv_bytes_per_row(config, rollout.max_context, mesh=mesh) / GIB


def _run(setup, rollout, *, params=None, mesh=None, logits_hook=None):
    """`run_episodes` recording the per-device bytes of the cache arrays of every state `generate` is given, and the
    cache rows each admission fills."""
    chat, config, base_params, browser = setup
    record = {"cache_bytes": [], "admitted": []}
    generate, prefill_rows = agent_lib.sampler_lib.generate, agent_lib.sampler_lib.prefill_rows

    def recording_generate(config_, params_, state, **kwargs):
        per_device = {}
        for leaf in jax.tree_util.tree_leaves(state.cache):
            for shard in leaf.addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
        record["cache_bytes"].append(max(per_device.values()))
        return generate(config_, params_, state, **kwargs)

    def recording_prefill_rows(config_, params_, state, rows, prompts, **chunks):
        record["admitted"].append(list(rows))
        return prefill_rows(config_, params_, state, rows, prompts, **chunks)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(agent_lib.sampler_lib, "generate", recording_generate)
        patch.setattr(agent_lib.sampler_lib, "prefill_rows", recording_prefill_rows)
        result = agent_lib.run_episodes(config, base_params if params is None else params, chat, TASKS, browser,
                                        rollout, jax.random.PRNGKey(5), mesh=mesh, logits_hook=logits_hook)
    return result, record


@pytest.fixture(scope="module")
def unbounded(setup):
    return {name: _run(setup, rollout)[0] for name, rollout in (("greedy", GREEDY), ("sampled", SAMPLED))}


def _assert_same_episodes(result, reference):
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(result.batch, name), getattr(reference.batch, name), err_msg=name)
    np.testing.assert_allclose(result.batch.sampler_logprobs, reference.batch.sampler_logprobs, atol=1e-5)
    assert [e.turn_texts for e in result.episodes] == [e.turn_texts for e in reference.episodes]


def test_one_row_costs_its_keys_values_and_length_and_a_tensor_axis_splits_its_heads(setup):
    _, config, _, _ = setup
    one_device = 2 * config.num_hidden_layers * 96 * config.num_key_value_heads * config.head_dim * 4 + 4
    assert kv_bytes_per_row(config, 96) == one_device
    assert kv_bytes_per_row(config, 96, dtype="bfloat16") == (one_device - 4) // 2 + 4
    mesh = models.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert kv_bytes_per_row(config, 96, mesh=mesh) == (one_device - 4) // 2 + 4  # 2 kv heads over tensor = 2
    assert batch_shards(mesh) == 4


def test_rows_within_budget_fits_the_budget_in_whole_rows_per_chip(setup):
    _, config, _, _ = setup
    assert rows_within_budget(config, SAMPLED, mesh=None, rows=8) == 8  # unbounded: every row
    with pytest.raises(ValueError, match="kv_budget_gib is None"):
        rows_within_budget(config, SAMPLED, mesh=None)
    three = dataclasses.replace(SAMPLED, kv_budget_gib=_budget(config, SAMPLED, 3))
    assert rows_within_budget(config, three, mesh=None) == 3
    assert rows_within_budget(config, three, mesh=None, rows=8) == 3
    assert rows_within_budget(config, three, mesh=None, rows=2) == 2
    mesh = models.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    one_per_chip = dataclasses.replace(SAMPLED, kv_budget_gib=_budget(config, SAMPLED, 1, mesh))
    assert rows_within_budget(config, one_per_chip, mesh=mesh, rows=8) == 4  # one row on each of 4 batch shards
    # 6 rows would be 2 on some chips; 1 row (held by every chip) fits, so does 4 = one per batch shard
    assert rows_within_budget(config, one_per_chip, mesh=mesh, rows=6) == 4
    assert rows_within_budget(config, one_per_chip, mesh=mesh, rows=3) == 1
    # what the 4 rows cost a chip (one each), and plan's override of the config's budget
    row = kv_bytes_per_row(config, SAMPLED.max_context, mesh=mesh)
    assert kv_bytes_per_chip(config, one_per_chip, 4, mesh=mesh) == row
    assert kv_bytes_per_chip(config, one_per_chip, 3, mesh=mesh) == 3 * row
    assert rows_within_budget(config, SAMPLED, mesh=mesh, budget_gib=one_per_chip.kv_budget_gib) == 4


def test_a_budget_that_holds_no_row_is_refused_naming_the_field_and_the_row_size(setup):
    _, config, _, _ = setup
    tiny = dataclasses.replace(SAMPLED, kv_budget_gib=_budget(config, SAMPLED, 0) / 2)
    row = kv_bytes_per_row(config, SAMPLED.max_context)
    with pytest.raises(ValueError, match=rf"kv_budget_gib .* holds no row: one row of max_context = "
                                         rf"{SAMPLED.max_context} takes {row} bytes"):
        rows_within_budget(config, tiny, mesh=None, rows=8)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_kv_budget_must_be_a_positive_number_of_gib(value):
    with pytest.raises(ValueError, match="RolloutConfig.kv_budget_gib must be a positive number of GiB"):
        RolloutConfig(kv_budget_gib=value)


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_a_budget_of_three_rows_gives_the_unbounded_tokens_within_the_budget(setup, unbounded, kind):
    _, config, _, _ = setup
    rollout = dataclasses.replace(GREEDY if kind == "greedy" else SAMPLED,
                                  kv_budget_gib=_budget(config, SAMPLED, 3))
    result, record = _run(setup, rollout)
    assert result.rows_at_once == 3 and unbounded[kind].rows_at_once == 2 * GROUP
    admitted = record["admitted"]  # the 8 rows were admitted in several rounds into cache rows 0..2
    assert len(admitted) > 1 and sum(map(len, admitted)) == 8 and max(map(max, admitted)) == 2
    budget = rollout.kv_budget_gib * GIB
    assert max(record["cache_bytes"]) <= budget
    assert result.kv_cache_bytes == max(record["cache_bytes"])
    _assert_same_episodes(result, unbounded[kind])


def test_a_row_is_admitted_while_others_are_mid_episode_and_hooks_see_rows_not_cache_rows(setup):
    """Row 0 is scripted to answer in its first turn: its cache row is given to the next waiting row while row 1
    is still at its second turn, and the script (indexed by row) still drives row 0 only."""
    chat, config, _, _ = setup
    answer = chat.assistant_content_ids("<answer>Paris</answer>") + [chat.im_end_id]
    hook = ScriptedPolicy([[answer]], config.vocab_size)
    # three cache rows, as in the test above: its admission and append programs serve
    three = dataclasses.replace(GREEDY, kv_budget_gib=_budget(config, GREEDY, 3))
    result, record = _run(setup, three, logits_hook=hook)
    reference, _ = _run(setup, GREEDY, logits_hook=hook)
    assert record["admitted"][0] == [0, 1, 2]
    assert record["admitted"][1] == [0]  # one free cache row; five rows were waiting
    assert result.episodes[0].status == "answered" and len(result.episodes[1].turn_texts) > 1
    _assert_same_episodes(result, reference)


def test_on_a_mesh_the_budget_is_per_chip_and_the_sampled_tokens_are_one_devices(setup, unbounded):
    """Sampled, the stricter case (greedy on a mesh: tests/rollout/test_rollout_agent.py)."""
    _, config, params, _ = setup
    mesh = models.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rollout = dataclasses.replace(SAMPLED, kv_budget_gib=_budget(config, SAMPLED, 1, mesh))
    result, record = _run(setup, rollout, params=models.shard_params(params, config, mesh), mesh=mesh)
    assert result.rows_at_once == 4  # one row on each of the 4 batch shards, heads split over tensor
    assert max(record["cache_bytes"]) <= rollout.kv_budget_gib * GIB
    # the same rows unbounded would take 2 rows per chip: the budget did bind
    assert 2 * kv_bytes_per_row(config, rollout.max_context, mesh=mesh) > rollout.kv_budget_gib * GIB
    _assert_same_episodes(result, unbounded["sampled"])


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_admissions_and_observations_dispatched_in_chunks_give_the_unchunked_runs_rows(setup, unbounded, name):
    # the 60- and 72-token prompts admit 32 tokens and append the rest in 16-token pieces, under a budget of 3 rows
    # (admissions while other rows are mid-episode); the observations' tool responses go in 16-token pieces too
    _, config, _, _ = setup
    rollout = dataclasses.replace(GREEDY if name == "greedy" else SAMPLED, prefill_chunk_tokens=32,
                                  append_chunk_tokens=16)
    rollout = dataclasses.replace(rollout, kv_budget_gib=_budget(config, rollout, 3))
    result, record = _run(setup, rollout)
    assert len(record["admitted"]) > 1
    _assert_same_episodes(result, unbounded[name])
