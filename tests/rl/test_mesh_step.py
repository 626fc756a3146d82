"""One mesh for the whole RL step (trace_jax/rl/loop.py `Placement`, `rl_step`): on 8 fake CPU devices every mesh
gives what one device gives (greedy rollout tokens, reference scores, loss and params after two RL steps), each
device holds its share of the KV cache, the reference and the policy, and no param passes through host memory
during the steps."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import jax
import numpy as np
import pytest

from trace_jax import models
from trace_jax.rl.gin_setup import parse
from trace_jax.rl.loop import Placement, build_environment, prompt_stream, rl_step, train
from trace_jax.rl.pipeline import RLPipeline
from trace_jax.rollout import paged as paged_lib
from trace_jax.train import distributed
from trace_jax.train.config import MeshConfig
from trace_jax.train.optimizer import make_optimizer
from trace_jax.train.state import init_train_state
from trace_jax.train.step import make_train_step

# 4 prompts x 2 samples = 8 rows: one row per device on the 8-device meshes. Greedy: the same tokens on every mesh
# (TRACE's turn credit still gives the update a signal when a group's outcomes agree). Learning rate 1e-4: Adam
# divides each gradient by its own running scale, so where a gradient is round-off-sized the meshes' different
# reduction orders move that element by a visible fraction of the learning rate (measured: 3.6e-5 on 2 of 136K
# elements at 1e-3); at 1e-4 that stays under the 1e-5 the params are compared at, and two steps still move them.
GIN = """
include 'configs/tiny.gin'
model_preset.hidden_size = 32
model_preset.intermediate_size = 64
model_preset.num_hidden_layers = 1
model_preset.num_attention_heads = 2
model_preset.num_key_value_heads = 2
model_preset.head_dim = 16
DataConfig.num_train_tasks = 8
DataConfig.num_eval_tasks = 2
RolloutConfig.group_size = 2
RolloutConfig.system_prompt = None
RolloutConfig.max_turns = 1
RolloutConfig.max_context = 128
RolloutConfig.turn_token_budget = 8
UpdateConfig.length_multiple = 128
SamplingConfig.greedy = True
WarmStartConfig.steps = 0
TrainConfig.prompts_per_step = 4
OptimizerConfig.learning_rate = 1e-4
"""
MOE_GIN = GIN + """
model_preset.name = 'tiny-qwen3-moe'
model_preset.moe_intermediate_size = 16
"""
STEPS = 2
ONE_DEVICE = dict(data=1, fsdp=1, tensor=1, expert=1, devices=1)
MESHES = {  # name -> (gin, MeshConfig fields)
    "one_device": (GIN, ONE_DEVICE),
    "fsdp4_tensor2": (GIN, dict(fsdp=4, tensor=2)),
    "data2_fsdp2_tensor2": (GIN, dict(data=2, fsdp=2, tensor=2)),
    "moe_one_device": (MOE_GIN, ONE_DEVICE),
    "moe_expert4": (MOE_GIN, dict(expert=4)),
}
pytestmark = pytest.mark.slow  # five meshes' programs compile once for the module (~1-2 min on 2 busy cores)
SHARDED = [name for name, (_, fields) in MESHES.items() if fields != ONE_DEVICE]


def _one_device_of(name: str) -> str:
    return "moe_one_device" if name.startswith("moe") else "one_device"


class HostTransferGuard:
    """Makes host transfers of params raise: `np.asarray` / `jax.device_get` of any array shaped like a param
    leaf, and every `process_allgather` / `distributed.host_local`."""

    def __init__(self, model_config):
        shapes = jax.eval_shape(lambda: models.init_params(model_config, jax.random.PRNGKey(0)))
        self.shapes = {tuple(x.shape) for x in jax.tree_util.tree_leaves(shapes) if x.ndim >= 2}
        self.blocked: list[tuple] = []

    def _check(self, x):
        if isinstance(x, jax.Array) and tuple(x.shape) in self.shapes:
            self.blocked.append(tuple(x.shape))
            raise AssertionError(f"a param-shaped array {tuple(x.shape)} went to host memory during an RL step")

    @contextlib.contextmanager
    def active(self):
        from jax._src.array import ArrayImpl
        from jax.experimental import multihost_utils

        guard = self
        patch = pytest.MonkeyPatch()
        to_numpy, device_get = ArrayImpl.__array__, jax.device_get

        def guarded_array(self, *args, **kwargs):
            guard._check(self)
            return to_numpy(self, *args, **kwargs)

        def guarded_device_get(tree):
            for leaf in jax.tree_util.tree_leaves(tree):
                guard._check(leaf)
            return device_get(tree)

        def refuse(*_args, **_kwargs):
            raise AssertionError("process_allgather / host_local during an RL step")

        patch.setattr(ArrayImpl, "__array__", guarded_array)
        patch.setattr(jax, "device_get", guarded_device_get)
        patch.setattr(multihost_utils, "process_allgather", refuse)
        patch.setattr(distributed, "host_local", refuse)
        try:
            yield self
        finally:
            patch.undo()


def _shard(x) -> tuple:
    return tuple(x.sharding.shard_shape(x.shape))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two RL steps of the same run on every mesh of MESHES (one build per model, one compile per mesh)."""
    root = tmp_path_factory.mktemp("mesh_step")
    environments: dict[str, tuple] = {}
    out = {}
    for name, (gin, mesh_fields) in MESHES.items():
        if gin not in environments:
            path = root / f"{len(environments)}.gin"
            path.write_text(gin)
            config = parse([str(path)])
            environments[gin] = config, build_environment(config, root / f"env{len(environments)}")
        config, environment = environments[gin]
        config = dataclasses.replace(config, mesh=MeshConfig(**mesh_fields))
        out[name] = _two_steps(config, environment)
    return out


