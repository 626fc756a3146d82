"""Outcome advantages: the group z-score of final rewards that GRPO, GSPO and TRACE all start from.

Two layouts share one implementation: groups on the last axis (`outcome_advantages`, rewards `[..., G]`) and a
flat batch with a group id per trajectory (`grouped_outcome_advantages`, what a rollout batch carries).
Knows nothing about turns, tokens or models.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from trace_jax.credit._checks import check_choice, check_float, check_int, check_rank, compute_dtype
from trace_jax.credit.config import STD_MODES


def group_moments(values, weights, group_id, num_groups: int, *, ddof: int = 0, per_column: bool = False):
    """Per-group weighted mean and variance, broadcast back to each row.

    Args:
      values: `[N, ...]` floats.
      weights: same shape as `values`, 1 for elements that count, 0 for padding.
      group_id: `[N]` int, the group of each row (`0 <= group_id < num_groups`).
      num_groups: static number of groups.
      ddof: 0 for the population variance, 1 for the sample variance.
      per_column: False pools every element of the group's rows; True keeps trailing positions apart
        (statistics per column across the group's rows).

    Returns:
      `(mean, var, count)` broadcastable against `values`: `[N, 1...]` pooled, `[N, ...]` per column;
      `count` is the number of counted elements. Groups whose count is `<= ddof` get variance 0.
    """
    reduce_axes = () if per_column else tuple(range(1, values.ndim))
    counted = weights != 0
    sums = jax.ops.segment_sum(jnp.sum(jnp.where(counted, values * weights, 0.0), axis=reduce_axes), group_id,
                               num_groups)
    counts = jax.ops.segment_sum(jnp.sum(weights, axis=reduce_axes), group_id, num_groups)
    mean_g = sums / jnp.maximum(counts, 1)
    expand = (slice(None),) + (None,) * len(reduce_axes)
    mean = mean_g[group_id][expand]
    sq = jnp.sum(jnp.where(counted, jnp.square(values - mean) * weights, 0.0), axis=reduce_axes)
    sq_g = jax.ops.segment_sum(sq, group_id, num_groups)
    var_g = jnp.where(counts > ddof, sq_g / jnp.maximum(counts - ddof, 1), 0.0)
    return mean, var_g[group_id][expand], counts[group_id][expand]


def standardize(values, mean, var, *, std: str, eps: float):
    """`(values - mean) / sqrt(var)` with the spec's guards: no division for `std="none"`, 0 where `sqrt(var) <= eps`."""
    centred = values - mean
    if std == "none":
        return centred
    sigma = jnp.sqrt(var)
    safe_sigma = jnp.where(sigma > eps, sigma, 1.0)
    return jnp.where(sigma > eps, centred / safe_sigma, 0.0)


def grouped_outcome_advantages(rewards, group_id, num_groups: int, *, std: str = "population", eps: float = 1e-6):
    """Group z-scored rewards for a flat batch (credit-spec section 1).

        mu_g = mean of R over group g;  sigma_g = sqrt(mean (R - mu_g)^2)   (ddof=1 for std="sample")
        A_i = (R_i - mu_g) / sigma_g  if sigma_g > eps  else 0;   std="none": A_i = R_i - mu_g (Dr.GRPO)

    Args:
      rewards: `[N]` float final rewards.
      group_id: `[N]` int in `[0, num_groups)`; trajectories of one prompt share an id, in any order.
      num_groups: static number of groups (groups with no member are allowed and ignored).
      std: `"population"` (default), `"sample"` or `"none"`.
      eps: sigma at or below this gives advantage 0 (zero-variance groups, groups of one).

    Returns:
      `[N]` advantages in float32 (or the input's wider float type).
    """
    check_rank("rewards", rewards, 1, "[N]")
    check_rank("group_id", group_id, 1, "[N]")
    check_float("rewards", rewards)
    check_int("group_id", group_id)
    check_choice("std", std, STD_MODES)
    if rewards.shape != group_id.shape:
        raise ValueError(f"rewards{rewards.shape} and group_id{group_id.shape} must have the same shape [N]")
    values = rewards.astype(compute_dtype(rewards))
    mean, var, _ = group_moments(values, jnp.ones_like(values), group_id, num_groups, ddof=1 if std == "sample" else 0)
    return standardize(values, mean, var, std=std, eps=eps)


def outcome_advantages(rewards, *, std: str = "population", eps: float = 1e-6):
    """Group z-scored rewards with the group on the last axis (credit-spec section 1).

    Args:
      rewards: `[..., G]` float; each slice along the last axis is one prompt's group of `G` trajectories.
      std: `"population"` (divide by G, default), `"sample"` (ddof=1) or `"none"` (Dr.GRPO: centre only).
      eps: a group whose sigma is `<= eps` (zero variance, or a group of one) gets advantage 0.

    Returns:
      `[..., G]` advantages, float32 (or wider if the input is wider).

    Example: `R = [1,0,0,0,1,0,0,0]` gives `[1.7321, -0.5774 x3, 1.7321, -0.5774 x3]`.
    """
    check_rank("rewards", rewards, tuple(range(1, 8)), "[..., G] with the group on the last axis")
    check_float("rewards", rewards)
    check_choice("std", std, STD_MODES)
    group_size = rewards.shape[-1]
    if group_size == 0:
        raise ValueError(f"rewards{rewards.shape}: empty group (G = 0); every prompt needs at least one trajectory")
    lead = rewards.shape[:-1]
    num_groups = math.prod(lead)
    flat = rewards.reshape(-1)
    group_id = jnp.repeat(jnp.arange(num_groups, dtype=jnp.int32), group_size)
    return grouped_outcome_advantages(flat, group_id, num_groups, std=std, eps=eps).reshape(rewards.shape)
