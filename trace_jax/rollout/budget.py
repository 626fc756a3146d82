"""The rollout's KV-cache budget: bytes one row's cache takes on a chip, and how many rows fit under
`RolloutConfig.kv_budget_gib`.

A row's cache is `k` and `v`, each `[layers, max_len, kv_heads, head_dim]` in the cache dtype, plus its int32
length. On a mesh the sampler places rows over the batch axes and kv heads over `tensor` (`sampler.state_shardings`,
the cache's logical axes under the sharding rules); a dimension its mesh axes do not divide is replicated. So one
row costs a chip `2 x layers x max_len x (kv_heads / tensor) x head_dim x itemsize + 4` bytes when `tensor` divides
the kv heads, and the full heads otherwise; `S` rows cost each chip `S / batch_shards` rows' bytes when the batch
shards divide `S`, and all `S` rows' bytes otherwise.

`kv_bytes_per_chip` is what a sampler cache of so many rows takes on one chip. `rows_within_budget` is the one rule
for how many rows the agent loop keeps in its cache at once (it admits waiting rows as others finish, see
`agent.run_episodes`); `trace-jax plan` reports the same number.

This module knows nothing about tokens, tools or sampling; only shapes, dtypes and the mesh.
"""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp

from trace_jax.models.config import ModelConfig
from trace_jax.models.sharding import DEFAULT_RULES, cache_logical_axes, logical_to_mesh_spec

GIB = 1 << 30


def _axes_size(mesh, spec_entry) -> int:
    if spec_entry is None:
        return 1
    names = (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)
    sizes = dict(mesh.shape)
    return math.prod(sizes[name] for name in names)


def batch_shards(mesh, rules=None) -> int:
    """How many ways the sampler splits cache rows on `mesh` (the product of the batch axes' sizes; 1 without a
    mesh). A row count this does not divide is replicated on every chip instead."""
    if mesh is None:
        return 1
    spec = logical_to_mesh_spec(cache_logical_axes()["lengths"], mesh, DEFAULT_RULES if rules is None else rules)
    return _axes_size(mesh, spec[0])


def kv_bytes_per_row(model_config: ModelConfig, max_len: int, *, mesh=None, dtype=None, rules=None) -> int:
    """Bytes of one row's KV cache (k, v and its length) on one chip, for rows of `max_len` slots.

    Args:
      model_config: the policy's config (layers, kv heads, head dim; `dtype` defaults to its compute dtype, the
        cache dtype `sampler.init_state` uses).
      max_len: cache slots per row (`RolloutConfig.max_context`).
      mesh: the rollout's mesh; kv heads are split over the axes the rules give `kv_heads` (`tensor`) when they
        divide them. None: one device.
      dtype: the cache dtype (default `model_config.dtype`).
      rules: the sharding rules of the sampler state (default `models.DEFAULT_RULES`).
    """
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        raise ValueError(f"kv_bytes_per_row: max_len must be an int >= 1, got {max_len!r}")
    itemsize = jnp.dtype(dtype or model_config.dtype).itemsize
    heads = model_config.num_key_value_heads
    if mesh is not None:
        shape = (model_config.num_hidden_layers, 1, max_len, heads, model_config.head_dim)
        spec = logical_to_mesh_spec(cache_logical_axes()["k"], mesh, DEFAULT_RULES if rules is None else rules,
                                    shape=shape)
        heads //= _axes_size(mesh, spec[3])
    per_tensor = model_config.num_hidden_layers * max_len * heads * model_config.head_dim * itemsize
    return 2 * per_tensor + jnp.dtype(jnp.int32).itemsize


def kv_bytes_per_chip(model_config: ModelConfig, rollout_config, rows: int, *, mesh, dtype=None, rules=None) -> int:
    """Bytes of a `rows`-row sampler cache of `rollout_config.max_context` slots on each chip of `mesh`:
    `rows / batch_shards` rows when the shards divide `rows`, every row (replicated) otherwise."""
    shards = batch_shards(mesh, rules)
    rows_per_chip = rows // shards if rows % shards == 0 else rows
    return rows_per_chip * kv_bytes_per_row(model_config, rollout_config.max_context, mesh=mesh, dtype=dtype,
                                            rules=rules)


def rows_within_budget(model_config: ModelConfig, rollout_config, *, mesh, rows: int | None = None,
                       budget_gib: float | None = None, dtype=None, rules=None) -> int:
    """How many rollout rows the sampler's cache holds at once under `rollout_config.kv_budget_gib` per chip.

    Without `rows`: the most rows that fit, a multiple of the batch shards (so rows split evenly over the chips).
    With `rows` (the rows a step wants, prompts x group_size): `rows` when they all fit at once (including a count
    the shards do not divide, which every chip then holds in full), else the most, fewer than `rows`, that fit:
    a multiple of the shards, or (when that is larger) a count small enough for every chip to hold in full.
    An unbounded budget (None) needs `rows` and returns it.

    Args:
      model_config: the policy's config.
      rollout_config: a `RolloutConfig` (its `max_context` and `kv_budget_gib`).
      mesh: the rollout's mesh (None: one device).
      rows: the rows wanted (None: the capacity of the budget).
      budget_gib: a budget in GiB per chip instead of `rollout_config.kv_budget_gib` (`trace-jax plan`'s flag).
      dtype, rules: as for `kv_bytes_per_row`.

    Raises:
      ValueError: the budget does not hold one row per chip (the message gives the bytes one row needs), or the
        budget is None and `rows` is not given.
    """
    budget_gib = rollout_config.kv_budget_gib if budget_gib is None else budget_gib
    if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 1):
        raise ValueError(f"rows_within_budget: rows must be an int >= 1, got {rows!r}")
    if budget_gib is None:
        if rows is None:
            raise ValueError("rows_within_budget: RolloutConfig.kv_budget_gib is None (unbounded): every row runs at "
                             "once; pass rows=prompts x group_size to get that count")
        return rows
    if isinstance(budget_gib, bool) or not isinstance(budget_gib, (int, float)) or not 0 < budget_gib < float("inf"):
        raise ValueError(f"rows_within_budget: budget_gib must be a positive number of GiB per chip, got "
                         f"{budget_gib!r}")
    budget = budget_gib * GIB
    max_len = rollout_config.max_context
    if rows is not None and kv_bytes_per_chip(model_config, rollout_config, rows, mesh=mesh, dtype=dtype,
                                              rules=rules) <= budget:
        return rows
    per_row = kv_bytes_per_row(model_config, max_len, mesh=mesh, dtype=dtype, rules=rules)
    per_chip = int(budget // per_row)
    if per_chip < 1:
        enough = math.ceil(per_row / GIB * 1000) / 1000  # rounded up: a budget printed here always holds the row
        raise ValueError(f"RolloutConfig.kv_budget_gib = {budget_gib} GiB holds no row: one row of max_context = "
                         f"{max_len} takes {per_row} bytes ({per_row / GIB:.6g} GiB) of KV cache per chip; raise "
                         f"the budget to at least {enough:g} GiB or lower max_context")
    shards = batch_shards(mesh, rules)
    if rows is None:
        return per_chip * shards
    # Either a multiple of the shards (split evenly) or few enough rows to hold them all on every chip.
    return max(min(per_chip * shards, rows) // shards * shards, min(per_chip, rows))


def cache_bytes_per_device(cache) -> int:
    """The largest bytes the arrays of `cache` (a pytree, e.g. a `KVCache`) occupy on one device."""
    per_device: dict = collections.Counter()
    for leaf in jax.tree_util.tree_leaves(cache):
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    return max(per_device.values(), default=0)
