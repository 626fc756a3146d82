"""The scaling table of docs/scaling.md: `trace_jax.plan` for Qwen3-4B and Qwen3-30B-A3B at the paper's settings
(configs/qwen3_*.gin: lr 1e-6, G = 8, 128 trajectories per step, 48K context) on v5e-16, v5p-8, v5p-16 and v6e-8.

Each cell compiles the programs ahead of time for the slice on this CPU host (needs libtpu, the `tpu` extra, in
a venv of its own, with JAX_PLATFORMS=cpu) and writes one markdown row as soon as it is done, so a long run that
is cut short keeps its rows. The mesh is fsdp over every chip (the 30B-A3B: experts over up to 8 chips, fsdp
over the rest); `LossConfig.micro_batches` is set so that a micro-batch holds one row per batch shard, and
`UpdateConfig.scoring_batch` scores one row per batch shard per pass. Compute is bfloat16 with full remat
(float32 master weights and AdamW). A Qwen3-4B train-step compile takes 3-8 minutes on a loaded 2-core host;
each cell whose train step fits also compiles the 1-2 layer unrolled variants behind the step-time estimate
(`plan.estimate_train_time`: compiler XLA ops + attention kernel at the compiler's dot rate) and its implied MFU,
an upper bound (docs/scaling.md). `--validate` adds the 3-layer variant and prints it against the prediction.

    python benchmarks/scaling_bench.py [--models qwen3-4b,qwen3-30b-a3b] [--slices v5e-16,v5p-8,v5p-16,v6e-8]
        [--programs train,decode] [--out docs/scaling_table.md] [--cell MODEL@SLICE:MESH ...]

`--cell qwen3-4b@v5e-16:fsdp=8,tensor=2` adds a cell with its own mesh (repeatable).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from trace_jax import plan
from trace_jax.rl.gin_setup import parse

GIB = 1024**3
CONFIGS = {"qwen3-4b": "configs/qwen3_4b.gin", "qwen3-30b-a3b": "configs/qwen3_30b_a3b.gin"}
HEADER = ("| model | slice | mesh | micro-batches | train GiB/chip (args + temp = peak) | score GiB/chip | "
          "decode GiB/chip | verdict (train / whole step) | step time est. = compiler XLA ops + attention kernel "
          "(XLA FLOPs counted / expected) | implied MFU | compile s |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def default_mesh(model: str, chips: int) -> str:
    if model == "qwen3-30b-a3b":
        expert = math.gcd(8, chips)
        return f"fsdp={chips // expert},expert={expert}"
    return f"fsdp={chips}"


def plan_cell(model: str, slice_name: str, mesh_text: str, programs: tuple[str, ...], *,
              validate: bool = False) -> plan.PlanReport:
    topology = plan.parse_topology(slice_name)
    mesh = plan.parse_mesh(mesh_text, None)
    axes = mesh.axis_sizes(topology.num_chips)
    shards = axes["data"] * axes["fsdp"] * axes["expert"]
    base = parse([CONFIGS[model]], [])
    rows = base.train.prompts_per_step * base.rollout.group_size
    micro = max(1, rows // shards)
    run_config = parse([CONFIGS[model]], [f"LossConfig.micro_batches = {micro}",
                                          f"UpdateConfig.scoring_batch = {shards}"])
    plan_config = plan.PlanConfig(topology=slice_name, programs=programs, dtype="bfloat16", remat="full",
                                  validate_estimate=validate)
    return plan.plan(run_config, plan_config, mesh, model_preset=model)


def _cell_bytes(p: plan.ProgramReport | None) -> str:
    if p is None:
        return "not compiled"
    peak = p.peak_bytes
    text = f"{(p.argument_bytes or 0) / GIB:.1f} + {(p.temp_bytes or 0) / GIB:.1f} = "
    return text + (f">{peak / GIB:.1f} (OOM)" if p.out_of_memory else f"{peak / GIB:.1f}")


def row(model: str, slice_name: str, report: plan.PlanReport, seconds: float) -> str:
    train = report.program("train")
    hbm = report.topology.chip.hbm_bytes
    train_ok = train is not None and not train.out_of_memory and train.peak_bytes <= hbm
    e = report.estimate
    if e is None:
        time_text = "n/a" if train is None or train.out_of_memory else f"n/a ({report.estimate_missing})"
    else:
        time_text = (f"{e.seconds:.2f} s = {e.xla_seconds:.2f} + {e.kernel_seconds:.2f} "
                     f"({100 * e.xla_flops / e.expected_xla_flops:.1f}%)")
    mfu = report.train_mfu
    mesh = ",".join(f"{a}={n}" for a, n in report.mesh.items() if n > 1)
    return (f"| {model} | {slice_name} ({report.topology.name}) | {mesh} | {report.settings['micro_batches']} x "
            f"{report.settings['micro_batch_rows']} rows | {_cell_bytes(train)} | "
            f"{_cell_bytes(report.program('score'))} | {_cell_bytes(report.program('decode'))} | "
            f"{'FIT' if train_ok else 'DOES NOT FIT'} / {report.verdict} | {time_text} | "
            f"{'n/a' if mfu is None else f'{100 * mfu:.0f}%'} | {seconds:.0f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3-4b,qwen3-30b-a3b")
    parser.add_argument("--slices", default="v5e-16,v5p-8,v5p-16,v6e-8")
    parser.add_argument("--programs", default="train,decode")
    parser.add_argument("--cell", action="append", default=[], help="MODEL@SLICE:MESH, an extra cell")
    parser.add_argument("--out", default="docs/scaling_table.md", help="markdown table, one row per finished cell")
    parser.add_argument("--validate", action="store_true",
                        help="also compile each cell's 3-layer variant against the estimate's prediction")
    args = parser.parse_args()
    cells = [(m, s, default_mesh(m, plan.parse_topology(s).num_chips))
             for m in args.models.split(",") if m for s in args.slices.split(",") if s]
    for extra in args.cell:
        model, _, rest = extra.partition("@")
        slice_name, _, mesh = rest.partition(":")
        cells.append((model, slice_name, mesh))
    programs = tuple(args.programs.split(","))
    out = Path(args.out)
    out.write_text(HEADER + "\n")
    print(HEADER, flush=True)
    for model, slice_name, mesh in cells:
        start = time.perf_counter()
        report = plan_cell(model, slice_name, mesh, programs, validate=args.validate)
        line = row(model, slice_name, report, time.perf_counter() - start)
        with out.open("a") as f:
            f.write(line + "\n")
        print(line, flush=True)
        print(plan.format_report(report), flush=True)


if __name__ == "__main__":
    main()
