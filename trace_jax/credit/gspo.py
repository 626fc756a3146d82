"""GSPO's sequence-level importance ratio (credit-spec section 4). The clipped objective lives in `trace_jax.train`."""

from __future__ import annotations

import jax.numpy as jnp

from trace_jax.credit._checks import check_float, check_rank, compute_dtype


def gspo_sequence_ratio(logprobs, old_logprobs, mask):
    """Length-normalised sequence ratio `s_i = exp(mean_t (log pi(y_it) - log pi_old(y_it)))` over trained tokens.

    Args:
      logprobs: `[N, L]` float current-policy log-probs of the sampled tokens.
      old_logprobs: `[N, L]` float behaviour-policy log-probs of the same tokens.
      mask: `[N, L]`, nonzero on the trajectory's assistant tokens.

    Returns:
      `[N]` float32 ratios; a trajectory with no trained token gets 1.
    """
    check_rank("logprobs", logprobs, 2, "[N, L]")
    check_float("logprobs", logprobs)
    check_float("old_logprobs", old_logprobs)
    if not (logprobs.shape == old_logprobs.shape == mask.shape):
        raise ValueError(f"logprobs{logprobs.shape}, old_logprobs{old_logprobs.shape} and mask{mask.shape} "
                         "must have the same shape [N, L]")
    dtype = compute_dtype(logprobs, old_logprobs)
    weight = (mask != 0).astype(dtype)
    log_ratio = jnp.where(mask != 0, logprobs.astype(dtype) - old_logprobs.astype(dtype), 0.0)
    mean_log_ratio = jnp.sum(log_ratio, axis=1) / jnp.maximum(jnp.sum(weight, axis=1), 1.0)
    return jnp.exp(mean_log_ratio)
