"""Synthetic `LossBatch`es of a given shape, for benchmarks, ahead-of-time memory checks and tests.

The rows look like agent trajectories: a prompt that is not trained, then generated tokens with advantages and
behaviour log-probs near the model's scale. This module knows nothing about models or rollouts.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from trace_jax.train.loss import LossBatch


def synthetic_batch(vocab_size: int, rows: int, length: int, *, seed: int = 0, prompt_fraction: float = 0.25,
                    with_reference: bool = False) -> LossBatch:
    """A random `LossBatch` with `rows x length` tokens; the first `prompt_fraction` of each row is prompt
    (mask 0), the rest is trained with random lengths, per-token advantages ~ N(0, 1) and behaviour log-probs
    ~ -log(vocab_size) + noise."""
    rs = np.random.RandomState(seed)
    tokens = rs.randint(0, vocab_size, (rows, length)).astype(np.int32)
    prompt = max(1, int(length * prompt_fraction))
    ends = rs.randint(prompt + 1, length + 1, rows)
    mask = ((np.arange(length)[None, :] >= prompt) & (np.arange(length)[None, :] < ends[:, None]))
    scale = -np.log(vocab_size)
    behaviour = (scale + 0.3 * rs.randn(rows, length)) * mask
    reference = (scale + 0.3 * rs.randn(rows, length)) * mask if with_reference else None
    f = lambda a: None if a is None else jnp.asarray(a, jnp.float32)  # noqa: E731
    return LossBatch(tokens=jnp.asarray(tokens),
                     positions=jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length)),
                     loss_mask=f(mask), advantages=f(rs.randn(rows, length) * mask),
                     behaviour_logprobs=f(behaviour), reference_logprobs=f(reference))
