"""`configs/smollm2.gin`: one RL step of SmolLM2-135M-Instruct as policy and as its own frozen TRACE reference."""

from __future__ import annotations

import json

import pytest

from trace_jax.train import cli as train_cli


@pytest.mark.slow
def test_smollm2_config_runs_one_trace_step_as_its_own_reference(smollm2_hf_dir, tmp_path):
    run_dir = tmp_path / "run"
    # smollm2.gin as shipped, pointed at the fixture's converted checkpoint and cut to CPU-test size
    params = [f"TrainConfig.checkpoint = '{smollm2_hf_dir}'", "EvalConfig.num_tasks = 1", "TrainConfig.receipts = 0",
              "RolloutConfig.max_turns = 1", "RolloutConfig.max_context = 1024",
              "RolloutConfig.turn_token_budget = 32"]
    assert train_cli.run_train(["configs/smollm2.gin"], params, str(run_dir), progress=False) == 0
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(line for line in steps if "reward" in line)
    assert step["step"] == 1
    # the reference is the initial policy, which is also the sampler: its answer scores are real log-probs
    assert -30.0 < step["credit/first_state_score"] < 0.0
    # sampler and trainer see the same SmolLM2 weights before the update
    assert step["sampler_trainer_gap"] < 1e-3
    # a non-zero advantage anywhere moves the weights
    assert (step["grad_norm"] > 0.0) == (step["credit/mean_abs_token_advantage"] > 0.0)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["estimator"] == "trace"
