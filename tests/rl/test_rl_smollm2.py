"""`configs/smollm2.gin`: one RL step of SmolLM2-135M-Instruct as policy and as its own frozen TRACE reference.

The step runs through `RLPipeline` (rollout, reference scoring, credit, update) on the config as `trace-jax train`
parses and checks it. The loop around the step (evaluations, checkpoints, the summary) is model-independent and is
run end to end on the tiny config (tests/rl/test_rl_cli.py, test_rl_resume.py); here it would only add two greedy
evaluations and three 1.6 GB checkpoint writes of the 135M-parameter state to the real-model check.
"""

from __future__ import annotations

import jax
import pytest

from trace_jax.rl.gin_setup import parse
from trace_jax.rl.loop import build_environment
from trace_jax.rl.pipeline import RLPipeline, check_compatible
from trace_jax.train.optimizer import make_optimizer
from trace_jax.train.state import init_train_state

# smollm2.gin as shipped, cut to CPU-test size: one group of 2 samples, one row per micro-batch as shipped, a tool
# turn of up to 8 tokens and the answer turn, and no tool schemas in the system turn. The schemas were ~570 of the
# prompt's 636 tokens, and SmolLM2-135M called no tool with them either: both rows wrote prose, got the "no
# <tool_call> found" error observation, wrote prose again and ended as max_turns, as they do without them (and as
# they do with turns of 16 tokens). The rows are ~145 tokens instead of ~760, and the step's cost grows with the
# positions; rendering tool schemas into the system turn is checked in tests/models/test_chat_format.py. Decoding
# reads every weight a step (~0.1 s on a CPU), so each token of a turn's budget costs two such steps. The update's
# width is max_context whatever the rows' length (UpdateConfig.max_length unset): 192 holds the rows with room and
# is a quarter fewer positions than 256.
CPU_SIZE = ["TrainConfig.prompts_per_step = 1", "LossConfig.micro_batches = 2", "TrainConfig.receipts = 0",
            "RolloutConfig.max_turns = 1", "RolloutConfig.max_context = 192", "RolloutConfig.turn_token_budget = 8",
            "RolloutConfig.with_tools = False"]

pytestmark = pytest.mark.usefixtures("optimized_xla")  # runs the real model: optimised


@pytest.mark.slow
def test_smollm2_config_runs_one_trace_step_as_its_own_reference(smollm2_hf_dir, tmp_path):
    config = parse(["configs/smollm2.gin"], [f"TrainConfig.checkpoint = '{smollm2_hf_dir}'", *CPU_SIZE])
    # what the run's summary.json would report
    assert config.train.steps == 1 and config.credit.estimator == "trace"
    prompts, update = config.train.prompts_per_step, config.update
    check_compatible(config.credit, config.loss, update, prompts * config.rollout.group_size)  # as the CLI does
    environment = build_environment(config, tmp_path)
    optimizer = make_optimizer(config.optimizer)
    pipeline = RLPipeline(environment.model_config, environment.chat, environment.browser, config.rollout,
                          config.credit, config.loss, update, optimizer)
    reference = environment.params  # the initial policy: the sampler, the trainer and the frozen reference
    state = init_train_state(environment.model_config, optimizer, reference, jax.random.PRNGKey(config.train.seed))
    rollout = pipeline.collect(state.params, environment.train_tasks[:prompts], jax.random.PRNGKey(0))
    prepared = pipeline.prepare(rollout, reference, num_prompts=prompts)
    state, metrics = pipeline.update(state, prepared, reference, seed=0)
    step = {**prepared.metrics, **metrics}
    # the reference is the initial policy, which is also the sampler: its answer scores are real log-probs
    assert -30.0 < step["credit/first_state_score"] < 0.0
    # sampler and trainer see the same SmolLM2 weights before the update
    assert step["sampler_trainer_gap"] < 1e-3
    # a non-zero advantage anywhere moves the weights
    assert (step["grad_norm"] > 0.0) == (step["credit/mean_abs_token_advantage"] > 0.0)