def _two_steps(config, environment) -> dict:
    model_config = environment.model_config
    placement = Placement(config, model_config)
    optimizer = make_optimizer(config.optimizer)
    pipeline = RLPipeline(model_config, environment.chat, environment.browser, config.rollout, config.credit,
                          config.loss, config.update, optimizer, mesh=placement.mesh,
                          train_step=make_train_step(model_config, config.loss, optimizer, mesh=placement.mesh))
    params = placement.policy(environment.params)
    initial = {k: np.asarray(x) for k, x in _flat(params).items()}
    reference = placement.frozen(params)
    state = init_train_state(model_config, optimizer, params, jax.random.PRNGKey(0), mesh=placement.mesh)
    record = {"placement": placement, "config": config, "environment": environment, "pipeline": pipeline,
              "initial": initial, "tokens": [], "scores": [], "losses": [], "cache_shards": [],
              "reference_shards": {k: _shard(x) for k, x in _flat(reference).items()},
              "policy_shards": {k: _shard(x) for k, x in _flat(state.params).items()},
              "rollout_shards": {k: _shard(x) for k, x in _flat(placement.rollout_params(state.params)).items()}}
    guard = HostTransferGuard(model_config)
    decode_program = paged_lib.decode_program

    def recording_decode_program(*build):
        program = decode_program(*build)

        def run(sampling, params_, pool, *rest):
            record["cache_shards"].append((_shard(pool.k), pool.k.shape))
            return program(sampling, params_, pool, *rest)

        return run

    with guard.active(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged_lib, "decode_program", recording_decode_program)
        prompts = prompt_stream(config, environment.train_tasks)  # the run's order, 4 prompts a step
        for step in range(STEPS):
            tasks = next(prompts)
            state, prepared, metrics = rl_step(pipeline, placement, state, reference, tasks,
                                               jax.random.PRNGKey(100 + step), seed=step)
            record.setdefault("rollouts", []).append(prepared.rollout)
            record["tokens"].append(np.asarray(prepared.rollout.batch.tokens))
            record["scores"].append(np.asarray(prepared.answer_scores))
            record["losses"].append(metrics["loss"])
    record["params"] = {k: np.asarray(x) for k, x in _flat(state.params).items()}
    record["guard"] = guard
    return record


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


# ------------------------------------------------------------------------------------------------ every mesh = one device
@pytest.mark.parametrize("name", SHARDED)
def test_greedy_rollout_tokens_equal_one_device(runs, name):
    for step, (tokens, expected) in enumerate(zip(runs[name]["tokens"], runs[_one_device_of(name)]["tokens"])):
        np.testing.assert_array_equal(tokens, expected, err_msg=f"step {step}")


@pytest.mark.parametrize("name", SHARDED)
def test_reference_scores_equal_one_device(runs, name):
    for step, (scores, expected) in enumerate(zip(runs[name]["scores"], runs[_one_device_of(name)]["scores"])):
        np.testing.assert_allclose(scores, expected, atol=1e-5, rtol=0, err_msg=f"step {step}")


@pytest.mark.parametrize("name", SHARDED)
def test_loss_and_params_after_two_steps_equal_one_device(runs, name):
    expected = runs[_one_device_of(name)]
    np.testing.assert_allclose(runs[name]["losses"], expected["losses"], atol=1e-5, rtol=0)
    for key, value in expected["params"].items():
        np.testing.assert_allclose(runs[name]["params"][key], value, atol=1e-5, rtol=0, err_msg=key)


def test_the_two_steps_moved_the_params(runs):
    """So the comparison above is one of trained params, not of the initial ones twice."""
    for name in ("one_device", "moe_one_device"):
        record = runs[name]
        moved = max(float(np.abs(record["params"][k] - v).max()) for k, v in record["initial"].items())
        assert moved > 5e-5, name


