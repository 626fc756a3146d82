"""One registry of the device programs an RL step dispatches, with the loop's own arguments.

`programs(run_config, model_config, mesh, ...)` lists every jitted program that one step of `loop.rl_step` runs on
the mesh, each as an `Entry`: the program object itself (taken from the builder that the loop's call goes through,
which keeps one object per set of static arguments, so it is the very object the loop calls) and abstract arguments
(`jax.ShapeDtypeStruct`s with the loop's shapes, dtypes and shardings; static arguments are in the program's key
and in the arguments' pytree structure), so `entry.lower()` lowers what the loop dispatches:

  * "paged_init":    `paged.init_pool_program`, the rollout engine's page pool, created sharded;
  * "paged_prefill": `paged.prefill_program`, admissions, observations and recomputes, at every (distinct rows,
                     chunk width, work items, output rows) bucket that `PagedConfig.prefill_tokens` lets through;
  * "paged_decode":  `paged.decode_program`, `RolloutConfig.sync_every` steps at every decode-batch bucket (powers
                     of two up to the slots) and work-item bucket (powers of two from 16, capped at the pool's
                     pages) (`paged_entries`);
  * "rollout_cast", "reshard": `models.cast_program` / `models.reshard_program`, the policy's rollout copy
                     (`Placement.rollout_params`), where it is not the train-layout params as they are;
  * "score":         `scoring.fork.fork_scores_program`, the reference's prefix-fork pass, at every padded shape
                     the step's length buckets, scorer chunks and answer lengths reach (only when the estimator
                     reads answer scores or the loss or metrics read the reference's token log-probs); with
                     `UpdateConfig.packing`, a cached-layout pass is `fork.rows_packed_program` at every packed-row
                     bucket (`models.packing.packed_row_buckets`) instead;
  * "behaviour":     `pipeline.behaviour_program`, the trainer's recomputation of pi_old on each chunk of the
                     step's batch (`LossConfig.tis` only);
  * "update":        `train.step.make_train_step` on one mini-batch of the step's `LossBatch`, padded to the run's
                     fixed update shape (`pipeline.update_shapes`, with `trained_index` and `token_mask`), and the
                     fallback shapes a step that does not fit it is padded to; with `UpdateConfig.packing`, each at
                     every packed-row bucket (`LossBatch.packed`; `Programs.fixed_update` is the largest).

Host arrays the loop passes as they are (numpy token chunks, per-row flags) have no sharding here (`sharding=None`),
as jit sees them; device arrays carry the layout the loop gives them. Every program is over the whole mesh, at the
global shapes: the scorer's rows are each process's chunk padded to the same count (the rollout engine runs on one
process's devices, `paged_entries`). Not listed: the small jitted helpers of the
host side (the rows' PRNG keys, `compute_advantages` on the step's `[rows, length]` advantages), and jnp
operations on single arrays; the naive scorer (`UpdateConfig.scoring = 'naive'`, for contrast only).
tests/rl/test_programs.py records what two RL steps dispatch and
checks it against this list.

`trace-jax plan` lowers these entries for a TPU topology, so its FIT verdict is about the programs the loop runs.

This module knows the run config and the builders of the programs; it runs nothing on a device and knows nothing
about tools, tasks or run directories.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import models
from trace_jax.credit.registry import get_estimator
from trace_jax.models import packing as packing_lib
from trace_jax.rl.pipeline import behaviour_program, packing_shards, update_shapes
from trace_jax.rollout import budget, sampler
from trace_jax.rollout import paged as paged_lib
from trace_jax.rollout.engine import decode_buckets, pool_pages, process_shards
from trace_jax.scoring import fork
from trace_jax.train.checkpoint import abstract_train_state
from trace_jax.train.loss import LossBatch, length_bucket
from trace_jax.train.optimizer import make_optimizer
from trace_jax.train.step import batch_sharding, make_train_step

PHASES = {"rollout_cast": "rollout", "reshard": "rollout", "paged_init": "rollout", "paged_prefill": "rollout",
          "paged_decode": "rollout", "score": "score", "behaviour": "update", "update": "update"}
NAMES = tuple(PHASES)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One program the loop dispatches, at one set of argument shapes.

    Attributes:
      name: the kind (`NAMES`).
      program: the builder's program object, the one the loop calls (`MeshProgram`, `ScoringProgram`, `TrainStep`
        or a jitted function).
      args: abstract arguments, `ShapeDtypeStruct`s with the loop's shardings (None: a host array).
      shape: what the shapes are, in words.
      fallback: a shape the loop runs only for a step that does not fit the run's fixed update shape (warned:
        `pipeline.UpdateShapeWarning`).
      bucket: one of the smaller packed-row counts of the update at its shape (`UpdateConfig.packing`); the entry
        without it is the largest, every row alone in a packed row.
    """

    name: str
    program: Any
    args: tuple
    shape: str
    fallback: bool = False
    bucket: bool = False

    @property
    def phase(self) -> str:
        return PHASES[self.name]

    def lower(self):
        """The program lowered on the abstract arguments (under its mesh, as the loop dispatches it)."""
        return self.program.lower(*self.args)

    @property
    def argument_bytes(self) -> int:
        """Bytes of the arguments on one device (their largest shard), host arrays whole."""
        total = 0
        for leaf in jax.tree_util.tree_leaves(self.args):
            shape = leaf.shape if leaf.sharding is None else leaf.sharding.shard_shape(leaf.shape)
            total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
        return total

    def accepts(self, args) -> bool:
        """Whether a call with `args` (the loop's arrays) is this entry's: the same pytree structure (so the same
        static fields), and every array of the same shape and dtype, host arrays (and uncommitted device arrays,
        which jit places as it places host data) where the entry has no sharding, device arrays in a layout
        equivalent to the entry's."""
        if jax.tree_util.tree_structure(args) != jax.tree_util.tree_structure(self.args):
            return False
        for got, want in zip(jax.tree_util.tree_leaves(args), jax.tree_util.tree_leaves(self.args)):
            array = np.asarray(got) if not isinstance(got, jax.Array) else got
            if tuple(array.shape) != tuple(want.shape) or jnp.dtype(array.dtype) != jnp.dtype(want.dtype):
                return False
            committed = isinstance(got, jax.Array) and got.committed
            if want.sharding is None:
                if committed:
                    return False
            elif not (committed and isinstance(got.sharding, jax.sharding.NamedSharding)
                      and got.sharding.mesh.devices.shape == want.sharding.mesh.devices.shape
                      and (got.sharding.mesh.devices == want.sharding.mesh.devices).all()
                      and got.sharding.is_equivalent_to(want.sharding, array.ndim)):
                return False
        return True


