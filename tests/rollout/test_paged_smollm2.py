"""Real model: SmolLM2-135M-Instruct's episodes on the paged engine are the dense engine's, greedy and sampled (its
`</tool_call>` is a stop string of several tokens, so turns end by the host's stop-string check and roll back)."""

import dataclasses

import jax
import numpy as np
import pytest

from trace_jax import models
from trace_jax.envs.oracle import make_browser
from trace_jax.envs.tasks import generate_tasks
from trace_jax.envs.world import WorldConfig, build_world
from trace_jax.models.chat import ChatFormat
from trace_jax.models.tokenizer import load_tokenizer
from trace_jax.rollout import RolloutConfig, SamplingConfig, run_episodes
from trace_jax.rollout.paged import PagedConfig

pytestmark = pytest.mark.slow

FIELDS = ("tokens", "loss_mask", "turn_index", "boundaries", "num_turns", "status", "reward", "lengths")


@pytest.mark.parametrize("sampling", [SamplingConfig(greedy=True), SamplingConfig(temperature=0.7, top_p=0.95)],
                         ids=["greedy", "sampled"])
def test_smollm2_episodes_on_the_paged_engine_are_the_dense_engines(smollm2_hf_dir, sampling):
    config, params = models.load_pretrained(smollm2_hf_dir)
    chat = ChatFormat(load_tokenizer(smollm2_hf_dir))
    world = build_world(WorldConfig.from_corpus_size(40, seed=3))
    tasks = generate_tasks(world, 2, seed=0)
    rollout = RolloutConfig(group_size=2, max_turns=1, max_context=384, turn_token_budget=32, sampling=sampling,
                            with_tools=False, max_observation_chars=120, sync_every=8)
    dense = run_episodes(config, params, chat, tasks, make_browser(world), rollout, jax.random.PRNGKey(0))
    paged = run_episodes(config, params, chat, tasks, make_browser(world),
                         dataclasses.replace(rollout, engine="paged", paged=PagedConfig(page_size=16)),
                         jax.random.PRNGKey(0))
    assert paged.stats.decode_dispatches > 0
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(paged.batch, name), getattr(dense.batch, name), err_msg=name)
    np.testing.assert_allclose(paged.batch.sampler_logprobs, dense.batch.sampler_logprobs, atol=1e-4)
    assert [e.turn_texts for e in paged.episodes] == [e.turn_texts for e in dense.episodes]
