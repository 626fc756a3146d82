"""`trace-jax plan`: will this run fit? Compile its device programs ahead of time for a TPU topology on a CPU host.

    trace-jax plan --gin-file configs/qwen3_4b.gin --topology v5e:4x4 [--mesh fsdp=16] [--gin-param ...]

With `libtpu` (the optional `tpu` extra) and `jax.experimental.topologies`, the device programs of one RL step
are lowered and compiled for the named TPU slice, given the mesh, on abstract inputs (`jax.ShapeDtypeStruct`s
carrying their shardings; nothing is allocated). They are the entries of the one registry the loop's programs come
from (`rl.programs.programs`: the same builders, keyed alike, with the loop's argument shapes, shardings and static
arguments; tests/rl/test_programs.py records two RL steps against it), so a FIT verdict is a statement about what
the loop runs. Each kind is reported by its largest entry (most argument bytes per chip) and how many it has:

  * "reshard": `models.reshard_program`, the policy's params from the train layout to the rollout layout
               (`Placement.rollout_params`; after `models.cast_program` to `TrainConfig.rollout_dtype`);
  * "init":    `rollout.paged.init_pool_program`, the rollout engine's page pool, created sharded;
  * "prefill": `rollout.paged.prefill_program`, chunks of admissions, observations and recomputes, at every bucket
               of `rl.programs.paged_entries`;
  * "decode":  `rollout.paged.decode_program`, `RolloutConfig.sync_every` decode steps of the rows in flight, at
               every decode-batch and work-item bucket; the pool is every row's `max_context`, or as many pages
               as a per-chip KV budget holds (`rollout.paged.pages_within_budget`);
  * "score":   `scoring.fork.fork_scores_program`, the reference's prefix-fork pass, at every padded shape
               (`fork.padded_shape`) of the step's length buckets, scorer chunks (`scoring_batch`) and answers up
               to `--answer-tokens` (with `UpdateConfig.packing`, the packed-trajectory pass at every packed-row
               bucket where it takes the cached layout);
  * "behaviour": `rl.pipeline.behaviour_program`, the trainer's pi_old on each chunk of the batch (with
               `LossConfig.tis` only);
  * "train":   `train.step.make_train_step` on one mini-batch of the run's fixed update shape
               (`pipeline.update_shapes`: `trained_index` and `token_mask` included; with `UpdateConfig.packing`
               its largest packed-row count, every row alone), the donated train state.

For each, the compiler's per-device memory (arguments, outputs, temporaries, aliased) and its FLOPs. A phase's
peak adds what stays resident while it runs (the train state and the frozen reference always, in its
`TrainConfig.reference_dtype`; the rollout-layout copy and the KV cache are the rollout programs' own arguments),
and the verdict compares the largest peak with the chip's HBM: FIT, or DOES NOT FIT with what to change.

Step time: `compiled.cost_analysis()` (jax 0.10, libtpu) gives FLOPs, bytes accessed and "optimal_seconds" (the
TPU compiler's cost-model time) but counts each loop body once (the scans over layers, micro-batches and log-prob
chunks) and gives the Pallas attention kernel no cost. `estimate_train_time` therefore compiles 1-2 layer
variants of the same step with every scan unrolled (`make_train_step(..., unroll=True)`), extends their figures
linearly to the step's layers and micro-batches, and adds the attention kernels' FLOPs at the compiler's own dot
rate: a roofline estimate of the update, from which the implied MFU (`flops.flops_per_token`, the MFU convention,
over estimate x chips x peak) is an upper bound. `estimate_step_split` adds roofline estimates of the rollout
and the reference scoring at the compiler's own rates, for the whole step split into rollout, score and update.
docs/scaling.md says how it is checked and what it is not.

Decode roofline (`decode_rooflines`, with "decode" among the programs): for both rollout engines at the run's
setting, rows in flight and decode tokens/s per chip at the HBM-bandwidth roofline (`HBM_BANDWIDTH`), from
formulas of the config (so the dense engine's line needs no dense program), and for the paged engine the
compiled one-step decode program at the batch those rows run in, its `bytes accessed` against it: an estimate, not a
measurement. GPU targets
(`--topology h100:8`): no GPU compiler runs on a CPU host, so only what the shapes and shardings determine is
checked (resident bytes per device, FLOPs per step); temporaries and time are reported as not checked.

This module knows configs, the device programs' builders and the chip table; it runs nothing and knows nothing
about tools, data or files beyond the gin files it is handed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator: HBM per chip, dense bfloat16 peak (key of `flops.PEAK_FLOPS`), HBM bandwidth per chip in
    bytes/s (`HBM_BANDWIDTH`), cores per chip in slice names (`v5p-8` counts TensorCores: 4 chips), and the 2D/3D
    torus shapes of its standard slices."""

    name: str
    hbm_bytes: int
    peak_key: str
    platform: str = "tpu"
    cores_per_chip: int = 1
    dims: int = 2

    @property
    def hbm_bandwidth(self) -> float:
        return HBM_BANDWIDTH[self.name]

    @property
    def peak_flops(self) -> float:
        from trace_jax.train.flops import PEAK_FLOPS

        return PEAK_FLOPS[self.peak_key]


# HBM bandwidth per chip, bytes/s, the vendors' figures: Google Cloud TPU system architecture pages (v4 1200 GB/s,
# v5e 819 GB/s, v5p 2765 GB/s, v6e 1640 GB/s; cloud.google.com/tpu/docs/v4, v5e, v5p, v6e) and NVIDIA's data
# sheets (A100 80GB SXM 2039 GB/s, H100 SXM 3.35 TB/s, H200 4.8 TB/s). The decode roofline (`decode_rooflines`).
HBM_BANDWIDTH: dict[str, float] = {"v4": 1200e9, "v5e": 819e9, "v5p": 2765e9, "v6e": 1640e9, "a100": 2039e9,
                                   "h100": 3350e9, "h200": 4800e9}
CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", 32 * GIB, "tpu-v4", cores_per_chip=2, dims=3),
    "v5e": Chip("v5e", 16 * GIB, "tpu-v5e"),
    "v5p": Chip("v5p", 95 * GIB, "tpu-v5p", cores_per_chip=2, dims=3),
    "v6e": Chip("v6e", 32 * GIB, "tpu-v6e"),
    "a100": Chip("a100", 80 * GIB, "a100", platform="gpu"),
    "h100": Chip("h100", 80 * GIB, "h100", platform="gpu"),
    "h200": Chip("h200", 141 * GIB, "h200", platform="gpu"),
}
# Standard slice shapes by chip count (what `v5e-16`-style names mean).
_SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
_SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
              256: (4, 8, 8), 512: (8, 8, 8)}
PROGRAMS = ("train", "behaviour", "score", "reshard", "init", "prefill", "decode")
# the registry's kinds (`rl.programs.NAMES`) each program of the report is the largest entry of
KINDS = {"train": ("update",), "behaviour": ("behaviour",), "score": ("score",), "reshard": ("reshard",),
         "init": ("paged_init",), "prefill": ("paged_prefill",), "decode": ("paged_decode",)}


