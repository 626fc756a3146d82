"""Outcome advantages: std modes, zero-variance groups, groups of one, grouped == axis layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import credit
from trace_jax.credit.reference import outcome_advantages_ref


@pytest.mark.parametrize("std", ["population", "sample", "none"])
def test_matches_numpy_reference_on_random_groups(std):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(7, 5)).astype(np.float32)
    got = credit.outcome_advantages(jnp.asarray(rewards), std=std)
    want = np.stack([outcome_advantages_ref(row, std=std) for row in rewards])
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_zero_variance_group_gives_zero():
    adv = credit.outcome_advantages(jnp.ones((2, 4)))
    np.testing.assert_array_equal(adv, np.zeros((2, 4)))


@pytest.mark.parametrize("std", ["population", "sample", "none"])
def test_group_of_one_gives_zero(std):
    np.testing.assert_array_equal(credit.outcome_advantages(jnp.array([[3.0], [-1.0]]), std=std), [[0.0], [0.0]])


def test_dr_grpo_only_centres():
    np.testing.assert_allclose(credit.outcome_advantages(jnp.array([2.0, 0.0, 1.0]), std="none"), [1.0, -1.0, 0.0])


def test_grouped_layout_with_shuffled_ids_equals_axis_layout():
    rng = np.random.default_rng(1)
    rewards = rng.integers(0, 2, size=(4, 8)).astype(np.float32)
    axis_form = np.asarray(credit.outcome_advantages(jnp.asarray(rewards)))
    order = rng.permutation(32)
    group_id = np.repeat(np.arange(4), 8)[order]
    flat = credit.grouped_outcome_advantages(jnp.asarray(rewards.reshape(-1)[order]), jnp.asarray(group_id), 4)
    np.testing.assert_allclose(flat, axis_form.reshape(-1)[order], atol=1e-6)


def test_empty_group_axis_raises():
    with pytest.raises(ValueError, match="empty group"):
        credit.outcome_advantages(jnp.zeros((3, 0)))


def test_unknown_std_mode_raises():
    with pytest.raises(ValueError, match="std='mad'"):
        credit.outcome_advantages(jnp.zeros((4,)), std="mad")


def test_jit_and_bfloat16():
    rewards = jnp.array([1.0, 0.0, 0.5, 0.25])
    eager = credit.outcome_advantages(rewards)
    np.testing.assert_allclose(jax.jit(credit.outcome_advantages)(rewards), eager, rtol=1e-6)  # fusion may move 1 ulp
    bf16 = credit.outcome_advantages(rewards.astype(jnp.bfloat16))
    assert bf16.dtype == jnp.float32
    np.testing.assert_allclose(bf16, eager, atol=1e-6)  # these rewards are exact in bfloat16
