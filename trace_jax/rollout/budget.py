"""The rollout's KV-cache budget: the bytes a row of cache takes on a chip, the rule the page pool is sized by.

A row of `max_len` tokens is `k` and `v`, each `[layers, max_len, kv_heads, head_dim]` in the cache dtype, plus its
int32 length. On a mesh kv heads go over `tensor` (the cache's logical axes under the sharding rules); a dimension
its mesh axes do not divide is replicated. So one row costs a chip `2 x layers x max_len x (kv_heads / tensor) x
head_dim x itemsize + 4` bytes when `tensor` divides the kv heads, and the full heads otherwise. The paged engine's
pool is a number of pages of `page_size` tokens (`paged.page_bytes`, `paged.pages_within_budget`: how many fit
under `RolloutConfig.kv_budget_gib` per chip, pages over the `batch_shards`); `trace-jax plan` reports the same.

This module knows nothing about tokens, tools or sampling; only shapes, dtypes and the mesh.
"""

from __future__ import annotations

import math

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
    """How many ways the rollout splits its cache (the pool's pages) on `mesh`: the product of the batch axes'
    sizes; 1 without a mesh. A count this does not divide is replicated on every chip instead."""
    if mesh is None:
        return 1
    spec = logical_to_mesh_spec(cache_logical_axes()["lengths"], mesh, DEFAULT_RULES if rules is None else rules)
    return _axes_size(mesh, spec[0])


def kv_bytes_per_row(model_config: ModelConfig, max_len: int, *, mesh=None, dtype=None, rules=None) -> int:
    """Bytes of one row's KV cache (k, v and its length) on one chip, for rows of `max_len` slots.

    Args:
      model_config: the policy's config (layers, kv heads, head dim; `dtype` defaults to its compute dtype, the
        cache dtype the engine's pool uses).
      max_len: cache slots per row (`RolloutConfig.max_context`).
      mesh: the rollout's mesh; kv heads are split over the axes the rules give `kv_heads` (`tensor`) when they
        divide them. None: one device.
      dtype: the cache dtype (default `model_config.dtype`).
      rules: the sharding rules of the rollout's cache (default `models.DEFAULT_RULES`).
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
