"""Two RL steps of a tiny run on a mesh whose one axis spans every device (fsdp=8, or expert=8 with an 8-expert tiny
MoE), run by every process of a (possibly multi-process) run, recording what the rollout and the reference scoring
hold on each device and what the steps produce.

`python tests/rl/multihost_spmd.py OUT_DIR SETTING` is what each process of tests/rl/test_spmd_processes.py runs (the
`TRACE_JAX_*` variables make it join the run); `run_steps(out_dir, setting)` is the same in the calling process.
Bytes come from the live device buffers the programs read (each addressable shard's `nbytes`, by device), taken
when the rollout engine's first decode and the first reference scoring are called;
the steps run under the program recorder of tests/rl/test_programs.py against the run's registry (what `trace-jax
plan` lowers). Process 0 writes OUT_DIR/result.json: the largest bytes on any of its devices, every process's rows
(gathered) of each step, and what the recorder saw dispatched outside the registry; with fsdp=8 also an
evaluation of 3 held-out tasks split unevenly over the processes and the engine alone on
tasks split unevenly (`engine_episodes`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

GIN = """
include 'configs/tiny.gin'
model_preset.hidden_size = 32
model_preset.intermediate_size = 64
model_preset.num_hidden_layers = 1
model_preset.num_attention_heads = 2
model_preset.num_key_value_heads = 2
model_preset.head_dim = 16
DataConfig.num_train_tasks = 8
DataConfig.num_eval_tasks = 3
RolloutConfig.group_size = 2
RolloutConfig.system_prompt = 'Search, open a page, then answer.'
RolloutConfig.max_turns = 1
RolloutConfig.max_context = 128
RolloutConfig.turn_token_budget = 8
# 29-30-token prompts prefilled in two chunks of at most 16 tokens (PagedConfig.prefill_chunk), and observations
# over 16 tokens too: every process must dispatch as many pieces
RolloutConfig.paged = @PagedConfig()
PagedConfig.prefill_chunk = 16
UpdateConfig.length_multiple = 128
WarmStartConfig.steps = 0
TrainConfig.prompts_per_step = 4
OptimizerConfig.learning_rate = 1e-4
"""
MOE = """
model_preset.name = 'tiny-qwen3-moe'
model_preset.moe_intermediate_size = 16
model_preset.num_experts = 8
"""
SETTINGS = {"fsdp8": (GIN, {"fsdp": 8}), "expert8": (GIN + MOE, {"expert": 8})}
STEPS = 2
# the engine-level check (fsdp8): 5 tasks, 4 on process 0 (whose tool calls take 150 ms) and 1 on process 1 (fast
# tools: it finishes first and takes part with padding); every row's first turn scripted as a tool call or not, the
# script given a block at a time (`ScriptedPolicy(blocks=True)`): the engine decodes `sync_every` (8) steps a
# dispatch, rows stopping mid-block as a free-running policy's do (a hook called between steps would make it one
# step a dispatch: ~100 lock-step decode dispatches instead of ~14, each a round of gloo collectives). On
# two processes each part of the pool holds one row of max_context a batch shard (`ENGINE_POOL_ROWS`), so process
# 0's 8 rows on its 4 shards run out of pages and are paused and recomputed while process 1 is not
ENGINE_TASKS = 5
ENGINE_POOL_ROWS = 4
ENGINE_TURN_BUDGET = 32
TOOL_SECONDS = (0.15, 0.0)
WORDS = ("river", "city", "north", "south", "mayor", "page")


class LatentTools:
    """One task's tools: each call returns 1-5 words drawn from the task and the call's number (the same on any
    process) after a latency that depends on the process (`TOOL_SECONDS`), so processes wait on tools at different
    times."""

    def __init__(self, task):
        self.task, self.calls = task, 0

    def execute(self, name, arguments):
        import random
        import time

        import jax

        draw = random.Random(f"{self.task.task_id}/{self.calls}/{name}")
        self.calls += 1
        time.sleep(TOOL_SECONDS[jax.process_index() % len(TOOL_SECONDS)])
        return " ".join(draw.choice(WORDS) for _ in range(draw.randint(1, 5)))


def engine_episodes(environment, config, placement, params) -> dict:
    """`engine.run_paged_episodes` on `ENGINE_TASKS` tasks split unevenly over the processes (process p's rows keep
    their global keys through `row_offset`), sampled, with a scripted first turn per row (a tool call for rows 0, 1,
    3, 4, ..., the model's own turn for rows 2, 5, ...; the script's biases a decode block at a time, so the engine
    keeps its blocks of `sync_every` steps) and `LatentTools`: every process's rows (gathered) and
    dispatch and preemption counts. Several processes share a pool of `ENGINE_POOL_ROWS` rows of max_context a
    process (preempting); one process has the default pool (every row at max_context: none preempted)."""
    import random

    import jax
    import numpy as np

    from trace_jax.rollout import engine as engine_lib
    from trace_jax.rollout.agent import ScriptedPolicy
    from trace_jax.train import distributed

    chat, group = environment.chat, config.rollout.group_size
    tasks = environment.train_tasks[:ENGINE_TASKS]
    draw = random.Random(0)
    scripts = [[chat.assistant_content_ids(None, [{"name": "search", "arguments": {"query": draw.choice(WORDS)}}])
                if row % 3 != 2 else []] for row in range(len(tasks) * group)]
    # process 0 runs the first 4 tasks, process 1 the last one (one process: all five)
    first, last = ((0, len(tasks)) if jax.process_count() == 1 else
                   ((0, len(tasks) - 1), (len(tasks) - 1, len(tasks)))[jax.process_index()])
    offset = first * group
    hook = ScriptedPolicy(scripts[offset:last * group], environment.model_config.vocab_size, blocks=True)
    rollout = dataclasses.replace(config.rollout, turn_token_budget=ENGINE_TURN_BUDGET)
    if jax.process_count() > 1:
        from trace_jax.rollout import paged as paged_lib

        row = paged_lib.pages_for(rollout.max_context, rollout.paged.page_size)
        rollout = dataclasses.replace(rollout, paged=dataclasses.replace(rollout.paged,
                                                                         num_pages=ENGINE_POOL_ROWS * row))
    result = engine_lib.run_paged_episodes(environment.model_config, params, chat, tasks[first:last], LatentTools,
                                           rollout, jax.random.PRNGKey(5), mesh=placement.mesh,
                                           rules=placement.rollout_rules, row_offset=offset, logits_hook=hook)
    batch, stats = result.batch, result.stats
    return {name: distributed.gather_rows(np.asarray(getattr(batch, name))).tolist()
            for name in ("tokens", "status", "lengths", "loss_mask", "sampler_logprobs")} | {
        "tool_calls": distributed.gather_rows(np.asarray([sum(isinstance(call, tuple) for call in e.tool_calls)
                                                          for e in result.episodes], np.int32)).tolist(),
        "dispatches": distributed.gather_rows(np.asarray([[stats.decode_dispatches, stats.prefill_dispatches,
                                                           stats.row_steps, stats.useful_row_steps,
                                                           stats.preemptions, stats.max_pages_held]],
                                                         np.int32)).tolist()}


def _bytes_by_device(tree) -> dict:
    """Bytes of the live buffers of `tree`'s arrays on each of this process's devices (addressable shards)."""
    import jax

    out = {device: 0 for device in jax.local_devices()}
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] += shard.data.nbytes
    return out


def _most(tree) -> int:
    """The most bytes of `tree` on any one of this process's devices."""
    return max(_bytes_by_device(tree).values())


