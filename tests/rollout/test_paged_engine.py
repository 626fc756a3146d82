"""The rollout engine (`rollout.engine`, behind `agent.run_episodes`): greedy episodes are the naive reference's
(tests/rollout/naive_reference.py: a full forward per token, no cache, the episode rules restated): the same tokens,
masks, boundaries, statuses and log-probs, with tools running on a worker pool while rows decode; rows paused and
recomputed under a small page pool, a prefill budget or a mesh change no episode, greedy or sampled."""

import copy
import dataclasses
import random
import time
import types

import jax
import numpy as np
import pytest

from tests.rollout.naive_reference import greedy_episodes
from trace_jax import models
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
from trace_jax.rollout import RolloutConfig, SamplingConfig, ScriptedPolicy, run_episodes
from trace_jax.rollout import engine as engine_lib
from trace_jax.rollout import paged as paged_lib

WORDS = ["alpha", "beta", "gamma", "delta", "river", "city", "mayor", "flows", "through", "search", "open", "query",
         "answer", "The", "is", "Error", "result", "page", "north", "south"]
FIELDS = ("tokens", "loss_mask", "turn_index", "boundaries", "num_turns", "status", "reward", "lengths")
ROLLOUT = RolloutConfig(group_size=2, max_turns=3, max_context=192, turn_token_budget=24, max_observation_chars=24,
                        system_prompt="Use tools.", with_tools=False, sync_every=4,
                        sampling=SamplingConfig(greedy=True))
SAMPLED = dataclasses.replace(ROLLOUT, sampling=SamplingConfig(temperature=1.3))
PAGED = engine_lib.PagedConfig(page_size=8, prefill_chunk=32, tool_workers=3)


class ScriptedTools:
    """A tool environment of one task: each call sleeps 0-30 ms and returns 1-12 words, drawn from the task and the
    call's number (so its answers do not depend on timing or on other rows)."""

    def __init__(self, task):
        self.task, self.calls = task, 0

    def execute(self, name, arguments):
        draw = random.Random(f"{self.task.task_id}/{self.calls}/{name}")
        self.calls += 1
        time.sleep(draw.uniform(0.0, 0.03))
        return " ".join(draw.choice(WORDS) for _ in range(draw.randint(1, 12)))


def _tasks(seed, count):
    draw = random.Random(seed)
    return [types.SimpleNamespace(task_id=f"t{seed}-{i}", answer=draw.choice(WORDS),
                                  question=" ".join(draw.choice(WORDS) for _ in range(draw.randint(2, 14))))
            for i in range(count)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokenizer = load_tokenizer(build_word_tokenizer(WORDS, tmp_path_factory.mktemp("tok")))
    chat = ChatFormat(tokenizer)
    # untied: with tied embeddings a random model's greedy choice is the token it was just fed ("\n" forever)
    config = models.get_preset("tiny-qwen3", vocab_size=len(tokenizer), num_hidden_layers=1, tie_word_embeddings=False)
    params = models.init_params(config, jax.random.PRNGKey(1))
    return chat, config, params


def _scripts(chat, tasks, seed):
    """Per row, per turn: a valid tool call of 1-6 query words, nothing (the model's own greedy turn), or an
    answer; random lengths, so rows end their turns and episodes at different steps."""
    draw = random.Random(seed)
    rows = []
    for _ in range(len(tasks) * ROLLOUT.group_size):
        turns = []
        for _ in range(ROLLOUT.max_turns + 1):
            kind = draw.choice(["call", "call", "free", "answer"])
            if kind == "call":
                query = " ".join(draw.choice(WORDS) for _ in range(draw.randint(1, 6)))
                turns.append(chat.assistant_content_ids(None, [{"name": "search", "arguments": {"query": query}}]))
            elif kind == "answer":
                turns.append(chat.assistant_content_ids(f"<answer>{draw.choice(WORDS)}</answer>")
                             + [chat.im_end_id])
            else:
                turns.append([])
        rows.append(turns)
    return rows


def _engine(setup, tasks, rollout, *, paged=PAGED, hook=None, rng=jax.random.PRNGKey(7), chat=None):
    chat_, config, params = setup
    return engine_lib.run_paged_episodes(config, params, chat or chat_, tasks, ScriptedTools, rollout, rng,
                                         paged=paged, logits_hook=hook)


def _reference(setup, tasks, rollout, *, hook=None, chat=None):
    chat_, config, params = setup
    return greedy_episodes(config, params, chat or chat_, tasks, ScriptedTools, rollout, logits_hook=hook)


def _assert_same_episodes(result, reference):
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(result.batch, name), getattr(reference.batch, name), err_msg=name)
    np.testing.assert_allclose(result.batch.sampler_logprobs, reference.batch.sampler_logprobs, atol=1e-5)
    for mine, theirs in zip(result.episodes, reference.episodes):
        assert dataclasses.asdict(mine) == dataclasses.asdict(theirs)
    assert result.generated_tokens == reference.generated_tokens


