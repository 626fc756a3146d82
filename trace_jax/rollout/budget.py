"""The rollout's KV-cache budget: bytes one row's cache takes, and how many rows run at once under a per-chip budget.

A row's cache holds keys and values for every layer at `RolloutConfig.max_context` tokens:

    kv_bytes_per_row = 2 (k, v) x layers x max_context x kv_heads x head_dim x bytes of the cache dtype

(Qwen3-4B at 48K tokens in bfloat16: 36 x 49152 x 8 x 128 x 2 x 2 = 6.75 GiB.) On a mesh the sampler splits rows
over the batch axes (`data`, `fsdp`, `expert`) and kv heads over `tensor` where they divide
(`sampler.state_shardings`), so a chip holds `rows / batch shards` rows of `1 / tensor` of their heads each.

`rows_within_budget` is what the rollout driver admits at once and what `trace-jax plan` compiles the rollout
programs for. This module knows the model's shape and the mesh, nothing about tools, prompts or the driver.
"""

from __future__ import annotations

import math

import numpy as np

from trace_jax.models.config import ModelConfig

GIB = 1024**3


def kv_bytes_per_row(model_config: ModelConfig, rollout_config, *, cache_dtype=None) -> int:
    """Bytes of one row's keys and values over every layer at `rollout_config.max_context` tokens, in
    `cache_dtype` (default: the model's compute dtype, as `sampler.init_state` allocates it)."""
    itemsize = np.dtype(cache_dtype or model_config.dtype).itemsize
    return (2 * model_config.num_hidden_layers * rollout_config.max_context * model_config.num_key_value_heads
            * model_config.head_dim * itemsize)


def _mesh_sizes(mesh) -> dict[str, int]:
    return {name: int(size) for name, size in dict(mesh.shape).items()}


def batch_shards(mesh) -> int:
    """Chips a rollout row count is split over: the product of the batch axes (`data`, `fsdp`, `expert`)."""
    sizes = _mesh_sizes(mesh)
    return math.prod(sizes.get(axis, 1) for axis in ("data", "fsdp", "expert"))


def kv_bytes_per_chip(model_config: ModelConfig, rollout_config, rows: int, *, mesh, cache_dtype=None) -> int:
    """Bytes of `rows` rows' caches on one chip of `mesh` (rows over the batch axes, rounded up; kv heads over
    `tensor` when they divide)."""
    tensor = _mesh_sizes(mesh).get("tensor", 1)
    head_split = tensor if model_config.num_key_value_heads % tensor == 0 else 1
    per_row = kv_bytes_per_row(model_config, rollout_config, cache_dtype=cache_dtype) // head_split
    return -(-rows // batch_shards(mesh)) * per_row


def rows_within_budget(model_config: ModelConfig, rollout_config, *, mesh, budget_gib: float | None = None,
                       cache_dtype=None) -> int:
    """Rollout rows whose caches fit in a per-chip budget of `budget_gib` GiB (default:
    `rollout_config.kv_budget_gib`), as a multiple of the mesh's batch shards (every chip holds as many rows).

    Raises ValueError when no budget is set or when not even one row per batch shard fits (the message gives the
    smallest budget that does).
    """
    if budget_gib is None:
        budget_gib = getattr(rollout_config, "kv_budget_gib", 0.0)
    if not budget_gib or budget_gib <= 0:
        raise ValueError("rows_within_budget needs a KV budget: set RolloutConfig.kv_budget_gib (GiB per chip) or "
                         "pass budget_gib")
    one = kv_bytes_per_chip(model_config, rollout_config, 1, mesh=mesh, cache_dtype=cache_dtype)
    per_chip = int(budget_gib * GIB) // one
    if per_chip < 1:
        raise ValueError(f"a KV budget of {budget_gib:g} GiB per chip holds no row of {rollout_config.max_context} "
                         f"tokens ({one / GIB:.2f} GiB per chip each): raise RolloutConfig.kv_budget_gib to at least "
                         f"{math.ceil(100 * one / GIB) / 100:g}, shorten RolloutConfig.max_context, or split kv heads "
                         "over a `tensor` mesh axis")
    return per_chip * batch_shards(mesh)