class PlanError(ValueError):
    """A topology, mesh or environment the plan cannot use; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """A parsed target: chip, torus shape (TPU) and number of chips; `name` is what libtpu is asked for."""

    chip: Chip
    shape: tuple[int, ...]
    num_chips: int

    @property
    def name(self) -> str:
        return f"{self.chip.name}:{'x'.join(map(str, self.shape))}"

    @property
    def slice_name(self) -> str:
        return f"{self.chip.name}-{self.num_chips * self.chip.cores_per_chip}"


def parse_topology(text: str) -> Topology:
    """`v5e:4x4`, `v5p:2x2x2`, slice names `v5e-16` / `v5p-8` (TensorCores for v4/v5p), or GPUs `h100:8`."""
    known = ", ".join(sorted(CHIPS))
    match = re.fullmatch(r"\s*([a-z0-9]+)\s*([:-])\s*([0-9x]+)\s*", text.lower())
    if not match or match.group(1) not in CHIPS:
        raise PlanError(f"--topology {text!r}: expected CHIP:SHAPE (v5e:4x4, v5p:2x2x2), a slice name (v5e-16, "
                        f"v5p-8) or GPU:COUNT (h100:8); known chips: {known}")
    chip, sep, rest = CHIPS[match.group(1)], match.group(2), match.group(3)
    if chip.platform == "gpu":
        parts = [int(p) for p in rest.split("x") if p]
        if not parts or min(parts) < 1:
            raise PlanError(f"--topology {text!r}: a GPU target is GPU:COUNT, e.g. h100:8 or h100:2x8 (hosts x GPUs)")
        return Topology(chip, tuple(parts), math.prod(parts))
    if sep == "-":
        if "x" in rest or int(rest) % chip.cores_per_chip:
            raise PlanError(f"--topology {text!r}: a slice name is {chip.name}-N with N "
                            f"{'TensorCores (2 per chip)' if chip.cores_per_chip == 2 else 'chips'}")
        chips = int(rest) // chip.cores_per_chip
        shapes = _SHAPES_3D if chip.dims == 3 else _SHAPES_2D
        if chips not in shapes:
            raise PlanError(f"--topology {text!r}: no standard {chip.name} slice of {chips} chips; known sizes: "
                            f"{', '.join(f'{chip.name}-{n * chip.cores_per_chip}' for n in shapes)}, or give the "
                            f"shape ({chip.name}:{'x'.join(['2'] * chip.dims)})")
        return Topology(chip, shapes[chips], chips)
    shape = tuple(int(p) for p in rest.split("x") if p)
    if len(shape) != chip.dims or min(shape) < 1:
        example = "4x4" if chip.dims == 2 else "2x2x2"
        raise PlanError(f"--topology {text!r}: a {chip.name} shape has {chip.dims} dimensions, e.g. "
                        f"{chip.name}:{example}")
    return Topology(chip, shape, math.prod(shape))


def parse_mesh(text: str | None, default):
    """`--mesh fsdp=8,tensor=2` (`MeshConfig.from_flag`: unnamed axes 1, one may be -1) -> a `MeshConfig`; None keeps
    `default`."""
    from trace_jax.train.config import MeshConfig, TrainConfigError

    if not text:
        return default
    try:
        return MeshConfig.from_flag(text)
    except TrainConfigError as error:
        raise PlanError(str(error)) from None


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """What to plan beyond the run's own configs.

    Attributes:
      topology: the target (`parse_topology` forms).
      programs: which of `PROGRAMS` ("train", "behaviour", "score", "reshard", "init", "prefill", "decode") to
        compile, each the largest of the registry's entries of its kind (`rl.programs`; a kind the
        run's step does not dispatch, e.g. "behaviour" without `LossConfig.tis`, is left out of the report).
      answer_tokens: tokens of the gold answer continuation the scorer appends after every state (template +
        answer; the run's real ones are short).
      dtype: compute dtype override of the policy ("" keeps the model config's); "bfloat16" is what TPUs want.
      remat: rematerialisation override ("" keeps the model config's).
      attention_impl: attention override; "" = the target platform's kernel when the config says "auto" (a CPU
        host would otherwise compile its own XLA path).
      estimate_time: also compile the small unrolled variants of the train step that give the whole step's
        roofline time estimate and implied MFU (`estimate_train_time`; 2-3 more compiles of 1-2 layer models).
      validate_estimate: also compile the 3-layer variant and report it against the estimate's prediction.
      kv_budget_gib: the rollout's per-chip KV-cache budget in GiB (None: `RolloutConfig.kv_budget_gib` where the
        run config has one, else none: a pool of every rollout row's `max_context`); the rollout programs are
        compiled for the pages it holds (`rollout.paged.pages_within_budget`).
    """

    topology: str
    programs: tuple[str, ...] = PROGRAMS
    answer_tokens: int = 32
    dtype: str = ""
    remat: str = ""
    attention_impl: str = ""
    estimate_time: bool = True
    validate_estimate: bool = False
    kv_budget_gib: float | None = None

    def __post_init__(self):
        parse_topology(self.topology)
        bad = [p for p in self.programs if p not in PROGRAMS]
        if bad or not self.programs:
            raise PlanError(f"--programs {','.join(self.programs)!r}: choose from {', '.join(PROGRAMS)}")
        if not isinstance(self.answer_tokens, int) or self.answer_tokens < 2:
            raise PlanError(f"--answer-tokens must be an int >= 2, got {self.answer_tokens!r}")
        if self.kv_budget_gib is not None and not self.kv_budget_gib > 0:
            raise PlanError(f"--kv-budget-gib must be > 0 (GiB of KV cache per chip), got {self.kv_budget_gib!r}")


# ------------------------------------------------------------------------------------------------ the model
def resolve_model(run_config, *, preset: str = "") -> tuple[Any, str]:
    """The policy's `ModelConfig` as the loop would build it, without weights; returns `(config, how)`.

    A fresh-init policy (`TrainConfig.model`) with the word tokenizer gets the tokenizer's vocabulary size (built
    in a temporary directory, as the loop does); a checkpoint directory's `config.json` is read; a checkpoint that
    is not on this host (e.g. configs/qwen3_4b.gin's placeholder) uses `preset`, or the preset whose name matches
    the directory's name (`Qwen3-4B` -> `qwen3-4b`).
    """
    from trace_jax import models

    train = run_config.train
    if preset:
        if preset not in models.preset_names():
            raise PlanError(f"--model-preset {preset!r}: unknown; presets: {', '.join(models.preset_names())}")
        return models.get_preset(preset), f"preset {preset} (--model-preset)"
    if train.model is not None:
        config = train.model
        if train.tokenizer == "word":
            from trace_jax.envs.oracle import trajectory_vocabulary
            from trace_jax.models.tokenizer import build_word_tokenizer, load_tokenizer

            with tempfile.TemporaryDirectory() as directory:
                vocab = len(load_tokenizer(build_word_tokenizer(trajectory_vocabulary(), directory)))
            config = config.replace(vocab_size=vocab)
            return config, f"TrainConfig.model, vocab {vocab} (the word tokenizer's)"
        return config, "TrainConfig.model"
    source = train.checkpoint
    if source == "gguf:smollm2":
        return models.get_preset("smollm2-135m"), "preset smollm2-135m (TrainConfig.checkpoint = 'gguf:smollm2')"
    if (Path(source) / "config.json").exists():
        return models.ModelConfig.from_hf(source, param_dtype="float32"), f"{source}/config.json"
    name = Path(source).name.lower()
    if name in models.preset_names():
        return models.get_preset(name), f"preset {name} ({source} is not on this host; matched by name)"
    raise PlanError(f"TrainConfig.checkpoint = {source!r} has no config.json on this host and matches no preset; "
                    f"pass --model-preset NAME ({', '.join(models.preset_names())}) or point the checkpoint at a "
                    "directory holding its config.json (only config.json is read)")


def _override_model(config, plan: PlanConfig, platform: str):
    from trace_jax.models.attention import resolve_impl

    changes = {}
    if plan.dtype:
        changes["dtype"] = plan.dtype
    if plan.remat:
        changes["remat"] = plan.remat
    impl = plan.attention_impl or config.attention_impl
    changes["attention_impl"] = resolve_impl(impl, platform)
    return config.replace(**changes)


# ------------------------------------------------------------------------------------------------ results
@dataclasses.dataclass
class ProgramReport:
    """One compiled program on one device (bytes per device; None = the compiler did not say / not checked)."""

    name: str
    shape: str
    argument_bytes: int | None = None
    output_bytes: int | None = None
    temp_bytes: int | None = None
    alias_bytes: int | None = None
    resident_other_bytes: int = 0
    flops: float | None = None
    bytes_accessed: float | None = None
    seconds: float | None = None
    compile_seconds: float | None = None
    model_flops: float | None = None
    out_of_memory: str = ""
    cost_keys: tuple[str, ...] = ()
    raw_seconds: float | None = None
    loops: int | None = None  # loops of > 1 iteration in the traced program (`loops_in`), when counted

    @property
    def program_bytes(self) -> int | None:
        if self.argument_bytes is None or self.temp_bytes is None:
            return None
        return self.argument_bytes + (self.output_bytes or 0) + self.temp_bytes - (self.alias_bytes or 0)

    @property
    def peak_bytes(self) -> int | None:
        own = self.program_bytes
        return None if own is None else own + self.resident_other_bytes


@dataclasses.dataclass
class PlanReport:
    """The whole plan: target, mesh, model, per-program reports, verdict and advice."""

    topology: Topology
    mesh: dict[str, int]
    model: str
    settings: dict[str, Any]
    programs: list[ProgramReport]
    resident: dict[str, int]
    checked: bool = True
    notes: list[str] = dataclasses.field(default_factory=list)
    advice: list[str] = dataclasses.field(default_factory=list)
    estimate: TimeEstimate | None = None
    estimate_missing: str = ""  # why there is no estimate (empty when there is one or none was asked for)
    split: StepSplit | None = None  # the whole step's time by phase (`estimate_step_split`)
    decode: list[DecodeRoofline] = dataclasses.field(default_factory=list)  # `decode_rooflines`, paged first

    @property
    def peak_bytes(self) -> int | None:
        peaks = [p.peak_bytes for p in self.programs if p.peak_bytes is not None]
        return max(peaks) if peaks else None

    @property
    def fits(self) -> bool | None:
        if any(p.out_of_memory for p in self.programs):
            return False
        peak = self.peak_bytes
        return None if peak is None or not self.checked else peak <= self.topology.chip.hbm_bytes

    @property
    def verdict(self) -> str:
        return {True: "FIT", False: "DOES NOT FIT", None: "NOT CHECKED"}[self.fits]

    def program(self, name: str) -> ProgramReport | None:
        return next((p for p in self.programs if p.name == name), None)

    @property
    def train_mfu(self) -> float | None:
        """Model FLOPs of the train step (`flops.flops_per_token`, the MFU convention) over (the whole step's
        roofline time `estimate.seconds` x the vendor peak of all chips); None without an estimate."""
        train = self.program("train")
        if train is None or self.estimate is None or not train.model_flops:
            return None
        return train.model_flops / (self.estimate.seconds * self.topology.chip.peak_flops * self.topology.num_chips)


# ------------------------------------------------------------------------------------------------ building
def libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def tpu_devices(topology: Topology):
    """The devices of `topology`'s slice, from libtpu's compile-only client (no TPU is opened)."""
    if not libtpu_installed():
        raise PlanError(f"planning for {topology.name} needs libtpu to compile TPU programs on this host: install "
                        "the `tpu` extra (pip install -e '.[tpu]', in a venv of its own: libtpu makes JAX probe "
                        "for a TPU at import) and run with JAX_PLATFORMS=cpu")
    import jax
    from jax.experimental import topologies

    # Compiling opens no TPU, so libtpu's one-process-per-host lock (/tmp/libtpu_lockfile) only makes concurrent
    # plans (and pytest workers) fail; it must be lifted before libtpu initialises.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # libtpu reads XLA_FLAGS once, at its first compile, and aborts the process on a flag its XLA does not know,
    # which includes XLA:CPU's own (`--xla_cpu_use_fusion_emitters`, ...). Those configure this host's CPU backend,
    # which reads them as it starts (so it starts here first), and mean nothing to a TPU compile: they leave this
    # process's XLA_FLAGS (and what the processes it starts inherit) for good.
    jax.devices("cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_cpu_" in flags:
        os.environ["XLA_FLAGS"] = " ".join(flag for flag in flags.split() if not flag.startswith("--xla_cpu_"))
    try:
        return topologies.get_topology_desc(topology_name=topology.name, platform="tpu").devices
    except Exception as error:  # libtpu's message for a shape it does not know
        raise PlanError(f"--topology {topology.name}: libtpu does not know this topology ({str(error)[:200]}); "
                        f"use a standard slice shape, e.g. {topology.chip.name}:"
                        f"{'x'.join(map(str, (_SHAPES_3D if topology.chip.dims == 3 else _SHAPES_2D)[4]))}") from None


def _abstract(tree, shardings):
    import jax

    return jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shardings)


def device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded `ShapeDtypeStruct`s (its largest shard of each leaf)."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if leaf is None:
            continue
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


_OOM = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)")


def loops_in(jaxpr) -> int:
    """Loops of more than one iteration in a jaxpr and its sub-jaxprs: `while` (fori / while_loop, data-dependent
    trip counts included) and `scan`s not fully unrolled. The compiler's cost analysis counts each one's body once.
    Pallas kernels' own jaxprs are not walked (they run inside the kernel)."""
    from jax.extend import core

    def subjaxprs(value):
        if isinstance(value, core.ClosedJaxpr):
            yield value.jaxpr
        elif isinstance(value, core.Jaxpr):
            yield value
        elif isinstance(value, (tuple, list)):
            for item in value:
                yield from subjaxprs(item)

    count = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":
            continue
        if name == "while" or (name == "scan" and eqn.params["length"] > max(1, int(eqn.params["unroll"]))):
            count += 1
        count += sum(loops_in(sub) for value in eqn.params.values() for sub in subjaxprs(value))
    return count


# The report fields each compile filled, by (target devices, HLO text digest, argument bytes): a program lowered
# again in this process, alike, gets the figures of its first compile (`_compile`).
_COMPILED: dict[tuple, dict[str, Any]] = {}


def _compile(report: ProgramReport, lower, argument_bytes: int, devices) -> None:
    """Compile for `devices` (the mesh's, in order), and fill `report` from the compiler's memory and cost analyses.
    A compile that runs out of HBM is a result, not an error: its temporaries come from the compiler's message,
    its arguments from the shapes.

    Each distinct program is compiled once per process: a lowering whose HLO text (the program and its shardings),
    argument bytes and target devices match an earlier compile's gets that compile's figures, `compile_seconds`
    included, without compiling again (the compiler is deterministic). `plan` and `estimate_train_time` lower
    some programs more than once (the step's variants at two contexts, the estimate's own variants), libtpu's
    compile-only executables do not load back from JAX's persistent cache, and `plan` clears JAX's in-memory
    caches after each compile to bound memory, so without this each repeat is compiled again (10-15 CPU seconds
    each for the tiny config on v5e:2x2)."""
    import hashlib

    lowered = lower()
    key = (tuple((d.platform, d.device_kind, d.id) for d in devices),
           hashlib.sha256(lowered.as_text().encode()).hexdigest(), argument_bytes)
    if key not in _COMPILED:
        _compile_now(report, lowered, argument_bytes)
        _COMPILED[key] = {name: getattr(report, name) for name in _COMPILE_FIELDS}
    for name, value in _COMPILED[key].items():
        setattr(report, name, value)


# What a compile fills in a report (`_compile_now`)
_COMPILE_FIELDS = ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "flops", "bytes_accessed", "seconds",
                   "compile_seconds", "out_of_memory", "cost_keys", "raw_seconds")


def _compile_now(report: ProgramReport, lowered, argument_bytes: int) -> None:
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as error:  # jax raises JaxRuntimeError (RESOURCE_EXHAUSTED) for a compile-time HBM OOM
        match = _OOM.search(str(error))
        if match is None:
            raise
        scale = {"K": 1024, "M": 1024**2, "G": GIB, "T": 1024 * GIB}
        report.compile_seconds = time.perf_counter() - start
        report.temp_bytes = int(float(match.group(1)) * scale[match.group(2)])
        report.argument_bytes = argument_bytes
        report.out_of_memory = (f"the compiler ran out of HBM: temporaries {match.group(1)}{match.group(2)} exceed "
                                f"the available {match.group(3)}{match.group(4)}")
        return
    report.compile_seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    if memory is not None:
        report.argument_bytes = int(memory.argument_size_in_bytes)
        report.output_bytes = int(memory.output_size_in_bytes)
        report.temp_bytes = int(memory.temp_size_in_bytes)
        report.alias_bytes = int(memory.alias_size_in_bytes)
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per program
        cost = cost[0] if cost else None
    cost = cost or {}
    report.cost_keys = tuple(sorted(k for k in cost if not k.startswith("utilization")))
    report.flops = cost.get("flops")
    report.bytes_accessed = cost.get("bytes accessed")
    seconds = cost.get("optimal_seconds")
    report.raw_seconds = None if seconds is None else float(seconds)
    report.seconds = float(seconds) if seconds is not None and seconds > 0 else None


# ------------------------------------------------------------------------------------------------ step time
_REFERENCE_COSTS: dict[tuple[str, str], dict] = {}


def _reference_cost(device, name: str, fn, dtype, count: int) -> dict:
    """The compiler's `cost_analysis()` of `fn` on `count` [8192, 8192] `dtype` arguments on `device` (a topology
    device), cached by device kind: the reference ops behind the compiler's rates."""
    import jax

    key = (device.device_kind, name)
    if key not in _REFERENCE_COSTS:
        sharding = jax.sharding.SingleDeviceSharding(device)
        args = [jax.ShapeDtypeStruct((8192, 8192), dtype, sharding=sharding)] * count
        cost = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).compile().cost_analysis()
        _REFERENCE_COSTS[key] = cost[0] if isinstance(cost, (list, tuple)) else cost
    return _REFERENCE_COSTS[key]


