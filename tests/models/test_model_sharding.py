"""Logical-axis sharding: rules -> mesh specs, sharded checkpoint loading, and sharded forward == unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trace_jax import models


def test_rules_drop_missing_axes_reuse_and_indivisible_dims():
    mesh = models.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    spec = models.logical_to_mesh_spec(P("layers", "embed", "kv_heads", "head_dim"), mesh, shape=(2, 64, 1, 16))
    assert spec == P(None, "fsdp", None, None)  # 1 kv head cannot be split over tensor=2
    assert models.logical_to_mesh_spec(P("batch", "length", "embed"), mesh) == P(("data", "fsdp"), None, None)
    assert models.logical_to_mesh_spec(P("experts", "mlp"), mesh) == P(None, "tensor")  # no expert axis in mesh


def test_unknown_logical_axis_is_an_error():
    mesh = models.make_mesh({"data": 8})
    with pytest.raises(KeyError, match="'bogus' has no sharding rule"):
        models.logical_to_mesh_spec(P("bogus"), mesh)


def test_every_param_has_logical_axes_of_matching_rank():
    for preset in ("tiny-qwen3", "tiny-qwen3-moe", "qwen3-30b-a3b"):
        config = models.get_preset(preset)
        shapes = models.param_shapes(config)
        axes = models.param_logical_axes(config)
        flat_shapes = jax.tree_util.tree_leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
        flat_axes = jax.tree_util.tree_leaves(axes, is_leaf=lambda x: isinstance(x, P))
        assert [len(s) for s in flat_shapes] == [len(a) for a in flat_axes]


@pytest.mark.parametrize("preset,mesh_shape", [
    ("tiny-qwen3", {"data": 2, "fsdp": 2, "tensor": 2}),
    ("tiny-qwen3-moe", {"fsdp": 2, "tensor": 2, "expert": 2}),
])
def test_sharded_load_places_params_and_forward_matches(preset, mesh_shape, tmp_path):
    config = models.get_preset(preset)
    params = models.init_params(config, jax.random.PRNGKey(0))
    models.save_pretrained(tmp_path, config, params)
    mesh = models.make_mesh(mesh_shape)

    loaded_config, sharded = models.load_pretrained(tmp_path, mesh=mesh)
    expected = models.param_shardings(loaded_config, mesh)
    for got, want in zip(jax.tree_util.tree_leaves(sharded), jax.tree_util.tree_leaves(expected)):
        assert got.sharding.is_equivalent_to(want, got.ndim), (got.sharding, want)
    q_spec = sharded["layers"]["attn"]["q_proj"].sharding.spec
    if config.is_moe:  # the non-expert weights' embed dimension over fsdp x expert; experts whole over expert
        assert tuple(q_spec) == (None, ("fsdp", "expert"), "tensor", None)
        assert tuple(sharded["layers"]["moe"]["router"].sharding.spec) == (None, ("fsdp", "expert"), None)
        assert tuple(sharded["layers"]["moe"]["gate_proj"].sharding.spec) == (None, "expert", "fsdp", "tensor")
    else:  # no expert axis: embed over fsdp
        assert tuple(q_spec) == (None, "fsdp", "tensor", None)

    tokens = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (4, 16)))
    batch_sharding = NamedSharding(mesh, models.logical_to_mesh_spec(P("batch", "length"), mesh))
    sharded_logits = models.forward(loaded_config, sharded, jax.device_put(tokens, batch_sharding))
    np.testing.assert_allclose(np.asarray(sharded_logits), np.asarray(models.forward(config, params, tokens)),
                               atol=1e-5)


def test_forward_under_set_mesh_constrains_activations_and_matches():
    config = models.get_preset("tiny-qwen3")
    params = models.init_params(config, jax.random.PRNGKey(3))
    tokens = jnp.asarray(np.random.RandomState(3).randint(0, config.vocab_size, (4, 8)))
    reference = np.asarray(models.token_logprobs(config, params, tokens))
    mesh = models.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with jax.set_mesh(mesh):
        sharded_params = models.shard_params(params, config, mesh)
        hidden = models.forward_hidden(config, sharded_params, tokens)
        logprobs = models.token_logprobs(config, sharded_params, tokens)
    assert tuple(hidden.sharding.spec)[:1] == (("data", "fsdp"),)
    np.testing.assert_allclose(np.asarray(logprobs), reference, atol=1e-5)
