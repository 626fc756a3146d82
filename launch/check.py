"""Pre-flight checks of the launch scripts: the slice or GPU count, the gin config and its mesh, the run directory.

The bash launchers (`launch/tpu_vm/tpu.sh`, `launch/tpu_vm/sweep.sh`, `launch/gpu/*.sh`) call this before they spend
anything (no VM is created, no job submitted until it passes). It parses the gin config exactly as `trace-jax train`
does (`trace_jax.rl.gin_setup.parse`), resolves `MeshConfig` against the device count of the slice, and prints
what the launcher needs as data: NUL-terminated NAME, VALUE pairs (`NAME[]` appends to an array), which
`launch/lib.sh`'s `preflight` reads with `read -d ''` into the variables it knows, never through `eval`. On a bad
argument it prints one line naming it and the fix to stderr and exits 2.

    python launch/check.py tpu --topology v5e:4x4 --run-dir /mnt/shared/runs/q4b --gin-file configs/qwen3_4b.gin
    python launch/check.py slice --topology v5p:2x2x2                 # the slice name alone
    python launch/check.py gpu --num-devices 16 --run-dir /shared/runs/q4b --gin-file configs/qwen3_4b.gin
    python launch/check.py sweep configs/sweeps/horizon.gin --topology v5e:2x2 --runs-root /mnt/shared/sweeps
    python launch/check.py lock           # pins of the runtime dependencies as installed here (constraints.txt)

TPU slices are named like `trace-jax plan --topology` names them (`v5e:4x4`, `v5p:2x2x2`, `v6e:2x4`, `v4:2x2x1`) or
by their gcloud accelerator type (`v5litepod-16`, `v5p-16`, `v6e-8`, `v4-8`). Every v4 and later chip is one JAX
device (v4 and v5p fuse their two TensorCores: megacore), so the mesh must multiply to the chip count.

This module knows the config parser, TPU slice names and the trainer's CLI flags; it knows nothing about gcloud,
SLURM or training itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shlex
import sys
from pathlib import Path

# The launcher only reads configs; keep JAX off any accelerator of the machine it runs on (a login node, a laptop).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `python launch/check.py` from a checkout, with or without an installed package
    sys.path.insert(0, str(REPO_ROOT))


@dataclasses.dataclass(frozen=True)
class Generation:
    """A TPU generation: how gcloud names its slices and which software image it boots."""

    name: str  # as in `v5e:4x4`
    accelerator_prefix: str  # gcloud accelerator type = f"{prefix}-{count}"
    count_is_cores: bool  # True: the accelerator type counts TensorCores (2 per chip), not chips
    dims: int  # topology dimensions (2D torus or 3D)
    runtime_version: str  # the TPU VM software image the launcher boots by default
    shapes: tuple[str, ...] = ()  # the supported 2D shapes; () = any AxBxC (gcloud checks the exact 3D shape)


GENERATIONS = {
    g.name: g for g in (
        Generation("v4", "v4", True, 3, "tpu-ubuntu2204-base"),
        Generation("v5p", "v5p", True, 3, "v2-alpha-tpuv5"),
        Generation("v5e", "v5litepod", False, 2, "v2-alpha-tpuv5-lite",
                   ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
        Generation("v6e", "v6e", False, 2, "v2-alpha-tpuv6e",
                   ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
    )
}
_ACCELERATOR_PREFIXES = {g.accelerator_prefix: g for g in GENERATIONS.values()}


class LaunchError(ValueError):
    """A launch argument or the config it names cannot work; the message names it and the fix."""


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU slice: generation, chip count, gcloud accelerator type and default runtime version."""

    generation: Generation
    chips: int
    topology: str  # "4x4" (the shape), or "" when named by accelerator type

    @property
    def accelerator_type(self) -> str:
        count = self.chips * 2 if self.generation.count_is_cores else self.chips
        return f"{self.generation.accelerator_prefix}-{count}"

    @property
    def devices(self) -> int:
        return self.chips


