"""The multi-host runtime: one program on every host (JAX's multi-controller model), set up from config or environment.

    DistributedConfig.mode = "off"       one process (the default); nothing is initialised
                             "auto"      `jax.distributed.initialize()` with no arguments: JAX detects the cluster
                                         (TPU VMs, SLURM, Open MPI, other clusters it knows)
                             "explicit"  the coordinator, process count and this process's id from the fields

The environment variables `TRACE_JAX_COORDINATOR` ("host:port"), `TRACE_JAX_NUM_PROCESSES` and
`TRACE_JAX_PROCESS_ID` override the fields and imply "explicit", so one command line (and one gin file) serves every
host: a launcher sets the three variables per host. `initialize(config)` must run before any other JAX call of the
process (`trace-jax train` calls it first); it is idempotent and returns `(process_index, process_count)`. On CPU
the cross-process collectives are gloo's (`jax_cpu_collectives_implementation`).

What a multi-process run does with it (`trace_jax.rl.loop`):

  * every process holds the same configs and builds the same tasks, tokenizer and initial params (deterministic in
    the config); the train state lives on one mesh over every process's devices (`MeshConfig`);
  * each process runs the rollouts of its contiguous share of the step's prompts (`process_share`), with all `G`
    samples of a prompt on the same process: prompt groups are host-local by construction, so group statistics
    (GRPO, TRACE, GiGPO) need no gathering. The rollout and the reference scoring are SPMD programs over the whole
    mesh with the params sharded over all of it: each process feeds its own rows and runs the agent loop (tools,
    parsing) for them, and the processes dispatch the same programs in lock step (`agree_max`, `agree_any`;
    `gather_sequences` and `gather_rows` for the small per-row host arguments every process passes alike;
    `local_rows` reads a result's rows from this process's shards); rows of all processes are assembled into one
    global update batch with `jax.make_array_from_process_local_data` (`global_batch`);
  * evaluations split the held-out tasks: each process runs its contiguous part (`process_part`, uneven counts
    allowed) in the same programs over the mesh, and the per-task outcomes are gathered (`gather_rows`), so every
    process holds the result one process evaluating every task would give;
  * only the primary process (index 0) writes logs, metrics, plots, receipts and the summary (`is_primary`); every
    process takes part in orbax checkpointing (orbax coordinates the processes itself).

This module knows JAX's distributed API and array placement; it knows nothing about models, losses, rollouts or
run directories.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Mapping

import jax
import numpy as np
from jax.sharding import Mesh

MODES = ("off", "auto", "explicit")
ENV_COORDINATOR = "TRACE_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "TRACE_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "TRACE_JAX_PROCESS_ID"
ENV_VARIABLES = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process run (gin: `DistributedConfig.*`; see the module docstring).

    Attributes:
      mode: "off" (one process), "auto" (JAX detects the cluster) or "explicit" (the fields below).
      coordinator_address: "host:port" of process 0's coordinator service ("explicit" only).
      num_processes: processes in the run ("explicit" only).
      process_id: this process's index in [0, num_processes) ("explicit" only).
      local_device_ids: the local devices this process uses (e.g. one GPU per process), or None for all.
      initialization_timeout_s: seconds to wait for every process to reach the coordinator before failing.
    """

    mode: str = "off"
    coordinator_address: str = ""
    num_processes: int = 1
    process_id: int = 0
    local_device_ids: tuple[int, ...] | None = None
    initialization_timeout_s: int = 300

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"DistributedConfig.mode must be one of {MODES}, got {self.mode!r}")
        if self.local_device_ids is not None:
            ids = self.local_device_ids
            ids = (ids,) if isinstance(ids, int) and not isinstance(ids, bool) else ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise ValueError(f"DistributedConfig.local_device_ids must be None or a non-empty tuple of device "
                                 f"ids >= 0, got {self.local_device_ids!r}")
            object.__setattr__(self, "local_device_ids", tuple(ids))
        if (not isinstance(self.initialization_timeout_s, int) or isinstance(self.initialization_timeout_s, bool)
                or self.initialization_timeout_s < 1):
            raise ValueError(f"DistributedConfig.initialization_timeout_s must be an int >= 1 (seconds), got "
                             f"{self.initialization_timeout_s!r}")
        for name in ("num_processes", "process_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"DistributedConfig.{name} must be an int, got {value!r}")
        if self.mode != "explicit":
            return
        host, _, port = self.coordinator_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"DistributedConfig.coordinator_address must be 'host:port' (process 0's address and "
                             f"a free port, e.g. '10.0.0.2:8476') in mode 'explicit', got "
                             f"{self.coordinator_address!r}; set it or {ENV_COORDINATOR}")
        if self.num_processes < 1:
            raise ValueError(f"DistributedConfig.num_processes must be >= 1, got {self.num_processes}; set it or "
                             f"{ENV_NUM_PROCESSES}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"DistributedConfig.process_id must be in [0, num_processes = {self.num_processes}), "
                             f"got {self.process_id}; set it or {ENV_PROCESS_ID} (one value per host)")


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} must be an integer") from None


