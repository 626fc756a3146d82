"""Sampling rules and the dense KV-cache sampler: single-token decode over a fixed batch of rows.

What every rollout path shares: `SamplingConfig` / `RowSampling` (temperature, top-k, top-p, greedy; per row and
traced), `sample_from_logits` (the draw and its two log-probs), `StopStrings`, `bucket_length` (the one padding
rule), the stop reasons, `MeshProgram` and `state_layout` / `divisible_shardings` (programs under a mesh, outputs
pinned to their layout). The rollout engine (`rollout.engine`, `rollout.paged`) uses these.

The dense sampler below (`init_state`, `prefill_rows`, `generate` over a `[B, max_len]` cache) is used by
serve/engine.py until it moves to the paged engine; the RL loop, evaluation and the warm start no longer use it
(issue 45). Its device side is jitted functions with the cache donated:

  * `init_state_program` creates an empty state with `out_shardings`: each device writes its own shard.
  * `prefill_rows_program` replaces some rows of a running batch by new prompts (a server admitting requests): only
    those prompts run through the model, on a small cache, and their keys/values are written into their rows.
  * `_decode_step` samples one token per active row from the pending logits, feeds it to the model
    (`_decode_model`: `models.extend` with n = 1, which updates the cache in place) and updates each row's stop
    state (stop token, per-row token budget, cache full). `decode_program` runs `sync_every` of these steps in one
    program (a `lax.scan`); `_decode_jit` runs one (the step a logits hook drives).

`generate` is the host loop around them. It reads the stop flags back every `sync_every` steps (every step when a
logits hook is set), checks stop *strings* (tags that are not single tokens, e.g. `</tool_call>` for SmolLM2) on the
host, and rolls back the cache length of a row that overshot a stop string.

Log-probs. For every generated token two values are returned:
  * `logprobs`: log p(token) under the *raw model* distribution at temperature 1, no top-k/top-p filtering (with a
    logits hook: of the hooked logits). This is what `trace_jax.models.token_logprobs` recomputes, so the
    trainer can compare it with its own log-probs (the sampler/trainer gap) and use it as the behaviour policy.
    It goes into `TrajectoryBatch.sampler_logprobs`.
  * `sampling_logprobs`: log q(token) under the distribution actually sampled from (tempered, then top-k, then
    top-p); 0.0 for greedy. Useful for importance corrections of the sampling procedure itself.

Randomness: step `s` of a `generate` call uses `jax.random.fold_in(rng, s)` for the whole batch, so a run is a
pure function of (params, prompts, rng) (tests/rollout/naive_reference.py reproduces it without a cache).
With one key per row (`rng` of shape [B, 2], or [B] typed keys) row b draws from `fold_in(rng[b], s)` alone, so its
tokens do not depend on the other rows (a server batching unrelated requests).

Sampling values (temperature, top-p, greedy) are traced arrays, one per row (`RowSampling`): a new temperature is new
data for the same program, never a compile. Only `top_k` (a static size) and two switches that leave out work no row
needs (the draw when every row is greedy, the vocabulary sort when no row filters by top-p) shape the program.

Rows never left-pad: row b's tokens sit at cache slots 0..length-1 and positions equal slot indices.

This module knows nothing about chat formats, tools, tasks or rewards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from trace_jax.models import cache as cache_lib
from trace_jax.models import decoder as dec
from trace_jax.models.config import ModelConfig
from trace_jax.models.sharding import cache_logical_axes, logical_to_sharding

# Why a row stopped generating (`Generation.stop_reason`).
RUNNING, STOP_TOKEN, STOP_STRING, BUDGET, CONTEXT_FULL = 0, 1, 2, 3, 4
STOP_REASONS = ("running", "stop_token", "stop_string", "budget", "context_full")
MIN_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn, one setting for a batch. `generate` passes its values to the decode step as traced
    per-row arrays (`RowSampling`); only `top_k` and whether any row samples or filters by top-p shape the program.

    Attributes:
      temperature: > 0; logits are divided by it before top-k / top-p.
      top_k: keep the k most likely tokens (0 = off).
      top_p: keep the smallest set of tokens whose probability reaches top_p (1.0 = off); at least one token.
      greedy: argmax of the raw logits (temperature, top_k, top_p ignored).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"SamplingConfig.temperature must be > 0, got {self.temperature!r}; use greedy=True "
                             "for argmax decoding")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"SamplingConfig.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p!r}")


@struct.dataclass
class RowSampling:
    """Per-row sampling values as traced arrays, so that one compiled program serves every value.

    Attributes:
      temperature: float32 [B], > 0 (1 on greedy rows; ignored there).
      top_p: float32 [B] in (0, 1] (1 = off).
      greedy: bool [B]: argmax of the raw logits.
      top_k: static, shared by every row (0 = off): `lax.top_k` needs a static size.
      sample: static; False when every row is greedy (nothing is drawn or filtered).
      filter_top_p: static; False when no row filters by top-p (no vocabulary sort).
    """

    temperature: jax.Array
    top_p: jax.Array
    greedy: jax.Array
    top_k: int = struct.field(pytree_node=False, default=0)
    sample: bool = struct.field(pytree_node=False, default=True)
    filter_top_p: bool = struct.field(pytree_node=False, default=True)

    @classmethod
    def of(cls, settings: Sequence[SamplingConfig]) -> "RowSampling":
        """Host arrays for one `SamplingConfig` per row (they must agree on `top_k`)."""
        top_ks = {s.top_k for s in settings if not s.greedy} or {0}
        if len(top_ks) > 1:
            raise ValueError(f"RowSampling.of: rows disagree on top_k ({sorted(top_ks)}); top_k is a static size "
                             "shared by the batch")
        greedy = np.asarray([s.greedy for s in settings], bool)
        temperature = np.asarray([1.0 if s.greedy else s.temperature for s in settings], np.float32)
        top_p = np.asarray([1.0 if s.greedy else s.top_p for s in settings], np.float32)
        return cls(temperature=temperature, top_p=top_p, greedy=greedy, top_k=top_ks.pop(),
                   sample=not greedy.all(), filter_top_p=bool((top_p < 1.0).any()))

    @classmethod
    def broadcast(cls, sampling: "SamplingConfig | RowSampling", batch: int) -> "RowSampling":
        """`sampling` for `batch` rows (a `RowSampling` is returned as it is)."""
        if isinstance(sampling, RowSampling):
            return sampling
        return cls.of([sampling] * batch)


def _step_keys(rng: jax.Array, step) -> jax.Array:
    """The key(s) of decode step `step`: `fold_in(rng, step)` for one batch key, row by row for per-row keys."""
    typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
    if rng.ndim == (1 if typed else 2):
        return jax.vmap(lambda key: jax.random.fold_in(key, step))(rng)
    return jax.random.fold_in(rng, step)


def bucket_length(n: int, minimum: int = MIN_BUCKET) -> int:
    """The padded chunk length for n tokens, so shapes repeat: powers of two up to 512, then multiples of 256
    (a 645-token prompt pads to 768, not 1024)."""
    if n > 512:
        return -(-n // 256) * 256
    size = minimum
    while size < n:
        size *= 2
    return size


def _padded(chunks: Sequence[Sequence[int]], width: int, rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [rows, width] (chunk b left-aligned in row b, zeros after; rows default len(chunks)) and the
    chunk lengths [rows] (0 for padding rows), as host arrays: the jitted programs take them as they are (an eager
    `jnp.asarray` is a dispatched program of its own, ~0.1 ms of host time each on this CPU)."""
    tokens = np.zeros((len(chunks) if rows is None else rows, width), np.int32)
    num_new = np.zeros(len(tokens), np.int32)
    for row, chunk in enumerate(chunks):
        tokens[row, :len(chunk)] = chunk
        num_new[row] = len(chunk)
    return tokens, num_new


