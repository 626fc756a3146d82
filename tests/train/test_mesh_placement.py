"""The placement pieces of one mesh for the whole step: `MeshConfig` on one process (all devices, or the first n),
`models.in_layout` (an on-device reshard; nothing moves for arrays already in their layout), the
rollout layout's rules and `models.placed_on`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trace_jax import models
from trace_jax.train.config import MeshConfig, TrainConfigError


def test_one_device_is_a_one_by_one_by_one_by_one_mesh():
    mesh = MeshConfig(data=1, fsdp=1, tensor=1, expert=1, devices=1).make_mesh()
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
    assert list(mesh.devices.flat) == [jax.devices()[0]]


def test_the_default_mesh_spans_every_device():
    assert MeshConfig().make_mesh().devices.size == jax.device_count()


def test_more_devices_than_the_process_has_is_a_clear_error():
    with pytest.raises(TrainConfigError, match="MeshConfig.devices: asks for the first 64 devices"):
        MeshConfig(devices=64).make_mesh()
    with pytest.raises(TrainConfigError, match="MeshConfig.devices: must be an int >= 0"):
        MeshConfig(devices=-1)


def test_in_layout_reshards_on_device_and_leaves_placed_arrays_alone():
    mesh = MeshConfig(fsdp=4, tensor=2).make_mesh()
    fsdp = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("fsdp", "tensor")))
    tensor = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("tensor")))
    target = {"w": NamedSharding(mesh, P(None, "tensor")), "b": NamedSharding(mesh, P("tensor"))}
    moved = models.in_layout({"w": fsdp, "b": tensor}, target)
    assert moved["b"] is tensor  # already in its layout: nothing runs
    assert moved["w"].sharding.shard_shape((8, 8)) == (8, 4)
    np.testing.assert_array_equal(moved["w"], np.arange(64.0).reshape(8, 8))
    fsdp.delete()  # the reshard made its own buffers
    assert float(moved["w"].sum()) == float(np.arange(64.0).sum())


def test_the_reshard_is_one_program_per_target_layout_the_loop_and_plan_share():
    mesh = MeshConfig(fsdp=4, tensor=2).make_mesh()
    config = models.get_preset("tiny-qwen3", num_hidden_layers=1)
    rollout = models.param_shardings(config, mesh, models.ROLLOUT_RULES)
    assert models.reshard_program(rollout) is models.reshard_program(
        models.param_shardings(config, mesh, models.ROLLOUT_RULES))
    assert models.reshard_program(rollout) is not models.reshard_program(models.param_shardings(config, mesh))
    with pytest.raises(TypeError, match="pytree of NamedShardings"):
        models.reshard_program({"w": P("fsdp")})


def test_the_rollout_layout_keeps_weights_whole_over_fsdp_and_split_over_tensor():
    config = models.get_preset("tiny-qwen3", num_hidden_layers=1)
    mesh = MeshConfig(fsdp=4, tensor=2).make_mesh()
    train = models.param_shardings(config, mesh)["layers"]["attn"]["q_proj"]
    rollout = models.param_shardings(config, mesh, models.ROLLOUT_RULES)["layers"]["attn"]["q_proj"]
    assert train.spec == P(None, "fsdp", "tensor", None) and rollout.spec == P(None, None, "tensor", None)


def test_placed_on_tells_arrays_on_the_mesh_from_others():
    mesh = MeshConfig(fsdp=8).make_mesh()
    on_mesh = jax.device_put(jnp.zeros((8, 2)), NamedSharding(mesh, P("fsdp")))
    assert models.placed_on({"a": on_mesh}, mesh)
    assert not models.placed_on({"a": on_mesh, "b": jnp.zeros(2)}, mesh)
    assert not models.placed_on({"a": np.zeros(2)}, mesh)
    assert not models.placed_on({"a": on_mesh}, MeshConfig(fsdp=4, tensor=2).make_mesh())


def test_a_reference_dtype_other_than_float32_or_bfloat16_names_the_field():
    from trace_jax.rl.gin_setup import TrainConfig

    with pytest.raises(ValueError, match="TrainConfig.reference_dtype must be 'float32' or 'bfloat16'"):
        TrainConfig(model=models.get_preset("tiny-qwen3"), reference_dtype="float16")


def test_a_rollout_dtype_other_than_float32_or_bfloat16_names_the_field():
    from trace_jax.rl.gin_setup import TrainConfig

    with pytest.raises(ValueError, match="TrainConfig.rollout_dtype must be 'float32' or 'bfloat16'"):
        TrainConfig(model=models.get_preset("tiny-qwen3"), rollout_dtype="float16")


# ------------------------------------------------------------------------------------------------ MeshConfig.rules
def test_mesh_config_without_rule_overrides_uses_the_default_rules():
    assert MeshConfig().train_rules() == models.DEFAULT_RULES
    assert MeshConfig().rollout_rules() == models.ROLLOUT_RULES


def test_rule_overrides_replace_only_the_logical_axes_they_name():
    rules = MeshConfig(rules=(("embed", ("data", "fsdp", "expert")), ("vocab", None))).train_rules()
    expected = {**dict(models.DEFAULT_RULES), "embed": ("data", "fsdp", "expert"), "vocab": None}
    assert rules == tuple(expected.items())


def test_the_rollout_rules_derive_from_the_overridden_train_rules():
    rollout = dict(MeshConfig(rules=(("heads", None), ("embed", "fsdp"))).rollout_rules())
    assert rollout["heads"] is None and rollout["embed"] is None  # embed is always whole in the rollout layout


def test_rule_overrides_given_as_lists_by_gin_are_normalised_to_hashable_tuples():
    config = MeshConfig(rules=[["embed", ["fsdp", "expert"]]])
    assert config.rules == (("embed", ("fsdp", "expert")),)
    hash(config)


@pytest.mark.parametrize("rules, words", [
    ((("embedding", "fsdp"),), "unknown logical axis 'embedding'; the logical axes are batch, length, embed"),
    ((("embed", "model"),), r"rule \('embed', 'model'\): the mesh axes must be one of"),
    ((("embed", ("fsdp", "fsdp")),), "a tuple of distinct ones"),
    ((("embed",),), r"rule \('embed',\): expected a pair \(logical axis, mesh axes\)"),
    ((("embed", "fsdp"), ("embed", None)), "logical axis 'embed' is given twice"),
    ("embed", "must be a tuple of \\(logical axis, mesh axes\\) pairs"),
])
def test_bad_rule_overrides_are_errors_naming_mesh_config_rules_the_entry_and_the_accepted_names(rules, words):
    with pytest.raises(TrainConfigError, match=f"MeshConfig.rules: .*{words}"):
        MeshConfig(rules=rules)


def test_a_mesh_flag_without_rules_keeps_the_runs_rules_and_one_with_rules_keeps_its_own():
    run_mesh = MeshConfig(rules=(("vocab", None),))
    flag = MeshConfig.from_flag("fsdp=2,tensor=2")
    assert flag.keeping_rules_of(run_mesh) == dataclasses.replace(flag, rules=(("vocab", None),))
    own = dataclasses.replace(flag, rules=(("embed", None),))
    assert own.keeping_rules_of(run_mesh) is own