def from_environment(config: DistributedConfig, environ: Mapping[str, str] | None = None) -> DistributedConfig:
    """`config` with the `TRACE_JAX_*` variables of `environ` (default `os.environ`) applied: any of them set
    makes the mode "explicit" and overrides its field. Raises ValueError naming the variable when the result is
    invalid (e.g. a process id but no coordinator)."""
    environ = os.environ if environ is None else environ
    if not any(environ.get(name, "").strip() for name in ENV_VARIABLES):
        return config
    changes: dict = {"mode": "explicit"}
    coordinator = environ.get(ENV_COORDINATOR, "").strip()
    if coordinator:
        changes["coordinator_address"] = coordinator
    for name, field in ((ENV_NUM_PROCESSES, "num_processes"), (ENV_PROCESS_ID, "process_id")):
        value = _env_int(environ, name)
        if value is not None:
            changes[field] = value
    try:
        return dataclasses.replace(config, **changes)
    except ValueError as error:
        set_vars = ", ".join(f"{n}={environ[n]!r}" for n in ENV_VARIABLES if environ.get(n, "").strip())
        raise ValueError(f"{error} (from the environment: {set_vars}; set all three of {', '.join(ENV_VARIABLES)})"
                         ) from None


_initialized_by_us: DistributedConfig | None = None


def initialize(config: DistributedConfig | None = None, *, environ: Mapping[str, str] | None = None,
               log: Callable[[str], None] | None = print) -> tuple[int, int]:
    """Join the multi-process run `config` describes (after the environment overrides); returns
    `(process_index, process_count)` and logs one line per process.

    Call it before any other JAX call of the process. Idempotent: a second call (or a call after someone else
    initialised `jax.distributed`) initialises nothing and returns the same pair. Mode "off" initialises nothing.
    """
    global _initialized_by_us
    config = from_environment(config or DistributedConfig(), environ)
    if config.mode != "off" and not jax.distributed.is_initialized():
        if jax.config.values.get("jax_cpu_collectives_implementation") in (None, "none"):
            # without cross-process collectives a multi-process CPU run would fail at its first all-reduce
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        try:
            if config.mode == "auto":
                jax.distributed.initialize(initialization_timeout=config.initialization_timeout_s)
            else:
                jax.distributed.initialize(coordinator_address=config.coordinator_address,
                                           num_processes=config.num_processes, process_id=config.process_id,
                                           local_device_ids=(list(config.local_device_ids)
                                                             if config.local_device_ids is not None else None),
                                           initialization_timeout=config.initialization_timeout_s)
        except RuntimeError as error:
            if "must be called before" not in str(error):
                raise
            raise RuntimeError("distributed.initialize came after JAX's backend was initialised (a computation, "
                               "jax.devices(), or an import that runs one): call it first in the process, as "
                               f"`trace-jax train` does ({error})") from None
        _initialized_by_us = config
        if log is not None:
            where = f" via {config.coordinator_address}" if config.mode == "explicit" else " (detected)"
            log(f"distributed: process {jax.process_index()} of {jax.process_count()}{where}, "
                f"{jax.local_device_count()} local of {jax.device_count()} devices "
                f"({jax.devices()[0].platform})")
    return jax.process_index(), jax.process_count()


def is_primary() -> bool:
    """True on the process that writes the run's files (process 0; the only one without multi-process)."""
    return jax.process_index() == 0


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def process_share(count: int, *, what: str = "rows", process_index: int | None = None,
                  process_count: int | None = None) -> slice:
    """Process i's contiguous share of `count` items (prompts, rows): `[i * count / n, (i + 1) * count / n)`, for
    this process unless `process_index` / `process_count` say otherwise.

    Raises ValueError when `count` is not divisible by the process count (every process must hold the same number
    of rows for the global batch)."""
    n = jax.process_count() if process_count is None else process_count
    i = jax.process_index() if process_index is None else process_index
    if count % n:
        raise ValueError(f"{count} {what} cannot be split evenly over {n} processes; make it a multiple of {n}")
    per = count // n
    return slice(i * per, (i + 1) * per)