@dataclasses.dataclass(frozen=True)
class Programs:
    """Every program of one RL step (`entries`), and what they were built from.

    Attributes:
      entries: the `Entry`s, in the order of the step (rollout, score, update).
      train_step: the update (`TrainStep`), the object the loop's pipeline calls.
      rows: rollout rows of this process per step; rows_at_once: the engine's slots (the most rows in flight).
      kv_cache_bytes: the engine's page pool's bytes on one device.
      state, reference, rollout_params: the abstract train state, frozen reference and rollout copy.
    """

    entries: tuple[Entry, ...]
    train_step: Any
    rows: int
    rows_at_once: int
    kv_cache_bytes: int
    state: Any
    reference: Any
    rollout_params: Any

    def named(self, name: str) -> tuple[Entry, ...]:
        if name not in NAMES:
            raise ValueError(f"Programs.named: name must be one of {NAMES}, got {name!r}")
        return tuple(e for e in self.entries if e.name == name)

    def largest(self, name: str) -> Entry | None:
        """The entry of `name` with the most argument bytes on a device (ties: the last listed), or None."""
        entries = self.named(name)
        return max(reversed(entries), key=lambda e: e.argument_bytes) if entries else None

    def fixed_update(self) -> Entry:
        """The update at the run's fixed shape (`pipeline.update_shapes`): with packing, its largest packed-row
        count."""
        (entry,) = [e for e in self.named("update") if not e.fallback and not e.bucket]
        return entry

    def match(self, program, args) -> Entry | None:
        """The entry of `program` (the same object) that accepts `args`, or None."""
        return next((e for e in self.entries if e.program is program and e.accepts(args)), None)


def _host(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _placed(tree, shardings):
    return jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shardings)