def compiler_dot_rate(device) -> float:
    """The highest FLOP/s the TPU compiler's cost model gives a matmul on `device` (a topology device): the FLOPs
    of a bfloat16 [8192, 8192] x [8192, 8192] dot over its `optimal_seconds`. libtpu 0.0.52 gives 197e12 on v5e,
    394e12 on v5p and 918e12 on v6e (smaller or thinner dots get less: 174e12 for [4096, 8192] x [8192, 8192] on
    v5e), so work costed at this rate takes at least this long in the compiler's model."""
    import jax.numpy as jnp

    cost = _reference_cost(device, "matmul", jnp.matmul, jnp.bfloat16, 2)
    return 2 * 8192**3 / float(cost["optimal_seconds"])


def compiler_memory_rate(device) -> float:
    """The bytes per second the TPU compiler's cost model gives a memory-bound op on `device`: `bytes accessed`
    over `optimal_seconds` of an elementwise float32 [8192, 8192] scale (read and write, no reuse)."""
    import jax.numpy as jnp

    cost = _reference_cost(device, "scale", lambda x: x * 2.0, jnp.float32, 1)
    return float(cost["bytes accessed"]) / float(cost["optimal_seconds"])


def splash_kernel_flops(config, rows: int, length: int, mesh) -> float:
    """FLOPs per chip the Pallas splash attention kernels run in one micro-batch's forward and backward: per layer,
    row and head, each visited causal block pair (the block lower triangle, diagonal included; `_splash_local`'s
    block sizes) costs 2 x q_block x k_block x head_dim per dot, and the kernels do 2 dots forward (q k^T, p v),
    2 more for the forward recomputed under remat, 3 in the dq kernel and 4 in the dkv kernel. Divided by the
    shards `_pallas_tpu_causal` splits rows and heads over (a dimension not divisible by its axes is computed on
    every chip of them)."""
    from jax.sharding import PartitionSpec as P

    from trace_jax.models.sharding import logical_to_mesh_spec

    H, Dh = config.num_attention_heads, config.head_dim
    bq = min(config.attention_q_block or config.attention_query_chunk or 128, length)
    bk = min(config.attention_k_block or 128, length)
    nk = -(-length // bk)
    pairs = sum(min(nk, -(-((i + 1) * bq) // bk)) for i in range(-(-length // bq)))
    dots = 2 + (2 if config.remat != "none" else 0) + 3 + 4
    total = dots * 2 * bq * bk * Dh * pairs * rows * H * config.num_hidden_layers
    sizes = dict(mesh.shape)
    spec = logical_to_mesh_spec(P("batch", "heads", None, None), mesh, shape=(rows, H, length, Dh))
    shards = 1
    for entry in spec[:2]:
        for axis in () if entry is None else (entry,) if isinstance(entry, str) else entry:
            shards *= sizes[axis]
    return total / shards


@dataclasses.dataclass
class TimeEstimate:
    """A roofline time of the whole train step on one chip, from the compiler's cost model (`estimate_train_time`).

    Attributes (per chip, whole step): seconds = xla_seconds + kernel_seconds; xla_seconds / xla_flops /
    xla_bytes: the compiler's `optimal_seconds`, FLOPs and bytes accessed with every loop iteration counted;
    kernel_seconds / kernel_flops: the Pallas attention kernels, which the compiler does not cost, at its own dot
    rate (`dot_rate`); expected_xla_flops: the matmul FLOPs outside attention (`flops.matmul_params_per_token`,
    x 4/3 for the forward recomputed under remat), to check the compiler counted everything; variants:
    `(layers, micro_batches, flops, optimal_seconds)` of each compiled variant; check: when the step has more
    layers than the variants, `(layers, micro_batches, compiled optimal_seconds, predicted)` of one more variant
    (`estimate_train_time(validate=True)`); lengths: the two contexts the variants were compiled at when not the
    step's own (their figures extended in tokens), else None; context: the step's tokens per row; time_source:
    "optimal_seconds" (the compiler's times), or how the times were made when it gave negative ones."""

    seconds: float
    xla_seconds: float
    xla_flops: float
    xla_bytes: float
    kernel_seconds: float
    kernel_flops: float
    dot_rate: float
    expected_xla_flops: float
    variants: tuple
    check: tuple | None = None
    lengths: tuple[int, int] | None = None
    context: int = 0
    time_source: str = "optimal_seconds"


def _combine(costs: dict, layers: int, micro: int) -> float:
    """Whole-step figure from the variants' figures `costs[(layers, micro_batches)]`, linear in layers:
    Cm(L) = C(1, m) + (L - 1) (C(2, m) - C(1, m)) for m = 1 (no accumulator) and, when the step has M >= 2
    micro-batches, m = 2; and linear in micro-batches from 2 on, each further micro-batch costing what the second
    one added: C = C2(L) + (M - 2) (C2(L) - C1(L)). On the tiny model C(1, 3) - C(1, 2) equals C(1, 2) - C(1, 1)
    to 0.2% in FLOPs and `optimal_seconds` (tests/test_plan.py checks a whole 4-layer, 2-micro-batch step).
    """
    def at(m):
        return costs[1, m] + (layers - 1) * (costs[2, m] - costs[1, m])

    if micro == 1:
        return at(1)
    return at(2) + (micro - 2) * (at(2) - at(1))


def _extend_in_tokens(short: dict, lengths: tuple[int, int], length: int) -> dict:
    """Each variant's figures at `length` tokens per row from the same variant at the two `lengths`, affine in
    tokens: C(T) = C(T1) + (T - T1) (C(T2) - C(T1)) / (T2 - T1). Under the Pallas kernel (which is costed apart)
    everything the compiler costs is per token (matmuls, norms, the chunked log-probs) or per step (the optimizer,
    weight gathers per micro-batch): affine in tokens."""
    t1, t2 = lengths
    return {key: tuple(a + (length - t1) * (b - a) / (t2 - t1) for a, b in zip(short[key, t1], short[key, t2]))
            for key in {k for k, _ in short}}


def short_context_lengths(length: int, block: int = 512) -> tuple[int, int]:
    """The two shorter contexts `estimate_train_time` compiles the variants at when full-length ones run out of
    HBM: about 1/16 and 1/8 of `length`, in whole attention blocks (3072 and 6144 tokens for 48K)."""
    short = max(block, (length // 16) // block * block)
    return short, 2 * short


def estimate_train_time(programs: "_Programs", device, *, validate: bool = False,
                        lengths: tuple[int, int] | None = None) -> tuple[TimeEstimate | None, str]:
    """The train step's roofline time per chip, or None and why not.

    The compiler's `cost_analysis()` counts a loop body once, and the step loops over layers, micro-batches and
    log-prob chunks. So variants of the same step with 1 and 2 layers and 1 (and, for a step of M >= 2, 2)
    micro-batches of the step's micro-batch shape are compiled with every scan unrolled, and their FLOPs, bytes
    and `optimal_seconds` are extended linearly to the step's layers and micro-batches (`_combine`; no variant
    has 3 micro-batches: unrolled, their activations are live at once, and for Qwen3-4B at 48K tokens that ran
    out of HBM). Unrolled, even the 1-layer variant can need several times the step's memory (the log-prob
    chunks' activations are live at once: 158 GiB for Qwen3-4B at 48K on v6e-8); when a full-length variant runs
    out of HBM, or when `lengths` is given, every variant is compiled at two shorter contexts instead
    (`short_context_lengths`, halved again while one still runs out of HBM and they stay whole attention blocks)
    and extended to the step's context affinely in tokens (`_extend_in_tokens`).
    The Pallas attention kernels are custom calls
    the cost model does not cost (0 FLOPs); their FLOPs (`splash_kernel_flops`, at the full context) are added at
    the compiler's own dot rate. A variant left with a loop (the XLA attention's tile loops have data-dependent
    trip counts) or out of HBM at the short contexts gives no estimate. Where the compiler gives a variant a
    negative `optimal_seconds` (libtpu 0.0.52 on v6e), every variant's time is instead the roofline
    max(FLOPs / dot rate, bytes / memory rate) of its counted FLOPs and bytes at the compiler's own rates
    (`compiler_dot_rate`, `compiler_memory_rate`), and `time_source` says so. `validate`: also compile the
    3-layer variant and record it against the prediction.
    """
    import jax

    from trace_jax.train.flops import matmul_params_per_token

    config, run = programs.config, programs.run
    layers, micro = config.num_hidden_layers, run.loss.micro_batches
    rows = programs.rows // run.update.mini_batches
    micro_rows = rows // micro
    grid = [(1, 1), (2, 1)] + ([(1, 2), (2, 2)] if micro > 1 else [])
    if validate and layers > 2:
        grid.append((3, 1))

    def compile_variants(length):
        """{(layers, micro): (flops, seconds, bytes)} at `length` tokens per row, or (None, why, out of HBM?)."""
        out = {}
        for n_layers, n_micro in grid:
            variant_run = dataclasses.replace(run, loss=dataclasses.replace(run.loss, micro_batches=n_micro),
                                              rollout=dataclasses.replace(run.rollout, max_context=length))
            variant = _Programs(config.replace(num_hidden_layers=n_layers), variant_run, programs.mesh, programs.plan)
            report = ProgramReport("train", "")
            variant.train(report, rows=n_micro * micro_rows, count_loops=True, unroll=True)
            jax.clear_caches()
            where = f"the {n_layers}-layer, {n_micro}-micro-batch variant at {length} tokens"
            if report.out_of_memory:
                return None, f"{where} ran out of HBM ({report.out_of_memory})", True
            if report.loops:
                return None, (f"{where} still has {report.loops} loop(s) the cost analysis counts once (attention "
                              f"{config.attention_impl!r}: the XLA path's tile loops have data-dependent trip "
                              "counts); plan with the Pallas kernel (attention 'pallas_tpu')"), False
            if not report.flops or not report.bytes_accessed or report.raw_seconds is None:
                return None, (f"the compiler gave no usable cost for {where} (flops {report.flops}, bytes "
                              f"{report.bytes_accessed}, optimal_seconds {report.raw_seconds})"), False
            out[n_layers, n_micro] = (report.flops, report.raw_seconds, report.bytes_accessed)
        return out, "", False

    figures, why, out_of_memory = (None, "", True) if lengths else compile_variants(programs.update_length)
    if figures is None and out_of_memory:
        first, forced = why, lengths is not None
        block = config.attention_q_block or 512
        lengths = lengths or short_context_lengths(programs.update_length, block)
        compiled: dict[int, dict] = {}
        while True:
            failed = None
            for length in sorted(lengths, reverse=True):  # the longer one is the likelier to run out of HBM
                if length not in compiled:
                    found, why, oom = compile_variants(length)
                    if found is None:
                        failed = (why, oom)
                        break
                    compiled[length] = found
            if failed is None:
                break
            # out of HBM even there: halve both contexts while they stay whole blocks (unless they were given)
            if forced or not failed[1] or lengths[0] // 2 < block:
                return None, (f"{first}; and {failed[0]}" if first else failed[0])
            lengths = (lengths[0] // 2, lengths[1] // 2)
        short = {(key, length): value for length in lengths for key, value in compiled[length].items()}
        figures = _extend_in_tokens(short, lengths, programs.update_length)
    elif figures is None:
        return None, why
    rate = compiler_dot_rate(device)
    time_source = "optimal_seconds"
    if any(seconds <= 0 for _, seconds, _ in figures.values()):
        # libtpu 0.0.52 gives some programs a negative optimal_seconds (every Qwen3-4B train variant on v6e):
        # then each variant's time is the roofline of its counted FLOPs and bytes at the compiler's own rates.
        memory_rate = compiler_memory_rate(device)
        figures = {key: (f, max(f / rate, b / memory_rate), b) for key, (f, _, b) in figures.items()}
        time_source = f"roofline of FLOPs and bytes (optimal_seconds was negative; {memory_rate / 1e9:.0f} GB/s)"
    pick = lambda i: {key: value[i] for key, value in figures.items()}  # noqa: E731
    xla_flops, xla_seconds, xla_bytes = (_combine(pick(i), layers, micro) for i in range(3))
    kernel_flops = 0.0
    if config.attention_impl == "pallas_tpu":
        kernel_flops = micro * splash_kernel_flops(config, micro_rows, programs.update_length, programs.mesh)
    tokens = rows * programs.update_length
    recompute = 4 / 3 if config.remat != "none" else 1.0
    expected = recompute * 3 * 2 * matmul_params_per_token(config) * tokens / programs.mesh.size
    check = None
    if validate and layers > 2:
        base = {key: value for key, value in pick(1).items() if key[0] < 3}
        # the variants' layer count enters linearly: C(3, 1) = C(1, 1) + 2 (C(2, 1) - C(1, 1))
        check = (3, 1, pick(1)[3, 1], base[1, 1] + 2 * (base[2, 1] - base[1, 1]))
    return TimeEstimate(seconds=xla_seconds + kernel_flops / rate, xla_seconds=xla_seconds, xla_flops=xla_flops,
                        xla_bytes=xla_bytes, kernel_seconds=kernel_flops / rate, kernel_flops=kernel_flops,
                        dot_rate=rate, expected_xla_flops=expected,
                        variants=tuple((l, m, f, t) for (l, m), (f, t, _) in figures.items()), check=check,
                        lengths=lengths, context=programs.update_length, time_source=time_source), ""


class _Programs:
    """The lowerings of one RL step's programs for one model, run config and mesh: the entries of the registry the
    loop's programs come from (`rl.programs.programs`: the same builders, keyed alike, with the loop's argument
    shapes, shardings and static arguments), each kind reported by its largest entry (most argument bytes per
    device) with the count of the kind's entries. `train(report, rows=..., unroll=...)` also builds the update's
    variants for `estimate_train_time`."""

    def __init__(self, model_config, run_config, mesh, plan: PlanConfig, mesh_config=None):
        import jax.numpy as jnp

        from trace_jax.rl import programs as rl_programs
        from trace_jax.train.optimizer import make_optimizer

        self.config, self.plan, self.mesh = model_config, plan, mesh
        # the run's logical-axis rules (`MeshConfig.rules`), as `loop.Placement` takes them
        self.run = run_config if mesh_config is None else dataclasses.replace(run_config, mesh=mesh_config)
        self.devices = tuple(mesh.devices.flat)
        self.rules, self.rollout_rules = self.run.mesh.train_rules(), self.run.mesh.rollout_rules()
        self.optimizer = make_optimizer(run_config.optimizer)
        budget_gib = plan.kv_budget_gib if plan.kv_budget_gib is not None else run_config.rollout.kv_budget_gib
        self.kv_budget_gib = budget_gib or 0.0
        try:
            self.registry = rl_programs.programs(self.run, model_config, mesh, optimizer=self.optimizer,
                                                 answer_tokens=plan.answer_tokens, kv_budget_gib=budget_gib)
        except ValueError as error:
            raise PlanError(str(error)) from None
        registry = self.registry
        self.state, self.reference, self.rollout_params = registry.state, registry.reference, registry.rollout_params
        self.rows = run_config.train.prompts_per_step * run_config.rollout.group_size
        self.rows_at_once, self.kv_cache_bytes = registry.rows_at_once, registry.kv_cache_bytes
        # the engine's pool (pages, tokens a page), read off its decode program's state
        paged = registry.largest("paged_decode")
        self.pool = None if paged is None else (paged.args[2].num_pages, paged.args[2].page_size)
        # Each process rolls out (and scores) its own rows, in programs over the whole mesh (a TPU topology's
        # processes are its hosts): the rows at once are every process's together, the bytes per chip the mesh's.
        self.processes = len({device.process_index for device in self.devices})
        self.process_rows = registry.rows
        self.length = run_config.rollout.max_context
        # the update's token width (`pipeline.update_shapes`: `UpdateConfig.max_length`, default the context)
        update = registry.fixed_update()
        self.update_length = update.args[1].shape[1]
        self.jnp = jnp

    def _lower(self, report: ProgramReport, name: str, resident_other_bytes: int) -> None:
        """Compile the largest entry of kind `name` into `report` (nothing to compile when the step has none)."""
        entries = self.registry.named(name)
        entry = self.registry.largest(name)
        if entry is None:
            report.shape = "not dispatched by this run's step"
            return
        report.shape = entry.shape + (f" (largest of {len(entries)} shapes)" if len(entries) > 1 else "")
        report.resident_other_bytes = resident_other_bytes
        _compile(report, entry.lower, device_bytes(entry.args), self.devices)

    def train(self, report: ProgramReport, *, rows: int | None = None, count_loops: bool = False,
              unroll: bool = False):
        """The update: the registry's entry at the run's fixed update shape, or (with `rows` or `unroll`: the
        variants of `estimate_train_time`) the same step built with those rows and its scans unrolled."""
        import jax

        from trace_jax.rl import programs as rl_programs
        from trace_jax.rl.pipeline import update_shapes
        from trace_jax.train.flops import flops_per_token
        from trace_jax.train.step import make_train_step

        loss = self.run.loss
        if rows is None and not unroll:
            entry = self.registry.fixed_update()
            step, batch = entry.program, entry.args[1]
        else:
            # A variant is as wide as its own context (`estimate_train_time` sets it) and runs the LM head over
            # every position (no `trained_index`), so its cost is affine in the tokens it is extended over; the
            # update's head over its `trained_index` positions costs less (the estimate over-counts that share).
            shapes = update_shapes(self.run.rollout, dataclasses.replace(self.run.update, max_length=0), self.rows)
            shapes = dataclasses.replace(shapes, head_width=None)
            step = make_train_step(self.config, loss, self.optimizer, mesh=self.mesh, rules=self.rules,
                                   unroll=unroll)
            rows = rows or self.rows // self.run.update.mini_batches
            batch = rl_programs.abstract_loss_batch(loss, self.mesh, self.rules, rows, shapes)
        rows, length = batch.shape
        report.shape = (f"{rows} rows x {length} tokens, {batch.head_width} trained positions, "
                        f"{loss.micro_batches} micro-batches of {rows // loss.micro_batches}")
        report.model_flops = flops_per_token(self.config, length) * rows * length
        report.resident_other_bytes = device_bytes(self.reference)  # the reference stays while the policy trains
        lower = lambda: step.lower(self.state, batch, None)  # noqa: E731
        if count_loops:
            with jax.set_mesh(self.mesh):
                traced = step.jitted.trace(self.state, batch, None)
            report.loops = loops_in(traced.jaxpr.jaxpr)

            def lower():
                with jax.set_mesh(self.mesh):
                    return traced.lower()
        _compile(report, lower, device_bytes((self.state, batch)), self.devices)

    def dispatches(self, program: str) -> bool:
        """Whether the run's step dispatches the report's `program` (`PROGRAMS`) at all."""
        return any(self.registry.named(kind) for kind in KINDS[program])

    def _kind(self, program: str) -> str:
        """The registry's kind of the report's `program` for this run's engine."""
        return next((kind for kind in KINDS[program] if self.registry.named(kind)), KINDS[program][0])

    def behaviour(self, report: ProgramReport):
        """The trainer's pi_old on one chunk of the batch (`LossConfig.tis`): the train state (its params are the
        argument) and the reference stay."""
        self._lower(report, "behaviour", device_bytes(self.state) - device_bytes(self.state.params)
                    + device_bytes(self.reference))

    def score(self, report: ProgramReport):
        # the policy's train state stays during scoring
        self._lower(report, "score", device_bytes(self.state))

    def reshard(self, report: ProgramReport):
        """The policy's params from the train layout to the rollout layout (`Placement.rollout_params`): the
        rest of the train state and the reference stay; the cast copy is the program's argument."""
        cast = bool(self.registry.named("rollout_cast"))
        params = device_bytes(self.state.params)
        self._lower(report, "reshard", device_bytes(self.state) - (0 if cast else params)
                    + device_bytes(self.reference))

    def _rollout_resident(self) -> int:
        # While the rollout runs: the whole train state and the reference (the rollout copy and the cache are the
        # programs' own arguments).
        return device_bytes(self.state) + device_bytes(self.reference)

    def init(self, report: ProgramReport):
        self._lower(report, self._kind("init"), self._rollout_resident() + device_bytes(self.rollout_params))

    def prefill(self, report: ProgramReport):
        """The engine's prefill (`paged.prefill_program`): admissions, observations and recomputes."""
        self._lower(report, self._kind("prefill"), self._rollout_resident())

    def decode(self, report: ProgramReport):
        self._lower(report, self._kind("decode"), self._rollout_resident())


def _advice(report: PlanReport, run_config, model_config) -> list[str]:
    """What to change, by the program that is over (or, when it fits, how to use the headroom)."""
    hbm = report.topology.chip.hbm_bytes
    out = []
    shards, micro_rows = report.settings["batch_shards"], report.settings["micro_batch_rows"]
    if micro_rows % shards:
        out.append(f"a micro-batch of {micro_rows} rows does not split over the {shards} batch shards of the mesh "
                   f"(data x fsdp x expert): rows are computed on fewer chips than hold them; make "
                   f"LossConfig.micro_batches divide {report.settings['rows'] // run_config.update.mini_batches // shards}")
    resident = report.resident["train state"] + report.resident["reference"]
    if resident > hbm / 2 and report.fits is False:
        out.append(f"the train state and the reference take {resident / GIB:.1f} of {hbm / GIB:.0f} GiB per chip "
                   f"before any activation: shard them over more chips (a bigger slice, or fsdp over every chip: "
                   f"--mesh fsdp=-1) or use a chip with more HBM")
    for p in report.programs:
        if not p.out_of_memory and (p.peak_bytes is None or p.peak_bytes <= hbm):
            continue
        over = f"{p.name} peaks at {p.peak_bytes / GIB:.1f} GiB"
        if p.name == "train":
            micro = run_config.loss.micro_batches
            rows = report.settings["rows"] // run_config.update.mini_batches
            if micro < rows:
                out.append(f"{over}: raise LossConfig.micro_batches (now {micro}, up to {rows}) or "
                           f"UpdateConfig.mini_batches to cut the temporaries that grow with rows (all temporaries: "
                           f"{p.temp_bytes / GIB:.1f} GiB, gradients and the optimizer update included)")
            if model_config.remat != "full":
                out.append(f"{over}: set remat to 'full' (now {model_config.remat!r})")
            if model_config.dtype != "bfloat16":
                out.append(f"{over}: compute in bfloat16 (now {model_config.dtype})")
        elif p.name == "score":
            out.append(f"{over}: set UpdateConfig.scoring_batch (now {run_config.update.scoring_batch or 'all'} rows)"
                       f" to score fewer rows per pass")
        elif p.name in ("init", "decode", "prefill"):
            cache = "" if model_config.dtype == "bfloat16" else ", or compute (and cache) in bfloat16"
            out.append(f"{over}: the rollout runs up to {report.settings['rows_at_once']} rows at once on a page "
                       f"pool for rows of {report.settings['length']} tokens: set a smaller per-chip KV budget "
                       f"(RolloutConfig.kv_budget_gib, or --kv-budget-gib; now "
                       f"{report.settings['kv_budget_gib'] or 'none'}) or PagedConfig.slots so fewer rows run at "
                       f"once, lower TrainConfig.prompts_per_step, or spread the rows over more chips{cache}")
        elif p.name == "reshard":
            out.append(f"{over}: the rollout layout holds the policy's weights whole over the batch axes "
                       f"({report.resident['rollout copy'] / GIB:.1f} GiB per chip): split heads and MLP over a "
                       f"`tensor` mesh axis (--mesh fsdp=N,tensor=M)")
        out.append(f"{over}: or shorten RolloutConfig.max_context (now {report.settings['length']})")
    return list(dict.fromkeys(out))


def plan(run_config, plan_config: PlanConfig, mesh_config=None, *, model_preset: str = "") -> PlanReport:
    """Compile the chosen programs for the topology and report per-device memory, FLOPs, time and the verdict."""
    import jax

    from trace_jax import models
    from trace_jax.train.config import TrainConfigError

    topology = parse_topology(plan_config.topology)
    mesh_config = mesh_config or run_config.mesh
    mesh_config = mesh_config.keeping_rules_of(run_config.mesh)
    try:
        axes = mesh_config.axis_sizes(topology.num_chips)
    except TrainConfigError as error:
        raise PlanError(f"{topology.name} has {topology.num_chips} chips: {error}") from None
    devices = tpu_devices(topology) if topology.chip.platform == "tpu" else None  # fail before any work
    model_config, how = resolve_model(run_config, preset=model_preset)
    model_config = run_config.train.policy_model(model_config)
    model_config = _override_model(model_config, plan_config, topology.chip.platform)
    rows = run_config.train.prompts_per_step * run_config.rollout.group_size
    settings = dict(rows=rows, length=run_config.rollout.max_context, micro_batches=run_config.loss.micro_batches,
                    mini_batches=run_config.update.mini_batches, dtype=model_config.dtype, remat=model_config.remat,
                    attention=model_config.attention_impl, learning_rate=run_config.optimizer.learning_rate)
    batch_axes = dict(mesh_config.train_rules())["batch"] or ()
    shards = math.prod(axes[a] for a in ((batch_axes,) if isinstance(batch_axes, str) else batch_axes))
    settings.update(batch_shards=shards, micro_batch_rows=rows // run_config.update.mini_batches
                    // run_config.loss.micro_batches)
    if topology.chip.platform == "gpu":
        return _gpu_report(topology, axes, model_config, how, settings, run_config, plan_config, mesh_config)
    mesh = models.make_mesh(axes, devices)
    programs = _Programs(model_config, run_config, mesh, plan_config, mesh_config)
    settings.update(rows_at_once=programs.rows_at_once, kv_budget_gib=programs.kv_budget_gib,
                    reference_dtype=run_config.train.reference_dtype, processes=programs.processes,
                    process_rows=programs.process_rows)
    if programs.pool is not None:
        settings.update(pool_pages=programs.pool[0], page_size=programs.pool[1])
    resident = {"train state": device_bytes(programs.state), "reference": device_bytes(programs.reference),
                "rollout copy": device_bytes(programs.rollout_params), "KV cache": programs.kv_cache_bytes}
    reports = []
    for name in plan_config.programs:
        if not programs.dispatches(name):
            continue
        report = ProgramReport(name, "")
        getattr(programs, name)(report)
        reports.append(report)
        jax.clear_caches()
    result = PlanReport(topology, axes, how, settings, reports, resident)
    if "decode" in plan_config.programs:
        result.decode = decode_rooflines(programs, topology)
        jax.clear_caches()
    train = result.program("train")
    if plan_config.estimate_time and train is not None and not train.out_of_memory:
        result.estimate, result.estimate_missing = estimate_train_time(
            programs, devices[0], validate=plan_config.validate_estimate)
    if plan_config.estimate_time:
        result.split = estimate_step_split(programs, devices[0], result.estimate)
    result.notes += [f"device kind {devices[0].device_kind}; compiled with jax {jax.__version__}"]
    result.advice = _advice(result, run_config, model_config)
    return result


@dataclasses.dataclass
class StepSplit:
    """The whole RL step's time per chip, split by phase (seconds; None = not estimated), and how each was made.

    rollout: the paged engine's continuous batching (no waves): `rows_in_flight` rows decode at once (`paged_flight`:
    the rows at the mean context each batch shard's block of the pool holds, at most the slots; `decode_rooflines`'
    paged line), each row
    decoding at most `decoded_tokens` (its turns at the turn budget, `(max_turns + 1) x turn_token_budget`, at most
    `max_context`), so `decode_steps = ceil(rows x decoded_tokens / rows_in_flight)`; each step at the roofline
    max(FLOPs / dot rate, bytes / memory rate) of its matmuls and attention at the mean context (half of
    `max_context`) against reading the rollout copy and those rows' own pages. The rest of each row's context
    (prompt and observations, `max_context - decoded_tokens`) is prefilled: `prefill` is its FLOPs at the dot
    rate. An upper bound: turns end before the budget and episodes before the context is full. score: the
    reference's forward FLOPs over every row's trajectory and answer copies at the dot rate. update:
    `UpdateConfig.mini_batches` times the train step's estimate (`estimate_train_time`), None without one. Rates
    are the compiler's own (`compiler_dot_rate`, `compiler_memory_rate`)."""

    rollout: float
    score: float
    update: float | None
    decode_steps: int
    why_no_update: str = ""
    prefill: float = 0.0  # the part of `rollout` that prefills prompts and observations
    rows_in_flight: int = 0
    decoded_tokens: int = 0

    @property
    def total(self) -> float | None:
        return None if self.update is None else self.rollout + self.score + self.update


def estimate_step_split(programs: "_Programs", device, estimate: "TimeEstimate | None") -> StepSplit:
    """Rollout, score and update time per step on one chip (see `StepSplit` for the model of each)."""
    from trace_jax.train.flops import flops_per_token

    config, run, chips = programs.config, programs.run, programs.mesh.size
    rate, memory_rate = compiler_dot_rate(device), compiler_memory_rate(device)
    length, rows = programs.length, programs.rows
    flight = paged_flight(programs)
    rollout_cfg = run.rollout
    decoded = min(length, (rollout_cfg.max_turns + 1) * rollout_cfg.turn_token_budget)
    steps = -(-rows * decoded // flight.rows)
    step_flops = flight.rows * flops_per_token(config, flight.context, training=False) / chips
    step_bytes = device_bytes(programs.rollout_params) + flight.kv_bytes(flight.rows, flight.context)
    decode = steps * max(step_flops / rate, step_bytes / memory_rate)
    prefill = rows * (length - decoded) * flops_per_token(config, flight.context, training=False) / chips / rate
    tokens_per_row = length + (rollout_cfg.max_turns + 1) * (programs.plan.answer_tokens - 1)
    score = rows * tokens_per_row * flops_per_token(config, length, training=False) / chips / rate
    update = None if estimate is None else run.update.mini_batches * estimate.seconds
    return StepSplit(rollout=decode + prefill, score=score, update=update, decode_steps=steps,
                     why_no_update="" if estimate is not None else "no train-step estimate", prefill=prefill,
                     rows_in_flight=flight.rows, decoded_tokens=decoded)


@dataclasses.dataclass(frozen=True)
class PagedFlight:
    """The paged engine's rows in flight at the run's setting, from the config (a model, not a measurement).

    rows: rows decoding at once over the whole mesh: the rows at the mean context each batch shard's block of the
      pool holds (a row's pages lie on one shard), at most the slots. context: the mean context a row's attention
      reads (`max_context / 2`). shards: the batch shards the rows split over. token_bytes: one token's KV on one
      chip."""

    rows: int
    context: int
    shards: int
    token_bytes: int

    def kv_bytes(self, rows: int, context: int) -> int:
        """The KV bytes one chip reads in a decode step of `rows` rows at `context` (its share of the rows)."""
        return int(-(-rows // self.shards) * context * self.token_bytes)


def paged_flight(programs: "_Programs") -> PagedFlight:
    """`PagedFlight` of the run, on the pool the registry's decode program holds (`rl.programs` lists the engine's
    programs for every run: its pool is the engine's own, `engine.pool_pages`)."""
    from trace_jax.rollout import paged as paged_lib
    from trace_jax.rollout.budget import batch_shards

    config, run, mesh, rules = programs.config, programs.run, programs.mesh, programs.rollout_rules
    paged, length, rows = run.rollout.paged, run.rollout.max_context, programs.rows
    mean = max(1, length // 2)
    pool = programs.pool[0]
    slots = max(1, min(rows, paged.slots or rows))
    shards = batch_shards(mesh, rules)
    # a row's pages lie on one batch shard (the engine's allocator), so each shard holds whole rows of its block
    row_pages = paged_lib.pages_for(mean, paged.page_size)
    fit = (pool // shards // row_pages) * shards if pool % shards == 0 else pool // row_pages
    return PagedFlight(rows=max(1, min(slots, fit)), context=mean, shards=shards,
                       token_bytes=paged_lib.page_bytes(config, 1, mesh=mesh, rules=rules))


# ------------------------------------------------------------------------------------------------ decode roofline
@dataclasses.dataclass
class DecodeRoofline:
    """One rollout engine's decode throughput per chip at the run's setting: an estimate, not a measurement.

    Attributes:
      engine: "paged" or "dense".
      rows_in_flight: rows decoding at once over the whole mesh (paged: the pool's pages over the pages of a row at
        the mean context, at most the slots; dense: the rows the per-chip KV budget holds at `max_context`, at most
        the step's rows).
      context: tokens of KV each row's attention reads per step (paged: the mean context, `max_context / 2`, a
        row's own pages; dense: `max_context`, the cache up to the batch's longest row).
      weight_bytes, kv_bytes: bytes one chip reads per decode step (its share of the rollout weights; its rows' KV).
      hbm_bandwidth: the chip's HBM bytes/s (`HBM_BANDWIDTH`).
      chips: chips of the mesh.
      compiled_bytes / compiled_rows: the compiled one-step decode program's `bytes accessed` per chip (the
        compiler's cost analysis, every layer unrolled) and its decode batch; None when not compiled.
      kernel_kv_bytes: on the Pallas kernel path, the KV per chip the kernel reads for those rows at `context` (the
        formula of `kv_bytes`), added to `compiled_bytes`: the kernel reads the rows' pages by DMA, which the cost
        analysis of its custom call does not see (whatever part of it the analysis does count is then counted twice:
        the sum errs towards fewer tokens/s). None on the XLA path, whose reads the analysis counts.
    """

    engine: str
    rows_in_flight: int
    context: int
    weight_bytes: int
    kv_bytes: int
    hbm_bandwidth: float
    chips: int
    compiled_bytes: float | None = None
    compiled_rows: int | None = None
    kernel_kv_bytes: int | None = None

    @property
    def step_seconds(self) -> float:
        """The roofline time of one decode step: its bytes per chip over the HBM bandwidth."""
        return (self.weight_bytes + self.kv_bytes) / self.hbm_bandwidth

    @property
    def tokens_per_second(self) -> float:
        """Decode tokens per second per chip at the roofline (every row in flight makes one token a step)."""
        return self.rows_in_flight / self.chips / self.step_seconds

    @property
    def compiled_tokens_per_second(self) -> float | None:
        """Tokens/s per chip the compiled program's memory traffic allows (its rows over its bytes, with the
        kernel's KV reads, at the HBM bandwidth), None when not compiled."""
        if not self.compiled_bytes or not self.compiled_rows:
            return None
        traffic = self.compiled_bytes + (self.kernel_kv_bytes or 0)
        return self.compiled_rows / self.chips / (traffic / self.hbm_bandwidth)

    @property
    def fraction_of_roofline(self) -> float | None:
        tokens = self.compiled_tokens_per_second
        return None if tokens is None else tokens / self.tokens_per_second


def decode_rooflines(programs: "_Programs", topology: Topology) -> list[DecodeRoofline]:
    """The decode roofline of the paged engine (with the run's `PagedConfig`) and of the dense engine at the run's
    setting, both from the config alone (formulas; the dense one needs no dense program), and, for the engine the
    run compiles (paged), the compiled one-step decode program's bytes (`compiled_decode_step`). Paged first."""
    from trace_jax.rollout.budget import kv_bytes_per_row

    config, run, mesh = programs.config, programs.run, programs.mesh
    rules, chips = programs.rollout_rules, mesh.size
    bandwidth = topology.chip.hbm_bandwidth
    weights = device_bytes(programs.rollout_params)
    flight = paged_flight(programs)
    length, rows = run.rollout.max_context, programs.rows
    if programs.kv_budget_gib:
        per_chip = int(programs.kv_budget_gib * GIB // kv_bytes_per_row(config, length, mesh=mesh, rules=rules))
        dense_rows = max(1, min(rows, per_chip * flight.shards))
    else:
        dense_rows = rows
    out = [DecodeRoofline("paged", flight.rows, flight.context, weights, flight.kv_bytes(flight.rows, flight.context),
                          bandwidth, chips),
           DecodeRoofline("dense", dense_rows, length, weights, flight.kv_bytes(dense_rows, length), bandwidth, chips)]
    step = compiled_decode_step(programs, flight.rows)
    if step is not None:
        from trace_jax.rollout import paged as paged_lib

        out[0].compiled_bytes, out[0].compiled_rows = step
        if paged_lib.attention_path(config) == "pallas_tpu":
            out[0].kernel_kv_bytes = flight.kv_bytes(out[0].compiled_rows, flight.context)
    return out


def compiled_decode_step(programs: "_Programs", rows_in_flight: int) -> tuple[float, int] | None:
    """(bytes accessed per chip, decode rows) of one step of the paged decode program the engine runs with
    `rows_in_flight` rows decoding (the registry's smallest decode batch that holds them, `engine.decode_rows`; its
    largest when none does), compiled with every layer unrolled (`ModelConfig.scan_unroll`: the cost analysis counts
    a loop body once), from the compiler's cost analysis; None when the registry has no paged decode or the compiler
    gives no bytes. The batch the roofline's rows run in, not the registry's largest: a 128-row decode entry
    compared against a roofline of 16 rows in flight measured a program the steady state does not run."""
    import jax

    from trace_jax.rollout import paged as paged_lib

    entries = programs.registry.named("paged_decode")
    if not entries:
        return None
    batch = lambda e: int(e.args[3].shape[0])  # noqa: E731
    holding = [e for e in entries if batch(e) >= rows_in_flight]
    entry = min(holding, key=batch) if holding else max(entries, key=batch)
    state = entry.args[2]
    layout = paged_lib.state_layout(state)
    program = paged_lib.decode_program(programs.config.replace(scan_unroll=True), 1,
                                       programs.run.rollout.max_context, layout)
    report = ProgramReport("decode step", "")
    _compile(report, lambda: program.lower(*entry.args), device_bytes(entry.args), programs.devices)
    jax.clear_caches()
    if not report.bytes_accessed:
        return None
    return float(report.bytes_accessed), int(entry.args[3].shape[0])


def format_decode(report: PlanReport) -> list[str]:
    """The decode roofline lines of both engines (`decode_rooflines`)."""
    if not report.decode:
        return []
    t = report.topology
    lines = [f"decode estimate per chip (a roofline from formulas and the compiler's cost analysis, not a "
             f"measurement; {t.chip.name} HBM {t.chip.hbm_bandwidth / 1e9:.0f} GB/s):"]
    for d in report.decode:
        context = "mean context" if d.engine == "paged" else "max_context (cache to the longest row)"
        line = (f"  {d.engine}: {d.rows_in_flight} rows in flight, KV of {d.context} tokens a row ({context}); a "
                f"step reads {_gib(d.weight_bytes)} weights + {_gib(d.kv_bytes)} KV per chip -> roofline "
                f"{d.tokens_per_second:,.0f} tokens/s per chip")
        if d.compiled_tokens_per_second is not None:
            line += f"; its compiled decode step ({d.compiled_rows} rows) accesses {_gib(d.compiled_bytes)} per chip"
            if d.kernel_kv_bytes is not None:
                line += (f" + the kernel's {_gib(d.kernel_kv_bytes)} of KV reads (DMA, unseen by the cost "
                         "analysis)")
            line += (f" -> {d.compiled_tokens_per_second:,.0f} tokens/s per chip, "
                     f"{100 * d.fraction_of_roofline:.0f}% of the roofline")
        lines.append(line)
    return lines


def _gpu_report(topology, axes, model_config, how, settings, run_config, plan_config, mesh_config) -> PlanReport:
    """What shapes and shardings alone say about a GPU mesh (no GPU compiler runs on a CPU host)."""
    import jax
    import numpy as np

    from trace_jax import models
    from trace_jax.train.flops import flops_per_token
    from trace_jax.train.optimizer import make_optimizer

    mesh = jax.sharding.AbstractMesh(tuple(axes.values()), tuple(axes))
    optimizer = make_optimizer(run_config.optimizer)
    shapes = jax.eval_shape(lambda: models.init_params(model_config, jax.random.PRNGKey(0), dtype="float32"))
    params = _abstract(shapes, models.param_shardings(model_config, mesh, mesh_config.train_rules()))
    opt_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize
                    for x in jax.tree_util.tree_leaves(jax.eval_shape(optimizer.init, shapes)))
    # Adam's moments are sharded like the params (state.py): scale the param bytes by the unsharded ratio.
    param_total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes))
    per_device_params = device_bytes(params)
    state_bytes = per_device_params + int(opt_bytes * per_device_params / max(param_total, 1))
    rows, length = settings["rows"], settings["length"]
    cache = 2 * model_config.num_hidden_layers * rows * length * model_config.num_key_value_heads * \
        model_config.head_dim * np.dtype(model_config.dtype).itemsize
    cache_per_device = cache // max(1, settings["batch_shards"])
    train = ProgramReport("train", f"{rows // run_config.update.mini_batches} rows x {length} tokens")
    train.model_flops = flops_per_token(model_config, length) * (rows // run_config.update.mini_batches) * length
    decode = ProgramReport("decode", f"{rows} rows, KV cache of {length} tokens")
    # the frozen reference in TrainConfig.reference_dtype (the params above are float32)
    reference_dtype = run_config.train.reference_dtype
    reference_bytes = per_device_params * np.dtype(jax.numpy.dtype(reference_dtype)).itemsize // 4
    settings = dict(settings, reference_dtype=reference_dtype)
    train.resident_other_bytes = reference_bytes
    report = PlanReport(topology, axes, how, settings, [train, decode],
                        {"train state": state_bytes, "reference": reference_bytes}, checked=False)
    report.notes += [
        f"GPU target {topology.chip.name} x {topology.num_chips}: no GPU compiler runs on this CPU host, so only "
        "what shapes and shardings determine is checked here.",
        f"checked: mesh {axes} matches {topology.num_chips} GPUs; per device the float32 train state (params + "
        f"AdamW) {state_bytes / GIB:.2f} GiB, the reference {reference_bytes / GIB:.2f} GiB, the rollout KV "
        f"cache {cache_per_device / GIB:.2f} GiB (rows over the batch rule's axes); model FLOPs per update "
        f"{train.model_flops:.3g}.",
        "not checked: activation temporaries, XLA's buffer assignment and the step time; run `trace-jax plan` on "
        "one GPU host of the target (the same command compiles there), or plan the same mesh on a TPU topology "
        "for a compiler-checked estimate of the temporaries.",
    ]
    return report


# ------------------------------------------------------------------------------------------------ printing
def _gib(value) -> str:
    if value is None:
        return "n/a"
    return f"{value / GIB:.2f}G" if value >= GIB / 10 else f"{value / 1024**2:.1f}M"


def format_report(report: PlanReport) -> str:
    """The human-readable plan (what `trace-jax plan` prints)."""
    t, s = report.topology, report.settings
    lines = [f"plan: {t.name} ({t.slice_name}, {t.num_chips} chips, {t.chip.hbm_bytes / GIB:.0f} GiB HBM each), "
             f"mesh {report.mesh}",
             f"model: {report.model}; compute {s['dtype']}, remat {s['remat']}, attention {s['attention']}",
             f"step: {s['rows']} trajectories x {s['length']} tokens, {s['mini_batches']} mini-batch(es), "
             f"{s['micro_batches']} micro-batch(es); float32 master weights + AdamW",
             *_resident_lines(report), ""]
    header = (f"| {'program':<9} | {'args':>8} | {'out':>8} | {'temp':>8} | {'aliased':>8} | "
              f"{'+resident':>9} | {'peak':>8} | {'TFLOP/chip':>10} | {'est. ms':>8} | shape")
    lines += [header, "|" + "|".join("-" * len(c) for c in header.split("|")[1:]) + "|"]
    for p in report.programs:
        flops = "n/a" if p.flops is None else f"{p.flops / 1e12:.3f}"
        ms = "n/a" if p.seconds is None else f"{p.seconds * 1e3:.1f}"
        peak = _gib(p.peak_bytes) if not p.out_of_memory else ">" + _gib(p.peak_bytes)
        lines.append(f"| {p.name:<9} | {_gib(p.argument_bytes):>8} | {_gib(p.output_bytes):>8} | "
                     f"{_gib(p.temp_bytes):>8} | {_gib(p.alias_bytes):>8} | {_gib(p.resident_other_bytes):>9} | "
                     f"{peak:>8} | {flops:>10} | {ms:>8} | {p.shape}{' (OUT OF MEMORY)' if p.out_of_memory else ''}")
    lines.append("")
    peak = report.peak_bytes
    lines += [f"{p.name}: {p.out_of_memory}" for p in report.programs if p.out_of_memory]
    if report.fits is None:
        lines.append("verdict: NOT CHECKED (see the notes)")
    else:
        lines.append(f"verdict: {report.verdict}: peak {'over ' if report.fits is False and peak <= t.chip.hbm_bytes else ''}{peak / GIB:.2f} GiB of {t.chip.hbm_bytes / GIB:.0f} GiB per "
                     f"chip ({100 * peak / t.chip.hbm_bytes:.0f}%)")
    lines += format_estimate(report)
    lines += format_split(report)
    lines += format_decode(report)
    lines += [f"advice: {a}" for a in report.advice]
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


def _resident_lines(report: PlanReport) -> list[str]:
    """What stays on each chip across the step's phases, and the rollout rows that run at once."""
    r, s = report.resident, report.settings
    cache = "the page pool" if "pool_pages" in s else "the rows at once"
    lines = [f"resident per chip across phases: train state {_gib(r['train state'])} (params + AdamW, always), "
             f"reference {_gib(r['reference'])} ({s.get('reference_dtype', 'float32')}, always)"
             + (f", rollout copy {_gib(r['rollout copy'])} (the policy in the rollout layout, during the rollout), "
                f"KV cache {_gib(r['KV cache'])} ({cache}, during the rollout)" if "KV cache" in r else "")
             + " (bytes per chip below: G = GiB, M = MiB)"]
    if "rows_at_once" in s:
        budget = (f"a KV budget of {s['kv_budget_gib']:g} GiB per chip" if s["kv_budget_gib"]
                  else "no KV budget (RolloutConfig.kv_budget_gib / --kv-budget-gib): every row at once")
        if s.get("processes", 1) > 1:
            lines.append(f"processes: {s['processes']} (one a host), each feeding {s['process_rows']} of the "
                         f"{s['rows']} rows (and running their tools) into the rollout and scoring programs over "
                         "the whole mesh")
        if "pool_pages" in s:  # a pool of pages shared by the rows in flight
            budget = budget.split(":")[0]
            lines.append(f"rollout (paged engine): a pool of {s['pool_pages']} pages x {s['page_size']} tokens "
                         f"({s['pool_pages'] * s['page_size']} tokens) under {budget}, shared by at most "
                         f"{s['rows_at_once']} of {s['rows']} rows in flight")
    return lines


def format_split(report: PlanReport) -> list[str]:
    """The whole step's time estimate by phase (`estimate_step_split`)."""
    split = report.split
    if split is None:
        return []
    update = "n/a (" + split.why_no_update + ")" if split.update is None else _secs(split.update)
    total = "" if split.total is None else f" = {_secs(split.total)} per step"
    return [f"step time estimate per chip: rollout {_secs(split.rollout)} ({split.decode_steps} decode steps of "
            f"{split.rows_in_flight} rows in flight, at most {split.decoded_tokens} decoded tokens a row, and "
            f"{_secs(split.prefill)} of prefill; an upper bound) + score {_secs(split.score)} + update {update} "
            f"({report.settings['mini_batches']} mini-batch(es)){total}"]


def _secs(value: float) -> str:
    return f"{value:.2f} s" if value >= 1 else f"{value * 1e3:.3g} ms"


def format_estimate(report: PlanReport) -> list[str]:
    """The train step's time lines: the roofline estimate and implied MFU, or why there is none."""
    t, train, e = report.topology, report.program("train"), report.estimate
    if train is None or not train.model_flops:
        return []
    if e is None:
        why = report.estimate_missing or "not asked for (--no-time-estimate)"
        if train.out_of_memory:
            why = "the step does not fit"
        return [f"train step: {train.model_flops / 1e12:.1f} model TFLOPs; no time estimate: {why}"]
    lines = [f"train step: {train.model_flops / 1e12:.1f} model TFLOPs; roofline estimate {_secs(e.seconds)} per step "
             f"-> implied MFU {100 * report.train_mfu:.0f}% of {t.num_chips} x {t.chip.peak_flops / 1e12:.0f} "
             f"TFLOP/s (an upper bound: see docs/scaling.md)",
             f"  = compiler {_secs(e.xla_seconds)} ({e.time_source} of the XLA ops, every loop iteration counted: "
             f"{e.xla_flops / 1e12:.3g} TFLOP/chip, {100 * e.xla_flops / e.expected_xla_flops:.1f}% of the "
             f"{e.expected_xla_flops / 1e12:.3g} matmul TFLOP/chip expected, {_gib(e.xla_bytes)} accessed)"
             f" + attention kernel {_secs(e.kernel_seconds)} ({e.kernel_flops / 1e12:.3g} TFLOP/chip at the "
             f"compiler's dot rate {e.dot_rate / 1e12:.0f} TFLOP/s)"]
    if e.lengths is not None:
        lines.append(f"  (the unrolled variants were compiled at {e.lengths[0]} and {e.lengths[1]} tokens per row and "
                     f"their figures extended in tokens to the step's {e.context})")
    if e.check is not None:
        layers, micro, got, predicted = e.check
        lines.append(f"  check: the {layers}-layer variant ({micro} micro-batch(es)) compiles to {got * 1e3:.1f} ms, "
                     f"predicted {predicted * 1e3:.1f} ms from the 1- and 2-layer ones "
                     f"({100 * (predicted / got - 1):+.2f}%)")
    return lines


# ------------------------------------------------------------------------------------------------ the command
def add_arguments(parser) -> None:
    parser.add_argument("--gin-file", "--gin_file", action="append", default=[], help="gin config file (repeatable)")
    parser.add_argument("--gin-param", "--gin_param", action="append", default=[],
                        help="extra binding (repeatable; later wins)")
    parser.add_argument("--topology", required=True,
                        help="target: v5e:4x4, v5p:2x2x2, a slice name (v5e-16, v5p-8), or a GPU count (h100:8)")
    parser.add_argument("--mesh", default=None, help="mesh axes, e.g. fsdp=8,tensor=2 (default: the MeshConfig "
                                                     "of the gin files)")
    parser.add_argument("--programs", default=",".join(PROGRAMS),
                        help="comma-separated subset of " + ",".join(PROGRAMS))
    parser.add_argument("--model-preset", "--model_preset", default="",
                        help="model preset when the checkpoint is not on this host")
    parser.add_argument("--dtype", default="", help="compute dtype override, e.g. bfloat16 (default: the model's)")
    parser.add_argument("--remat", default="", help="rematerialisation override, e.g. full (default: the model's)")
    parser.add_argument("--answer-tokens", "--answer_tokens", type=int, default=32,
                        help="answer continuation length for scoring")
    parser.add_argument("--no-time-estimate", "--no_time_estimate", action="store_true",
                        help="skip the unrolled 1-2 layer variants of the train step behind the step-time estimate")
    parser.add_argument("--kv-budget-gib", "--kv_budget_gib", type=float, default=None,
                        help="the rollout's KV-cache budget per chip in GiB (default: RolloutConfig.kv_budget_gib "
                             "where the config has one, else every rollout row at once)")
    parser.add_argument("--validate-estimate", "--validate_estimate", action="store_true",
                        help="also compile the 3-layer variant and print it against the estimate's prediction")


def run(args) -> int:
    import sys

    from trace_jax.rl.gin_setup import ConfigError, parse

    if not args.gin_file:
        print("error: trace-jax plan needs --gin-file (e.g. configs/qwen3_4b.gin)", file=sys.stderr)
        return 2
    try:
        run_config = parse(args.gin_file, args.gin_param)
        plan_config = PlanConfig(topology=args.topology, programs=tuple(p.strip() for p in args.programs.split(",")),
                                 answer_tokens=args.answer_tokens, dtype=args.dtype, remat=args.remat,
                                 estimate_time=not args.no_time_estimate,
                                 validate_estimate=args.validate_estimate, kv_budget_gib=args.kv_budget_gib)
        mesh_config = parse_mesh(args.mesh, None)
        report = plan(run_config, plan_config, mesh_config, model_preset=args.model_preset)
    except (ConfigError, PlanError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_report(report))
    return 1 if report.fits is False else 0
