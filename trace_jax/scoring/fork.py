"""One-pass prefix-fork answer scoring: the gold answer after every state boundary, from one forward per trajectory.

For a trajectory of `L` tokens with states `S_0..S_T` (token offsets `b_k`) and an answer of `m` tokens
(`template + y*`), the reference model scores `y*` after each state. Instead of `T+1` forwards over growing prefixes
(`naive.py`), one pass runs the trajectory once plus one copy of the answer per state (design.md, "Prefix-fork
scoring"). Copy `k` takes RoPE positions `b_k, b_k+1, ...` and sees trajectory keys `< b_k` and its own earlier
tokens only, so its hidden states equal those of the naive forward over `tokens[:b_k] + answer`.

Two layouts of the same computation:

  * "packed": trajectory and copies in one sequence with an explicit boolean mask (`models.forward_hidden`).
    Simple; attention memory is `O((L + (T+1) m)^2)`, fine up to a few thousand tokens.
  * "cached": prefill the trajectory (causal attention, keys/values kept per layer), then run all copies as one
    query block against the cached keys with a per-query key limit (`models.attend_cached_block`). Its attention is
    the tiled kernel with the copies as block keys: a tile of copy queries reads cached key tiles only up to its
    largest `b_k` and only the copy tokens within one answer width of it, so the work is about `sum_k (m-1) b_k`
    scores and memory is linear in `L`.

Only `m - 1` answer tokens per state run through the model: answer token 0 is predicted by the trajectory's own
hidden state at `b_k - 1` (which only sees keys `< b_k`), and the last answer token predicts nothing we score.
Log-probs come from `models.hidden_logprobs` in sequence chunks, so float32 `[batch, length, vocab]` logits never
exist. The same pass yields the reference's per-token log-probs of the trajectory itself.

On a mesh over several processes every process calls `score_answer_prefixes` with its own rows; the pass is one
collective program over every process's rows (shapes agreed over the processes), each process feeding its block of
the rows and reading its scores back from its own shards.

Shapes are padded to buckets (`padded_shape`) so jit compiles once per bucket, not per batch. With a `mesh`,
trajectories are split over the mesh's batch axes (data parallel) and params placed by the logical-axis rules.
`fork_scores_program` is the public builder of the device program: the loop (through `score_answer_prefixes`) and
`trace-jax plan` call the same program object, traced under the mesh it runs on (the Pallas TPU attention lowers
per device inside `shard_map` only under a mesh context).

This module knows nothing about chat formats, tokenizers, credit or files.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trace_jax import models
from trace_jax.models.config import ModelConfig
from trace_jax.models.packing import PackedRows, plan_packing, take_packed, unpack_token_values
from trace_jax.train import distributed

METHODS = ("fork", "cached", "naive")
LAYOUTS = ("auto", "packed", "cached")
# "auto" runs the packed layout only for small passes: rows of at most DEFAULT_PACKED_MAX_LEN packed tokens
# (trajectory + all answer copies) and a batch of at most DEFAULT_PACKED_MAX_TOKENS packed tokens in all. The
# packed mask and score tensors grow as the square of the packed length, while the cached layout's prefill
# (`models.prefill`) skips the masked half of the trajectory's attention and its copy block skips keys past each
# copy's boundary (linear in memory); but it runs more, smaller ops per layer, which a small batch does not
# amortise. Measured side by side on CPU (benchmarks/scoring_layout_bench.py, 2026-12-02): on the embedded
# default's model with 64 rows the cached layout is 1.04-1.6x faster from 79 packed tokens a row (5K in all) on;
# on SmolLM2-135M with 4 rows the packed one is 1.12x faster at 271 tokens a row and the cached one 1.09x faster
# at 399. Where the rule errs on those measurements it costs under 8%.
DEFAULT_PACKED_MAX_LEN = 384
DEFAULT_PACKED_MAX_TOKENS = 4096


class PrefixScores(NamedTuple):
    """Result of `score_answer_prefixes`.

    Attributes:
      answer_scores: float32 `[N, S]` mean log-prob of the gold answer tokens after state `k`; 0 for padded states
        (`k >= num_states[n]`).
      token_logprobs: float32 `[N, L]` the reference's log-prob of the trajectory's next token,
        `token_logprobs[n, t] = log p(tokens[n, t+1] | tokens[n, :t+1])`; the last position (and positions at or
        beyond `lengths[n] - 1` when `lengths` is given) is 0; None when asked not to compute it.
    """

    answer_scores: jax.Array
    token_logprobs: jax.Array


# ---------------------------------------------------------------------------------------------------- host helpers
def bucket_size(n: int, minimum: int = 8) -> int:
    """Round `n` up to the next bucket `2^i` or `3 * 2^(i-1)` (at least `minimum`): <= 33% padding, few compiles."""
    n = max(int(n), int(minimum))
    power = 1 << (n - 1).bit_length()
    three_quarters = 3 * power // 4
    return three_quarters if three_quarters >= n and three_quarters % minimum == 0 else power


def _state_bucket(slots: int) -> int:
    """States pad to 1, 2, 3, 4, 6, 8, then multiples of 8: every padded state costs m - 1 copy tokens."""
    return bucket_size(slots, 1) if slots <= 8 else -(-slots // 8) * 8


def _as_int_array(name, value, rank, expected):
    array = np.asarray(value)
    if array.ndim != rank or not (np.issubdtype(array.dtype, np.integer) or array.dtype == bool):
        raise ValueError(f"{name} must be an integer array {expected}, got dtype {array.dtype} shape {array.shape}")
    return array.astype(np.int32)


def validate_scoring_inputs(tokens, boundaries, num_states, answer_tokens, answer_mask, lengths=None):
    """Check shapes and values on the host; returns int32 numpy copies with answers broadcast to `[N, m]`.

    Raises ValueError naming the input, the expected form and the fix.
    """
    tokens = _as_int_array("tokens", tokens, 2, "[N, L] token ids")
    n, length = tokens.shape
    boundaries = _as_int_array("boundaries", boundaries, 2, "[N, S] state offsets (S = T_max + 1)")
    num_states = _as_int_array("num_states", num_states, 1, "[N] number of states T_n + 1")
    answer_tokens = np.asarray(answer_tokens)
    answer_mask = np.asarray(answer_mask)
    if answer_tokens.ndim == 1:
        answer_tokens = np.broadcast_to(answer_tokens, (n, answer_tokens.shape[0]))
    if answer_mask.ndim == 1:
        answer_mask = np.broadcast_to(answer_mask, (n, answer_mask.shape[0]))
    answer_tokens = _as_int_array("answer_tokens", answer_tokens, 2, "[N, m] or [m] (template + gold answer)")
    answer_mask = _as_int_array("answer_mask", answer_mask, 2, "[N, m] or [m], 1 on scored gold tokens")
    if boundaries.shape[0] != n or num_states.shape[0] != n or answer_tokens.shape[0] != n:
        raise ValueError(f"tokens{tokens.shape}, boundaries{boundaries.shape}, num_states{num_states.shape} and "
                         f"answer_tokens{answer_tokens.shape} must agree on N")
    if answer_mask.shape != answer_tokens.shape:
        raise ValueError(f"answer_mask{answer_mask.shape} must match answer_tokens{answer_tokens.shape}")
    if answer_tokens.shape[1] < 1:
        raise ValueError("answer_tokens is empty; pass at least one gold answer token per row")
    slots = boundaries.shape[1]
    if np.any(num_states < 1) or np.any(num_states > slots):
        bad = np.flatnonzero((num_states < 1) | (num_states > slots))[:5].tolist()
        raise ValueError(f"num_states must be in [1, {slots}] (T_n + 1 states, at most boundaries.shape[1]); "
                         f"rows {bad} are out of range")
    if not np.all(answer_mask.sum(axis=1) > 0):
        bad = np.flatnonzero(answer_mask.sum(axis=1) == 0)[:5].tolist()
        raise ValueError(f"answer_mask rows {bad} score no token; mark the gold answer tokens with 1")
    limit = np.full((n,), length, np.int32) if lengths is None else _as_int_array("lengths", lengths, 1, "[N]")
    real = np.arange(slots)[None, :] < num_states[:, None]
    out_of_range = real & ((boundaries < 1) | (boundaries > limit[:, None]))
    if out_of_range.any():
        row = int(np.flatnonzero(out_of_range.any(axis=1))[0])
        raise ValueError(f"boundaries of row {row} are {boundaries[row, :num_states[row]].tolist()}; every real "
                         f"state offset must be in [1, {int(limit[row])}] (the trajectory length); S_0 needs a "
                         "non-empty prompt before it")
    decreasing = real[:, 1:] & (np.diff(boundaries, axis=1) < 0)
    if decreasing.any():
        row = int(np.flatnonzero(decreasing.any(axis=1))[0])
        raise ValueError(f"boundaries of row {row} decrease: {boundaries[row, :num_states[row]].tolist()}; "
                         "state offsets must be non-decreasing")
    return tokens, boundaries, num_states, answer_tokens, answer_mask


def _pad_to(array, shape, value=0):
    pads = [(0, target - size) for size, target in zip(array.shape, shape)]
    return np.pad(array, pads, constant_values=value)


def row_sharding(mesh, rank: int, rules=None) -> NamedSharding:
    """The sharding of a scoring input of `rank` dimensions on `mesh`: rows over the `batch` rule's mesh axes."""
    spec = models.logical_to_mesh_spec(P("batch", *([None] * (rank - 1))), mesh, rules)
    return NamedSharding(mesh, spec)


