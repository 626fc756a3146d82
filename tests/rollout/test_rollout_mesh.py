"""The rollout engine on a mesh of 8 fake CPU devices: its programs run under the mesh (the model's sharding
constraints and the MoE's expert-parallel dispatch apply), with the episodes of one device."""

import dataclasses
import random
import types

import jax
import numpy as np
import pytest

from trace_jax import models
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer
from trace_jax.rollout import RolloutConfig, SamplingConfig, run_episodes
from trace_jax.rollout import paged as paged_lib
from trace_jax.rollout import sampler as S

MOE, EXPERT_MESH = "tiny-qwen3-moe", {"data": 2, "tensor": 2, "expert": 2}  # the expert axis divides its 4 experts
WORDS = ["alpha", "beta", "river", "city", "search", "query", "answer", "The", "is"]
ROLLOUT = RolloutConfig(group_size=2, max_turns=1, max_context=96, turn_token_budget=8, system_prompt="Use tools.",
                        with_tools=False, sync_every=4, sampling=SamplingConfig(temperature=1.0),
                        paged=paged_lib.PagedConfig(page_size=8))


def _decode_args(config, params, state, rows, width):
    return (S.RowSampling.broadcast(SamplingConfig(greedy=True), rows), params, state,
            np.arange(rows, dtype=np.int32), np.zeros((rows, width), np.int32), np.full(rows, 3, np.int32),
            np.ones(rows, bool), np.full(rows, 3, np.int32), np.asarray([-1], np.int32), np.zeros((rows, 2), np.uint32),
            np.zeros(rows, np.int32), np.zeros(rows, np.int32),
            tuple(np.zeros(16, np.int32) for _ in range(3)), None)


def test_moe_decode_on_an_expert_mesh_dispatches_tokens_by_all_to_all():
    """The engine's decode program traces under its mesh, so `expert_parallel.resolve_dispatch` sees the expert axis;
    the same jitted function lowered without the mesh takes the global sort instead."""
    config = models.get_preset(MOE)
    mesh = models.make_mesh(EXPERT_MESH)
    params = models.shard_params(models.init_params(config, jax.random.PRNGKey(0)), config, mesh,
                                 models.ROLLOUT_RULES)
    state = paged_lib.abstract_state(config, 16, 8, 8, mesh=mesh, rules=models.ROLLOUT_RULES)
    program = paged_lib.decode_program(config, 2, 64, paged_lib.state_layout(state))
    assert program.mesh is mesh
    args = _decode_args(config, params, state, 8, paged_lib.pages_for(64, 8))
    assert "all_to_all" in program.lower(*args).as_text()
    assert "all_to_all" not in program.jitted.lower(*args).as_text()


@pytest.mark.slow
def test_an_moe_policy_on_an_expert_mesh_samples_one_devices_episodes(tmp_path):
    chat = ChatFormat(load_tokenizer(build_word_tokenizer(WORDS, tmp_path)))
    config = models.get_preset(MOE, vocab_size=len(chat.tokenizer), tie_word_embeddings=False)
    params = models.init_params(config, jax.random.PRNGKey(0))
    draw = random.Random(0)
    tasks = [types.SimpleNamespace(task_id=f"t{i}", answer="alpha",
                                   question=" ".join(draw.choice(WORDS) for _ in range(6))) for i in range(2)]

    def tools(task):
        return types.SimpleNamespace(execute=lambda name, arguments: "river city")

    mesh = models.make_mesh(EXPERT_MESH)
    sharded = run_episodes(config, models.shard_params(params, config, mesh, models.ROLLOUT_RULES), chat, tasks,
                           tools, ROLLOUT, jax.random.PRNGKey(3), mesh=mesh, rules=models.ROLLOUT_RULES)
    single = run_episodes(config, params, chat, tasks, tools, ROLLOUT, jax.random.PRNGKey(3))
    for name in ("tokens", "loss_mask", "boundaries", "status"):
        np.testing.assert_array_equal(getattr(sharded.batch, name), getattr(single.batch, name), err_msg=name)
    np.testing.assert_allclose(sharded.batch.sampler_logprobs, single.batch.sampler_logprobs, atol=1e-4)


