"""Expert-parallel MoE dispatch (all-to-all over the `expert` mesh axis) against the single-device sort dispatch."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import models
from trace_jax.models import expert_parallel
from trace_jax.models.config import ConfigError


def _value_and_grad(config, params, tokens, attention_mask, probe):
    """hidden, aux loss, dropped count and d(sum(hidden * probe) + aux)/d(params), as one jitted function."""
    def loss(p):
        hidden, aux, dropped = models.forward_hidden(config, p, tokens, attention_mask=attention_mask,
                                                     return_router_loss=True, return_moe_dropped=True)
        return jnp.sum(hidden * probe) + aux, (hidden, aux, dropped)

    return jax.value_and_grad(loss, has_aux=True)(params)


# name: (mesh, preset overrides, tokens shape). One layer where the two-layer preset adds nothing but compile time
# (the scanned layer body is the same); the first and last share one single-device reference compile.
MESHES = {
    "fsdp2_expert4": ({"fsdp": 2, "expert": 4}, {"num_hidden_layers": 1}, (4, 6)),
    "expert8": ({"expert": 8}, {"num_experts": 8}, (2, 7)),  # 14 tokens: padded to 16 for 8 token shards
    # mlp partial sums reduced over tensor
    "fsdp2_expert2_tensor2": ({"fsdp": 2, "expert": 2, "tensor": 2}, {"num_hidden_layers": 1}, (4, 6)),
}


@pytest.fixture(scope="module", params=sorted(MESHES))
def sharded_and_reference(request):
    mesh_shape, overrides, (batch, length) = MESHES[request.param]
    config = models.get_preset("tiny-qwen3-moe", **overrides)
    rng = np.random.RandomState(len(request.param))
    params = models.init_params(config, jax.random.PRNGKey(rng.randint(1 << 30)))
    tokens = jnp.asarray(rng.randint(0, config.vocab_size, (batch, length)))
    attention_mask = jnp.asarray(np.arange(length)[None, :] < rng.randint(length // 2, length + 1, (batch, 1)))
    probe = jnp.asarray(rng.normal(size=(batch, length, config.hidden_size)), jnp.float32)

    reference = jax.jit(_value_and_grad, static_argnums=0)(config.replace(moe_dispatch="sort"), params, tokens,
                                                          attention_mask, probe)
    mesh = models.make_mesh(mesh_shape)
    with jax.set_mesh(mesh):
        assert expert_parallel.resolve_dispatch(config) == "all_to_all"
        sharded_params = models.shard_params(params, config, mesh)
        compiled = jax.jit(_value_and_grad, static_argnums=0).lower(
            config, sharded_params, tokens, attention_mask, probe).compile()
        sharded = compiled(sharded_params, tokens, attention_mask, probe)
    return compiled.as_text(), sharded, reference


def test_expert_parallel_hidden_and_router_loss_equal_single_device(sharded_and_reference):
    _, ((_, (hidden, aux, dropped)), _), ((_, (ref_hidden, ref_aux, ref_dropped)), _) = sharded_and_reference
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(ref_hidden), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(float(aux), float(ref_aux), rtol=1e-6)
    assert float(dropped) == float(ref_dropped) == 0.0  # dropless by default


def test_expert_parallel_gradient_equals_single_device(sharded_and_reference):
    _, (_, grads), (_, ref_grads) = sharded_and_reference
    flat, _ = jax.tree_util.tree_flatten_with_path(grads)
    ref_flat = jax.tree_util.tree_leaves(ref_grads)
    for (path, got), want in zip(flat, ref_flat):
        scale = float(np.abs(np.asarray(want)).max()) or 1.0
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5 * scale, rtol=1e-4,
                                   err_msg=jax.tree_util.keystr(path))


def _dispatch_all_to_alls(hlo: str) -> list[str]:
    """The all-to-all instructions of the expert dispatch (the shard_map's `all_to_all`); the partitioner may add
    others of its own, e.g. to gather embedding rows whose embed dimension is split over fsdp x expert."""
    return [line for line in hlo.splitlines() if " all-to-all(" in line and "shard_map/all_to_all" in line]


def test_compiled_expert_parallel_step_exchanges_tokens_by_all_to_all(sharded_and_reference):
    hlo, _, _ = sharded_and_reference
    assert _dispatch_all_to_alls(hlo)


def test_sort_dispatch_on_the_same_mesh_has_no_all_to_all():
    # The HLO check above can fail: the gathering path compiles without the dispatch's all-to-all.
    config = models.get_preset("tiny-qwen3-moe", num_experts=8, moe_dispatch="sort", num_hidden_layers=1)
    params = models.init_params(config, jax.random.PRNGKey(0))
    mesh = models.make_mesh({"expert": 8})
    with jax.set_mesh(mesh):
        sharded_params = models.shard_params(params, config, mesh)
        hlo = models.forward_hidden.lower(config, sharded_params, jnp.zeros((8, 4), jnp.int32)).compile().as_text()
    assert not _dispatch_all_to_alls(hlo)


# ---------------------------------------------------------------------------------------------------- selection
def test_auto_dispatch_is_all_to_all_only_on_an_expert_axis_dividing_the_experts():
    config = models.get_preset("tiny-qwen3-moe")  # 4 experts
    assert expert_parallel.resolve_dispatch(config) == "sort"  # no mesh set
    assert expert_parallel.resolve_dispatch(config, models.make_mesh({"fsdp": 2, "expert": 4})) == "all_to_all"
    assert expert_parallel.resolve_dispatch(config, models.make_mesh({"fsdp": 8})) == "sort"
    assert expert_parallel.resolve_dispatch(config, models.make_mesh({"expert": 8})) == "sort"  # 8 does not divide 4
    sort = config.replace(moe_dispatch="sort")
    assert expert_parallel.resolve_dispatch(sort, models.make_mesh({"expert": 4, "data": 2})) == "sort"


def test_explicit_all_to_all_without_a_usable_expert_axis_names_the_fix():
    config = models.get_preset("tiny-qwen3-moe", moe_dispatch="all_to_all")
    with pytest.raises(ValueError, match=r"moe_dispatch='all_to_all' needs a mesh .* expert=1"):
        expert_parallel.resolve_dispatch(config)
    with pytest.raises(ValueError, match=r"divides num_experts=4.*expert=8"):
        expert_parallel.resolve_dispatch(config, models.make_mesh({"expert": 8}))


def test_config_rejects_unknown_dispatch_negative_capacity_and_capacity_with_sort():
    with pytest.raises(ConfigError, match="moe_dispatch: must be one of"):
        models.get_preset("tiny-qwen3-moe", moe_dispatch="gather")
    with pytest.raises(ConfigError, match="moe_capacity_factor: must be >= 0"):
        models.get_preset("tiny-qwen3-moe", moe_capacity_factor=-1.0)
    with pytest.raises(ConfigError, match="moe_dispatch='sort' is always dropless"):
        models.get_preset("tiny-qwen3-moe", moe_dispatch="sort", moe_capacity_factor=1.0)


# ---------------------------------------------------------------------------------------------------- capacity
def test_dropless_capacity_is_the_most_one_shard_can_send_to_another():
    config = models.get_preset("qwen3-30b-a3b")  # 128 experts, top 8
    assert expert_parallel.dispatch_capacity(config, tokens_per_shard=64, num_shards=8) == 64 * 8
    assert expert_parallel.dispatch_capacity(config, tokens_per_shard=64, num_shards=64) == 64 * 2  # 2 local experts
    capped = config.replace(moe_capacity_factor=1.25)
    assert expert_parallel.dispatch_capacity(capped, tokens_per_shard=64, num_shards=8) == math.ceil(1.25 * 64)


def _capacity_reference(x, top_e, top_w, token_weight, gate, up, down, *, token_shards, expert_shards, capacity):
    """float64 loop over the documented semantics: each source shard (a contiguous block of tokens) takes its
    assignments in (expert, token, slot) order; the first `capacity` bound for each expert shard run, the rest are
    dropped and counted with their token's weight."""
    T, k = top_e.shape
    per_shard, local_experts = T // token_shards, gate.shape[0] // expert_shards
    out = np.zeros(x.shape)
    dropped = 0.0
    for shard in range(token_shards):
        rows = range(shard * per_shard, (shard + 1) * per_shard)
        pairs = sorted((top_e[t, s], t, s) for t in rows for s in range(k))
        sent = [0] * expert_shards
        for e, t, s in pairs:
            dest = e // local_experts
            if sent[dest] >= capacity:
                dropped += token_weight[t]
                continue
            sent[dest] += 1
            h = x[t] @ gate[e]
            out[t] += top_w[t, s] * ((h / (1 + np.exp(-h)) * (x[t] @ up[e])) @ down[e])
    return out, dropped


def test_capacity_overflow_is_dropped_and_counted_as_the_reference_says():
    config = models.get_preset("tiny-qwen3-moe", num_experts=8, num_experts_per_tok=2, moe_capacity_factor=1.0)
    T, D, Fe, E = 32, config.hidden_size, config.moe_intermediate_size, 8
    rng = np.random.RandomState(7)
    x = rng.normal(size=(T, D)).astype(np.float32)
    # Skewed routing: most assignments pick experts 0-2 (expert shards 0 and 1), so those destinations overflow.
    top_e = np.stack([rng.choice(E, 2, replace=False, p=[.3, .3, .2, .04, .04, .04, .04, .04]) for _ in range(T)])
    top_w = rng.uniform(size=(T, 2)).astype(np.float32)
    token_weight = (rng.uniform(size=T) < 0.8).astype(np.float32)
    moe = {name: (rng.normal(size=shape) * 0.2).astype(np.float32)
           for name, shape in (("gate_proj", (E, D, Fe)), ("up_proj", (E, D, Fe)), ("down_proj", (E, Fe, D)))}
    # Tokens go over the batch axes data x expert: 8 source shards of 4 tokens, each with 2 rows per expert shard.
    capacity = expert_parallel.dispatch_capacity(config, T // 8, 4)
    assert capacity == 2

    with jax.set_mesh(models.make_mesh({"data": 2, "expert": 4})):
        out, dropped = jax.jit(expert_parallel.expert_parallel_mlp, static_argnums=0)(
            config, moe, jnp.asarray(x), jnp.asarray(top_e), jnp.asarray(top_w), jnp.asarray(token_weight))
    ref_out, ref_dropped = _capacity_reference(
        x.astype(np.float64), top_e, top_w, token_weight,
        *(moe[name].astype(np.float64) for name in ("gate_proj", "up_proj", "down_proj")),
        token_shards=8, expert_shards=4, capacity=capacity)
    assert ref_dropped > 0
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=1e-4, rtol=1e-4)
    assert float(dropped) == pytest.approx(ref_dropped)


def test_forward_hidden_reports_the_assignments_the_capacity_dropped():
    config = models.get_preset("tiny-qwen3-moe", num_hidden_layers=1, moe_capacity_factor=0.25)
    params = models.init_params(config, jax.random.PRNGKey(5))
    tokens = jnp.asarray(np.random.RandomState(5).randint(0, config.vocab_size, (4, 8)))
    with jax.set_mesh(models.make_mesh({"expert": 4, "data": 2})):
        _, dropped = models.forward_hidden(config, params, tokens, return_moe_dropped=True)
    # 8 source shards of 4 tokens x 2 slots; capacity ceil(0.25 * 4 * 2 / 4) = 1 row per expert shard, so each
    # source keeps at most 4 of its 8 assignments.
    assert expert_parallel.dispatch_capacity(config, 4, 4) == 1
    assert 8 * 4 <= float(dropped) <= 8 * 7