# ---------------------------------------------------------------------------------------------------- sampling
def sampling_logits(logits: jax.Array, sampling: SamplingConfig | RowSampling) -> jax.Array:
    """float32 [B, V] logits of the distribution actually sampled from: tempered, top-k, top-p (-inf = removed),
    each row with its own temperature and top-p."""
    rows = RowSampling.broadcast(sampling, logits.shape[0])
    logits = logits.astype(jnp.float32) / jnp.asarray(rows.temperature, jnp.float32)[:, None]
    if rows.top_k and rows.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, rows.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if rows.filter_top_p:
        top_p = jnp.asarray(rows.top_p, jnp.float32)[:, None]
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < top_p  # the first token always stays
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where((logits < threshold) & (top_p < 1.0), -jnp.inf, logits)
    return logits


def sample_from_logits(logits: jax.Array, rng: jax.Array, sampling: SamplingConfig | RowSampling):
    """Draw one token per row.

    Args:
      logits: float [B, V] next-token logits (raw model, or hooked).
      rng: one key for the whole batch, or one per row ([B, 2] raw keys / [B] typed keys).
      sampling: one setting for every row, or per-row values (`RowSampling`).

    Returns:
      (tokens int32 [B], logprobs float32 [B] under log_softmax(logits), sampling_logprobs float32 [B] under the
      sampled distribution; 0 for greedy rows).
    """
    rows = RowSampling.broadcast(sampling, logits.shape[0])
    logits = logits.astype(jnp.float32)
    raw = jax.nn.log_softmax(logits, axis=-1)
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled_lp = jnp.zeros(tokens.shape, jnp.float32)
    if rows.sample:
        filtered = sampling_logits(logits, rows)
        typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
        if rng.ndim == (1 if typed else 2):  # one key per row
            drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(rng, filtered).astype(jnp.int32)
        else:
            drawn = jax.random.categorical(rng, filtered, axis=-1).astype(jnp.int32)
        greedy = jnp.asarray(rows.greedy, bool)
        tokens = jnp.where(greedy, tokens, drawn)
        drawn_lp = jnp.take_along_axis(jax.nn.log_softmax(filtered, axis=-1), tokens[:, None], axis=-1)[:, 0]
        sampled_lp = jnp.where(greedy, sampled_lp, drawn_lp)
    logprobs = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs, sampled_lp