@pytest.mark.parametrize("seed", [0, 1])
def test_scripted_tool_episodes_with_random_turn_lengths_are_the_naive_references(setup, seed):
    chat, config, _ = setup
    tasks = _tasks(seed, 3)
    hook = ScriptedPolicy(_scripts(chat, tasks, seed), config.vocab_size)
    result = _engine(setup, tasks, ROLLOUT, hook=hook)
    _assert_same_episodes(result, _reference(setup, tasks, ROLLOUT, hook=hook))
    statuses = {e.status for e in result.episodes}
    assert len(statuses) > 1  # episodes ended in different ways and at different turns
    assert sum(len(e.observations) for e in result.episodes) > 0


FREE_TASKS = _tasks(3, 4)  # 8 rows running free (the model's own turns), shared by the tests below


@pytest.fixture(scope="module")
def free_running(setup):
    """Per sampling mode: (the reference episodes, the engine's with an unbounded pool) on FREE_TASKS; the
    reference of a sampled run is the engine's own, unbounded."""
    greedy = _engine(setup, FREE_TASKS, ROLLOUT)
    sampled = _engine(setup, FREE_TASKS, SAMPLED)
    return {"greedy": (_reference(setup, FREE_TASKS, ROLLOUT), greedy), "sampled": (sampled, sampled)}


def test_free_running_greedy_tokens_are_the_naive_references(free_running):
    reference, result = free_running["greedy"]
    _assert_same_episodes(result, reference)
    assert result.stats.decode_dispatches > 0 and result.stats.preemptions == 0
    assert 0 < result.stats.useful_row_steps <= result.stats.row_steps


def test_sampled_episodes_depend_on_the_key_alone(setup, free_running):
    """The same key gives the same sampled episodes (tool latencies vary run to run); another key others."""
    _, first = free_running["sampled"]
    _assert_same_episodes(_engine(setup, FREE_TASKS, SAMPLED), first)
    other = _engine(setup, FREE_TASKS, SAMPLED, rng=jax.random.PRNGKey(8))
    assert not np.array_equal(np.asarray(other.batch.tokens), np.asarray(first.batch.tokens))


def test_prefill_runs_a_prompts_samples_once_and_every_observation(free_running):
    """Tokens prefill ran through the model: every row's tokens but its generated ones, with each prompt once for
    its G samples (they are admitted together). Sampled, so a prompt's rows part after their prompt (greedy rows
    stay identical, and so share every prefill)."""
    _, result = free_running["sampled"]
    batch = result.batch
    not_generated = int(np.asarray(batch.lengths).sum() - np.asarray(batch.loss_mask).sum())
    prompts = np.asarray(batch.boundaries)[::ROLLOUT.group_size, 0]
    assert result.stats.prefill_tokens == not_generated - (ROLLOUT.group_size - 1) * int(prompts.sum())


def test_sampled_log_probs_equal_the_trainers(setup, free_running):
    _, config, params = setup
    batch = free_running["sampled"][1].batch
    trainer = np.asarray(models.to_token_aligned(models.token_logprobs(config, params, batch.tokens)))
    mask = np.asarray(batch.loss_mask) == 1
    assert mask.sum() > 20
    np.testing.assert_allclose(np.asarray(batch.sampler_logprobs)[mask], trainer[mask], atol=1e-5)