def bucket_lengths(longest: int, minimum: int = sampler.MIN_BUCKET) -> tuple[int, ...]:
    """Every `sampler.bucket_length(n, minimum)` for 1 <= n <= longest, in increasing order: the sizes the one
    bucketing rule can give (powers of two from `minimum` up to 512, then multiples of 256)."""
    top, out, size = sampler.bucket_length(longest, minimum), [], minimum
    while size <= min(512, top):
        out.append(size)
        size *= 2
    out += list(range(768, top + 1, 256))
    return tuple(out)


def programs(run_config, model_config, mesh, *, optimizer=None, train_step=None, num_stop_ids: int = 2,
             answer_tokens: int = 32, kv_budget_gib: float | None = None) -> Programs:
    """The registry of one RL step of `run_config` for the policy `model_config` on `mesh` (see the module doc).

    Args:
      mesh: the run's mesh (`MeshConfig.make_mesh()`; a TPU topology's devices for `trace-jax plan`).
      optimizer: the optax optimizer (default `make_optimizer(run_config.optimizer)`).
      train_step: the loop's update (`RLPipeline.train_step`); None builds it as the loop does.
      num_stop_ids: the chat format's assistant stop ids (`ChatFormat.assistant_stop_ids`), a decode argument.
      answer_tokens: the most tokens of an answer continuation the reference scores (template + gold).
      kv_budget_gib: the rollout's KV budget per chip (None: `RolloutConfig.kv_budget_gib`).
    """
    rollout, update, loss, train = run_config.rollout, run_config.update, run_config.loss, run_config.train
    rules, rollout_rules = run_config.mesh.train_rules(), run_config.mesh.rollout_rules()
    optimizer = optimizer or make_optimizer(run_config.optimizer)
    train_step = train_step or make_train_step(model_config, loss, optimizer, mesh=mesh, rules=rules)
    # each process rolls out its share of the rows (`loop.rl_step`); the processes are those of the mesh's devices
    # (a TPU topology's hosts for `trace-jax plan`, every process in a run)
    processes = len({device.process_index for device in mesh.devices.flat})
    episodes = train.prompts_per_step * rollout.group_size // processes
    max_len = rollout.max_context

    # the params as each phase reads them (loop.Placement)
    shapes = jax.eval_shape(lambda: models.init_params(model_config, jax.random.PRNGKey(0), dtype="float32"))
    train_shardings = models.param_shardings(model_config, mesh, rules)
    rollout_shardings = models.param_shardings(model_config, mesh, rollout_rules)
    state = abstract_train_state(model_config, optimizer, mesh=mesh, rules=rules)
    reference_dtype, rollout_dtype = jnp.dtype(train.reference_dtype), jnp.dtype(train.rollout_dtype)
    reference = _placed(jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, reference_dtype), shapes),
                        train_shardings)
    rollout_params = _placed(jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, rollout_dtype), shapes),
                             rollout_shardings)
    entries: list[Entry] = []

    # rollout: the copy of the policy it reads, in its dtype and layout
    cast = any(x.dtype != rollout_dtype for x in jax.tree_util.tree_leaves(state.params))
    if cast:
        entries.append(Entry("rollout_cast", models.cast_program(rollout_dtype, train_shardings), (state.params,),
                             f"policy params -> {rollout_dtype.name}, train layout"))
    cast_params = _placed(jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, rollout_dtype),
                                                 state.params), train_shardings)
    leaves = jax.tree_util.tree_leaves(cast_params)
    targets = jax.tree_util.tree_leaves(rollout_params)
    moving = [i for i, (x, t) in enumerate(zip(leaves, targets))
              if not x.sharding.is_equivalent_to(t.sharding, len(x.shape))]
    if moving:
        entries.append(Entry("reshard", models.reshard_program([targets[i].sharding for i in moving]),
                             ([leaves[i] for i in moving],),
                             f"{len(moving)} of {len(leaves)} policy params, train layout -> rollout layout"))

    # rollout: the engine's programs (rollout.agent.run_episodes -> rollout.engine)
    rollout_entries, slots, kv_cache_bytes = paged_entries(run_config, model_config, mesh, rollout_params, episodes,
                                                           num_stop_ids, kv_budget_gib)
    entries += rollout_entries

    # score: the reference's prefix-fork pass (pipeline.score -> fork.score_answer_prefixes)
    estimator = get_estimator(run_config.credit.estimator)
    token_logprobs = loss.needs_reference or update.kl_metric
    if update.scoring == "fork" and ("answer_scores" in estimator.requires or token_logprobs):
        entries += _score_entries(run_config, model_config, mesh, rules, reference, episodes, answer_tokens,
                                  token_logprobs, processes)

    # update: one mini-batch of the run's fixed update shape, and the fallbacks (pipeline.update_shapes)
    fixed = update_shapes(rollout, update, episodes)
    fallbacks = {fixed, update_shapes(rollout, update, episodes, length=max_len)}
    bound = update_shapes(rollout, dataclasses.replace(update, max_trained_tokens=0), episodes, length=max_len)
    fallbacks |= {dataclasses.replace(s, head_width=bound.head_width) for s in set(fallbacks)}
    for shape in sorted(fallbacks, key=lambda s: (s != fixed, s.length, s.head_width)):
        if loss.needs_sampler_logprobs:  # pi_old by the trainer, in chunks of one micro-batch's rows
            n = shape.rows * processes
            chunk = max(1, n // (update.mini_batches * loss.micro_batches))
            for rows in sorted({chunk, n % chunk} - {0}):
                entries.append(Entry("behaviour", behaviour_program(model_config, loss, train_step.mesh),
                                     (state.params, abstract_loss_batch(loss, mesh, rules, rows, shape)),
                                     f"{rows} rows x {shape.length} tokens, {shape.head_width} trained positions"
                                     + ("" if shape == fixed else " (fallback)"), fallback=shape != fixed))
        rows = shape.rows * processes // update.mini_batches
        words = (f"{rows} rows x {shape.length} tokens, {shape.head_width} trained positions, "
                 f"{loss.micro_batches} micro-batch(es)")
        fallback = "" if shape == fixed else " (fallback)"
        if not update.packing or processes > 1:  # several processes: the update runs padded (`RLPipeline.packed`)
            batch = abstract_loss_batch(loss, mesh, rules, rows, shape)
            entries.append(Entry("update", train_step, (state, batch, None), words + fallback,
                                 fallback=shape != fixed))
            continue
        # packed (`RLPipeline.packed`): every packed-row count a group of rows can take, largest first
        shards = packing_shards(train_step.mesh, rules, rows, loss.micro_batches)
        groups = loss.micro_batches * shards
        for size in sorted(packing_lib.packed_row_buckets(rows // groups), reverse=True):
            batch = abstract_loss_batch(loss, mesh, rules, rows, shape, packed_rows=groups * size, shards=shards)
            entries.append(Entry("update", train_step, (state, batch, None),
                                 words + f", packed in {groups * size} rows" + fallback,
                                 fallback=shape != fixed, bucket=size != rows // groups))
    return Programs(tuple(entries), train_step, episodes, slots, kv_cache_bytes, state, reference, rollout_params)


def paged_entries(run_config, model_config, mesh, rollout_params, episodes: int, num_stop_ids: int,
                  kv_budget_gib: float | None = None) -> tuple[list[Entry], int, int]:
    """The rollout engine's programs (`rollout.engine`) for one process's
    `episodes` rows, at every shape its host schedule can give: (entries, slots, pool bytes on one device).

    The engine buckets each dispatch (decode batch D: `engine.decode_buckets`), prefill rows U and output rows R to
    `sampler.bucket_length(n, minimum=1)` (n <= slots), a prefill chunk's width W to `sampler.bucket_length` (at
    most `PagedConfig.prefill_chunk`, and under `max_context`), the pages read to one size
    (`paged.item_capacity` of G x the pool's pages: a prompt's G samples share its full pages). A prefill dispatch
    runs at most `PagedConfig.prefill_tokens` distinct tokens unless it runs one row: a (U, W) bucket is listed
    when its fewest tokens (the smallest U' and W' that round to it: W' + U' - 1) fit, or U is 1. On a mesh over several
    processes the engine runs in lock step (`engine` module doc): the pool and the slots are every process's parts,
    and each dispatch takes every process's rows at the largest bucket any process needs (so U and W of different
    processes meet: every (U, W) is listed), the global shapes being the processes times those buckets."""
    rollout = run_config.rollout
    paged, rules = rollout.paged, run_config.mesh.rollout_rules()
    processes = len({device.process_index for device in mesh.devices.flat})
    if kv_budget_gib is not None:
        rollout = dataclasses.replace(rollout, kv_budget_gib=kv_budget_gib)
    max_len, page_size, steps = rollout.max_context, paged.page_size, rollout.sync_every
    num_pages = pool_pages(model_config, rollout, paged, episodes, mesh=mesh, rules=rules, processes=processes)
    slots = max(1, min(episodes, paged.slots or episodes))
    width = paged_lib.pages_for(max_len, page_size)  # a page table's width
    item_size = paged_lib.item_capacity(num_pages, rollout.group_size, slots, width)  # the engine's one items shape
    state = paged_lib.abstract_state(model_config, processes * num_pages, page_size, processes * slots, mesh=mesh,
                                     rules=rules)
    layout = paged_lib.state_layout(state)
    pool_bytes = sum(int(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)) * np.dtype(x.dtype).itemsize
                     for x in (state.k, state.v))
    pool = f"a pool of {processes * num_pages} pages x {page_size} tokens, {processes * slots} slots"
    entries = [Entry("paged_init", paged_lib.init_pool_program(model_config, processes * num_pages, page_size,
                                                               processes * slots, mesh, rules), (), pool)]

    def smallest(buckets):  # the fewest rows (tokens) that round up to each bucket
        return {b: a + 1 for a, b in zip((0,) + buckets, buckets)}

    def items(count):
        return tuple(_host((processes * count,), jnp.int32) for _ in range(3))

    rows = bucket_lengths(slots, minimum=1)
    fewest_rows = smallest(rows)
    chunk_widths = bucket_lengths(min(paged.prefill_chunk, max_len - 1))
    fewest_tokens = smallest(chunk_widths)
    prefill = paged_lib.prefill_program(model_config, max_len, layout)
    for unique in rows:
        for chunk in chunk_widths:
            if (processes == 1 and unique > 1
                    and fewest_tokens[chunk] + fewest_rows[unique] - 1 > paged.prefill_tokens):
                continue
            u = processes * unique
            for count in (item_size,):
                for out in (processes * r for r in rows if r >= unique):
                    args = (rollout_params, state, _host((u,), jnp.int32), _host((u, chunk), jnp.int32),
                            _host((u,), jnp.int32), items(count), _host((out,), jnp.int32),
                            _host((out, width), jnp.int32), _host((out,), jnp.int32))
                    entries.append(Entry("paged_prefill", prefill, args,
                                         f"{u} rows x {chunk} tokens reading {processes * count} pages, written to "
                                         f"{out} rows; {pool}"))
    decode = paged_lib.decode_program(model_config, steps, max_len, layout)
    for batch in decode_buckets(slots, process_shards(mesh, rules, processes)):
        d = processes * batch
        host = sampler.RowSampling.broadcast(rollout.sampling, d)
        sampling = host.replace(temperature=_host((d,), jnp.float32), top_p=_host((d,), jnp.float32),
                                greedy=_host((d,), jnp.bool_))
        vector = _host((d,), jnp.int32)
        for count in (item_size,):
            args = (sampling, rollout_params, state, vector, _host((d, width), jnp.int32), vector,
                    _host((d,), jnp.bool_), vector, _host((num_stop_ids,), jnp.int32),
                    _host((d, 2), jnp.uint32), vector, vector, items(count), None)
            entries.append(Entry("paged_decode", decode, args, f"{d} rows x {steps} steps reading "
                                                               f"{processes * count} pages; {pool}"))
    return entries, processes * slots, pool_bytes


def abstract_loss_batch(loss, mesh, rules, rows: int, shape, *, packed_rows: int | None = None,
                        shards: int = 1) -> LossBatch:
    """The abstract `LossBatch` of one update call of `rows` rows at `shape` (`pipeline.UpdateShapes`: its token
    and `trained_index` widths; a `head_width` of None: no `trained_index`), as `TrainStep` places it
    (`shard_batch`); with `packed_rows`, packed in that many rows (`LossBatch.packed` with `shards`)."""
    def spec(width, dtype, count=rows):
        shape = (count,) if width is None else (count, width)
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=batch_sharding(mesh, rules, shape))

    length = shape.length
    return LossBatch(tokens=spec(length, jnp.int32), positions=spec(length, jnp.int32),
                     loss_mask=spec(length, jnp.float32), advantages=spec(length, jnp.float32),
                     behaviour_logprobs=spec(length, jnp.float32),
                     reference_logprobs=spec(length, jnp.float32) if loss.needs_reference else None,
                     sampler_logprobs=spec(length, jnp.float32) if loss.needs_sampler_logprobs else None,
                     token_mask=spec(length, jnp.float32),
                     trained_index=None if shape.head_width is None else spec(shape.head_width, jnp.int32),
                     packing=None if packed_rows is None else packing_lib.PackedRows(
                         tokens=spec(length, jnp.int32, packed_rows), positions=spec(length, jnp.int32, packed_rows),
                         segment_ids=spec(length, jnp.int32, packed_rows), slot=spec(None, jnp.int32),
                         offset=spec(None, jnp.int32), length=spec(None, jnp.int32), shards=shards))


def _score_entries(run_config, model_config, mesh, rules, reference, episodes: int, answer_tokens: int,
                   token_logprobs: bool, processes: int) -> list[Entry]:
    """The scorer's padded shapes (`fork.padded_shape`) at every length bucket of a step, every scorer chunk of its
    rows and every answer length up to `answer_tokens`; with several processes, of every process's chunk together,
    each process's rows padded to the same count (`fork.score_answer_prefixes`)."""
    rollout, update = run_config.rollout, run_config.update
    max_len, slots = rollout.max_context, rollout.max_turns + 1
    most_rows = episodes * (update.rows_per_episode if rollout.context_budget else 1)
    chunk_rows = set()
    for n in range(episodes, most_rows + 1):
        chunk = update.scoring_batch or n
        chunk_rows |= {min(chunk, n)} | ({n % chunk} if n % chunk else set())
    widths = sorted({length_bucket(k * update.length_multiple, update.length_multiple, max_len)
                     for k in range(1, -(-max_len // update.length_multiple) + 1)})
    shapes = sorted({fork.padded_shape(n * processes, w, slots, m, mesh=mesh, rules=rules)
                     for n in chunk_rows for w in widths for m in range(1, answer_tokens + 1)})
    shapes = sorted({(-(-pn // processes) * processes, *rest) for pn, *rest in shapes})
    entries = []

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=fork.row_sharding(mesh, len(shape), rules))

    for pn, pl, ps, pm in shapes:
        layout = fork.choose_layout(pl, ps, pm, rows=pn)
        rest = (arg((pn, ps), jnp.int32), arg((pn, ps), jnp.bool_), arg((pn, pm), jnp.int32), arg((pn, pm), jnp.int32))
        words = (f"{pn} rows x {pl} tokens, {ps} states x {pm} answer tokens, {layout} layout"
                 + (", + trajectory log-probs" if token_logprobs else ""))
        if update.packing and layout == "cached" and processes == 1:
            # the trajectories packed (`score_answer_prefixes(..., pack_rows=True)`): every packed-row bucket
            shards = fork.row_shards(mesh, rules)
            program = fork.rows_packed_program(model_config, shards=shards, logprob_chunk=256, query_chunk=0,
                                               with_token_logprobs=token_logprobs, mesh=mesh)
            for size in packing_lib.packed_row_buckets(pn // shards):
                packed = packing_lib.PackedRows(
                    tokens=arg((shards * size, pl), jnp.int32), positions=arg((shards * size, pl), jnp.int32),
                    segment_ids=arg((shards * size, pl), jnp.int32), slot=arg((pn,), jnp.int32),
                    offset=arg((pn,), jnp.int32), length=arg((pn,), jnp.int32), shards=shards)
                entries.append(Entry("score", program, (reference, packed) + rest,
                                     words + f", packed in {shards * size} rows"))
            continue
        program = fork.fork_scores_program(model_config, layout=layout, logprob_chunk=256, query_chunk=0,
                                           with_token_logprobs=token_logprobs, mesh=mesh)
        entries.append(Entry("score", program, (reference, arg((pn, pl), jnp.int32)) + rest, words))
    return entries
