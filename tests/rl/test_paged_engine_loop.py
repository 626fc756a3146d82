"""The RL loop on the rollout engine: two RL steps are a function of the config and the key alone (tools finishing
in any order on the engine's worker pool change no reward or loss), and log the engine's statistics."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.rl.test_rl_pipeline import SMALL
from trace_jax.rl.gin_setup import parse
from trace_jax.rl.loop import RLBatch, RLState, build_environment, make_rl_step, rollout_key
from trace_jax.rollout import paged as paged_lib
from trace_jax.train.state import init_train_state


def _two_steps(root, name):
    gin_file = root / f"{name}.gin"
    gin_file.write_text(SMALL + "PagedConfig.page_size = 8\nRolloutConfig.paged = @PagedConfig()\n")
    config = parse([str(gin_file)])
    assert config.rollout.paged.page_size == 8
    environment = build_environment(config, root / name)
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
def test_two_rl_steps_give_the_same_rewards_and_losses_when_run_again(tmp_path, monkeypatch):
    built = []  # the step ran the engine: it asked for its decode program (counting compiles would miss a program
    build = paged_lib.decode_program  # an earlier test in this process compiled already)
    monkeypatch.setattr(paged_lib, "decode_program", lambda *args, **kwargs: built.append(1) or build(*args, **kwargs))
    first = _two_steps(tmp_path, "first")
    assert built
    again = _two_steps(tmp_path, "again")
    for mine, theirs in zip(again, first):
        assert mine["reward"] == theirs["reward"]
        np.testing.assert_allclose(mine["loss"], theirs["loss"], rtol=1e-5, atol=1e-6)
        assert mine["rollout_tokens_per_s"] > 0
        assert 0 < mine["rollout_useful_row_steps"] <= 1 and mine["rollout_preemptions"] >= 0
