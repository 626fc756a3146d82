"""Rollouts under a per-chip KV-cache budget (`RolloutConfig.kv_budget_gib`, `rollout.budget`): the engine's page
pool holds only what fits, rows wait or are preempted, and the tokens are those of the unbounded run with the same
key, on one device and on a mesh of the 8 fake CPU devices (tests/conftest.py); rows wait for a free slot
(`PagedConfig.slots`) and the test hook sees rows, not slots."""

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
from trace_jax.rollout import RolloutConfig, SamplingConfig, ScriptedPolicy, kv_bytes_per_row, run_episodes
from trace_jax.rollout.budget import GIB, batch_shards
from trace_jax.rollout.paged import PagedConfig

DOCS = [{"docid": "d1", "url": "https://wiki.example/alpha", "title": "Alpha river",
         "text": "The Alpha river flows through Paris."}]
WORDS = ["Alpha", "river", "flows", "through", "Paris", "search", "open", "query", "answer", "The", "is", "Error"]
TASKS = [types.SimpleNamespace(task_id="q0", question="Where does the Alpha river flow?", answer="Paris"),
         types.SimpleNamespace(task_id="q1", question="Which river flows through Paris?", answer="Alpha")]
GROUP = 4  # 2 prompts x 4 samples = 8 rows
# Few programs to compile (the cost of these tests): short turns and observations, a 128-token context.
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
    chat, config, base_params, browser = setup
    return run_episodes(config, base_params if params is None else params, chat, TASKS, browser, rollout,
                        jax.random.PRNGKey(5), mesh=mesh, logits_hook=logits_hook)


@pytest.fixture(scope="module")
def unbounded(setup):
    return _run(setup, SAMPLED)


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


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_kv_budget_must_be_a_positive_number_of_gib(value):
    with pytest.raises(ValueError, match="RolloutConfig.kv_budget_gib must be a positive number of GiB"):
        RolloutConfig(kv_budget_gib=value)


def test_a_budget_of_three_rows_gives_the_unbounded_tokens_within_the_budget(setup, unbounded):
    _, config, _, _ = setup
    rollout = dataclasses.replace(SAMPLED, kv_budget_gib=_budget(config, SAMPLED, 3))
    result = _run(setup, rollout)
    budget = rollout.kv_budget_gib * GIB
    assert result.kv_cache_bytes <= budget < unbounded.kv_cache_bytes
    assert result.stats.max_pages_held * (kv_bytes_per_row(config, 16) - 4) <= budget  # 16-token pages, no length
    _assert_same_episodes(result, unbounded)


def test_a_row_is_admitted_while_others_are_mid_episode_and_hooks_see_rows_not_slots(setup):
    """Row 0 is scripted to answer in its first turn: of three slots, its slot is given to the next waiting row
    while row 1 is still mid-episode, and the script (indexed by row) still drives row 0 only."""
    chat, config, _, _ = setup
    answer = chat.assistant_content_ids("<answer>Paris</answer>") + [chat.im_end_id]
    hook = ScriptedPolicy([[answer]], config.vocab_size)
    result = _run(setup, dataclasses.replace(GREEDY, paged=PagedConfig(slots=3)), logits_hook=hook)
    reference = _run(setup, GREEDY, logits_hook=hook)
    assert result.rows_at_once == 3 and reference.rows_at_once == 2 * GROUP
    assert result.episodes[0].status == "answered" and len(result.episodes[1].turn_texts) > 1
    _assert_same_episodes(result, reference)


def test_on_a_mesh_the_budget_is_per_chip_and_the_sampled_tokens_are_one_devices(setup, unbounded):
    """Sampled, the stricter case (greedy on a mesh: tests/rollout/test_rollout_agent.py)."""
    _, config, params, _ = setup
    mesh = models.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rollout = dataclasses.replace(SAMPLED, kv_budget_gib=_budget(config, SAMPLED, 1, mesh))
    result = _run(setup, rollout, params=models.shard_params(params, config, mesh), mesh=mesh)
    assert result.kv_cache_bytes <= rollout.kv_budget_gib * GIB
    # the same rows unbounded would take 2 rows per chip: the budget did bind
    assert 2 * kv_bytes_per_row(config, rollout.max_context, mesh=mesh) > rollout.kv_budget_gib * GIB
    _assert_same_episodes(result, unbounded)
