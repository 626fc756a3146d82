"""Context management in a run: the gin binding, and one RL step whose episodes compact (the update and the credit
receipts read them per episode)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.rl.test_rl_pipeline import SMALL
from trace_jax.rl.gin_setup import parse
from trace_jax.rl.loop import RLBatch, RLState, build_environment, make_rl_step, rollout_key, write_credit_receipts
from trace_jax.rollout.batch import episode_view
from trace_jax.train.state import init_train_state

COMPACTING = SMALL + """
RolloutConfig.max_turns = 6
RolloutConfig.context_budget = 400
RolloutConfig.context_record_tokens = 64
"""


def _parse(tmp_path, text):
    gin_file = tmp_path / "run.gin"
    gin_file.write_text(text)
    return parse([str(gin_file)])


def test_gin_binds_the_context_budget_and_checks_it(tmp_path):
    assert _parse(tmp_path, SMALL).rollout.context_budget == 0
    assert _parse(tmp_path, COMPACTING).rollout.context_budget == 400
    with pytest.raises(ValueError, match=r"RolloutConfig.context_budget = 600 must be 0 \(off\)"):
        _parse(tmp_path, COMPACTING + "RolloutConfig.context_budget = 600\n")


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    root = tmp_path_factory.mktemp("context_training")
    config = _parse(root, COMPACTING)
    environment = build_environment(config, root)
    rl = make_rl_step(config, environment)
    collected = []
    collect = rl.pipeline.collect

    def recording_collect(*args, **kwargs):
        collected.append(collect(*args, **kwargs))
        return collected[-1]

    rl.pipeline.collect = recording_collect
    params = rl.placement.policy(environment.params)
    reference = rl.placement.frozen(params)
    train = init_train_state(environment.model_config, rl.optimizer, params, jax.random.PRNGKey(0),
                             mesh=rl.placement.mesh, rules=rl.placement.rules)
    before = np.asarray(jax.tree_util.tree_leaves(train.params)[0]).copy()
    tasks = tuple(environment.train_tasks[:config.train.prompts_per_step])
    state, metrics = rl(RLState(train, reference), RLBatch(1, tasks, rollout_key(config.train.seed, 1)))
    return config, environment, rl, state, metrics, collected[0], before, root


def test_an_rl_step_trains_on_compacted_episodes(step):
    config, _, _, state, metrics, rollout, before, _ = step
    batch = rollout.batch
    assert batch.segmented and batch.shape[0] > len(rollout.episodes)
    assert episode_view(batch).num_episodes == config.train.prompts_per_step * config.rollout.group_size
    assert (np.asarray(batch.lengths) <= config.rollout.max_context).all()
    assert metrics["updates"] == 1.0 and np.isfinite(metrics["loss"])
    assert metrics["tool_calls"] == np.mean([len(e.tool_calls) for e in rollout.episodes])
    assert not np.array_equal(np.asarray(jax.tree_util.tree_leaves(state.train.params)[0]), before)


def test_credit_receipts_are_one_per_episode(step):
    config, environment, rl, state, _, _, _, root = step
    # as many tasks as a step has prompts: the receipts' rollout and scoring reuse the step's compiled programs
    tasks = environment.train_tasks[:config.train.prompts_per_step]
    paths = write_credit_receipts(rl.pipeline, rl.placement.rollout_params(state.train.params), state.reference,
                                  tasks, jax.random.PRNGKey(3), root / "receipts")
    assert len(paths) == len(tasks) * config.rollout.group_size and all(p.exists() for p in paths)

