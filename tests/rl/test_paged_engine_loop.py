"""The RL loop's users of the rollout on the paged engine (`RolloutConfig.engine = 'paged'`): two RL steps give the
dense engine's rewards and losses; held-out evaluation gives its outcomes."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from tests.rl.test_loop_evaluate import ROLLOUT, TASKS, greedy_scripts, setup  # noqa: F401  (setup: a fixture)
from tests.rl.test_rl_pipeline import SMALL
from trace_jax.rl.evaluate import EvalConfig, evaluate
from trace_jax.rl.gin_setup import parse
from trace_jax.rl.loop import RLBatch, RLState, build_environment, make_rl_step, rollout_key
from trace_jax.rollout import ScriptedPolicy
from trace_jax.rollout import paged as paged_lib
from trace_jax.train.state import init_train_state


def _two_steps(root, engine):
    gin_file = root / f"{engine}.gin"
    gin_file.write_text(SMALL + f"RolloutConfig.engine = '{engine}'\nPagedConfig.page_size = 8\n"
                        "RolloutConfig.paged = @PagedConfig()\n")
    config = parse([str(gin_file)])
    assert config.rollout.engine == engine and config.rollout.paged.page_size == 8
    environment = build_environment(config, root / engine)
    rl = make_rl_step(config, environment)
    params = rl.placement.policy(environment.params)
    state = RLState(init_train_state(environment.model_config, rl.optimizer, params, jax.random.PRNGKey(0),
                                     mesh=rl.placement.mesh, rules=rl.placement.rules), rl.placement.frozen(params))
    metrics = []
    for step in (1, 2):
        tasks = tuple(environment.train_tasks[(step - 1) * 2:step * 2])
        state, step_metrics = rl(state, RLBatch(step, tasks, rollout_key(config.train.seed, step)))
        metrics.append(step_metrics)
    return metrics


@pytest.mark.slow
def test_two_rl_steps_on_the_paged_engine_give_the_dense_engines_rewards_and_losses(tmp_path):
    dense = _two_steps(tmp_path, "dense")
    before = paged_lib.compiled_programs("paged_decode")
    paged = _two_steps(tmp_path, "paged")
    assert paged_lib.compiled_programs("paged_decode") > before  # the step ran the paged engine
    for mine, theirs in zip(paged, dense):
        assert mine["reward"] == theirs["reward"]
        np.testing.assert_allclose(mine["loss"], theirs["loss"], rtol=1e-4, atol=1e-5)
        assert mine["rollout_tokens_per_s"] > 0
        assert 0 < mine["rollout_useful_row_steps"] <= 1 and "rollout_useful_row_steps" not in theirs


def test_evaluation_on_the_paged_engine_gives_the_dense_engines_outcomes(setup):  # noqa: F811
    chat, config, params, browser = setup
    hook = ScriptedPolicy(greedy_scripts(chat), config.vocab_size)
    dense = evaluate(config, params, chat, TASKS, browser, ROLLOUT, EvalConfig(num_tasks=4), logits_hook=hook)
    before = paged_lib.compiled_programs("paged_prefill")
    paged = evaluate(config, params, chat, TASKS, browser, dataclasses.replace(ROLLOUT, engine="paged"),
                     EvalConfig(num_tasks=4), logits_hook=hook)
    assert paged_lib.compiled_programs("paged_prefill") > before  # evaluation ran the paged engine
    assert paged.outcomes == dense.outcomes and paged.correct == (True, False, True, False)