# ---------------------------------------------------------------------------------------------------- state
@struct.dataclass
class SamplerState:
    """The device state of a batch of rows: the KV cache and each row's pending next-token logits.

    `logits [B, V]` float32 are the model's logits after each row's last token; they are valid for a row after an
    `prefill_rows`, or after a `generate` that stopped it by a stop token, the budget, or not at all (a stop-string
    rollback leaves them stale: prefill the row again before generating).
    """

    cache: cache_lib.KVCache
    logits: jax.Array

    @property
    def lengths(self) -> jax.Array:
        return self.cache.lengths

    @property
    def max_len(self) -> int:
        return self.cache.max_len


def state_shardings(mesh, rules=None):
    """`NamedSharding`s of a `SamplerState` on `mesh`: rows over the batch axes, kv heads over `tensor`."""
    from jax.sharding import PartitionSpec as P

    axes = cache_logical_axes()
    cache_axes = cache_lib.KVCache(k=axes["k"], v=axes["v"], lengths=axes["lengths"])
    return SamplerState(cache=logical_to_sharding(cache_axes, mesh, rules),
                        logits=logical_to_sharding(P("batch", "vocab"), mesh, rules))


def _hashable_rules(rules):
    """`rules` as nested tuples (a builder's cache key), None kept."""
    if rules is None:
        return None
    return tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules)


def abstract_state(config: ModelConfig, batch_size: int, max_len: int, *, mesh=None, rules=None,
                   cache_dtype=None) -> SamplerState:
    """The `ShapeDtypeStruct`s of an empty state, each with the sharding `init_state` gives it: on `mesh`, rows
    over the batch axes and kv heads over `tensor` where divisible (`divisible_shardings`), else on the default
    device. Nothing is allocated."""
    dtype = jnp.dtype(cache_dtype or config.dtype)
    shape = (config.num_hidden_layers, batch_size, max_len, config.num_key_value_heads, config.head_dim)
    shapes = SamplerState(cache=cache_lib.KVCache(k=jax.ShapeDtypeStruct(shape, dtype),
                                                  v=jax.ShapeDtypeStruct(shape, dtype),
                                                  lengths=jax.ShapeDtypeStruct((batch_size,), jnp.int32)),
                          logits=jax.ShapeDtypeStruct((batch_size, config.vocab_size), jnp.float32))
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree_util.tree_map(lambda _: device, shapes)
    else:
        shardings = divisible_shardings(shapes, state_shardings(mesh, rules))
    return jax.tree_util.tree_map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                                  shapes, shardings)


def _empty_state(config: ModelConfig, batch_size: int, max_len: int, dtype) -> SamplerState:
    return SamplerState(cache=cache_lib.init_cache(config, batch_size, max_len, dtype=dtype),
                        logits=jnp.zeros((batch_size, config.vocab_size), jnp.float32))


def init_state_program(config: ModelConfig, batch_size: int, max_len: int, mesh=None, rules=None, *,
                       cache_dtype=None):
    """The rollout's state initialiser: `program() -> SamplerState`, an empty state (zeros, lengths 0) created by
    one jitted program with `out_shardings` (`abstract_state`): each device writes its own shard of the cache, and
    no array of the whole cache ever exists on one device (an eager `jnp.zeros` then `device_put` put Qwen3-4B's
    8-row, 48K-token cache, ~54 GiB, on chip 0 first). One program object per set of arguments (a `MeshProgram`):
    `init_state` calls the same one."""
    dtype = jnp.dtype(cache_dtype or config.dtype)
    rules = _hashable_rules(rules)

    def build():
        layout = jax.tree_util.tree_map(lambda s: s.sharding,
                                        abstract_state(config, batch_size, max_len, mesh=mesh, rules=rules,
                                                       cache_dtype=dtype))
        return MeshProgram(jax.jit(functools.partial(_empty_state, config, batch_size, max_len, dtype),
                                   out_shardings=layout), mesh)

    return _program("init", (config, batch_size, max_len, mesh, rules, dtype), build)


def init_state(config: ModelConfig, batch_size: int, max_len: int, *, mesh=None, rules=None,
               cache_dtype=None) -> SamplerState:
    """An empty state for `batch_size` rows of at most `max_len` tokens, created in place (`init_state_program`):
    on `mesh` when given, else committed to the default device.

    With a mesh, rows are split over its batch axes (`data`, `fsdp`, `expert`) and kv heads over `tensor` when
    divisible; shard the params with `trace_jax.models.shard_params` on the same mesh. The programs that take the
    state (`prefill_rows`, `generate`) then run under `jax.set_mesh` of its mesh.
    """
    return init_state_program(config, batch_size, max_len, mesh, rules, cache_dtype=cache_dtype)()


