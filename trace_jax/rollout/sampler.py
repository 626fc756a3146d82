"""The sampling rules every rollout path shares: how a token is drawn, what it is logged with, when a row stops.

  * `SamplingConfig` / `RowSampling`: temperature, top-k, top-p, greedy; per row and traced.
  * `sampling_logits`, `sample_from_logits`: the draw and its two log-probs.
  * `StopStrings`: host-side detection of stop strings (tags that are not single tokens, e.g. `</tool_call>` for
    SmolLM2).
  * `bucket_length`: the one padding rule (chunk widths, row counts), so shapes repeat.
  * the stop reasons (`STOP_REASONS`), and `MeshProgram` / `state_layout` / `divisible_shardings`: programs that
    run under a mesh with their outputs pinned to their layout.

The paged rollout engine (`rollout.engine`, `rollout.paged`) and `trace-jax serve` (serve/engine.py) use these.
The dense `[rows, max_len]` KV-cache sampler that lived here until issue 45 is gone (docs/rollout.md, "History:
the dense sampler").

Log-probs. For every generated token two values are returned:
  * `logprobs`: log p(token) under the *raw model* distribution at temperature 1, no top-k/top-p filtering (with a
    logits hook: of the hooked logits). This is what `trace_jax.models.token_logprobs` recomputes, so the
    trainer can compare it with its own log-probs (the sampler/trainer gap) and use it as the behaviour policy.
    It goes into `TrajectoryBatch.sampler_logprobs`.
  * `sampling_logprobs`: log q(token) under the distribution actually sampled from (tempered, then top-k, then
    top-p); 0.0 for greedy. Useful for importance corrections of the sampling procedure itself.

Randomness: `sample_from_logits` takes one key for the whole batch, or one per row ([B, 2] raw or [B] typed keys),
so a row's draw does not depend on the other rows (the engines key row r's token t with `fold_in(key[r], t)`).

Sampling values (temperature, top-p, greedy) are traced arrays, one per row (`RowSampling`): a new temperature is new
data for the same program, never a compile. Only `top_k` (a static size) and two switches that leave out work no row
needs (the draw when every row is greedy, the vocabulary sort when no row filters by top-p) shape the program.

This module knows nothing about chat formats, tools, tasks, rewards or KV caches.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# Why a row stopped generating (the decode programs' `reason`).
RUNNING, STOP_TOKEN, STOP_STRING, BUDGET, CONTEXT_FULL = 0, 1, 2, 3, 4
STOP_REASONS = ("running", "stop_token", "stop_string", "budget", "context_full")
MIN_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn, one setting for a batch. The decode programs take its values as traced per-row arrays
    (`RowSampling`); only `top_k` and whether any row samples or filters by top-p shape the program.

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


def bucket_length(n: int, minimum: int = MIN_BUCKET) -> int:
    """The padded chunk length for n tokens, so shapes repeat: powers of two up to 512, then multiples of 256
    (a 645-token prompt pads to 768, not 1024)."""
    if n > 512:
        return -(-n // 256) * 256
    size = minimum
    while size < n:
        size *= 2
    return size


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


# ------------------------------------------------------------------------------------------ programs on a mesh
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


def state_layout(state):
    """The `NamedSharding`s of a state (arrays or `ShapeDtypeStruct`s) placed on a mesh, each in its canonical
    spelling (hashable: a builder's argument that pins a program's output to its input's layout, the same for
    every state in that layout), or None for a state on one device."""
    shardings = jax.tree_util.tree_map(lambda x: getattr(x, "sharding", None), state)
    leaves = jax.tree_util.tree_leaves(shardings)
    if not leaves or not all(isinstance(s, jax.sharding.NamedSharding) for s in leaves):
        return None
    return jax.tree_util.tree_map(lambda x: _canonical(x.sharding, len(x.shape)), state)

