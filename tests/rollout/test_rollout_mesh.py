"""The rollout on a mesh of 8 fake CPU devices: its state is created in shards, never whole on one device, and its
programs run under the mesh (the model's sharding constraints and the MoE's expert-parallel dispatch apply), with
the tokens and log-probs of one device."""

import gc

import jax
import numpy as np
import pytest

from trace_jax import models
from trace_jax.rollout import sampler as S

PROMPTS = [[5, 9, 17, 33], [100, 3, 4], [44, 45], [7, 8, 9, 10, 11]]
GROUP = 2  # 4 prompts x 2 samples: 8 rows, one per batch shard x tensor shard below
GREEDY = S.SamplingConfig(greedy=True)
# name: (preset, overrides, mesh). Both split 8 rows over 4 batch shards and 2 kv heads over tensor=2: a device holds
# 1/8 of the cache. The dense model uses the XLA attention; the MoE mesh has an expert axis dividing its 4 experts
# (the expert-parallel dispatch).
MESHES = {
    "dense_data4_tensor2": ("tiny-qwen3", {"attention_impl": "xla"}, {"data": 4, "tensor": 2}),
    "moe_data2_tensor2_expert2": ("tiny-qwen3-moe", {}, {"data": 2, "tensor": 2, "expert": 2}),
}


def _add_shards(out: dict, array) -> None:
    # From the sharding, not `shard.data`: that makes a jax array per shard, itself live afterwards, aliasing the
    # buffer it would count again.
    shard_bytes = int(np.prod(array.sharding.shard_shape(array.shape))) * array.dtype.itemsize
    for device in array.sharding.addressable_devices:
        out[device] += shard_bytes


def bytes_per_device() -> dict:
    """Bytes of every live device buffer, by device (each addressable shard of each live array)."""
    gc.collect()
    out = {device: 0 for device in jax.devices()}
    for array in jax.live_arrays():
        _add_shards(out, array)
    return out


def tree_bytes_per_device(tree) -> dict:
    out = {device: 0 for device in jax.devices()}
    for leaf in jax.tree_util.tree_leaves(tree):
        _add_shards(out, leaf)
    return out


@pytest.fixture(scope="module", params=sorted(MESHES))
def setting(request):
    preset, overrides, shape = MESHES[request.param]
    config = models.get_preset(preset, **overrides)
    return config, models.init_params(config, jax.random.PRNGKey(0)), models.make_mesh(shape)


def _rollout(config, params, mesh, *, max_len=16, new_tokens=4):
    """Grouped prefill, a greedy turn, an observation appended to two rows, an admission into two rows and a second
    turn: every program of the rollout (append, decode, prefill, prefill_rows)."""
    state = S.init_state(config, len(PROMPTS) * GROUP, max_len, mesh=mesh, rules=models.ROLLOUT_RULES)
    state = S.prefill_groups(config, params, state, PROMPTS, GROUP)
    turns = []
    for turn in range(2):
        state, generation = S.generate(config, params, state, rng=jax.random.PRNGKey(turn), active=np.ones(8, bool),
                                       max_new_tokens=new_tokens, stop_ids=(), sampling=GREEDY, sync_every=4)
        turns.append(generation)
        if turn == 0:
            state = S.append(config, params, state, [[], [11, 12, 13], [], [], [], [], [14], []])
            state = S.prefill_rows(config, params, state, [0, 5], [[21, 22, 23], [30, 31]])
    return state, turns


def test_rollout_on_the_mesh_gives_the_tokens_and_logprobs_of_one_device(setting):
    config, params, mesh = setting
    state, sharded = _rollout(config, models.shard_params(params, config, mesh, models.ROLLOUT_RULES), mesh)
    assert len(state.cache.k.sharding.device_set) == 8
    _, single = _rollout(config, params, None)
    for got, want in zip(sharded, single):
        for row in range(8):
            np.testing.assert_array_equal(got.tokens[row], want.tokens[row])
            np.testing.assert_allclose(got.logprobs[row], want.logprobs[row], atol=1e-5)


def _decode_args(config, params, state):
    rows = state.cache.batch_size
    return (S.RowSampling.broadcast(GREEDY, rows), params, state, np.ones(rows, bool), np.full(rows, 3, np.int32),
            np.asarray([-1], np.int32), jax.random.PRNGKey(0), np.uint32(0), np.zeros(rows, np.int32))