# ------------------------------------------------------------------------------------------------ shard shapes
def test_each_device_holds_its_share_of_the_kv_cache_pages_and_heads(runs):
    # the engine's page pool [kv heads, layers, pages, page_size, head_dim]: heads over tensor, pages over the
    # batch axes
    for shard, shape in runs["fsdp4_tensor2"]["cache_shards"]:
        assert shard == (shape[0] // 2, shape[1], shape[2] // 4, shape[3], shape[4])
    for shard, shape in runs["data2_fsdp2_tensor2"]["cache_shards"]:
        assert shard == (shape[0] // 2, shape[1], shape[2] // 4, shape[3], shape[4])
    for shard, shape in runs["moe_expert4"]["cache_shards"]:  # pages over fsdp x expert = 8
        assert shard == (shape[0], shape[1], shape[2] // 8, *shape[3:])


def test_the_policy_trains_fsdp_x_tensor_sharded_and_rolls_out_whole_over_the_batch_axes(runs):
    record = runs["fsdp4_tensor2"]
    q = "['layers']['attn']['q_proj']"  # [layers, embed, heads, head_dim]
    assert record["policy_shards"][q] == (1, 32 // 4, 2 // 2, 16)
    assert record["rollout_shards"][q] == (1, 32, 2 // 2, 16)


def test_the_reference_is_sharded_like_the_policy_on_the_mesh(runs):
    for name in SHARDED:
        assert runs[name]["reference_shards"] == runs[name]["policy_shards"], name


def test_experts_are_split_over_the_expert_axis(runs):
    record = runs["moe_expert4"]
    up = "['layers']['moe']['up_proj']"  # [layers, experts, embed, mlp]
    assert record["policy_shards"][up][1] == 1 and record["rollout_shards"][up][1] == 1


# ------------------------------------------------------------------------------------------------ no host copies
def test_the_steps_ran_with_host_transfers_of_params_refused(runs):
    for name, record in runs.items():
        assert record["guard"].blocked == [], name
    guard = runs["fsdp4_tensor2"]["guard"]
    param = models.shard_params(models.init_params(runs["fsdp4_tensor2"]["placement"].model_config,
                                                   jax.random.PRNGKey(0)),
                                runs["fsdp4_tensor2"]["placement"].model_config,
                                runs["fsdp4_tensor2"]["placement"].mesh)["layers"]["attn"]["q_proj"]
    with guard.active(), pytest.raises(AssertionError, match="went to host memory"):
        np.asarray(param)
    with guard.active(), pytest.raises(AssertionError, match="process_allgather"):
        distributed.host_local(param)


# ------------------------------------------------------------------------------------------------ the reference's dtype
def test_a_bfloat16_reference_is_held_sharded_in_bfloat16_and_scores_near_float32(runs):
    record = runs["fsdp4_tensor2"]
    config, environment = record["config"], record["environment"]
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, reference_dtype="bfloat16"))
    placement = Placement(config, environment.model_config)
    reference = placement.frozen(placement.policy(environment.params))
    assert {x.dtype for x in jax.tree_util.tree_leaves(reference)} == {np.dtype(jax.numpy.bfloat16)}
    assert {k: _shard(x) for k, x in _flat(reference).items()} == record["reference_shards"]
    rollout = record["rollouts"][0]
    scores, _ = record["pipeline"].score(reference, rollout, rollout.batch.tokens.shape[1])
    np.testing.assert_allclose(scores, record["scores"][0], atol=0.1, rtol=0.02)
    assert not np.array_equal(scores, record["scores"][0])  # scored in bfloat16, not float32


# --------------------------------------------------------------------------------------------- the rollout copy's dtype
def test_a_bfloat16_rollout_copy_is_the_policy_rounded_in_the_rollout_layout(runs):
    record = runs["fsdp4_tensor2"]
    config, environment = record["config"], record["environment"]
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, rollout_dtype="bfloat16"))
    placement = Placement(config, environment.model_config)
    policy = placement.policy(environment.params)
    rollout = placement.rollout_params(policy)
    assert {x.dtype for x in jax.tree_util.tree_leaves(rollout)} == {np.dtype(jax.numpy.bfloat16)}
    assert {k: _shard(x) for k, x in _flat(rollout).items()} == record["rollout_shards"]
    assert {x.dtype for x in jax.tree_util.tree_leaves(policy)} == {np.dtype(np.float32)}  # master weights stay
    for key, value in _flat(rollout).items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(_flat(policy)[key]).astype(jax.numpy.bfloat16))


# ------------------------------------------------------------------------------------------------ the record
def test_a_run_records_its_mesh_in_the_summary_and_its_first_log_line(tmp_path):
    gin = tmp_path / "run.gin"
    gin.write_text(GIN + "TrainConfig.steps = 0\nTrainConfig.receipts = 0\nEvalConfig.num_tasks = 1\n"
                   "MeshConfig.fsdp = 2\nMeshConfig.tensor = 2\nMeshConfig.devices = 4\n")
    lines: list[str] = []
    summary = train(parse([str(gin)]), tmp_path / "run", progress=False, log=lines.append)
    assert lines[0].startswith("run ") and lines[0].endswith(
        "mesh data=1 fsdp=2 tensor=2 expert=1 (4 cpu devices, 1 process)")
    expected = {"axes": {"data": 1, "fsdp": 2, "tensor": 2, "expert": 1}, "devices": 4, "processes": 1,
                "platform": "cpu"}
    assert summary["mesh"] == expected
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["mesh"] == expected