def divisible_shardings(tree, shardings):
    """`shardings` (a matching tree of `NamedSharding`s) for the arrays of `tree` (arrays or `ShapeDtypeStruct`s),
    with any dimension whose size is not divisible by its mesh axes replicated (e.g. 2 kv heads on tensor=4)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def fix(x, sharding):
        sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.devices.shape))
        spec = []
        for dim, axes in enumerate(tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))):
            names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            total = int(np.prod([sizes[a] for a in names])) if names else 1
            spec.append(axes if x.shape[dim] % total == 0 else None)
        return NamedSharding(sharding.mesh, P(*spec))

    return jax.tree_util.tree_map(fix, tree, shardings)


# ---------------------------------------------------------------------------------------------------- device steps
_PROGRAMS: dict[tuple, Callable] = {}  # (builder, its arguments) -> the jitted program: one object per program
_KINDS = ("init", "decode", "prefill_rows")


def _program(kind: str, key: tuple, build: Callable) -> Callable:
    program = _PROGRAMS.get((kind, *key))
    if program is None:
        program = _PROGRAMS[(kind, *key)] = build()
    return program


class MeshProgram:
    """A jitted rollout program with the mesh it runs on: `program(*args)` and `program.lower(*args)` trace and
    dispatch under `jax.set_mesh(mesh)` when a mesh is given, as the train step and the reference scoring do, so
    the model's sharding constraints (the residual stream's layout) apply, the Pallas TPU attention runs per device
    inside `shard_map`, and an MoE layer takes the expert-parallel all-to-all (`models.expert_parallel.
    resolve_dispatch` reads the active mesh) instead of the global sort that gathers every token onto every
    expert shard. Without a mesh the program is the plain jitted function."""

    def __init__(self, jitted, mesh):
        self.jitted, self.mesh = jitted, mesh

    def _context(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def __call__(self, *args):
        with self._context():
            return self.jitted(*args)

    def lower(self, *args):
        with self._context():
            return self.jitted.lower(*args)


def _cache_size(program) -> int:
    return (program.jitted if isinstance(program, MeshProgram) else program)._cache_size()


def compiled_programs(kind: str) -> int:
    """Executables compiled so far by the programs of one builder: "init" (`init_state_program`), "decode"
    (`decode_program`) or "prefill_rows" (`prefill_rows_program`). Tests use it to check that new sampling values or row counts compile nothing."""
    if kind not in _KINDS:
        raise ValueError(f"compiled_programs: kind must be one of {_KINDS}, got {kind!r}")
    return sum(_cache_size(program) for key, program in _PROGRAMS.items() if key[0] == kind)


def layout_mesh(layout):
    """The mesh of a state's layout (`state_layout`), or None on one device: the mesh its programs run under."""
    return None if layout is None else layout.cache.k.mesh


def _decode_model(config: ModelConfig, params, cache: cache_lib.KVCache, tokens: jax.Array, active: jax.Array,
                  attend_len: int | None = None):
    """One token per active row through the model (`models.extend` with n = 1); inactive rows keep their cache.
    `attend_len`: read only that many cache slots (every row's length must fit; see `models.cache.extend`).

    Returns float32 logits [B, V] (meaningless for inactive rows) and the cache.
    """
    return cache_lib.extend(config, params, cache, tokens[:, None], active.astype(jnp.int32), return_logits="last",
                            attend_len=attend_len)


def _decode_step(config: ModelConfig, sampling: SamplingConfig | RowSampling, params, state: SamplerState,
                 active: jax.Array, budget_left: jax.Array, stop_ids: jax.Array, rng: jax.Array, logit_bias,
                 attend_len=None):
    """One decode step (traced, not jitted): sample from the pending logits, feed the tokens, update stop states."""
    logits = state.logits if logit_bias is None else state.logits + logit_bias
    tokens, logprobs, sampled_lp = sample_from_logits(logits, rng, sampling)
    tokens = jnp.where(active, tokens, 0)

    # No `lax.cond` to skip the model once every row stopped: on CPU it copied the whole cache every step (decode
    # step 460 vs 236 ms for extend alone on SmolLM2), far more than the few idle steps before the next host sync.
    new_logits, cache = _decode_model(config, params, state.cache, tokens, active, attend_len)
    budget_left = budget_left - active.astype(jnp.int32)
    hit_stop = jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1)
    full = cache.lengths >= cache.max_len
    reason = jnp.where(hit_stop, STOP_TOKEN, jnp.where(full, CONTEXT_FULL, jnp.where(budget_left <= 0, BUDGET,
                                                                                       RUNNING)))
    reason = jnp.where(active, reason, RUNNING)
    still_active = active & (reason == RUNNING)
    logits_out = jnp.where(active[:, None], new_logits, state.logits)
    return SamplerState(cache=cache, logits=logits_out), tokens, logprobs, sampled_lp, still_active, reason, \
        budget_left


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def _decode_jit(config: ModelConfig, sampling: SamplingConfig | None, params, state: SamplerState, active: jax.Array,
                budget_left: jax.Array, stop_ids: jax.Array, rng: jax.Array, logit_bias,
                rows: RowSampling | None = None):
    """One decode step (`_decode_step`) as its own program: the step a logits hook drives.
    `rows` (traced) replaces the static `sampling` when given (`generate` passes `sampling=None` and `rows`)."""
    return _decode_step(config, sampling if rows is None else rows, params, state, active, budget_left, stop_ids,
                        rng, logit_bias)


