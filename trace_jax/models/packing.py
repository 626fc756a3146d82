"""Row packing: variable-length rows laid end to end in rows of a fixed token budget, told apart by segment ids.

A batch of N rows padded to its longest row (L tokens) runs N x L tokens through every linear layer; at uniform
8K-48K rows about 42% of them are padding. Packed, the rows share P rows of `budget` tokens (first-fit decreasing,
deterministic), each token keeping its row's own RoPE position and attending only to earlier tokens of its own
row (`segment_ids`, the decoder's packing semantics: the row's index is its segment id, padding is -1, which the
MoE router statistics count as padding). Results are read back at the original rows (`take_packed`), so whatever
consumes per-row, per-token values is unchanged.

Rows are packed within groups, so that a packed row holds rows of one group only: the train step's micro-batches
(row i is micro-batch i % M, `train.step`) and, within one, the batch shards of the mesh (contiguous blocks of
rows). The packed rows are laid out the same way (packed row p is micro-batch p % M; within it, shard s holds a
contiguous block of `rows_per_group` packed rows), so reading a row's results back is a gather within its own
shard (`take_packed` indexes per shard group: no rows cross devices).

The number of packed rows a group needs varies with the lengths; it is rounded up to `packed_rows_bucket` (at
most 16 sizes up to the group's row count), so a jitted consumer compiles a bounded number of shapes.

Host side: `plan_packing(lengths, budget, micro_batches=, shards=) -> PackPlan`, `pack(values, plan, fill)`,
`PackedRows.build(tokens, positions, plan)`. Device side: `take_packed(x, slot, index, shards)`, `take_rows`,
`unpack_token_values`.

This module knows nothing about losses, scoring or configs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# A group's packed-row count is rounded up to a multiple of ceil(rows / BUCKETS): at most this many shapes a group.
BUCKETS = 16


def packed_rows_bucket(count: int, most: int) -> int:
    """`count` packed rows rounded up to a multiple of `ceil(most / BUCKETS)` (at least one multiple), at most
    `most` (the group's rows: one row per packed row always fits)."""
    step = max(1, -(-most // BUCKETS))
    return max(1, min(most, -(-max(count, 1) // step) * step))


def packed_row_buckets(most: int) -> tuple[int, ...]:
    """Every size `packed_rows_bucket(count, most)` can give for 0 <= count <= most, increasing."""
    return tuple(sorted({packed_rows_bucket(count, most) for count in range(most + 1)}))


class PackPlan(NamedTuple):
    """Where every row goes. Shapes: N rows of at most L tokens into `rows` packed rows of `budget` tokens.

    Attributes:
      slot: int32 [N], the packed row holding row n, counted within its (micro-batch, shard) group.
      offset: int32 [N], its first token's index in that packed row.
      length: int32 [N], its tokens (rows of length 0 are not placed: slot and offset 0).
      source: int32 [rows, budget], the flat index `n * L + t` of the token at each packed place, -1 on padding.
      segment: int32 [rows, budget], the row index n of each packed place, -1 on padding.
      rows_per_group: packed rows per (micro-batch, shard) group; rows = micro_batches x shards x rows_per_group.
      shards: batch shards per micro-batch (the groups `take_packed` indexes within).
    """

    slot: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    source: np.ndarray
    segment: np.ndarray
    rows_per_group: int
    shards: int

    @property
    def rows(self) -> int:
        return int(self.source.shape[0])

    @property
    def budget(self) -> int:
        return int(self.source.shape[1])


def _first_fit_decreasing(lengths: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(bin [n], offset [n], bins) of FFD over `lengths` (longest first, ties by index: deterministic); rows of
    length 0 get bin 0, offset 0 and are not counted."""
    bins_of, offsets = np.zeros(len(lengths), np.int32), np.zeros(len(lengths), np.int32)
    used: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: (-int(lengths[r]), r)):
        size = int(lengths[row])
        if size == 0:
            continue
        place = next((b for b, filled in enumerate(used) if filled + size <= budget), len(used))
        if place == len(used):
            used.append(0)
        bins_of[row], offsets[row] = place, used[place]
        used[place] += size
    return bins_of, offsets, len(used)


def plan_packing(lengths, budget: int, *, micro_batches: int = 1, shards: int = 1, width: int | None = None,
                 rows_per_group: int | None = None) -> PackPlan:
    """Pack rows of `lengths [N]` tokens (each at most `budget`) into rows of `budget` tokens, within groups.

    Row n is in micro-batch `n % micro_batches` (the train step's split) and, among that micro-batch's rows in
    order, in the shard of its contiguous block (`shards` blocks). Each group is packed first-fit decreasing; every
    group gets the same number of packed rows, the largest need rounded by `packed_rows_bucket` (or
    `rows_per_group` when given: at least the need). `width`: the original rows' token width L (the stride of
    `source`; default `budget`). Raises ValueError naming the argument on a row longer than the budget or rows
    that do not split into the groups."""
    lengths = np.asarray(lengths, np.int64)
    n = lengths.shape[0]
    width = budget if width is None else width
    if lengths.ndim != 1 or (lengths < 0).any() or (lengths > width).any():
        raise ValueError(f"plan_packing: lengths must be [N] token counts in [0, width={width}], got "
                         f"{lengths.tolist()[:8]}")
    if (lengths > budget).any():
        row = int(np.argmax(lengths > budget))
        raise ValueError(f"plan_packing: row {row} has {int(lengths[row])} tokens, more than the packing budget "
                         f"{budget}; every row must fit one packed row (raise the budget)")
    groups = micro_batches * shards
    if micro_batches < 1 or shards < 1 or n % groups:
        raise ValueError(f"plan_packing: {n} rows do not split into micro_batches={micro_batches} x "
                         f"shards={shards} equal groups")
    per_group = n // groups
    local = np.arange(n) // micro_batches  # index within the micro-batch
    group_of = (np.arange(n) % micro_batches) * shards + local // max(per_group, 1)
    members = [np.flatnonzero(group_of == g) for g in range(groups)]
    packed = [_first_fit_decreasing(lengths[rows], budget) for rows in members]
    need = max([bins for _, _, bins in packed] + [0])
    size = packed_rows_bucket(need, per_group) if rows_per_group is None else rows_per_group
    if size < need:
        raise ValueError(f"plan_packing: rows_per_group={size} is fewer than the {need} packed rows a group needs")
    slot, offset = np.zeros(n, np.int32), np.zeros(n, np.int32)
    source = np.full((groups * size, budget), -1, np.int32)
    segment = np.full((groups * size, budget), -1, np.int32)
    for g, (rows, (bins_of, offsets, _)) in enumerate(zip(members, packed)):
        micro, shard = divmod(g, shards)
        for row, b, start in zip(rows, bins_of, offsets):
            slot[row], offset[row] = shard * size + b, start
            size_row = int(lengths[row])
            if size_row == 0:
                slot[row] = shard * size
                continue
            packed_row = (shard * size + b) * micro_batches + micro  # micro-batch p % M, as the step splits rows
            source[packed_row, start:start + size_row] = row * width + np.arange(size_row)
            segment[packed_row, start:start + size_row] = row
    # `slot` counts within the micro-batch (all its shards' blocks); `take_packed` splits it per shard
    return PackPlan(slot=slot, offset=offset, length=lengths.astype(np.int32), source=source, segment=segment,
                    rows_per_group=size, shards=shards)


def pack(values, plan: PackPlan, fill=0) -> np.ndarray:
    """Host: `values [N, L]` laid out as the plan's packed rows `[rows, budget]`, `fill` on padding."""
    values = np.asarray(values)
    flat = values.reshape(-1)
    return np.where(plan.source >= 0, flat[np.maximum(plan.source, 0)], np.asarray(fill, values.dtype))


def padding_fraction(lengths, width: int) -> float:
    """The share of `len(lengths) x width` token places that hold no row's token."""
    lengths = np.asarray(lengths, np.float64)
    return float(1.0 - lengths.sum() / max(lengths.size * width, 1))


@struct.dataclass
class PackedRows:
    """A batch's rows packed (`plan_packing`), what a model forward runs on, and where each row went.

    tokens, positions: int32 [P, B], each packed token's id and its row's own RoPE position.
    segment_ids: int32 [P, B], the row index of each packed token (-1: padding).
    slot, offset, length: int32 [N] (`PackPlan`); `slot` counts within the row's micro-batch.
    shards: static, the batch shards each micro-batch's rows and packed rows are split in (`take_packed`).
    """

    tokens: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    slot: jax.Array
    offset: jax.Array
    length: jax.Array
    shards: int = struct.field(pytree_node=False, default=1)

    @classmethod
    def build(cls, tokens, positions, plan: PackPlan) -> "PackedRows":
        """Host: the packed rows of `tokens` and `positions [N, L]` (numpy-convertible) under `plan`."""
        return cls(tokens=pack(tokens, plan).astype(np.int32), positions=pack(positions, plan).astype(np.int32),
                   segment_ids=plan.segment, slot=plan.slot, offset=plan.offset, length=plan.length,
                   shards=plan.shards)


def take_packed(x, slot, index, shards: int = 1):
    """Device: `x [P, B, ...]` (packed rows of one micro-batch) read at row n's packed places: `out[n, k] =
    x[slot[n], index[n, k]]` for `slot [N]` and `index [N, K]` (clipped into [0, B)). The rows and packed rows are
    split into `shards` contiguous blocks with `slot` counted over all of them; the gather runs per block (a
    batched gather over the block axis), so on a mesh whose batch shards are those blocks no row crosses devices.
    """
    P, B = x.shape[:2]
    N, K = index.shape
    trailing = x.shape[2:]
    per_block = P // shards
    blocks = x.reshape(shards, per_block * B, *trailing)
    local = slot.astype(jnp.int32) - (jnp.arange(N, dtype=jnp.int32) // (N // shards)) * per_block
    flat = (local[:, None] * B + jnp.clip(index.astype(jnp.int32), 0, B - 1)).reshape(shards, (N // shards) * K)
    flat = flat.reshape(flat.shape + (1,) * len(trailing))
    return jnp.take_along_axis(blocks, flat, axis=1).reshape(N, K, *trailing)


def take_rows(x, slot, shards: int = 1):
    """Device: whole packed rows `x [P, ...]` at row n's slot, `[N, ...]` (per shard block, as `take_packed`)."""
    P, N = x.shape[0], slot.shape[0]
    per_block = P // shards
    blocks = x.reshape(shards, per_block, *x.shape[1:])
    local = slot.astype(jnp.int32) - (jnp.arange(N, dtype=jnp.int32) // (N // shards)) * per_block
    index = local.reshape(shards, N // shards)
    return jnp.take_along_axis(blocks, index.reshape(index.shape + (1,) * (x.ndim - 1)), axis=1).reshape(
        N, *x.shape[1:])


def unpack_token_values(values, packing: PackedRows, width: int, *, shift: int = 0):
    """Device: per-token values of packed rows `[P, B]` back at the original rows, `[N, width]`: `out[n, t] =
    values[slot[n], offset[n] + t + shift]` where both t and `t + shift` are in [0, length[n]), else 0.
    `shift = -1` reads a next-token-aligned value (computed at the token before) as token-aligned."""
    t = jnp.arange(width, dtype=jnp.int32)[None, :]
    source = t + shift
    out = take_packed(values, packing.slot, packing.offset[:, None] + source, packing.shards)
    length = packing.length[:, None]
    keep = (source >= 0) & (source < length) & (t < length)
    return jnp.where(keep, out, 0.0)
