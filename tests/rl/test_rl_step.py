"""The loop's shape (trace_jax/rl/loop.py): `make_rl_step(run_config, environment)` is `step(state, batch) -> (state,
metrics)`, and what a run does besides the step are hooks that run after the steps where they are due."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from tests.rl.test_rl_pipeline import SMALL
from trace_jax.rl.gin_setup import parse
from trace_jax.rl.loop import Hook, RLBatch, RLState, build_environment, make_rl_step, rollout_key, run_hooks
from trace_jax.train.state import init_train_state


def test_hooks_run_in_order_after_the_steps_where_they_are_due():
    calls = []
    hooks = [Hook("evaluation", lambda step, state, metrics: metrics.update(eval=step), every=2),
             Hook("record", lambda step, state, metrics: calls.append((step, dict(metrics)))),
             Hook("never", lambda step, state, metrics: calls.append("never"), every=0)]
    for step in (1, 2, 3, 4):
        run_hooks(hooks, step, RLState(None, None), {"reward": float(step)})
    assert calls == [(1, {"reward": 1.0}), (2, {"reward": 2.0, "eval": 2}), (3, {"reward": 3.0}),
                     (4, {"reward": 4.0, "eval": 4})]


def test_a_hook_that_returns_a_state_replaces_the_runs_state_for_the_hooks_after_it():
    seen = []
    swap = Hook("reference swap", lambda step, state, metrics: RLState(state.train, "new reference"))
    after = Hook("checkpoint", lambda step, state, metrics: seen.append(state.reference))
    state = run_hooks([swap, after], 1, RLState("train", "old reference"), {})
    assert state == RLState("train", "new reference") and seen == ["new reference"]



def test_end_of_run_hooks_run_once_after_the_last_step_in_order_and_only_then():
    calls = []
    hooks = [Hook("final evaluation", lambda step, state, metrics: metrics.update(final=step), 0, at_end=True),
             Hook("record", lambda step, state, metrics: calls.append(("record", step, dict(metrics))), at_end=True),
             Hook("checkpoint", lambda step, state, metrics: calls.append(("checkpoint", step))),
             Hook("receipts", lambda step, state, metrics: calls.append(("receipts", step)), 0, at_end=True)]
    run_hooks(hooks, 1, RLState(None, None), {"reward": 1.0})
    run_hooks(hooks, 1, RLState(None, None), {}, end=True)
    assert calls == [("record", 1, {"reward": 1.0}), ("checkpoint", 1),
                     ("record", 1, {"final": 1}), ("receipts", 1)]


def test_a_hook_that_returns_anything_but_a_state_or_none_is_an_error_naming_it():
    with pytest.raises(TypeError, match="hook 'record' returned a dict; a hook returns a new RLState or None"):
        run_hooks([Hook("record", lambda step, state, metrics: {"logged": True})], 1, RLState(None, None), {})

def test_rollout_keys_depend_on_the_step_and_are_those_runs_checkpointed_before_the_step_loop_existed():
    assert not np.array_equal(rollout_key(0, 1), rollout_key(0, 2))
    # the keys of earlier runs (fold_in(PRNGKey(seed), 7919 + steps done)), so their checkpoints resume as before
    np.testing.assert_array_equal(rollout_key(3, 5), jax.random.fold_in(jax.random.PRNGKey(3), 7919 + 4))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_step")
    gin_file = root / "small.gin"
    gin_file.write_text(SMALL)
    config = parse([str(gin_file)])
    return config, build_environment(config, root)


def test_the_rl_step_takes_a_state_and_a_batch_and_returns_the_next_state_and_the_metrics(small):
    config, environment = small
    rl = make_rl_step(config, environment)
    params = rl.placement.policy(environment.params)
    reference = rl.placement.frozen(params)
    train = init_train_state(environment.model_config, rl.optimizer, params, jax.random.PRNGKey(0),
                             mesh=rl.placement.mesh, rules=rl.placement.rules)
    before = np.asarray(jax.tree_util.tree_leaves(train.params)[0]).copy()
    tasks = tuple(environment.train_tasks[:config.train.prompts_per_step])
    state, metrics = rl(RLState(train, reference), RLBatch(1, tasks, rollout_key(config.train.seed, 1)))
    assert int(state.train.step) == 1 and state.reference is reference
    assert {"reward", "loss", "time/rollout", "time/update", "rollout_tokens_per_s"} <= set(metrics)
    assert not np.array_equal(np.asarray(jax.tree_util.tree_leaves(state.train.params)[0]), before)


def test_a_kv_budget_that_holds_no_row_fails_when_the_step_is_made(small):
    config, environment = small
    tight = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, kv_budget_gib=1e-9))
    with pytest.raises(ValueError, match="kv_budget_gib"):
        make_rl_step(tight, environment)
