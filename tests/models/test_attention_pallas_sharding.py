"""The Pallas TPU attention path's `shard_map` wiring, checked on CPU devices: under a mesh each device gets its
own rows and heads (with the keys and values that belong to them), and the gathered result equals attention over
the whole arrays.

The splash kernel itself only runs on a TPU, so here the per-device kernel (`attention._splash_local`) is replaced
by a dense reference with the same contract; tests/models/test_attention_pallas_tpu.py compiles the real kernel
for a multi-chip TPU topology.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trace_jax.models import attention
from trace_jax.models.sharding import make_mesh


def local_reference(qh, kh, vh, seg, *, q_block, k_block, mqa, calls):
    """Dense causal attention with the splash kernel's contract (qh pre-scaled, [b, h, S, Dh])."""
    calls.append((qh.shape, kh.shape))
    if mqa:
        kh, vh = kh[:, None], vh[:, None]
    S = qh.shape[2]
    s = jnp.einsum("bhqd,bhkd->bhqk", qh.astype(jnp.float32), kh.astype(jnp.float32))
    mask = jnp.tril(jnp.ones((S, S), bool))[None, None]
    if seg is not None:
        mask = mask & (seg[:, None, :, None] == seg[:, None, None, :])
    p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p, vh.astype(jnp.float32)).astype(vh.dtype)


@pytest.mark.parametrize("mesh_shape, heads", [
    ({"fsdp": 4, "tensor": 2}, (8, 2)),   # grouped-query, heads over tensor
    ({"data": 2, "fsdp": 4}, (4, 4)),     # rows only
    ({"fsdp": 2, "tensor": 4}, (8, 1)),   # multi-query: the kv head replicated over the head shards
    ({"fsdp": 4, "tensor": 2}, (3, 1)),   # 3 heads do not split over tensor=2: heads replicated
])
@pytest.mark.parametrize("packed", [False, True])
def test_sharded_pallas_path_gives_each_device_its_rows_and_heads(monkeypatch, mesh_shape, heads, packed):
    calls = []
    monkeypatch.setattr(attention, "_splash_local",
                        lambda *a, **kw: local_reference(*a, **kw, calls=calls))
    axes = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1} | mesh_shape
    mesh = make_mesh(axes, jax.devices()[:8])
    H, K = heads
    B, S, Dh = 8, 32, 16
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32)
               for shape in ((B, S, H, Dh), (B, S, K, Dh), (B, S, K, Dh)))
    segments = jnp.asarray(np.repeat(np.arange(4), S // 4)[None].repeat(B, 0), jnp.int32) if packed else None
    expected = attention.dense_attention(q, k, v, attention.causal_ranges(B, S, segment_ids=segments).dense(S))

    run = jax.jit(lambda q, k, v, s: attention.attention(
        q, k, v, attention.causal_ranges(B, S, segment_ids=s), impl="pallas_tpu", self_attention=True,
        segment_ids=s))
    row_spec = NamedSharding(mesh, P(("data", "fsdp"), None))
    with jax.set_mesh(mesh):
        got = run(*(jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp")))) for x in (q, k, v)),
                  None if segments is None else jax.device_put(segments, row_spec))
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, rtol=2e-5)
    row_shards = axes["data"] * axes["fsdp"]
    head_shards = axes["tensor"] if H % axes["tensor"] == 0 else 1
    assert calls and calls[0][0] == (B // row_shards, H // head_shards, S, Dh)


def test_without_a_mesh_the_kernel_sees_the_whole_arrays(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "_splash_local", lambda *a, **kw: local_reference(*a, **kw, calls=calls))
    B, S, H, K, Dh = 2, 16, 4, 2, 8
    q, k, v = (jnp.ones((B, S, n, Dh), jnp.float32) for n in (H, K, K))
    attention.attention(q, k, v, attention.causal_ranges(B, S), impl="pallas_tpu", self_attention=True)
    assert calls == [((B, H, S, Dh), (B, H, S, Dh))]