def parse_slice(text: str) -> Slice:
    """`v5e:4x4` or `v5litepod-16` -> Slice. Raises LaunchError naming the accepted forms."""
    known = ", ".join(f"{g.name}:{g.shapes[2] if g.shapes else '2x2x1'}" for g in GENERATIONS.values())
    match = re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+)+)", text or "")
    if match:
        name, shape = match.groups()
        if name not in GENERATIONS:
            raise LaunchError(f"--topology {text!r}: unknown TPU generation {name!r}; known: "
                              f"{', '.join(GENERATIONS)} (e.g. {known})")
        generation = GENERATIONS[name]
        sizes = [int(s) for s in shape.split("x")]
        if len(sizes) != generation.dims:
            raise LaunchError(f"--topology {text!r}: {name} slices are {generation.dims}D "
                              f"(e.g. {name}:{'x'.join(['2'] * generation.dims)})")
        if generation.shapes and shape not in generation.shapes:
            raise LaunchError(f"--topology {text!r}: {name} has no {shape} slice; supported shapes: "
                              f"{', '.join(generation.shapes)}")
        if min(sizes) < 1:
            raise LaunchError(f"--topology {text!r}: every dimension must be >= 1")
        return Slice(generation, math.prod(sizes), shape)
    match = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", text or "")
    if match and match.group(1) in _ACCELERATOR_PREFIXES:
        generation = _ACCELERATOR_PREFIXES[match.group(1)]
        count = int(match.group(2))
        if count < 1 or (generation.count_is_cores and count % 2):
            raise LaunchError(f"--topology {text!r}: {generation.accelerator_prefix} accelerator types count "
                              "TensorCores, 2 per chip: the number must be even (v5p-8 = 4 chips)")
        return Slice(generation, count // 2 if generation.count_is_cores else count, "")
    raise LaunchError(f"--topology {text!r} is not a TPU slice; write GENERATION:SHAPE ({known}) or a gcloud "
                      f"accelerator type ({', '.join(p + '-N' for p in _ACCELERATOR_PREFIXES)})")


def check_run_dir(run_dir: str, *, durable: bool) -> None:
    """The trainer resumes from `run_dir`, so it must be a local or mounted path (not a URL); on a TPU VM, which a
    preemption wipes, it must be absolute on storage mounted on every worker (a gcsfuse bucket or an NFS share)."""
    if not run_dir:
        raise LaunchError("--run-dir is required: the run resumes from it after a preemption or a restart")
    if re.match(r"^[a-z][a-z0-9+.-]*://", run_dir):
        raise LaunchError(f"--run-dir {run_dir!r}: the trainer writes its run directory with local file I/O, so a "
                          "URL does not work; mount the bucket on every host (gcsfuse, e.g. /mnt/gcs) or use a shared "
                          "disk (NFS/Filestore) and pass that absolute path (docs/launch.md, 'Durable storage')")
    if durable and not run_dir.startswith("/"):
        raise LaunchError(f"--run-dir {run_dir!r} is relative: every host must write the same run directory on "
                          "durable storage that survives the VM (a preemption deletes its disk); pass an absolute "
                          "path on a gcsfuse or NFS mount present on every worker, e.g. /mnt/gcs/runs/qwen3_4b")


def check_config(gin_files, gin_params, devices: int, where: str, *, workers_copy: bool = False) -> dict[str, int]:
    """Parse the config as `trace-jax train` does and resolve its mesh on `devices` devices; returns the axis sizes.

    With `workers_copy` (TPU VMs, which run from a fresh copy of the checkout), a pretrained checkpoint must be an
    absolute path on a mount every worker has.

    Raises LaunchError naming the binding (gin errors) or the MeshConfig axes and the slice (mesh errors)."""
    from trace_jax.train.config import MESH_AXES, TrainConfigError
    from trace_jax.rl.gin_setup import ConfigError, parse
    from trace_jax.rl.pipeline import check_compatible

    for path in gin_files:
        if not Path(path).is_file() and not (REPO_ROOT / path).is_file():
            raise LaunchError(f"--gin-file {path!r} does not exist (relative paths are from the repository root, "
                              f"e.g. configs/qwen3_4b.gin)")
    try:
        config = parse(gin_files, gin_params)
    except ConfigError as error:
        raise LaunchError(str(error)) from None
    checkpoint = config.train.checkpoint
    if workers_copy and checkpoint and not checkpoint.startswith(("/", "gguf:")):
        raise LaunchError(f"TrainConfig.checkpoint = {checkpoint!r} is relative: on the workers it would resolve "
                          "inside their copy of the checkout, which setup replaces; put the Hugging Face checkpoint "
                          "on a mount every worker has and bind it absolutely, e.g. --gin-param "
                          "\"TrainConfig.checkpoint = '/mnt/gcs/models/Qwen3-4B'\"")
    try:
        check_compatible(config.credit, config.loss, config.update,
                         config.train.prompts_per_step * config.rollout.group_size)
    except ValueError as error:
        raise LaunchError(str(error)) from None
    try:
        sizes = config.mesh.axis_sizes(devices)
    except TrainConfigError as error:
        bound = {axis: getattr(config.mesh, axis) for axis in MESH_AXES}
        raise LaunchError(f"the mesh does not fit {where}: {error} (bound: MeshConfig "
                          f"{' '.join(f'{a}={s}' for a, s in bound.items())}); {_mesh_fix(bound, devices)}") from None
    rows = config.train.prompts_per_step * config.rollout.group_size
    micro_rows = rows // ((config.update.mini_batches if config.update else 1) * config.loss.micro_batches)
    batch_shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    if micro_rows % batch_shards:
        print(f"warning: a micro-batch holds {micro_rows} rows, not divisible by the {batch_shards} batch shards "
              f"(data x fsdp x expert) of {where}: the devices cannot each take an equal share of every "
              "micro-batch (idle or duplicated work); fewer LossConfig.micro_batches or more rows per step fixes it",
              file=sys.stderr)
    return sizes


def _mesh_fix(bound: dict[str, int], devices: int) -> str:
    """A binding that makes the axes multiply to `devices`: each fixed axis cut to what still divides the rest."""
    remaining, fixed = devices, dict(bound)
    for axis, size in bound.items():
        if size != -1:
            fixed[axis] = math.gcd(size, remaining)
            remaining //= fixed[axis]
    if -1 not in fixed.values() and remaining > 1:
        fixed["fsdp"] = -1
    changes = [f"--gin-param 'MeshConfig.{a} = {s}'" for a, s in fixed.items() if s != bound[a]]
    return (f"the axes must multiply to {devices} (one may be -1 = the rest); e.g. " + " ".join(changes)
            if changes else f"the axes must multiply to {devices} (one may be -1 = the rest)")


def _assign(name: str, value) -> list[tuple[str, str]]:
    """(name, value) records of one variable; a list becomes one `name[]` record per element."""
    if isinstance(value, (list, tuple)):
        return [(f"{name}[]", str(v)) for v in value]
    return [(name, str(value))]


def _mesh_text(sizes: dict[str, int]) -> str:
    return " ".join(f"{axis}={size}" for axis, size in sizes.items())


def _tpu(args) -> list[str]:
    tpu_slice = parse_slice(args.topology)
    check_run_dir(args.run_dir, durable=True)
    where = f"{args.topology} ({tpu_slice.chips} chips)"
    sizes = check_config(args.gin_file, args.gin_param, tpu_slice.devices, where, workers_copy=True)
    return [*_assign("ACCELERATOR_TYPE", tpu_slice.accelerator_type),
            *_assign("RUNTIME_VERSION", tpu_slice.generation.runtime_version),
            *_assign("CHIPS", tpu_slice.chips), *_assign("MESH", _mesh_text(sizes))]


def _slice(args) -> list[str]:
    tpu_slice = parse_slice(args.topology)
    return [*_assign("ACCELERATOR_TYPE", tpu_slice.accelerator_type),
            *_assign("RUNTIME_VERSION", tpu_slice.generation.runtime_version), *_assign("CHIPS", tpu_slice.chips)]


def _gpu(args) -> list[str]:
    if args.num_devices < 1:
        raise LaunchError(f"the GPU count must be >= 1, got {args.num_devices}")
    check_run_dir(args.run_dir, durable=False)
    sizes = check_config(args.gin_file, args.gin_param, args.num_devices, f"{args.num_devices} GPUs")
    return _assign("MESH", _mesh_text(sizes))


def _sweep(args) -> list[str]:
    from trace_jax.rl.gin_setup import ConfigError
    from trace_jax.rl.sweep import expand, load_sweep

    tpu_slice = parse_slice(args.topology)
    check_run_dir(args.runs_root, durable=True)
    try:
        sweep = load_sweep(args.sweep_file)
    except ConfigError as error:
        raise LaunchError(str(error)) from None
    runs = expand(sweep, runs_root=args.runs_root)
    counts, arguments = [], []
    for run in runs:
        check_config(run.gin_files, run.gin_params, tpu_slice.devices,
                     f"{args.topology} ({tpu_slice.chips} chips) in sweep run {run.name!r}", workers_copy=True)
        parts = shlex.split(run.command())[4:]  # the arguments after `python -m trace_jax.cli train`
        counts.append(len(parts))
        arguments.extend(parts)
    # every run's arguments in one flat array, RUN_ARGC[i] of them for run i (bash has no nested arrays)
    return [*_assign("SWEEP_NAME", sweep.name), *_assign("RUN_NAMES", [r.name for r in runs]),
            *_assign("RUN_ARGC", counts), *_assign("RUN_ARGV", arguments)]


def _lock(_args) -> list[str]:
    """Exact pins of pyproject's runtime dependencies as installed here, and of libtpu as jax[tpu] requires it."""
    import importlib.metadata as metadata
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    lines = ["# Pinned runtime dependencies the launchers install on every worker (`pip install -c`). Regenerate",
             "# with `python launch/check.py lock > launch/constraints.txt` in an environment whose tests pass."]
    for requirement in project["dependencies"]:
        name = Requirement(requirement).name
        lines.append(f"{name}=={metadata.version(name)}")
    # libtpu is not installed on a CPU host: pin the version the installed jax's `tpu` extra requires.
    libtpu = next(Requirement(r.split(";")[0]) for r in metadata.requires("jax") if r.startswith("libtpu"))
    lines.append(f"libtpu{libtpu.specifier}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    """The preflight's command line (`--kebab-case` flags with snake_case aliases, as `trace-jax`'s)."""
    parser = argparse.ArgumentParser(prog="launch/check.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    config_args = argparse.ArgumentParser(add_help=False)
    config_args.add_argument("--gin-file", "--gin_file", action="append", default=[])
    config_args.add_argument("--gin-param", "--gin_param", action="append", default=[])
    config_args.add_argument("--run-dir", "--run_dir", default="")
    tpu = commands.add_parser("tpu", parents=[config_args], help="a TPU slice")
    tpu.add_argument("--topology", required=True)
    only_slice = commands.add_parser("slice", help="a TPU slice name alone")
    only_slice.add_argument("--topology", required=True)
    gpu = commands.add_parser("gpu", parents=[config_args], help="GPUs")
    gpu.add_argument("--num-devices", "--num_devices", type=int, required=True)
    sweep = commands.add_parser("sweep", help="every run of a sweep on a TPU slice")
    sweep.add_argument("sweep_file")
    sweep.add_argument("--topology", required=True)
    sweep.add_argument("--runs-root", "--runs_root", required=True)
    commands.add_parser("lock", help="pins of the runtime dependencies installed here")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("tpu", "gpu") and not args.gin_file:
        from trace_jax.rl.cli import DEFAULT_GIN

        args.gin_file = [DEFAULT_GIN]  # what `trace-jax train` runs without --gin-file
    if args.command == "lock":
        print("\n".join(_lock(args)))
        return 0
    handler = {"tpu": _tpu, "slice": _slice, "gpu": _gpu, "sweep": _sweep}[args.command]
    try:
        records = handler(args)
    except LaunchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write("".join(f"{name}\0{value}\0" for name, value in records))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