def process_part(count: int, *, process_index: int | None = None, process_count: int | None = None) -> slice:
    """Process i's contiguous part of `count` items that need not be split evenly (held-out tasks, each evaluated
    on its own): `[i * count // n, (i + 1) * count // n)`, so the parts differ by at most one item, cover every
    item once in process order, and a process gets none when there are fewer items than processes. For this
    process unless `process_index` / `process_count` say otherwise."""
    n = jax.process_count() if process_count is None else process_count
    i = jax.process_index() if process_index is None else process_index
    return slice(i * count // n, (i + 1) * count // n)


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (nothing to wait for with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def global_batch(tree, shardings):
    """Host-local rows -> global arrays: each process passes its own `[n_local, ...]` rows of every leaf (the same
    number on every process, in process order) and gets `[n_local * process_count, ...]` arrays placed with
    `shardings` (a sharding, or a pytree of them matching `tree`) whose rows are split over the processes.

    With one process this is `jax.device_put`. The batch mesh axes must put process p's devices on the p-th
    block of rows (true of a mesh built over `jax.devices()`, which lists devices in process order)."""
    def place(x, sharding):
        if x is None:
            return None
        x = np.asarray(x)
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        global_shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
        check_rows_split_by_process(sharding, global_shape)
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree_util.tree_map(lambda x: place(x, shardings), tree)
    return jax.tree_util.tree_map(place, tree, shardings)


def check_rows_split_by_process(sharding, global_shape) -> None:
    """Raise ValueError unless this process's devices hold exactly its own block of the rows of a `global_shape`
    array placed with `sharding` (in process order), as `global_batch` needs."""
    per = global_shape[0] // jax.process_count()
    mine = (jax.process_index() * per, (jax.process_index() + 1) * per)
    rows = set()
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        start, stop, _ = index[0].indices(global_shape[0])
        rows.update(range(start, stop))
    if rows != set(range(*mine)):
        raise ValueError(f"a global batch of {global_shape[0]} rows on {sharding} does not give process "
                         f"{jax.process_index()} rows [{mine[0]}, {mine[1]}): the rows must be split over the "
                         f"batch mesh axes across every process (make the rows per step a multiple of the devices "
                         f"on the batch axes, {jax.device_count()} with the default MeshConfig)")


def put_replicated_value(tree, shardings):
    """Place a value every process holds in full (e.g. params initialised from the same seed) onto global
    `shardings` (each process keeps its own shards). `shardings` is a sharding or a pytree matching `tree`.

    With one process, device arrays move device to device (`jax.device_put`); with several, each process cuts its
    own shards out of its full copy (`make_array_from_callback`), as a global array cannot be built from one
    process's device buffers."""
    def put(x, sharding):
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree_util.tree_map(lambda x: put(x, shardings), tree)
    return jax.tree_util.tree_map(put, tree, shardings)


# ------------------------------------------------------------------------------------------------ lock-step
# The rollout and the reference scoring are SPMD programs over the whole mesh: every process must dispatch the same
# programs with the same shapes in the same order. These helpers are the host side of that agreement (a tiny
# all-gather each); with one process each is the identity and talks to no one.
def agree_max(value: int) -> int:
    """The largest `value` of any process (a collective; `value` itself with one process)."""
    if jax.process_count() == 1:
        return int(value)
    return int(gather_to_hosts(np.asarray(int(value), np.int32)).max())


def agree_any(flag: bool) -> bool:
    """Whether `flag` holds on any process (a collective; `flag` itself with one process)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(gather_to_hosts(np.asarray(bool(flag), np.int32)).any())


def spans_processes(where) -> bool:
    """Whether a mesh (or an array, a sharding) has devices of other processes than this one: its programs are
    collectives every process must dispatch together. False for None (one device) and with one process."""
    if where is None or jax.process_count() == 1:
        return False
    if isinstance(where, jax.Array):
        return not where.is_fully_addressable
    devices = where.devices if isinstance(where, Mesh) else where.mesh.devices
    me = jax.process_index()
    return any(device.process_index != me for device in np.asarray(devices).flat)


def gather_sequences(sequences) -> list[list[int]]:
    """Every process's lists of ints (any number of lists of any lengths), concatenated in process order on every
    process (a collective; the lists themselves with one process). For the token ids of rows that a collective
    program takes from every process (admitted prompts, appended observations)."""
    sequences = [[int(t) for t in seq] for seq in sequences]
    if jax.process_count() == 1:
        return sequences
    longest = agree_max(max((len(seq) for seq in sequences), default=0))
    rows = np.zeros((len(sequences), longest + 1), np.int32)
    for i, seq in enumerate(sequences):
        rows[i, 0] = len(seq)
        rows[i, 1:1 + len(seq)] = seq
    gathered = gather_rows(rows)
    return [row[1:1 + int(row[0])].tolist() for row in gathered]


def local_rows(x, rows: slice, axis: int = 0) -> np.ndarray:
    """Rows `rows` (along `axis`) of the array `x`, as host numpy, read from this process's addressable shards (no
    communication) when they hold those rows; otherwise from the all-gathered array (a collective). Every process
    asks for its own block of rows of a layout that either splits the rows by process or replicates them, so every
    process takes the same branch (the rollout's and the scorer's rows; a layout that puts a process's rows on
    another process's devices would have only some processes gather). A fully addressable array is read as it is."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)[(slice(None),) * axis + (rows,)]
    start, stop, _ = rows.indices(x.shape[axis])
    shape = list(x.shape)
    shape[axis] = stop - start
    out = np.zeros(shape, x.dtype)
    covered = np.zeros(shape, bool)
    for shard in x.addressable_shards:
        index = list(shard.index) + [slice(None)] * (x.ndim - len(shard.index))
        lo, hi, _ = index[axis].indices(x.shape[axis])
        lo, hi = max(lo, start), min(hi, stop)
        if lo >= hi:
            continue
        data = np.asarray(shard.data)
        source = [slice(None)] * x.ndim
        first, _, _ = index[axis].indices(x.shape[axis])
        source[axis] = slice(lo - first, hi - first)
        target = list(index)
        target[axis] = slice(lo - start, hi - start)
        out[tuple(target)] = data[tuple(source)]
        covered[tuple(target)] = True
    if covered.all():
        return out
    from jax.experimental import multihost_utils

    whole = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return whole[(slice(None),) * axis + (slice(start, stop),)]


def describe_mesh(mesh: Mesh) -> dict:
    """What a run records about its mesh: `{"axes": {axis: size}, "devices": n, "processes": p, "platform": ...}`."""
    return {"axes": {a: int(s) for a, s in dict(mesh.shape).items()}, "devices": int(mesh.devices.size),
            "processes": jax.process_count(), "platform": mesh.devices.flat[0].platform}


def host_local(tree):
    """A copy of a pytree of (possibly global) arrays that lives on this process only (its first local device), to
    read results on the host (tests, tools). Arrays this process holds in full are copied from its own shard;
    arrays sharded across processes are all-gathered through host memory (a collective: every process must call
    this). The training loop never uses it: its phases read their own shards."""
    from jax.experimental import multihost_utils

    device = jax.local_devices()[0]

    def local(x):
        if not isinstance(x, jax.Array):
            return x
        if x.is_fully_addressable:
            return jax.device_put(x, device)
        if x.is_fully_replicated:
            return jax.device_put(x.addressable_data(0), device)
        return jax.device_put(np.asarray(multihost_utils.process_allgather(x, tiled=True)), device)

    return jax.tree_util.tree_map(local, tree)


def gather_rows(rows: np.ndarray) -> np.ndarray:
    """Every process's host-local `[n_i, ...]` rows, concatenated in process order on every process (a collective;
    the rows themselves with one process). Unlike `gather_to_hosts`, the processes may hold different numbers of
    rows (none included); the trailing shape and dtype must agree, and the dtype be one JAX holds (32-bit unless
    `jax_enable_x64`: the rows travel as JAX arrays)."""
    rows = np.asarray(rows)
    if jax.process_count() == 1:
        return rows
    counts = gather_to_hosts(np.asarray(rows.shape[0], np.int32))
    most = int(counts.max())
    # equal shapes for the all-gather: pad to the most rows any process holds, then keep each process's own
    padded = np.zeros((most, *rows.shape[1:]), rows.dtype)
    padded[:rows.shape[0]] = rows
    stacked = gather_to_hosts(padded)
    return np.concatenate([stacked[p, :int(n)] for p, n in enumerate(counts)])


def gather_to_hosts(tree):
    """Every process's host-local numpy values of `tree`, stacked on a new leading axis of size `process_count`
    (a collective; `[1, ...]` with one process). For host-side statistics such as per-step metrics."""
    if jax.process_count() == 1:
        return jax.tree_util.tree_map(lambda x: np.asarray(x)[None], tree)
    from jax.experimental import multihost_utils

    return jax.tree_util.tree_map(np.asarray, multihost_utils.process_allgather(tree, tiled=False))