def _experts(params) -> list:
    """The expert weights of an MoE's params (none for a dense model)."""
    moe = params["layers"].get("moe", {})
    return [moe[name] for name in ("gate_proj", "up_proj", "down_proj") if name in moe]


def run_steps(out_dir: str | Path, setting: str) -> dict:
    import jax
    import numpy as np

    from tests.rl.test_programs import Recorder
    from trace_jax.rl import pipeline as pipeline_lib
    from trace_jax.rl.gin_setup import parse
    from trace_jax.rl.loop import Placement, build_environment, make_rl_step, prompt_stream, rl_step
    from trace_jax.rollout import paged as paged_lib
    from trace_jax.train import distributed
    from trace_jax.train.config import MeshConfig
    from trace_jax.train.state import init_train_state

    out_dir = Path(out_dir)
    gin, mesh_fields = SETTINGS[setting]
    gin_file = out_dir / f"{setting}{jax.process_index()}.gin"
    gin_file.write_text(gin)
    config = parse([str(gin_file)])
    config = dataclasses.replace(config, mesh=MeshConfig(**mesh_fields))
    environment = build_environment(config, out_dir / f"env{jax.process_index()}")
    placement = Placement(config, environment.model_config)
    rl = make_rl_step(config, environment, placement=placement)
    params = placement.policy(environment.params)
    reference = placement.frozen(params)
    state = init_train_state(environment.model_config, rl.optimizer, params, jax.random.PRNGKey(0),
                             mesh=placement.mesh)

    seen: dict = {}
    pool: dict = {}
    score = pipeline_lib.score_answer_prefixes

    def measuring_score(config_, params_, *args, **kwargs):
        if "reference" not in seen:
            seen["reference"] = _most(params_)
            seen["reference_experts"] = _most(_experts(params_))
            seen["reference_experts_whole"] = sum(x.size * x.dtype.itemsize for x in _experts(params_))
        return score(config_, params_, *args, **kwargs)

    decode_program = paged_lib.decode_program

    def measuring_decode_program(*args, **kwargs):  # the paged engine's decode reads the params and the pool
        program = decode_program(*args, **kwargs)

        def call(sampling, params_, state_, *rest):
            if "rollout_params" not in seen:
                seen["rollout_params"], seen["cache"] = _most(params_), _most((state_.k, state_.v))
                # the pool's pages on this process's devices: its own part of the pool (engine module doc)
                here = [shard.index[2].indices(state_.num_pages)[:2] for shard in state_.k.addressable_shards]
                pool.update(pages=state_.num_pages, here=[min(a for a, _ in here), max(b for _, b in here)])
                seen["rollout_experts"] = _most(_experts(params_))
                seen["rollout_experts_whole"] = sum(x.size * x.dtype.itemsize for x in _experts(params_))
            return program(sampling, params_, state_, *rest)

        return call

    record = {"processes": jax.process_count(), "tokens": [], "logprobs": [], "rewards": [], "scores": [],
              "losses": []}
    recorder = Recorder(rl.programs(environment.train_tasks))  # what `trace-jax plan` lowers for this run
    pipeline_lib.score_answer_prefixes = measuring_score
    paged_lib.decode_program = measuring_decode_program
    try:
        prompts = prompt_stream(config, environment.train_tasks)
        with recorder:
            for step in range(STEPS):
                state, prepared, metrics = rl_step(rl.pipeline, placement, state, reference, next(prompts),
                                                   jax.random.PRNGKey(100 + step), seed=step)
                batch = prepared.rollout.batch
                record["tokens"].append(distributed.gather_rows(np.asarray(batch.tokens)).tolist())
                # the sampler's log-probs: KV a row reads wrongly shows here (a tiny random policy's sampled tokens
                # hardly change under it)
                record["logprobs"].append(distributed.gather_rows(np.asarray(batch.sampler_logprobs)).tolist())
                record["rewards"].append(distributed.gather_rows(np.asarray(batch.reward)).tolist())
                record["scores"].append(distributed.gather_rows(np.asarray(prepared.answer_scores)).tolist())
                record["losses"].append(float(metrics["loss"]))
    finally:
        pipeline_lib.score_answer_prefixes = score
        paged_lib.decode_program = decode_program
    if setting == "fsdp8":  # 3 held-out tasks a task a call: process 0 runs 1, then takes part with an empty call
        from trace_jax.rl.evaluate import EvalConfig, evaluate

        result = evaluate(environment.model_config, placement.rollout_params(state.params), environment.chat,
                          environment.eval_tasks[:3], environment.browser, config.rollout,
                          EvalConfig(num_tasks=3, batch_size=1), mesh=placement.mesh, rules=placement.rollout_rules)
        record["evaluation"] = {k: v for k, v in result.to_json().items() if k != "seconds"}
        record["engine"] = engine_episodes(environment, config, placement, placement.rollout_params(state.params))
    record["engine_kind"] = "paged"  # the one rollout engine (the test reads it)
    record["bytes"] = seen
    record["pool"] = pool
    record["unlisted"] = recorder.unlisted()
    record["dispatched"] = sorted({entry.name for _, entry in recorder.calls if entry is not None})
    if distributed.is_primary():
        (out_dir / "result.json").write_text(json.dumps(record), encoding="utf-8")
    distributed.barrier("multihost_spmd written")
    return json.loads(json.dumps(record))


if __name__ == "__main__":
    from trace_jax.train import distributed

    distributed.initialize(distributed.DistributedConfig(initialization_timeout_s=60))
    run_steps(sys.argv[1], sys.argv[2])
