"""The Pallas TPU (splash) attention path lowers and compiles for a real TPU topology, on this CPU host.

Needs `libtpu` (the optional `tpu` extra: `pip install -e .[tpu]`); without it the test skips and says so. No TPU
is used: `jax.experimental.topologies` describes a v5e chip and the program is compiled ahead of time for it.
Run it in an environment of its own (libtpu makes JAX probe for a TPU at import in every process).
"""

import importlib.util

import pytest

if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed (pip install -e '.[tpu]' in a separate venv to AOT-compile the Pallas TPU "
                "attention kernel)", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from trace_jax import plan  # noqa: E402
from trace_jax.models import attention  # noqa: E402

pytestmark = pytest.mark.usefixtures("tpu_compiles")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tpu_device():
    return plan.tpu_devices(plan.parse_topology("v5e:1x1"))[0]


def compile_for(device, fn, *shapes):
    """Ahead-of-time compile `fn` for `device` (a topology device, no hardware) on abstract inputs."""
    args = [jax.ShapeDtypeStruct(s, d, sharding=SingleDeviceSharding(device)) for s, d in shapes]
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).compile()


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("packed", [False, True])
def test_pallas_tpu_causal_attention_and_its_gradient_compile_for_a_v5e(tpu_device, heads, packed):
    H, K = heads
    B, S, Dh = 2, 1024, 128

    def loss(q, k, v, segments):
        out = attention.attention(q, k, v, attention.causal_ranges(B, S, segment_ids=segments if packed else None),
                                  impl="pallas_tpu", self_attention=True, segment_ids=segments if packed else None)
        return jnp.sum(out.astype(jnp.float32))

    compiled = compile_for(tpu_device, jax.grad(loss, argnums=(0, 1, 2)),
                           ((B, S, H, Dh), jnp.bfloat16), ((B, S, K, Dh), jnp.bfloat16),
                           ((B, S, K, Dh), jnp.bfloat16), ((B, S), jnp.int32))
    assert 'custom_call_target="tpu_custom_call"' in compiled.as_text()  # the Mosaic kernel, not an XLA fallback


@pytest.mark.parametrize("mesh_shape, heads", [
    ({"fsdp": 4}, (8, 2)),                 # rows over fsdp, grouped-query heads
    ({"fsdp": 2, "tensor": 2}, (8, 8)),    # rows over fsdp, heads over tensor
    ({"data": 2, "tensor": 2}, (8, 1)),    # multi-query: the one kv head replicated over the head shards
])
def test_pallas_tpu_attention_and_its_gradient_compile_on_a_multi_chip_v5e_mesh(mesh_shape, heads):
    """Under a mesh of 4 chips the Mosaic kernel runs per device inside `shard_map` (GSPMD cannot partition it:
    without the shard_map this lowering fails with "Mosaic kernels cannot be automatically partitioned")."""
    import math

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from trace_jax.models.sharding import make_mesh

    devices = plan.tpu_devices(plan.parse_topology("v5e:2x2"))
    axes = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1} | mesh_shape
    assert math.prod(axes.values()) == len(devices) == 4
    mesh = make_mesh(axes, devices)
    H, K = heads
    B, S, Dh = 4, 1024, 128
    rows = tuple(a for a in ("data", "fsdp") if axes[a] > 1)
    heads_axis = "tensor" if axes["tensor"] > 1 else None

    def loss(q, k, v, segments):
        out = attention.attention(q, k, v, attention.causal_ranges(B, S, segment_ids=segments), impl="pallas_tpu",
                                  self_attention=True, segment_ids=segments)
        return jnp.sum(out.astype(jnp.float32))

    def arg(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.int32 if len(shape) == 2 else jnp.bfloat16,
                                    sharding=NamedSharding(mesh, spec))

    args = (arg((B, S, H, Dh), P(rows, None, heads_axis, None)),
            arg((B, S, K, Dh), P(rows, None, heads_axis if K % 2 == 0 else None, None)),
            arg((B, S, K, Dh), P(rows, None, heads_axis if K % 2 == 0 else None, None)),
            arg((B, S), P(rows, None)))
    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(
            lowering_platforms=("tpu",)).compile()
    text = compiled.as_text()
    assert 'custom_call_target="tpu_custom_call"' in text  # the Mosaic kernel, not an XLA fallback
    # Each device runs the kernel on its own shard: the kernel's q operand is [B / row shards, H / head shards, S].
    local_b = B // math.prod(axes[a] for a in rows)
    local_h = H // (axes["tensor"] if heads_axis else 1)
    assert f"bf16[{local_h},{S},{Dh}]" in text or f"bf16[{local_b},{local_h},{S},{Dh}]" in text