@pytest.fixture(scope="module")
def kernel_policy(tmp_path_factory):
    """A word-vocabulary tiny-qwen3 on the kernel path: head_dim 128 (the kernel's lanes), `attention_impl =
    "pallas_tpu"` (run in Pallas' TPU interpret mode on CPU). float32: in bfloat16 a random model's greedy logits
    have near-ties (top two 1e-4 apart) that the sharded matmuls' summation order flips."""
    chat = ChatFormat(load_tokenizer(build_word_tokenizer(WORDS, tmp_path_factory.mktemp("tok"))))
    config = models.get_preset("tiny-qwen3", vocab_size=len(chat.tokenizer), num_hidden_layers=1, head_dim=128,
                               tie_word_embeddings=False, attention_impl="pallas_tpu")
    draw = random.Random(1)
    tasks = [types.SimpleNamespace(task_id=f"t{i}", answer="alpha",
                                   question=" ".join(draw.choice(WORDS) for _ in range(draw.randint(2, 6))))
             for i in range(3)]
    return chat, config, models.init_params(config, jax.random.PRNGKey(2)), tasks


@pytest.mark.slow
def test_on_an_fsdp_mesh_the_kernel_path_runs_each_row_on_its_pages_shard_with_one_devices_episodes(
        kernel_policy, monkeypatch):
    """6 rows (4 in flight) on a mesh of fsdp=2 (the pool's pages over 2 batch shards) with a pool of one row of
    max_context a shard: rows are admitted to both shards, paused and recomputed, every row's pages on one shard,
    and the kernel path's sampled episodes are one device's (unbounded pool): the same tokens, log-probs within
    1e-3. (Sampled only: equal sampled tokens need equal logits as greedy ones do; the kernel decode program's
    greedy tokens are checked against the XLA path in test_paged_kernel.)"""
    from jax.experimental.pallas import tpu as pltpu

    chat, config, params, tasks = kernel_policy
    rollout = RolloutConfig(group_size=2, max_turns=1, max_context=64, turn_token_budget=16,
                            system_prompt="Use tools.", with_tools=False, sync_every=4,
                            sampling=SamplingConfig(temperature=1.0),
                            paged=paged_lib.PagedConfig(page_size=8, slots=4))
    mesh = models.make_mesh({"fsdp": 2}, jax.devices()[:2])
    kernel_calls = []
    kernel = paged_lib.paged_attention_kernel
    monkeypatch.setattr(paged_lib, "paged_attention_kernel", lambda *a, **k: kernel_calls.append(1) or kernel(*a, **k))
    placed = []  # the shards of a row's pages after each growth
    grow = paged_lib.grow_pages

    def recording(allocator, row, pages, rows, newest, preempt, *, shard=0):
        grown = grow(allocator, row, pages, rows, newest, preempt, shard=shard)
        placed.append({allocator.shard_of(p) for p in row.pages} | {shard} if grown else {shard})
        return grown

    monkeypatch.setattr(paged_lib, "grow_pages", recording)
    pages = 2 * paged_lib.pages_for(rollout.max_context, 8)
    with pltpu.force_tpu_interpret_mode():
        single = run_episodes(config, params, chat, tasks, lambda task: None, rollout, jax.random.PRNGKey(3))
        calls = len(kernel_calls)
        sharded = run_episodes(config, models.shard_params(params, config, mesh), chat, tasks, lambda task: None,
                               dataclasses.replace(rollout, paged=dataclasses.replace(rollout.paged, num_pages=pages)),
                               jax.random.PRNGKey(3), mesh=mesh)
    assert calls > 0 and len(kernel_calls) > calls  # both decode programs traced the kernel
    assert sharded.stats.preemptions > 0 and sharded.stats.max_pages_held <= pages
    assert all(len(shards) == 1 for shards in placed) and {s for shards in placed for s in shards} == {0, 1}
    for name in ("tokens", "loss_mask", "boundaries", "status", "lengths"):
        np.testing.assert_array_equal(getattr(sharded.batch, name), getattr(single.batch, name), err_msg=name)
    # the kernel reads keys in bfloat16: keys the sharded matmuls leave 1e-7 apart can round to neighbouring values
    np.testing.assert_allclose(sharded.batch.sampler_logprobs, single.batch.sampler_logprobs, atol=1e-3)