def test_moe_decode_on_an_expert_mesh_dispatches_tokens_by_all_to_all():
    """The decode program traces under its mesh, so `expert_parallel.resolve_dispatch` sees the expert axis; the same
    jitted function lowered without the mesh (as every rollout program was) takes the global sort instead."""
    preset, overrides, shape = MESHES["moe_data2_tensor2_expert2"]
    config = models.get_preset(preset, **overrides)
    mesh = models.make_mesh(shape)
    params = models.shard_params(models.init_params(config, jax.random.PRNGKey(0)), config, mesh,
                                 models.ROLLOUT_RULES)
    state = S.abstract_state(config, 8, 64, mesh=mesh, rules=models.ROLLOUT_RULES)
    program = S.decode_program(config, 2, None, mesh)
    assert program.mesh is mesh
    assert "all_to_all" in program.lower(*_decode_args(config, params, state)).as_text()
    assert "all_to_all" not in program.jitted.lower(*_decode_args(config, params, state)).as_text()


def test_init_creates_each_shard_on_its_device_without_moving_a_whole_cache(setting):
    """No transfer between devices while the state is created (the eager `jnp.zeros` + `device_put` it replaces
    built the whole cache on device 0 and then moved it: "Disallowed device-to-device transfer: aval=float32[2,8,
    256,2,16]"), and the program's outputs are the state's sharded layout."""
    config, _, mesh = setting
    with jax.transfer_guard_device_to_device("disallow_explicit"):
        state = S.init_state(config, 8, 256, mesh=mesh, rules=models.ROLLOUT_RULES)
    want = S.abstract_state(config, 8, 256, mesh=mesh, rules=models.ROLLOUT_RULES)
    for leaf, spec in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(want)):
        assert leaf.sharding.is_equivalent_to(spec.sharding, leaf.ndim), (leaf.shape, leaf.sharding)
    assert not np.asarray(state.cache.k).any() and not np.asarray(state.lengths).any()


def test_no_device_holds_more_than_its_share_during_init_and_the_first_decode_step(setting):
    """Live device buffers, by device, after the state is created and after prefill + the first decode step: at
    most 1/8 of the state plus the device's own share of the params, + 10%."""
    config, params, mesh = setting
    before = bytes_per_device()
    params = models.shard_params(params, config, mesh, models.ROLLOUT_RULES)
    param_share = tree_bytes_per_device(params)
    rows, max_len = 8, 512  # the cache (2 MiB) is most of what a device holds
    state = S.init_state(config, rows, max_len, mesh=mesh, rules=models.ROLLOUT_RULES)
    state_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(state))

    def check(when):
        now = bytes_per_device()
        for device in jax.devices():
            allowed = 1.1 * (state_bytes / len(jax.devices()) + param_share[device])
            assert now[device] - before[device] <= allowed, (when, device, now[device] - before[device], allowed)

    check("after init")
    state = S.prefill_groups(config, params, state, PROMPTS, GROUP)
    state, _ = S.generate(config, params, state, rng=jax.random.PRNGKey(0), active=np.ones(rows, bool),
                          max_new_tokens=1, stop_ids=(), sampling=GREEDY, sync_every=1)
    check("after the first decode step")


def test_append_on_a_mesh_writes_each_rows_keys_and_values_on_its_own_shard():
    """Appending a chunk to rows split over `data` gathers no float data: each shard writes its own rows' new keys
    and values (a scatter indexed by row numbers gathered all 8 rows' [2, 8, 128, 1, 16] keys onto every device)."""
    config = models.get_preset("tiny-qwen3", attention_impl="xla")
    mesh = models.make_mesh({"data": 4, "tensor": 2})
    params = models.shard_params(models.init_params(config, jax.random.PRNGKey(0)), config, mesh,
                                 models.ROLLOUT_RULES)
    state = S.abstract_state(config, 8, 256, mesh=mesh, rules=models.ROLLOUT_RULES)
    program = S.append_program(config, S.state_layout(state))
    hlo = program.lower(params, state, np.zeros((8, 128), np.int32), np.zeros(8, np.int32)).compile().as_text()
    gathers = [line.strip() for line in hlo.splitlines() if " all-gather(" in line and "= f32[" in line]
    assert not gathers, gathers