def _decode_steps(config: ModelConfig, num_steps: int, attend_len: int | None, layout, sampling: RowSampling, params,
                  state: SamplerState, active: jax.Array, budget_left: jax.Array, stop_ids: jax.Array, rng: jax.Array,
                  first_step: jax.Array, reason: jax.Array):
    def body(carry, s):
        state, active, budget_left, reason = carry
        state, tokens, lp, slp, still, step_reason, budget_left = _decode_step(
            config, sampling, params, state, active, budget_left, stop_ids, _step_keys(rng, first_step + s), None,
            attend_len)
        reason = jnp.where(active, step_reason, reason)
        return (state, still, budget_left, reason), (tokens, lp, slp, active)

    (state, active, budget_left, reason), (tokens, lp, slp, was_active) = jax.lax.scan(
        body, (state, active, budget_left, reason), jnp.arange(num_steps, dtype=jnp.uint32),
        unroll=config.scan_unroll)
    return _keep_layout(state, layout), tokens, lp, slp, was_active, active, reason, budget_left


def decode_program(config: ModelConfig, num_steps: int, attend_len: int | None = None, mesh=None,
                   layout=None) -> MeshProgram:
    """The rollout's decode program: `num_steps` decode steps in one dispatch (a `lax.scan` over `_decode_step`).

        program(sampling: RowSampling, params, state, active bool [B], budget_left int32 [B], stop_ids int32 [S],
                rng, first_step uint32 [], reason int32 [B])
          -> (state, tokens [num_steps, B], logprobs [num_steps, B], sampling_logprobs [num_steps, B],
              active before each step [num_steps, B], active after the last step [B], reason [B], budget_left [B])

    Step `s` is keyed `fold_in(rng, first_step + s)` (row by row for per-row keys), as the one-step loop keys it,
    so both give the same tokens. `sampling` is traced: its values are data, only its static fields shape the
    program. The state is donated. `attend_len`: the cache slots attention reads, at least every row's length
    after the last step (`generate` passes a `bucket_length` above it; None = the whole cache). Rows that stopped
    keep `reason`. `mesh`: the mesh the state is placed on (None on one device); the program runs under it
    (`MeshProgram`). `layout` (`state_layout`, on `mesh`) pins the output state to the input's layout, as the other
    programs that take a state do: left to the compiler, the state came out with other (equivalent) shardings,
    and the next program was built and compiled for them anew. One program object per (config, num_steps,
    attend_len, mesh, layout): `generate` calls the same one. One
    dispatch instead of `num_steps`: on a small model the host round trip of each step (~0.45 ms of Python and
    dispatch on this CPU) costs more than the step itself.
    """
    if layout is not None and layout_mesh(layout) != mesh:
        raise ValueError("decode_program: layout must be on mesh (the state's layout, `state_layout(state)`)")
    return _program("decode", (config, num_steps, attend_len, mesh, layout), lambda: MeshProgram(
        jax.jit(functools.partial(_decode_steps, config, num_steps, attend_len, layout), donate_argnums=2), mesh))


