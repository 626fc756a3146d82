"""The run's `turn_scores.jsonl` (trace_jax/rl/loop.py): per-state reference scores and values of every scored
episode, one line per episode and step."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from tests.rl.test_rl_pipeline import PROMPTS, SMALL
from trace_jax.credit import trace_values
from trace_jax.rl import cli as train_cli
from trace_jax.rl.loop import TURN_SCORES_FILE


@pytest.mark.slow
def test_a_two_step_grpo_run_with_kl_metric_writes_scores_and_values_of_every_episode(tmp_path):
    gin = tmp_path / "small.gin"
    # GRPO reads no scores: kl_metric alone makes the reference score its rollouts (configs/study.gin's reason)
    gin.write_text(SMALL + "TrainConfig.steps = 2\nCreditConfig.estimator = 'grpo'\nUpdateConfig.kl_metric = True\n")
    run_dir = tmp_path / "run"
    assert train_cli.run_train([str(gin)], [], str(run_dir), progress=False) == 0
    records = [json.loads(line) for line in (run_dir / TURN_SCORES_FILE).read_text().splitlines()]
    rows = PROMPTS * 2  # RolloutConfig.group_size = 2 in SMALL
    assert [r["step"] for r in records] == [1] * rows + [2] * rows
    for r in records:
        assert len(r["scores"]) == len(r["values"]) == r["num_turns"] + 1
        assert 0 <= r["group"] < PROMPTS and r["reward"] in (0.0, 1.0) and isinstance(r["correct"], bool)
        values = trace_values(jnp.asarray([r["scores"]], jnp.float32), jnp.asarray([r["num_turns"]]))
        np.testing.assert_allclose(r["values"], np.asarray(values)[0], atol=2e-4)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("kl_ref" in m for m in metrics if "reward" in m)
