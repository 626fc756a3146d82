"""The reference scorer's and the rollout engine's prefill programs, built by their public builders (the ones the
loop and `trace-jax plan` call), compile for a 4-chip TPU mesh with `attention_impl = "pallas_tpu"`, on this CPU host.

The scorer's cached layout prefills the trajectory with causal self-attention: the Pallas splash kernel, a
per-device Mosaic kernel that GSPMD cannot partition. It lowers only when the program is traced under its mesh
(`fork.fork_scores_program(..., mesh=)`), where `models.attention` wraps it in `shard_map`. The engine's prefill
reads a page pool (`paged.paged_attention`, the XLA path): it must compile all the same.

Needs `libtpu` (the `tpu` extra); without it the module skips and says so. No TPU is used: the programs are
compiled ahead of time for `jax.experimental.topologies`' v5e:2x2.
"""

import importlib.util

import pytest

if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed (pip install -e '.[tpu]' in a separate venv to AOT-compile the Pallas TPU "
                "attention kernel)", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from trace_jax import models, plan  # noqa: E402
from trace_jax.rollout import paged  # noqa: E402
from trace_jax.scoring import fork  # noqa: E402

pytestmark = pytest.mark.usefixtures("tpu_compiles")  # see tests/conftest.py

MESHES = {"fsdp=4": {"fsdp": 4}, "fsdp=2,tensor=2": {"fsdp": 2, "tensor": 2}}
KERNEL = 'custom_call_target="tpu_custom_call"'  # the Mosaic kernel in the compiled program


@pytest.fixture(scope="module")
def config():
    return models.get_preset("tiny-qwen3").replace(attention_impl="pallas_tpu", dtype="bfloat16")


@pytest.fixture(scope="module", params=list(MESHES), ids=list(MESHES))
def mesh(request):
    devices = plan.tpu_devices(plan.parse_topology("v5e:2x2"))
    return models.make_mesh({"data": 1, "fsdp": 1, "tensor": 1, "expert": 1} | MESHES[request.param], devices)


def abstract_params(config, mesh, rules):
    shapes = jax.eval_shape(lambda: models.init_params(config, jax.random.PRNGKey(0), dtype="float32"))
    return jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                                  models.param_shardings(config, mesh, rules))


def test_the_cached_scoring_program_compiles_with_the_pallas_kernel_on_a_tpu_mesh(config, mesh):
    # 4 rows of 512 tokens, 3 states, an 8-token answer: the layout the paper's 48K-token rows take
    n, length, slots, m = fork.padded_shape(4, 512, 3, 8, mesh=mesh)
    assert fork.choose_layout(length, slots, m, rows=n) == "cached"

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=fork.row_sharding(mesh, len(shape)))

    args = (arg((n, length), jnp.int32), arg((n, slots), jnp.int32), arg((n, slots), jnp.bool_),
            arg((n, m), jnp.int32), arg((n, m), jnp.int32))
    program = fork.fork_scores_program(config, layout="cached", mesh=mesh)
    compiled = program.lower(abstract_params(config, mesh, models.DEFAULT_RULES), *args).compile()
    assert KERNEL in compiled.as_text()


def test_the_engines_prefill_program_compiles_with_pallas_attention_configured_on_a_tpu_mesh(config, mesh):
    rows, width, max_len, page_size, pages = 4, 128, 512, 16, 128
    rules = models.ROLLOUT_RULES
    state = paged.abstract_state(config, pages, page_size, rows, mesh=mesh, rules=rules)
    layout = paged.state_layout(state)
    replicated = NamedSharding(mesh, P())

    def host(shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=replicated)

    table = paged.pages_for(max_len, page_size)
    args = (abstract_params(config, mesh, rules), state, host((rows,)), host((rows, width)), host((rows,)),
            tuple(host((32,)) for _ in range(3)), host((rows,)), host((rows, table)), host((rows,)))
    compiled = paged.prefill_program(config, max_len, layout).lower(*args).compile()
    # the prefilled pool comes out in its own layout (pages over fsdp, kv heads over tensor)
    for got, want, shape in zip(jax.tree_util.tree_leaves(compiled.output_shardings),
                                jax.tree_util.tree_leaves(layout), jax.tree_util.tree_leaves(state)):
        assert got.is_equivalent_to(want, len(shape.shape)), (got, want)