def _canonical(sharding, ndim: int):
    """`sharding` in one canonical spelling: a spec entry per dimension, mesh axes of size 1 left out. The compiler
    spells the layout of a program's output its own way (`P()` for a state placed as `P(None, None, ...)`); a
    builder keyed by the layout would otherwise build (and compile) its program again for the same layout."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.devices.shape))
    spec = []
    for axes in tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec)):
        names = tuple(a for a in (() if axes is None else (axes,) if isinstance(axes, str) else axes) if sizes[a] > 1)
        spec.append(None if not names else names[0] if len(names) == 1 else names)
    return NamedSharding(sharding.mesh, P(*spec), memory_kind=sharding.memory_kind)


def state_layout(state: SamplerState):
    """The `NamedSharding`s of a state (arrays or `ShapeDtypeStruct`s) placed on a mesh, each in its canonical
    spelling (hashable: a builder's argument that pins a program's output to its input's layout, the same for
    every state in that layout), or None for a state on one device."""
    shardings = jax.tree_util.tree_map(lambda x: getattr(x, "sharding", None), state)
    leaves = jax.tree_util.tree_leaves(shardings)
    if not leaves or not all(isinstance(s, jax.sharding.NamedSharding) for s in leaves):
        return None
    return jax.tree_util.tree_map(lambda x: _canonical(x.sharding, len(x.shape)), state)


def _keep_layout(state: SamplerState, layout) -> SamplerState:
    """`state` constrained to `layout` (see `state_layout`) inside a program: a state built anew there (the grouped
    prefill's repeated rows) would otherwise come out in whatever layout the compiler picks, e.g. rows replicated
    on every device of the mesh."""
    return state if layout is None else jax.lax.with_sharding_constraint(state, layout)


def _prefill_rows(config: ModelConfig, layout, params, state: SamplerState, tokens: jax.Array, num_new: jax.Array,
                  rows: jax.Array, source: jax.Array, count: jax.Array):
    """tokens [U, W] / num_new [U]: the distinct prompts; rows, source [B]: entry i < count writes prompt
    source[i] into row rows[i] (entries from count on are padding, rows = B). The row count is a traced loop
    bound, not a shape, so only (U, W) compile."""
    U, W = tokens.shape
    small = cache_lib.init_cache(config, U, W, dtype=state.cache.k.dtype)
    logits, small = cache_lib.extend.__wrapped__(config, params, small, tokens, num_new, return_logits="last")

    def write(i, kv):  # one row's slots 0..W-1, in place; slots >= W keep stale values beyond the row's length
        k, v = kv
        at = (0, rows[i], 0, 0, 0)
        return (jax.lax.dynamic_update_slice(k, jax.lax.dynamic_slice_in_dim(small.k, source[i], 1, axis=1), at),
                jax.lax.dynamic_update_slice(v, jax.lax.dynamic_slice_in_dim(small.v, source[i], 1, axis=1), at))

    k, v = jax.lax.fori_loop(0, count, write, (state.cache.k, state.cache.v))
    lengths = state.cache.lengths.at[rows].set(num_new[source], mode="drop")
    return _keep_layout(SamplerState(cache=cache_lib.KVCache(k=k, v=v, lengths=lengths),
                                     logits=state.logits.at[rows].set(logits[source], mode="drop")), layout)


def prefill_rows_program(config: ModelConfig, layout=None):
    """The server's admission program: `program(params, state, tokens [U, W], num_new [U], rows [B], source [B],
    count []) -> state`, prompt `source[i]` written into row `rows[i]` for i < count (see `prefill_rows`). The
    state is donated; `layout` (`state_layout`) pins the output to the cache's layout on a mesh and the program
    runs under that mesh."""
    return _program("prefill_rows", (config, layout), lambda: MeshProgram(
        jax.jit(functools.partial(_prefill_rows, config, layout), donate_argnums=1), layout_mesh(layout)))





def prefill_rows(config: ModelConfig, params, state: SamplerState, rows: Sequence[int],
                 prompts: Sequence[Sequence[int]]) -> SamplerState:
    """Replace rows `rows[i]` of a running state by fresh prompts `prompts[i]` (their old tokens are discarded);
    the other rows are untouched.

    Only the new prompts run through the model, on a cache just wide enough for the longest (`bucket_length`),
    and their keys/values are written into the state's rows (not every row of the batch against all `max_len`
    cache slots). Identical prompts (a request's `n` choices) run once. The distinct prompts are
    padded to a `bucket_length(count, minimum=1)` count (powers of two) and a `bucket_length` width, so shapes
    repeat (the number of rows is not a shape). The old state is donated: do not reuse it.

    Args:
      rows: distinct row indices in [0, batch).
      prompts: one non-empty token-id sequence per row, each at most `max_len` tokens.
    """
    batch = state.cache.batch_size
    if len(rows) != len(prompts):
        raise ValueError(f"prefill_rows got {len(rows)} rows and {len(prompts)} prompts; pass one prompt per row")
    if not rows:
        return state
    if len(set(rows)) != len(rows) or not all(0 <= int(r) < batch for r in rows):
        raise ValueError(f"prefill_rows needs distinct rows in [0, {batch}), got {list(rows)}")
    unique: dict[tuple[int, ...], int] = {}
    source = []
    for row, prompt in zip(rows, prompts):
        prompt = tuple(int(t) for t in prompt)
        if not prompt or len(prompt) > state.max_len:
            raise ValueError(f"prefill_rows: the prompt for row {row} has {len(prompt)} tokens; it must have 1 to "
                             f"{state.max_len} (the cache's max_len)")
        dec.check_token_ids(config, np.asarray(prompt, np.int64), f"prompt for row {row}")
        if prompt not in unique:
            unique[prompt] = len(unique)
        source.append(unique[prompt])
    width = min(bucket_length(max(len(p) for p in unique)), state.max_len)
    tokens, num_new = _padded(list(unique), width, rows=bucket_length(len(unique), minimum=1))
    row_ids = np.full(batch, batch, np.int32)  # padding entries point past the batch: their writes are dropped
    row_ids[:len(rows)] = rows
    source_ids = np.zeros(batch, np.int32)
    source_ids[:len(rows)] = source
    return prefill_rows_program(config, state_layout(state))(params, state, tokens, num_new, row_ids, source_ids,
                                                              np.int32(len(rows)))


@dataclasses.dataclass
class Generation:
    """What one `generate` call produced, per row (host numpy; rows that did not run have empty entries).

    Attributes:
      tokens: list of int32 [n_b] generated ids, including the stop token / the token that completed a stop string.
      logprobs: list of float32 [n_b] raw-model log-probs (temperature 1, unfiltered; see module doc).
      sampling_logprobs: list of float32 [n_b] log-probs under the sampled (tempered/filtered) distribution.
      stop_reason: int32 [B] (`STOP_REASONS`); RUNNING for rows that were not active.
      steps: decode steps run (the longest row).
    """

    tokens: list
    logprobs: list
    sampling_logprobs: list
    stop_reason: np.ndarray
    steps: int


class StopStrings:
    """Host-side detection of stop strings (tags that are not single tokens) in generated ids.

    Only tokens whose text contains the last character of some stop string are checked, by decoding the tail of
    the row, so the cost per token is a set lookup.
    """

    def __init__(self, tokenizer, strings: Sequence[str], tail_tokens: int = 24):
        self.tokenizer = tokenizer
        self.strings = tuple(strings)
        self.tail_tokens = tail_tokens
        last_chars = {s[-1] for s in self.strings}
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.candidates = frozenset(i for i, p in enumerate(pieces) if p is None or any(c in p for c in last_chars))

    def first_stop(self, ids: Sequence[int], start: int = 0) -> int | None:
        """Smallest j >= start such that ids[:j+1] contains a stop string that ids[:j] does not; else None."""
        for j in range(start, len(ids)):
            if int(ids[j]) not in self.candidates:
                continue
            lo = max(0, j + 1 - self.tail_tokens)
            text = self.tokenizer.decode(ids[lo:j + 1])
            if any(s in text for s in self.strings):
                before = self.tokenizer.decode(ids[lo:j])
                if not any(s in before for s in self.strings):
                    return j
        return None


def generate(config: ModelConfig, params, state: SamplerState, *, rng: jax.Array, active, max_new_tokens,
             stop_ids: Sequence[int], sampling: SamplingConfig | RowSampling = SamplingConfig(),
             stop_strings: StopStrings | None = None,
             logits_hook: Callable[[int, list], np.ndarray | None] | None = None,
             sync_every: int = 16) -> tuple[SamplerState, Generation]:
    """Sample until every active row stops; returns the new state (old one donated) and a `Generation`.

    Args:
      state: rows with valid pending logits (after `prefill_rows`).
      rng: key; step s uses `fold_in(rng, s)`. One key per row ([B, 2] raw or [B] typed keys): row b uses
        `fold_in(rng[b], s)`, so its tokens do not depend on the other rows.
      active: bool [B], rows that generate (others are untouched).
      max_new_tokens: int or int [B], the per-row token budget of this call.
      stop_ids: token ids that end a row's generation (the stop token is kept and fed to the cache).
      sampling: one setting for every row, or per-row values (`RowSampling`); either way the values are traced
        (a new temperature compiles nothing).
      stop_strings: optional host check for multi-token stop tags.
      logits_hook: test hook `(step, generated_so_far: list of per-row id lists) -> float [B, V] bias or None`,
        added to the logits before sampling (a large bias on one id forces it: a scripted policy).
      sync_every: decode steps between host reads of the stop flags (1 with a hook), run as one program. Every
        value runs the same per-step program (a `lax.scan` of that length), so it trades host syncs (each a wait for
        the device and a wake-up of its threads, costly on a loaded CPU) against the steps that rows which stopped
        still run until the next sync (at most `sync_every - 1`). 16, as the serving engine's
        `EngineConfig.sync_every` (docs/rollout.md, "Decode speed at the defaults"); the agent loop passes its own
        (`RolloutConfig.sync_every`).

    A row also stops when its cache is full (`CONTEXT_FULL`).
    """
    layout = state_layout(state)
    mesh = layout_mesh(layout)
    on_mesh = (lambda: jax.set_mesh(mesh)) if mesh is not None else contextlib.nullcontext
    batch = state.cache.batch_size
    active = np.asarray(active, bool).copy()
    budget = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (batch,)).copy()
    lengths0 = np.asarray(state.cache.lengths)
    active &= (budget > 0) & (lengths0 < state.max_len)  # a full row cannot take another token
    longest = int(lengths0.max(initial=0))
    # Host arrays go into the programs as they are: an eager `jnp.asarray` per argument was a dispatch of its own
    # (a seventh of a serving engine's time between slices).
    stop_arr = np.asarray(list(stop_ids) or [-1], np.int32)
    rows = RowSampling.broadcast(sampling, batch)
    active_dev, budget_dev = active, budget
    sync_every = 1 if logits_hook is not None else max(1, sync_every)

    # Host copies of the decoded steps, one [steps, B] block per host sync: tokens, logprobs, sampling logprobs and
    # each row's active flag *before* the step (a row's generation is its tokens at the steps it was active).
    tok_blocks, lp_blocks, slp_blocks, act_blocks = [], [], [], []
    reason_dev = np.full((state.cache.batch_size,), RUNNING, np.int32)
    generated: list[list[int]] = [[] for _ in range(batch)]
    checked = np.zeros(batch, np.int64)  # tokens of each row already scanned for stop strings
    host_active = active.copy()
    step = 0
    while host_active.any():
        if logits_hook is None:
            # sync_every steps in one dispatch (same keys and tokens as one step per call); attention reads a
            # bucket of slots above the longest row after them, not the whole cache (one compile per bucket).
            attend = bucket_length(longest + step + sync_every)
            attend = None if attend >= state.max_len else attend
            state, tokens, lp, slp, was_active, active_dev, reason_dev, budget_dev = decode_program(
                config, sync_every, attend, mesh, layout)(rows, params, state, active_dev, budget_dev, stop_arr, rng,
                                                          np.uint32(step), reason_dev)
            step += sync_every
        else:
            hooked = logits_hook(step, generated)
            bias = None if hooked is None else jnp.asarray(hooked, jnp.float32)
            keys = _step_keys(rng, step)
            was_active = active_dev
            with on_mesh():  # the one-step program runs under the state's mesh, as `decode_program` does
                state, tokens, lp, slp, active_dev, step_reason, budget_dev = _decode_jit(
                    config, None, params, state, active_dev, budget_dev, stop_arr, keys, bias, rows)
            reason_dev = jnp.where(was_active, step_reason, reason_dev)
            step += 1
            tok_np, act_np = np.asarray(tokens), np.asarray(was_active)
            for row in np.nonzero(act_np)[0]:
                generated[row].append(int(tok_np[row]))
            tokens, lp, slp, was_active = tokens[None], lp[None], slp[None], was_active[None]  # a 1-step block
        tok_blocks.append(np.asarray(tokens))
        lp_blocks.append(np.asarray(lp))
        slp_blocks.append(np.asarray(slp))
        act_blocks.append(np.asarray(was_active).copy())
        host_active = np.asarray(active_dev)
        reason = np.asarray(reason_dev).copy()
        if stop_strings is not None and stop_strings.strings:
            # Check the rows' new tokens; a row that completed a stop string is stopped and rolled back.
            tokens_np = np.concatenate(tok_blocks, axis=0).T
            mask_np = np.concatenate(act_blocks, axis=0).T.copy()
            rollback = {}
            for row in np.nonzero(active)[0]:
                ids = tokens_np[row][mask_np[row]]
                if reason[row] in (STOP_TOKEN,) and checked[row] >= len(ids):
                    continue
                hit = stop_strings.first_stop(ids, start=int(checked[row]))
                checked[row] = len(ids)
                if hit is not None and (reason[row] != STOP_TOKEN or hit < len(ids) - 1):
                    rollback[row] = hit + 1
            if rollback:
                new_active = host_active.copy()
                current = np.asarray(state.cache.lengths).copy()
                for row, keep in rollback.items():
                    new_active[row] = False
                    reason[row] = STOP_STRING
                    current[row] = lengths0[row] + keep
                    # Drop the overshoot from the recorded steps of this row.
                    mask_np[row, np.nonzero(mask_np[row])[0][keep:]] = False
                act_blocks = [mask_np.T]
                host_active = new_active
                active_dev, reason_dev = new_active, reason
                new_lengths = jax.device_put(current.astype(np.int32), state.cache.lengths.sharding)
                state = state.replace(cache=state.cache.replace(lengths=new_lengths))

    if step == 0:
        empty = [np.zeros(0, np.int32) for _ in range(batch)]
        return state, Generation(empty, [np.zeros(0, np.float32)] * batch, [np.zeros(0, np.float32)] * batch,
                                 np.full(batch, RUNNING, np.int32), 0)
    tokens_np, lp_np, slp_np, mask_np = (np.concatenate(blocks, axis=0).T
                                         for blocks in (tok_blocks, lp_blocks, slp_blocks, act_blocks))
    out = Generation(tokens=[tokens_np[b][mask_np[b]].astype(np.int32) for b in range(batch)],
                     logprobs=[lp_np[b][mask_np[b]] for b in range(batch)],
                     sampling_logprobs=[slp_np[b][mask_np[b]] for b in range(batch)],
                     stop_reason=np.where(active, reason, RUNNING).astype(np.int32), steps=step)
    return state, out
