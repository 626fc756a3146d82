"""The rollout's KV budget: bytes a row's cache takes, and the rows a per-chip budget holds on a mesh."""

import re

import jax
import pytest

from trace_jax import models
from trace_jax.rollout import RolloutConfig, budget

GIB = 1024**3


def mesh_of(**sizes):
    axes = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1, **sizes}
    return jax.sharding.AbstractMesh(tuple(axes.values()), tuple(axes))


def test_a_qwen3_4b_row_at_48k_tokens_in_bfloat16_takes_6_75_gib():
    # 2 (k, v) x 36 layers x 49152 tokens x 8 kv heads x 128 dims x 2 bytes, and the row's int32 length
    config = models.get_preset("qwen3-4b").replace(dtype="bfloat16")
    assert budget.kv_bytes_per_row(config, 49152) == 2 * 36 * 49152 * 8 * 128 * 2 + 4
    assert budget.kv_bytes_per_row(config, 49152) == int(6.75 * GIB) + 4


def test_rows_within_budget_are_whole_rows_per_batch_shard_with_kv_heads_over_tensor():
    config = models.get_preset("qwen3-4b").replace(dtype="bfloat16")
    rollout = RolloutConfig(max_context=49152)
    assert budget.rows_within_budget(config, rollout, mesh=mesh_of(fsdp=8), budget_gib=14.0) == 16  # 2 a chip
    # 8 kv heads over tensor=2: half a row's cache per chip, so twice the rows per chip, over 4 batch shards
    assert budget.rows_within_budget(config, rollout, mesh=mesh_of(fsdp=4, tensor=2), budget_gib=14.0) == 16
    assert budget.kv_bytes_per_chip(config, rollout, 16, mesh=mesh_of(fsdp=4, tensor=2)) == int(13.5 * GIB) + 4 * 4  # 4 rows a chip


def test_a_budget_below_one_row_or_none_at_all_is_an_error_naming_the_field():
    config = models.get_preset("qwen3-4b").replace(dtype="bfloat16")
    with pytest.raises(ValueError, match=r"kv_budget_gib = 6.0 GiB holds no row: .*6.75 GiB"):
        budget.rows_within_budget(config, RolloutConfig(max_context=49152), mesh=mesh_of(fsdp=8), budget_gib=6.0)
    # just under one row: the budget the message proposes holds the row (no "6.75 GiB > 6.75 GiB" reading)
    row = budget.kv_bytes_per_row(config, 49152, mesh=mesh_of(fsdp=8)) / GIB
    with pytest.raises(ValueError, match=r"raise the budget to at least ([\d.]+) GiB") as error:
        budget.rows_within_budget(config, RolloutConfig(max_context=49152), mesh=mesh_of(fsdp=8),
                                  budget_gib=row * (1 - 1e-9))
    proposed = float(re.search(r"at least ([\d.]+) GiB", str(error.value)).group(1))
    assert budget.rows_within_budget(config, RolloutConfig(max_context=49152), mesh=mesh_of(fsdp=8),
                                     budget_gib=proposed) >= 1
    with pytest.raises(ValueError, match=r"kv_budget_gib is None \(unbounded\)"):
        budget.rows_within_budget(config, RolloutConfig(max_context=49152), mesh=mesh_of(fsdp=8))
