"""The rollout's KV budget: bytes a row's cache takes, and the pages a per-chip budget gives the engine's pool on a
mesh."""

import dataclasses

import jax
import pytest

from trace_jax import models
from trace_jax.rollout import RolloutConfig, budget
from trace_jax.rollout import paged as paged_lib
from trace_jax.rollout.engine import pool_pages

GIB = 1024**3


def mesh_of(**sizes):
    axes = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1, **sizes}
    return jax.sharding.AbstractMesh(tuple(axes.values()), tuple(axes))


def test_a_qwen3_4b_row_at_48k_tokens_in_bfloat16_takes_6_75_gib():
    # 2 (k, v) x 36 layers x 49152 tokens x 8 kv heads x 128 dims x 2 bytes, and the row's int32 length
    config = models.get_preset("qwen3-4b").replace(dtype="bfloat16")
    assert budget.kv_bytes_per_row(config, 49152) == 2 * 36 * 49152 * 8 * 128 * 2 + 4
    assert budget.kv_bytes_per_row(config, 49152) == int(6.75 * GIB) + 4


@pytest.mark.parametrize("tensor", [1, 2])
def test_a_budget_gives_whole_pages_per_chip_over_the_batch_shards_with_kv_heads_over_tensor(tensor):
    config = models.get_preset("qwen3-4b").replace(dtype="bfloat16")
    page = 2 * 36 * 16 * (8 // tensor) * 128 * 2  # a 16-token page's k and v, its kv heads split over tensor
    mesh = mesh_of(fsdp=8 // tensor, tensor=tensor)
    assert paged_lib.page_bytes(config, 16, mesh=mesh) == page
    assert paged_lib.pages_within_budget(config, 16, 14.0, mesh=mesh) == int(14.0 * GIB // page) * (8 // tensor)


def test_a_budget_below_one_row_is_refused_naming_the_field_and_the_pages_a_row_needs():
    config = models.get_preset("qwen3-4b").replace(dtype="bfloat16")
    rollout = RolloutConfig(max_context=49152, kv_budget_gib=6.0)
    pages = int(6.0 * GIB // paged_lib.page_bytes(config, 16))
    with pytest.raises(ValueError, match=rf"RolloutConfig.kv_budget_gib = 6.0 gives a pool of {pages} pages of 16 "
                                         rf"tokens; one row of max_context = 49152 needs 3072: raise it"):
        pool_pages(config, rollout, rollout.paged, 8)
    # pages split over 8 batch shards: the pool holds 8 chips' budgets, more than the row, but a row's pages lie on
    # one shard (the kernel path runs it there), so each chip's budget must hold one
    with pytest.raises(ValueError, match=rf"gives a pool of {8 * pages} pages of 16 tokens over 8 batch shards, "
                                         rf"{pages} a shard; a row's pages lie on one shard and one row of "
                                         rf"max_context = 49152 needs 3072: raise it \(to 24576 pages at least\)"):
        pool_pages(config, rollout, rollout.paged, 8, mesh=mesh_of(fsdp=8))
    enough = dataclasses.replace(rollout, kv_budget_gib=6.8)  # configs/qwen3_4b.gin's: 3094 pages a chip
    assert pool_pages(config, enough, rollout.paged, 8, mesh=mesh_of(fsdp=8)) == 8 * 3094


def test_without_a_budget_the_pool_holds_every_rows_max_context():
    config = models.get_preset("qwen3-4b").replace(dtype="bfloat16")
    rollout = RolloutConfig(max_context=4096)
    assert pool_pages(config, rollout, rollout.paged, 8) == 8 * 4096 // 16
