"""The rollout engine on a mesh of 8 fake CPU devices: its programs run under the mesh (the model's sharding
constraints and the MoE's expert-parallel dispatch apply), with the episodes of one device."""

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