def _quarter_pool(reference, page_size):
    """Pages of a pool holding 25% of the rows' total tokens (at least one row of max_context)."""
    total = int(np.asarray(reference.batch.lengths).sum())
    return max(total // 4 // page_size, -(-ROLLOUT.max_context // page_size))


def test_a_prefill_token_budget_spreads_prefill_over_dispatches_and_changes_no_episode(setup, free_running):
    _, unbounded = free_running["sampled"]
    small = _engine(setup, FREE_TASKS, SAMPLED, paged=dataclasses.replace(PAGED, prefill_tokens=40))
    assert small.stats.prefill_dispatches > unbounded.stats.prefill_dispatches
    assert small.stats.prefill_tokens == unbounded.stats.prefill_tokens
    _assert_same_episodes(small, unbounded)


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_a_pool_of_a_quarter_of_the_tokens_preempts_rows_and_loses_or_alters_no_episode(setup, free_running, kind):
    reference, _ = free_running[kind]
    pages = _quarter_pool(reference, PAGED.page_size)
    small = _engine(setup, FREE_TASKS, ROLLOUT if kind == "greedy" else SAMPLED,
                    paged=dataclasses.replace(PAGED, num_pages=pages))
    assert small.stats.preemptions > 0 and small.stats.recomputed_tokens > 0
    assert small.stats.max_pages_held <= pages
    assert all(e.status != "running" for e in small.episodes)
    _assert_same_episodes(small, reference)


def test_a_row_preempted_mid_turn_is_recomputed_and_gives_the_same_tokens(setup, free_running):
    """A pool of exactly one row's context for 8 rows: rows are paused while generating, and their turns resume
    after recompute with the same keys."""
    reference, _ = free_running["greedy"]
    pages = -(-ROLLOUT.max_context // PAGED.page_size)
    small = _engine(setup, FREE_TASKS, ROLLOUT, paged=dataclasses.replace(PAGED, num_pages=pages))
    assert small.stats.preemptions_mid_turn > 0
    _assert_same_episodes(small, reference)


def test_on_a_mesh_the_pool_is_split_and_the_episodes_are_one_devices(setup, free_running):
    """8 fake CPU devices (tests/conftest.py): pages over data x fsdp, kv heads over tensor."""
    chat, config, params = setup
    mesh = models.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded = engine_lib.run_paged_episodes(config, models.shard_params(params, config, mesh), chat, FREE_TASKS,
                                            ScriptedTools, ROLLOUT, jax.random.PRNGKey(7), paged=PAGED, mesh=mesh)
    single = free_running["greedy"][1]
    assert sharded.kv_cache_bytes * 8 == single.kv_cache_bytes
    _assert_same_episodes(sharded, single)


def test_stop_strings_end_turns_and_drop_the_overshoot_as_the_naive_reference_does(setup):
    """A chat format whose stop *string* is "a" (any word or byte with an a): turns end mid decode block, and the
    tokens drawn after the string within the block are dropped and uncached."""
    chat, config, params = setup
    stringy = copy.copy(chat)
    stringy.assistant_stop_strings = ("a",)
    tasks = FREE_TASKS[:2]
    result = run_episodes(config, params, stringy, tasks, ScriptedTools, dataclasses.replace(ROLLOUT, paged=PAGED),
                          jax.random.PRNGKey(7))
    _assert_same_episodes(result, _reference(setup, tasks, ROLLOUT, chat=stringy))
    turns = [text for e in result.episodes for text in e.turn_texts]
    assert sum("a" in text for text in turns) > len(turns) // 2
    short = [text for text in turns if len(stringy.tokenizer.encode(text)) < ROLLOUT.turn_token_budget]
    assert short  # ended by the stop string before the turn budget


def test_context_management_compacts_rows_into_segments_as_the_naive_reference_does(setup):
    """`RolloutConfig.context_budget`: a row whose next observation would pass the budget starts a new segment from
    its compacted context, recomputed into fresh pages of its slot."""
    rollout = dataclasses.replace(ROLLOUT, context_budget=150, context_record_tokens=48)
    tasks = FREE_TASKS[:2]
    reference = _reference(setup, tasks, rollout)
    result = _engine(setup, tasks, rollout)
    tight = _engine(setup, tasks, rollout, paged=dataclasses.replace(
        PAGED, num_pages=-(-rollout.max_context // PAGED.page_size)))
    assert len(np.asarray(result.batch.tokens)) > len(result.episodes)  # some episodes took several segments
    assert tight.stats.preemptions > 0
    for run in (result, tight):  # compacted rows restart in fresh pages, also when the pool is short
        _assert_same_episodes(run, reference)
        for name in ("episode", "first_turn"):
            np.testing.assert_array_equal(getattr(run.batch, name), getattr(reference.batch, name))


def test_a_pool_smaller_than_one_row_is_refused_naming_the_field(setup):
    chat, config, params = setup
    with pytest.raises(ValueError, match=r"PagedConfig.num_pages = 3 gives a pool of 3 pages of 8 tokens; one row "
                                         r"of max_context = 192 needs 24"):
        engine_lib.run_paged_episodes(config, params, chat, _tasks(0, 1), ScriptedTools, ROLLOUT,
                                      jax.random.PRNGKey(0), paged=dataclasses.replace(PAGED, num_pages=3))


def test_on_a_mesh_every_batch_shard_of_the_pool_must_hold_one_row_naming_the_field_and_the_fix(setup):
    """Pages over data x fsdp = 4 batch shards: a row's pages lie on one shard, so 40 pages (10 a shard) cannot hold
    one row of 24; 30 pages do not divide over the shards (the pool is replicated on each) and are one block."""
    _, config, _ = setup
    mesh = models.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with pytest.raises(ValueError, match=r"PagedConfig.num_pages = 40 gives a pool of 40 pages of 8 tokens over 4 "
                                         r"batch shards, 10 a shard; a row's pages lie on one shard and one row of "
                                         r"max_context = 192 needs 24: raise it \(to 96 pages at least\)"):
        engine_lib.pool_pages(config, ROLLOUT, dataclasses.replace(PAGED, num_pages=40), 8, mesh=mesh)
    assert engine_lib.pool_pages(config, ROLLOUT, dataclasses.replace(PAGED, num_pages=96), 8, mesh=mesh) == 96
    assert engine_lib.pool_pages(config, ROLLOUT, dataclasses.replace(PAGED, num_pages=30), 8, mesh=mesh) == 30
    assert engine_lib.pool_shards(30, mesh=mesh) == 1 and engine_lib.pool_shards(96, mesh=mesh) == 4
    tiny_budget = dataclasses.replace(ROLLOUT, kv_budget_gib=paged_lib.page_bytes(config, 8, mesh=mesh) * 20.5 / 2**30)
    with pytest.raises(ValueError, match=r"RolloutConfig.kv_budget_gib = .* gives a pool of 80 pages .* 20 a shard"):
        engine_lib.pool_pages(config, tiny_budget, PAGED, 8, mesh=mesh)


def test_the_default_pool_holds_whole_rows_on_every_batch_shard():
    """No budget: 3 rows of 24 pages over 4 shards round up to one row a shard (96 pages, not 72: a row cannot
    straddle two shards' 18); over 2 processes each part spans 2 shards (2 x 24), and over 8 processes a shard
    holds two processes' parts (one row each)."""
    config = models.get_preset("tiny-qwen3")
    mesh = models.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert engine_lib.pool_pages(config, ROLLOUT, PAGED, 3, mesh=mesh) == 96
    assert engine_lib.pool_pages(config, ROLLOUT, PAGED, 3, mesh=mesh, processes=2) == 96
    assert engine_lib.pool_shards(96, mesh=mesh, processes=2) == 2
    assert engine_lib.pool_pages(config, ROLLOUT, PAGED, 3, mesh=mesh, processes=8) == 72
    assert engine_lib.pool_shards(72, mesh=mesh, processes=8) == 1
    with pytest.raises(ValueError, match="each process's part of the page pool would straddle shards"):
        engine_lib.pool_shards(24, mesh=mesh, processes=3)


def test_a_prompt_with_ids_past_the_models_vocabulary_is_refused_naming_the_task(setup):
    """A tokenizer larger than the model's vocabulary would give NaN embeddings on the device."""
    chat, config, params = setup
    small = config.replace(vocab_size=8)
    with pytest.raises(ValueError, match=r"task 0's prompt holds token id \d+ .*vocab_size=8"):
        engine_lib.run_paged_episodes(small, params, chat, _tasks(0, 1), ScriptedTools, ROLLOUT,
                                      jax.random.PRNGKey(0), paged=PAGED)


@pytest.mark.parametrize("field, value", [("page_size", 0), ("prefill_chunk", -1), ("num_pages", 0),
                                          ("slots", 1.5), ("tool_workers", True), ("prefill_tokens", 0)])
def test_paged_config_refuses_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"PagedConfig.{field} must be an int"):
        engine_lib.PagedConfig(**{field: value})


def test_the_pool_line_says_the_pages_and_tokens_the_engine_holds_and_where_they_come_from(setup):
    _, config, _ = setup
    paged = dataclasses.replace(ROLLOUT, paged=dataclasses.replace(PAGED, slots=2))
    # no budget: every row's max_context, 4 rows x 192 / 8 = 96 pages
    assert engine_lib.paged_pool_line(config, paged, 4) == (
        "rollout (paged engine): a pool of 96 pages x 8 tokens (768 tokens, from every row's max_context (no KV "
        "budget)) for at most 2 of 4 rows in flight")
    set_pages = dataclasses.replace(paged, paged=dataclasses.replace(paged.paged, num_pages=30))
    assert "a pool of 30 pages x 8 tokens (240 tokens, from PagedConfig.num_pages)" in engine_lib.paged_pool_line(
        config, set_pages, 4)
    budget = dataclasses.replace(paged, kv_budget_gib=0.001)
    pages = paged_lib.pages_within_budget(config, 8, 0.001)
    assert (f"a pool of {pages} pages x 8 tokens ({pages * 8} tokens, from the KV budget of 0.001 GiB per chip)"
            in engine_lib.paged_pool_line(config, budget, 4))


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_a_prompts_samples_share_its_full_pages_and_hold_only_their_own_tokens_besides(setup, kind):
    """G = 4 samples of one long prompt (5 full pages of 8 tokens) admitted together: they hold the prompt's full
    pages once (refcounted) and each its own last partial page and generated tokens, with the dense engine's
    episodes. Greedy rows stay identical and end together, so the most pages held is exactly that; sampled rows
    part and end apart, so it is at most that."""
    chat, config, params = setup
    rollout = dataclasses.replace(ROLLOUT if kind == "greedy" else SAMPLED, group_size=4, max_turns=0,
                                  sync_every=1)
    tasks = [types.SimpleNamespace(task_id="long", answer="alpha", question=" ".join(["river"] * 36))]
    dense = run_episodes(config, params, chat, tasks, ScriptedTools, rollout, jax.random.PRNGKey(7))
    result = engine_lib.run_paged_episodes(config, params, chat, tasks, ScriptedTools, rollout,
                                           jax.random.PRNGKey(7), paged=PAGED)
    _assert_same_episodes(result, dense)
    size = PAGED.page_size
    full = int(np.asarray(result.batch.boundaries)[0, 0]) // size
    own = [paged_lib.pages_for(n, size) - full for n in np.asarray(result.batch.lengths)]
    assert full >= 5 and all(n >= 1 for n in own)
    shared = full + sum(own)  # the prompt's full pages once, then each row's own
    assert shared < sum(full + n for n in own)  # what copies of the prompt would hold
    if kind == "greedy":
        assert result.stats.max_pages_held == shared
    else:
        assert result.stats.max_pages_held <= shared


@pytest.mark.parametrize("shards", [1, 2, 8])
def test_a_decode_batch_pads_at_most_a_fifth_above_eight_rows_to_a_listed_multiple_of_the_shards(shards):
    """`engine.decode_rows`: powers of two up to 8 rows, then a quarter octave apart; above the shards a multiple
    of them; never above the slots (rounded up to the shards); every size in `decode_buckets`."""
    for slots in (1, 7, 9, 18, 32, 48, 100):
        cap = -(-slots // shards) * shards
        buckets = engine_lib.decode_buckets(slots, shards)
        for n in range(1, slots + 1):
            size = engine_lib.decode_rows(n, slots, shards)
            assert n <= size <= cap and size in buckets
            if size >= shards:
                assert size % shards == 0
            if n > 8 and shards == 1 and size < cap:
                assert (size - n) / size < 0.2
    assert engine_lib.decode_buckets(32) == (1, 2, 4, 8, 10, 12, 14, 16, 20, 24, 28, 32)
    with pytest.raises(ValueError, match="decode_rows: 0 decoding rows for 4 slots"):
        engine_lib.decode_rows(0, 4)


def _answers(chat, lengths):
    """Per row: one answering turn of `lengths[row]` tokens (words, then the answer)."""
    rows = []
    for length in lengths:
        ids = chat.assistant_content_ids(" ".join(["north"] * (length - 5)) + " <answer>alpha</answer>")
        rows.append([ids + [chat.im_end_id]])
    assert [len(row[0]) for row in rows] == list(lengths)
    return rows


def test_nine_decoding_rows_of_twelve_run_in_a_batch_of_ten_not_sixteen_and_the_episodes_are_unchanged(setup):
    """12 rows decode together (blocks of 4 steps), 3 of them answer in 8 tokens and 9 in 40: after 2 blocks the
    batch of 9 is padded to 10 rows, so 92% of the row-steps are useful (powers of two padded 12 and 9 rows to 16:
    384 of 640, 60%). The hook gives the engine whole blocks (`ScriptedPolicy(blocks=True)`); the episodes are
    the naive reference's."""
    chat, config, _ = setup
    rollout = dataclasses.replace(ROLLOUT, group_size=1, sync_every=4, max_turns=0, turn_token_budget=48)
    tasks = _tasks(5, 12)
    lengths = [8, 40, 40, 40] * 3
    hook = ScriptedPolicy(_answers(chat, lengths), config.vocab_size, blocks=True)
    result = _engine(setup, tasks, rollout, hook=hook)
    _assert_same_episodes(result, _reference(setup, tasks, rollout, hook=hook))
    stats = result.stats
    assert {e.status for e in result.episodes} == {"answered"}
    assert stats.decode_dispatches == 10
    assert stats.row_steps == 2 * 12 * 4 + 8 * 10 * 4
    assert stats.useful_row_steps == result.generated_tokens == sum(lengths) == 384
    assert stats.useful_row_steps / stats.row_steps > 0.9


def test_a_block_hook_gives_the_episodes_of_a_step_hook_with_rows_stopping_mid_block(setup):
    """Scripted tool episodes of random turn lengths: the hook's blocks (`sync_every` steps a dispatch) and its
    steps (one step a dispatch) give the same episodes; in blocks rows stop mid-block, so some row-steps are
    wasted, and far fewer dispatches run."""
    chat, config, _ = setup
    tasks = _tasks(0, 3)
    scripts = _scripts(chat, tasks, 0)
    blocks = _engine(setup, tasks, ROLLOUT, hook=ScriptedPolicy(scripts, config.vocab_size, blocks=True))
    steps = _engine(setup, tasks, ROLLOUT, hook=ScriptedPolicy(scripts, config.vocab_size))
    _assert_same_episodes(blocks, steps)
    assert blocks.stats.useful_row_steps == steps.stats.useful_row_steps
    assert blocks.stats.row_steps > blocks.stats.useful_row_steps
    assert blocks.stats.decode_dispatches * 2 < steps.stats.decode_dispatches
