"""The run's sharding rules (`MeshConfig.rules`) reach its arrays: the loop's `Placement` shards the params as the
overrides say (8 fake CPU devices, tests/conftest.py)."""

from __future__ import annotations

import jax
import pytest

from trace_jax import models
from trace_jax.rl.gin_setup import parse
from trace_jax.rl.loop import Placement


@pytest.fixture(scope="module")
def tiny_run_config():
    return parse(["configs/tiny.gin"], ["MeshConfig.fsdp = 4", "MeshConfig.tensor = 2"])


def test_a_runs_rule_override_shards_its_params_as_the_override_says(tiny_run_config):
    config = models.get_preset("tiny-qwen3", num_hidden_layers=1, num_attention_heads=8)
    params = models.init_params(config, jax.random.PRNGKey(0), dtype="float32")
    default = Placement(tiny_run_config, config).policy(params)["layers"]["attn"]["q_proj"]
    override = parse(["configs/tiny.gin"], ["MeshConfig.fsdp = 4", "MeshConfig.tensor = 2",
                                            "MeshConfig.rules = (('embed', None), ('heads', ('fsdp', 'tensor')))"])
    placement = Placement(override, config)
    q_proj = placement.policy(params)["layers"]["attn"]["q_proj"]  # [layers, embed, heads, head_dim]
    layers, embed, heads, head_dim = q_proj.shape
    assert default.sharding.shard_shape(q_proj.shape) == (layers, embed // 4, heads // 2, head_dim)
    assert q_proj.sharding.shard_shape(q_proj.shape) == (layers, embed, heads // 8, head_dim)
    assert placement.rules == override.mesh.train_rules()
    assert dict(placement.rollout_rules)["heads"] == ("fsdp", "tensor")