def row_shards(mesh, rules=None) -> int:
    """How many blocks a scoring pass's rows are split in on `mesh` (the `batch` rule's mesh axes; 1 without a
    mesh): `padded_shape` pads rows to a multiple of it, and packed rows are packed within each block."""
    return _batch_multiple(mesh, rules)


def _batch_multiple(mesh, rules) -> int:
    if mesh is None:
        return 1
    spec = models.logical_to_mesh_spec(P("batch"), mesh, rules)
    axes = spec[0]
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else axes
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    return math.prod(sizes[a] for a in axes)


def padded_shape(n: int, length: int, slots: int, m: int, *, mesh=None, rules=None,
                 bucket: bool = True) -> tuple[int, int, int, int]:
    """The shape `(N, L, S, m)` one scoring pass pads its inputs to (the one bucketing rule of the scorer):
    rows to a `bucket_size` and then a multiple of the mesh's batch shards, tokens to a `bucket_size` multiple of
    16, states to 1, 2, 3, 4, 6, 8 and then multiples of 8, answer tokens to a `bucket_size`. `bucket=False`
    pads only the rows to the batch shards."""
    multiple = _batch_multiple(mesh, rules)
    if not bucket:
        return -(-n // multiple) * multiple, length, slots, m
    return -(-bucket_size(n, 1) // multiple) * multiple, bucket_size(length, 16), _state_bucket(slots), \
        bucket_size(m, 1)


# ---------------------------------------------------------------------------------------------------- device code
def _answer_log_probs(config, params, first, copy_hidden, answer_tokens, answer_mask, logprob_chunk):
    """Mean gold log-prob per state from the trajectory's hidden state before each boundary, `first [N, S, D]`
    (`traj_hidden[:, b_k - 1]`), and the copies' hidden states `copy_hidden [N, S, m-1, D]`."""
    n, slots = first.shape[:2]
    m = answer_tokens.shape[1]
    # Answer token 0 is predicted by the trajectory's own state at b_k - 1 (it sees exactly tokens < b_k).
    predictors = first[:, :, None, :]
    if copy_hidden is not None:
        predictors = jnp.concatenate([predictors, copy_hidden], axis=2)  # [N, S, m, D]
    targets = jnp.broadcast_to(answer_tokens[:, None, :], (n, slots, m))
    log_probs = models.hidden_logprobs(config, params, predictors.reshape(n, slots * m, -1),
                                       targets.reshape(n, slots * m), chunk_size=logprob_chunk)
    log_probs = log_probs.reshape(n, slots, m)
    weights = answer_mask.astype(jnp.float32)[:, None, :]
    return jnp.sum(log_probs * weights, axis=-1) / jnp.sum(weights, axis=-1)


def _trajectory_log_probs(config, params, traj_hidden, tokens, logprob_chunk):
    shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    log_probs = models.hidden_logprobs(config, params, traj_hidden, shifted, chunk_size=logprob_chunk)
    return log_probs.at[:, -1].set(0.0)


def _copies(answer_tokens, boundaries):
    """Copy tokens/positions [N, S*(m-1)] and each copy token's (state, offset) ids [S*(m-1)]."""
    n, slots = boundaries.shape
    width = answer_tokens.shape[1] - 1
    offsets = jnp.arange(width, dtype=jnp.int32)
    copy_tokens = jnp.broadcast_to(answer_tokens[:, None, :width], (n, slots, width)).reshape(n, slots * width)
    copy_positions = (boundaries[:, :, None] + offsets[None, None, :]).reshape(n, slots * width)
    state_of = jnp.repeat(jnp.arange(slots, dtype=jnp.int32), width)
    offset_of = jnp.tile(offsets, slots)
    return copy_tokens, copy_positions, state_of, offset_of


def _packed_hidden(config, params, tokens, boundaries, answer_tokens):
    n, length = tokens.shape
    slots = boundaries.shape[1]
    width = answer_tokens.shape[1] - 1
    if width == 0:
        return models.forward_hidden(config, params, tokens), None
    copy_tokens, copy_positions, state_of, offset_of = _copies(answer_tokens, boundaries)
    sequence = jnp.concatenate([tokens, copy_tokens], axis=1)
    positions = jnp.concatenate([jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (n, length)),
                                 copy_positions], axis=1)
    key = jnp.arange(length + slots * width)
    # Trajectory queries: causal (added by the model). Copy query (k, j): trajectory keys < b_k, plus copy keys of
    # the same state k at offsets <= j.
    copy_sees_traj = key[None, None, :length] < jnp.repeat(boundaries, width, axis=1)[:, :, None]  # [N, Q, L]
    same_copy = (state_of[:, None] == state_of[None, :]) & (offset_of[None, :] <= offset_of[:, None])  # [Q, Q]
    copy_rows = jnp.concatenate([copy_sees_traj, jnp.broadcast_to(same_copy, (n,) + same_copy.shape)], axis=2)
    traj_rows = jnp.broadcast_to(key[None, None, :] < length, (n, length, key.shape[0]))
    mask = jnp.concatenate([traj_rows, copy_rows], axis=1)
    hidden = models.forward_hidden(config, params, sequence, positions=positions, attention_mask=mask)
    return hidden[:, :length], hidden[:, length:].reshape(n, slots, width, -1)


def _cached_hidden(config, params, tokens, boundaries, answer_tokens):
    n = tokens.shape[0]
    slots = boundaries.shape[1]
    width = answer_tokens.shape[1] - 1
    traj_hidden, cache = models.prefill(config, params, tokens)
    if width == 0:
        return traj_hidden, None
    copy_tokens, copy_positions, state_of, offset_of = _copies(answer_tokens, boundaries)
    key_limit = jnp.repeat(boundaries, width, axis=1)
    same_copy = (state_of[:, None] == state_of[None, :]) & (offset_of[None, :] <= offset_of[:, None])
    block_mask = jnp.broadcast_to(same_copy, (n,) + same_copy.shape)
    copy_hidden = models.attend_cached_block(config, params, cache, copy_tokens, copy_positions, key_limit,
                                             block_mask, block_band=width)
    return traj_hidden, copy_hidden.reshape(n, slots, width, -1)


def _fork_scores(config: ModelConfig, layout: str, logprob_chunk: int, query_chunk: int, with_token_logprobs: bool,
                 params, tokens, boundaries, state_valid, answer_tokens, answer_mask):
    length = tokens.shape[1]
    boundaries = jnp.clip(boundaries, 1, length)  # padded states: any legal offset, result discarded
    if layout == "packed":
        traj_hidden, copy_hidden = _packed_hidden(config, params, tokens, boundaries, answer_tokens)
    else:
        if query_chunk:
            config = config.replace(attention_query_chunk=query_chunk)
        traj_hidden, copy_hidden = _cached_hidden(config, params, tokens, boundaries, answer_tokens)
    first = jnp.take_along_axis(traj_hidden, (boundaries - 1)[:, :, None], axis=1)  # [N, S, D]
    scores = _answer_log_probs(config, params, first, copy_hidden, answer_tokens, answer_mask, logprob_chunk)
    scores = jnp.where(state_valid, scores, 0.0)
    if not with_token_logprobs:  # the LM head over every trajectory position is most of a small model's cost
        return scores, None
    return scores, _trajectory_log_probs(config, params, traj_hidden, tokens, logprob_chunk)


def _fork_scores_rows_packed(config: ModelConfig, logprob_chunk: int, query_chunk: int, with_token_logprobs: bool,
                             shards: int, params, packed: PackedRows, boundaries, state_valid, answer_tokens,
                             answer_mask):
    """`_fork_scores` of the cached layout with the trajectories packed (`models.packing`): one causal prefill
    of the packed rows (segments, each row's own positions), then every row's answer copies against its packed
    row's cache from the row's first slot (`key_start`) to its boundary. Returns the same `(scores [N, S],
    token_logprobs [N, B] or None)`, each row's log-probs 0 from its last real token on."""
    if query_chunk:
        config = config.replace(attention_query_chunk=query_chunk)
    n, slots = boundaries.shape
    width = answer_tokens.shape[1] - 1
    length = packed.tokens.shape[1]
    boundaries = jnp.clip(boundaries, 1, length)
    traj_hidden, cache = models.prefill(config, params, packed.tokens, positions=packed.positions,
                                        segment_ids=packed.segment_ids)
    offset = packed.offset[:, None]
    first = take_packed(traj_hidden, packed.slot, offset + boundaries - 1, shards)  # [N, S, D]
    copy_hidden = None
    if width:
        copy_tokens, copy_positions, state_of, offset_of = _copies(answer_tokens, boundaries)
        same_copy = (state_of[:, None] == state_of[None, :]) & (offset_of[None, :] <= offset_of[:, None])
        copy_hidden = models.attend_cached_block(
            config, params, cache, copy_tokens, copy_positions, offset + jnp.repeat(boundaries, width, axis=1),
            jnp.broadcast_to(same_copy, (n,) + same_copy.shape), block_band=width,
            key_start=jnp.broadcast_to(offset, copy_tokens.shape), cache_rows=packed.slot, cache_shards=shards)
        copy_hidden = copy_hidden.reshape(n, slots, width, -1)
    scores = _answer_log_probs(config, params, first, copy_hidden, answer_tokens, answer_mask, logprob_chunk)
    scores = jnp.where(state_valid, scores, 0.0)
    if not with_token_logprobs:
        return scores, None
    shifted = jnp.concatenate([packed.tokens[:, 1:], jnp.zeros_like(packed.tokens[:, :1])], axis=1)
    log_probs = models.hidden_logprobs(config, params, traj_hidden, shifted, chunk_size=logprob_chunk)
    # next-token-aligned: a row's last real token predicts the next row's first; keep positions < length - 1
    token_lp = unpack_token_values(log_probs, packed, length)
    real = jnp.arange(length)[None, :] < (packed.length[:, None] - 1)
    return scores, jnp.where(real, token_lp, 0.0)


class ScoringProgram:
    """The jitted prefix-fork pass with the mesh it runs on: call it as `program(params, tokens, boundaries,
    state_valid, answer_tokens, answer_mask)`; `lower(...)` takes the same arguments (ahead-of-time compilation,
    `trace-jax plan`). Both trace under `jax.set_mesh(mesh)` when a mesh is given, as the train step does, so the
    model's sharding constraints and the Pallas TPU attention (a per-device Mosaic kernel that GSPMD cannot
    partition: `models.attention` runs it inside `shard_map` under the mesh) lower on a multi-chip mesh."""

    def __init__(self, jitted, mesh):
        self.jitted, self.mesh = jitted, mesh

    def _context(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def __call__(self, params, *args):
        with self._context():
            return self.jitted(params, *args)

    def lower(self, params, *args):
        with self._context():
            return self.jitted.lower(params, *args)


@functools.lru_cache(maxsize=None)
def fork_scores_program(config: ModelConfig, *, layout: str, logprob_chunk: int = 256, query_chunk: int = 0,
                        with_token_logprobs: bool = True, mesh: Mesh | None = None) -> ScoringProgram:
    """The reference-scoring program of one prefix-fork pass over padded inputs (`padded_shape`):

        program(params, tokens int32 [N, L], boundaries int32 [N, S], state_valid bool [N, S],
                answer_tokens int32 [N, m], answer_mask int32 [N, m])
          -> (answer_scores float32 [N, S], token_logprobs float32 [N, L] or None)

    `layout` is "packed" or "cached" (`choose_layout`); `logprob_chunk`, `query_chunk`, `with_token_logprobs` as
    in `score_answer_prefixes`. `mesh`: the mesh the inputs are placed on (None on one device); the program is
    traced under it (`ScoringProgram`). Nothing is donated (the reference is read again every step). One program
    object per set of arguments: `score_answer_prefixes` and `trace-jax plan` call the same one."""
    if layout not in ("packed", "cached"):
        raise ValueError(f"fork_scores_program: layout must be 'packed' or 'cached', got {layout!r}")
    jitted = jax.jit(functools.partial(_fork_scores, config, layout, logprob_chunk, query_chunk, with_token_logprobs))
    return ScoringProgram(jitted, mesh)


@functools.lru_cache(maxsize=None)
def rows_packed_program(config: ModelConfig, *, shards: int = 1, logprob_chunk: int = 256, query_chunk: int = 0,
                        with_token_logprobs: bool = True, mesh: Mesh | None = None) -> ScoringProgram:
    """The reference-scoring program of one prefix-fork pass (cached layout) over packed trajectories
    (`score_answer_prefixes(..., pack_rows=True)`):

        program(params, packed PackedRows (tokens, positions, segment_ids [P, L]; slot, offset, length [N]),
                boundaries int32 [N, S], state_valid bool [N, S], answer_tokens int32 [N, m],
                answer_mask int32 [N, m])
          -> (answer_scores float32 [N, S], token_logprobs float32 [N, L] or None)

    `shards`: the batch shards of the rows on `mesh` (`PackedRows.shards`); one program object per set of
    arguments, as `fork_scores_program`."""
    jitted = jax.jit(functools.partial(_fork_scores_rows_packed, config, logprob_chunk, query_chunk,
                                       with_token_logprobs, shards))
    return ScoringProgram(jitted, mesh)


def packed_length(length: int, num_slots: int, answer_length: int) -> int:
    """Tokens in one packed fork pass: the trajectory plus `m - 1` answer tokens per state."""
    return length + num_slots * (answer_length - 1)


def choose_layout(length: int, num_slots: int, answer_length: int, packed_max_len: int = DEFAULT_PACKED_MAX_LEN,
                  rows: int = 1, packed_max_tokens: int = DEFAULT_PACKED_MAX_TOKENS):
    """"packed" while a row's packed sequence is at most `packed_max_len` tokens and the batch's (`rows` of
    them) at most `packed_max_tokens`, else "cached" (linear memory; faster for all but small passes)."""
    packed = packed_length(length, num_slots, answer_length)
    return "packed" if packed <= packed_max_len and rows * packed <= packed_max_tokens else "cached"


# ---------------------------------------------------------------------------------------------------- public API
def score_answer_prefixes(config: ModelConfig, params, tokens, boundaries, num_states, answer_tokens, answer_mask,
                          *, method: str = "fork", layout: str = "auto", lengths=None, mesh=None, rules=None,
                          packed_max_len: int = DEFAULT_PACKED_MAX_LEN,
                          packed_max_tokens: int = DEFAULT_PACKED_MAX_TOKENS, logprob_chunk: int = 256,
                          query_chunk: int = 0, bucket: bool = True, token_logprobs: bool = True,
                          pack_rows: bool = False) -> PrefixScores:
    """Score the gold answer after every state boundary of every trajectory (TRACE's reference scores).

        answer_scores[n, k] = (1/|y*|) sum_j log pi_ref(y*_j | tokens[n, :b_k] + template, y*_<j)

    Args:
      config, params: the reference model (any `models` decoder; params not differentiated).
      tokens: int `[N, L]` trajectories, right-padded (padding is never attended by a real state).
      boundaries: int `[N, S]` state offsets `b_k` (`S >= T_n + 1`); `1 <= b_k <= L`, non-decreasing; entries at
        `k >= num_states[n]` are ignored.
      num_states: int `[N]` number of real states `T_n + 1` (`1` for a trajectory without tool calls).
      answer_tokens: int `[N, m]` or `[m]`: template tokens, then gold tokens, then any right padding.
      answer_mask: `[N, m]` or `[m]`, nonzero on the gold tokens that are scored. Tokens before them (the template)
        are conditioned on; tokens after them (padding) influence nothing.
      method: "fork" (one pass; layout by `layout`), "cached" (= fork with layout "cached"), "naive" (one forward
        per prefix, the reference; see `trace_jax.scoring.naive`).
      layout: "auto" (packed while a row is at most `packed_max_len` packed tokens and the padded batch at most
        `packed_max_tokens`, else cached; `choose_layout`), "packed" or "cached".
      lengths: optional int `[N]` true trajectory lengths; only used to zero `token_logprobs` beyond them and to
        check boundaries.
      mesh, rules: optional mesh; trajectories are split over the mesh axes that the logical "batch" axis maps to
        (data parallel). Params already placed on `mesh` are read in their own layout (the frozen reference is
        sharded once, in its own dtype); others are placed by `rules` (default `models.DEFAULT_RULES`). The
        program runs under `jax.set_mesh(mesh)` (`fork_scores_program`).
      logprob_chunk: positions per log-softmax chunk (at most float32 `[N, chunk, V]` logits at once).
      query_chunk: query rows per tile of the cached layout's attention (`ModelConfig.attention_query_chunk`:
        the prefill's tiled kernel and `attend_cached_block`); 0 = the model's automatic choice (by head width).
      bucket: pad `N, L, S, m` up to buckets (`bucket_size`) so jit compiles once per bucket.
      token_logprobs: also compute the trajectory's own log-probs (False: `token_logprobs` is None, and the
        fork methods skip the LM head over the trajectory; the trainer needs them only for a KL term).
      pack_rows: where the pass runs the cached layout, pack the trajectories (their `lengths`; every row whole
        without them) end to end into as few rows of the padded length as first-fit decreasing gives
        (`models.packing`, `rows_packed_program`) instead of padding each: the same results, fewer padding
        tokens through the prefill. On one process only (a mesh over several processes runs unpacked).

    Returns:
      `PrefixScores(answer_scores [N, S] float32, token_logprobs [N, L] float32)`, as numpy-convertible jax arrays
      cut back to the input shapes.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    tokens, boundaries, num_states, answer_tokens, answer_mask = validate_scoring_inputs(
        tokens, boundaries, num_states, answer_tokens, answer_mask, lengths)
    if method == "naive":
        from trace_jax.scoring.naive import score_answer_prefixes_naive

        return score_answer_prefixes_naive(config, params, tokens, boundaries, num_states, answer_tokens,
                                           answer_mask, lengths=lengths, logprob_chunk=logprob_chunk)
    if method == "cached":
        layout = "cached"
    if distributed.spans_processes(mesh):
        return _score_over_processes(config, params, tokens, boundaries, num_states, answer_tokens, answer_mask,
                                     layout=layout, lengths=lengths, mesh=mesh, rules=rules,
                                     packed_max_len=packed_max_len, packed_max_tokens=packed_max_tokens,
                                     logprob_chunk=logprob_chunk, query_chunk=query_chunk, bucket=bucket,
                                     token_logprobs=token_logprobs)
    n, length = tokens.shape
    slots, m = boundaries.shape[1], answer_tokens.shape[1]
    pn, pl, ps, pm = padded_shape(n, length, slots, m, mesh=mesh, rules=rules, bucket=bucket)
    if layout == "auto":
        layout = choose_layout(pl, ps, pm, packed_max_len, rows=pn, packed_max_tokens=packed_max_tokens)
    state_valid = np.arange(ps)[None, :] < _pad_to(num_states, (pn,))[:, None]
    # Padded rows: one state at offset 1 with one scored token, so nothing divides by zero; results discarded.
    padded_boundaries = _pad_to(boundaries, (pn, ps), 1)
    args = (_pad_to(tokens, (pn, pl)), padded_boundaries, state_valid,
            _pad_to(answer_tokens, (pn, pm)), _pad_to(answer_mask, (pn, pm)))
    if n < pn:
        args[4][n:, 0] = 1
    if pack_rows and layout == "cached":
        shards = row_shards(mesh, rules)
        real = np.full((n,), length, np.int32) if lengths is None else np.asarray(lengths, np.int32)
        plan = plan_packing(_pad_to(real, (pn,)), pl, shards=shards)  # padded rows: length 0, not placed
        positions = np.broadcast_to(np.arange(pl, dtype=np.int32), (pn, pl))
        args = (PackedRows.build(args[0], positions, plan),) + args[1:]
        program = rows_packed_program(config, shards=shards, logprob_chunk=logprob_chunk, query_chunk=query_chunk,
                                      with_token_logprobs=token_logprobs, mesh=mesh)
    else:
        program = fork_scores_program(config, layout=layout, logprob_chunk=logprob_chunk, query_chunk=query_chunk,
                                      with_token_logprobs=token_logprobs, mesh=mesh)
    if mesh is not None:
        if not models.placed_on(params, mesh):  # params already on the mesh (e.g. a sharded reference) stay put
            params = models.shard_params(params, config, mesh, rules)
        args = jax.tree_util.tree_map(lambda a: jax.device_put(a, row_sharding(mesh, a.ndim, rules)), args)
    scores, token_lp = program(params, *args)
    if token_lp is None:
        return PrefixScores(scores[:n, :slots], None)
    scores, token_lp = scores[:n, :slots], token_lp[:n, :length].at[:, -1].set(0.0)
    if lengths is not None:
        keep = jnp.arange(length)[None, :] < (jnp.asarray(lengths, jnp.int32)[:, None] - 1)
        token_lp = jnp.where(keep, token_lp, 0.0)
    return PrefixScores(scores, token_lp)


def _score_over_processes(config, params, tokens, boundaries, num_states, answer_tokens, answer_mask, *, layout,
                          lengths, mesh, rules, packed_max_len, packed_max_tokens, logprob_chunk, query_chunk, bucket,
                          token_logprobs) -> PrefixScores:
    """`score_answer_prefixes` of this process's rows on a mesh over several processes: one collective pass over
    every process's rows (every process calls it; the shapes are agreed over the processes, `distributed.
    agree_max`). Each process's rows are padded to the same count and take the process's block of the global
    batch (`distributed.global_batch`: fed from this process, no gather), so the scores are read back from its
    own shards (`distributed.local_rows`). Returns host arrays of this process's rows."""
    processes = jax.process_count()
    n, length = tokens.shape
    slots, m = boundaries.shape[1], answer_tokens.shape[1]
    most, length, m = (distributed.agree_max(v) for v in (n, length, m))
    pn, pl, ps, pm = padded_shape(most * processes, length, slots, m, mesh=mesh, rules=rules, bucket=bucket)
    per = -(-pn // processes)
    pn = per * processes
    if layout == "auto":
        layout = choose_layout(pl, ps, pm, packed_max_len, rows=pn, packed_max_tokens=packed_max_tokens)
    state_valid = np.arange(ps)[None, :] < _pad_to(num_states, (per,))[:, None]
    local = [_pad_to(tokens, (per, pl)), _pad_to(boundaries, (per, ps), 1), state_valid,
             _pad_to(answer_tokens, (per, pm)), _pad_to(answer_mask, (per, pm))]
    local[4][n:, 0] = 1  # padded rows: one state at offset 1 with one scored token (results discarded)
    shardings = [row_sharding(mesh, a.ndim, rules) for a in local]
    try:
        distributed.check_rows_split_by_process(shardings[0], (pn, pl))
        args = distributed.global_batch(local, shardings)
    except ValueError:  # rows not split by process (e.g. replicated): every process passes every row
        args = distributed.put_replicated_value([distributed.gather_rows(a) for a in local], shardings)
    if not models.placed_on(params, mesh):
        params = models.shard_params(params, config, mesh, rules)
    program = fork_scores_program(config, layout=layout, logprob_chunk=logprob_chunk, query_chunk=query_chunk,
                                  with_token_logprobs=token_logprobs, mesh=mesh)
    scores, token_lp = program(params, *args)
    mine = slice(jax.process_index() * per, jax.process_index() * per + n)
    scores = distributed.local_rows(scores, mine)[:, :slots]
    if token_lp is None:
        return PrefixScores(scores, None)
    token_lp = distributed.local_rows(token_lp, mine)[:, :tokens.shape[1]].copy()
    token_lp[:, -1] = 0.0
    if lengths is not None:
        keep = np.arange(tokens.shape[1])[None, :] < (np.asarray(lengths, np.int32)[:, None] - 1)
        token_lp = np.where(keep, token_lp, 0.0).astype(np.float32)
    return PrefixScores(scores, token_lp)


def compiled_memory(config: ModelConfig, params, tokens, boundaries, num_states, answer_tokens, answer_mask, *,
                    layout: str = "packed", logprob_chunk: int = 256, query_chunk: int = 0) -> dict:
    """Compiled memory analysis (bytes) of one fork pass for these (already bucketed) shapes, for benchmarks."""
    tokens, boundaries, num_states, answer_tokens, answer_mask = validate_scoring_inputs(
        tokens, boundaries, num_states, answer_tokens, answer_mask)
    state_valid = np.arange(boundaries.shape[1])[None, :] < num_states[:, None]
    program = fork_scores_program(config, layout=layout, logprob_chunk=logprob_chunk, query_chunk=query_chunk)
    lowered = program.lower(params, tokens, boundaries, state_valid, answer_tokens, answer_mask)
    analysis = lowered.compile().memory_analysis()
    return {"temp_bytes": int(getattr(analysis, "temp_size_in_bytes", 0)),
            "argument_bytes": int(getattr(analysis, "argument_size_in_bytes", 0)),
            "output_bytes": int(getattr(analysis, "output_size_in_bytes", 0))}
