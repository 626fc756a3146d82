"""MoE dispatch side by side: the GSPMD "sort" dispatch vs the expert-parallel "all_to_all" dispatch.

Two parts, both on fake CPU devices (set before JAX starts):

1. Compiled, nothing allocated: one MoE layer's forward + backward with Qwen3-30B-A3B's layer shapes (128 experts,
   top 8, D=2048, Fe=768, bfloat16) and T tokens per device, lowered from abstract arrays on an `expert` mesh.
   Reports the per-device bytes XLA plans (arguments, temporaries) and the collectives in the compiled HLO.
2. Run: a scaled-down layer (fits a laptop), forward + backward, calls of the contenders interleaved, best of
   several repeats; the time ratio is a CPU figure (fake devices share the cores), so read it for direction only.

    python benchmarks/moe_dispatch_bench.py [--devices 8] [--tokens-per-device 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import time


def _setup_devices(n: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


CONTENDERS = (("sort", {"moe_dispatch": "sort"}),
              ("all_to_all dropless", {"moe_dispatch": "all_to_all"}),
              ("all_to_all cf=1.25", {"moe_dispatch": "all_to_all", "moe_capacity_factor": 1.25}))


def _layer_step(config):
    """jit of d(sum(out * probe))/d(x, weights) through one MoE layer (`decoder.mlp_block`)."""
    import jax
    import jax.numpy as jnp

    from trace_jax.models import decoder

    def loss(moe, x, probe):
        out, stats = decoder.mlp_block(config, {"moe": moe}, x)
        return jnp.sum(out.astype(jnp.float32) * probe) + stats[2]

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _shardings(config, mesh, batch, length):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from trace_jax.models.sharding import logical_to_sharding

    E, D, Fe = config.num_experts, config.hidden_size, config.moe_intermediate_size
    axes = {"router": P("embed", None), "gate_proj": P("experts", "embed", "mlp"),
            "up_proj": P("experts", "embed", "mlp"), "down_proj": P("experts", "mlp", "embed")}
    shapes = {"router": (D, E), "gate_proj": (E, D, Fe), "up_proj": (E, D, Fe), "down_proj": (E, Fe, D)}
    moe = logical_to_sharding(axes, mesh, shapes=shapes)
    x = logical_to_sharding(P("batch", "length", "embed"), mesh, shapes=(batch, length, D))
    probe = NamedSharding(mesh, x.spec)
    abstract = lambda shape, dtype, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    dtype = jax.numpy.dtype(config.dtype)
    args = ({k: abstract(shapes[k], dtype, moe[k]) for k in shapes}, abstract((batch, length, D), dtype, x),
            abstract((batch, length, D), jax.numpy.float32, probe))
    return args


_COLLECTIVE = re.compile(r"= (\(.*?\)|\S+) (all-gather|all-to-all|all-reduce|reduce-scatter|collective-permute)"
                         r"(?:-start)?\(")
_ARRAY = re.compile(r"(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}


def collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes of the results of each kind of collective in a compiled (per-device) HLO module."""
    totals: dict[str, int] = {}
    for shapes, op in _COLLECTIVE.findall(hlo):
        size = sum(_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
                   for dtype, dims in _ARRAY.findall(shapes))
        totals[op] = totals.get(op, 0) + size
    return totals


def compiled_table(devices: int, tokens_per_device: int) -> list[str]:
    import jax

    from trace_jax import models

    mesh = models.make_mesh({"expert": devices})
    base = models.get_preset("qwen3-30b-a3b", dtype="bfloat16", param_dtype="bfloat16")
    batch, length = devices, tokens_per_device
    mib = lambda b: f"{b / 2**20:10.1f}"
    rows = ["| dispatch            | temp MiB/dev | all-gather MiB | all-to-all MiB | all-reduce MiB |",
            "|---------------------|--------------|----------------|----------------|----------------|"]
    for name, overrides in CONTENDERS:
        config = base.replace(**overrides)
        with jax.set_mesh(mesh):
            compiled = _layer_step(config).lower(*_shardings(config, mesh, batch, length)).compile()
        moved = collective_bytes(compiled.as_text())
        rows.append(f"| {name:19s} | {mib(compiled.memory_analysis().temp_size_in_bytes):>12s} | "
                    f"{mib(moved.get('all-gather', 0)):>14s} | {mib(moved.get('all-to-all', 0)):>14s} | "
                    f"{mib(moved.get('all-reduce', 0)):>14s} |")
    return rows


def timed_table(devices: int, repeats: int) -> list[str]:
    import jax
    import numpy as np

    from trace_jax import models

    mesh = models.make_mesh({"expert": devices})
    base = models.get_preset("tiny-qwen3-moe", num_experts=4 * devices, num_experts_per_tok=4, hidden_size=256,
                             moe_intermediate_size=128)
    batch, length = devices, 256
    rng = np.random.RandomState(0)
    inputs = jax.tree_util.tree_map(  # the same arrays for every contender
        lambda a: jax.device_put((rng.normal(size=a.shape) * 0.05).astype(a.dtype), a.sharding),
        _shardings(base, mesh, batch, length))
    steps = {}
    with jax.set_mesh(mesh):
        for name, overrides in CONTENDERS:
            step = _layer_step(base.replace(**overrides))
            jax.block_until_ready(step(*inputs))  # compile
            steps[name] = step
        best = {name: float("inf") for name in steps}
        for _ in range(repeats):
            for name, step in steps.items():  # interleaved: every contender sees the same load
                start = time.perf_counter()
                jax.block_until_ready(step(*inputs))
                best[name] = min(best[name], time.perf_counter() - start)
    ref = best["sort"]
    rows = ["| dispatch            | best ms | vs sort |", "|---------------------|---------|---------|"]
    rows += [f"| {name:19s} | {t * 1e3:7.1f} | {ref / t:6.2f}x |" for name, t in best.items()]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--tokens-per-device", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    _setup_devices(args.devices)
    import jax

    print(f"jax {jax.__version__}, {args.devices} fake CPU devices, mesh expert={args.devices}")
    print(f"\nOne Qwen3-30B-A3B MoE layer (E=128, k=8, D=2048, Fe=768, bf16), forward + backward, "
          f"{args.tokens_per_device} tokens per device, compiled from abstract arrays:")
    print("\n".join(compiled_table(args.devices, args.tokens_per_device)))
    if not args.skip_timing:
        print(f"\nScaled-down layer (E={4 * args.devices}, k=4, D=256, Fe=128, f32, 256 tokens per device), "
              f"forward + backward, best of {args.repeats} interleaved:")
        print("\n".join(timed_table(args.devices, args.repeats)))


if __name__ == "__main__":
    main()
