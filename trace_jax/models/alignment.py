"""The one alignment convention for per-token log-probs, and the conversions to and from it.

Token-aligned (the project's convention; `TrajectoryBatch.sampler_logprobs`, `train.LossBatch`, the trainer):
    index t holds log p(tokens[t] | tokens[:t]); index 0 (no context) holds 0.
Next-token aligned (what a forward pass produces; `models.token_logprobs` with default targets, the scorer's
`PrefixScores.token_logprobs`):
    index t holds log p(tokens[t + 1] | tokens[:t + 1]); the last index (no next token) holds 0.

The same conversions apply to any per-position quantity of the predicted distribution (e.g. its entropy).
This module knows nothing about models; it only shifts `[..., L]` arrays along their last axis.
"""

from __future__ import annotations

import jax.numpy as jnp


def to_token_aligned(next_token_values):
    """Next-token aligned `[..., L]` -> token-aligned `[..., L]`: `out[..., t] = x[..., t - 1]`, `out[..., 0] = 0`.

    The last input column (a prediction past the sequence) is dropped.
    """
    x = jnp.asarray(next_token_values)
    return jnp.concatenate([jnp.zeros_like(x[..., :1]), x[..., :-1]], axis=-1)


def to_next_token_aligned(token_aligned_values):
    """Token-aligned `[..., L]` -> next-token aligned `[..., L]`: `out[..., t] = x[..., t + 1]`, `out[..., -1] = 0`.

    The first input column (token 0, which has no context) is dropped.
    """
    x = jnp.asarray(token_aligned_values)
    return jnp.concatenate([x[..., 1:], jnp.zeros_like(x[..., :1])], axis=-1)
