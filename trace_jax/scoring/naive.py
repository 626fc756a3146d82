"""Naive answer scoring: one forward per prefix. The reference that tests and benchmarks compare the fork against.

For each state `k` the batch of prefixes `tokens[n, :b_k] + answer[n]` is run through the model with an ordinary
causal mask, each prefix cut to a bucketed length (so the work is about `sum_k (b_k + m)` tokens, as a researcher's
loop would spend). Nothing here is clever on purpose: it must be obviously right.

This module knows nothing about chat formats, tokenizers, credit or files.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import models
from trace_jax.models.config import ModelConfig


@functools.partial(jax.jit, static_argnames=("config", "logprob_chunk"))
def _prefix_answer_log_probs(params, sequences, starts, answer_tokens, *, config: ModelConfig, logprob_chunk: int):
    """sequences [N, P] = prefix + answer + padding; answer j sits at starts[n] + j. Returns log-probs [N, m]."""
    m = answer_tokens.shape[1]
    hidden = models.forward_hidden(config, params, sequences)
    predictor_index = starts[:, None] - 1 + jnp.arange(m)[None, :]  # hidden at i predicts token i + 1
    predictors = jnp.take_along_axis(hidden, predictor_index[:, :, None], axis=1)
    return models.hidden_logprobs(config, params, predictors, answer_tokens, chunk_size=logprob_chunk)


def _bucket(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def score_answer_prefixes_naive(config: ModelConfig, params, tokens, boundaries, num_states, answer_tokens,
                                answer_mask, *, lengths=None, logprob_chunk: int = 256, length_multiple: int = 64):
    """`score_answer_prefixes(..., method="naive")` on validated numpy inputs (see `fork.score_answer_prefixes`).

    One forward per state over the batch of prefixes `tokens[:, :b_k] + answer`, each cut to a multiple of
    `length_multiple` tokens; plus one full forward for the trajectory's own token log-probs.
    """
    from trace_jax.scoring.fork import PrefixScores

    tokens = np.asarray(tokens, np.int32)
    boundaries = np.asarray(boundaries, np.int32)
    num_states = np.asarray(num_states, np.int32)
    answer_tokens = np.asarray(answer_tokens, np.int32)
    weights = np.asarray(answer_mask).astype(np.float32)
    n, length = tokens.shape
    slots, m = boundaries.shape[1], answer_tokens.shape[1]
    scores = np.zeros((n, slots), np.float32)
    for state in range(slots):
        if not np.any(num_states > state):
            break
        # Every row runs (fewer compiled shapes); rows without this state get a dummy prefix and are discarded.
        rows = np.arange(n)
        valid = num_states > state
        starts = np.where(valid, boundaries[:, state], 1)
        width = _bucket(int(starts.max()) + m, length_multiple)
        sequences = np.zeros((rows.size, width), np.int32)
        for i, row in enumerate(rows):
            start = int(starts[i])
            sequences[i, :start] = tokens[row, :start]
            sequences[i, start:start + m] = answer_tokens[row]
        log_probs = np.asarray(_prefix_answer_log_probs(params, sequences, starts, answer_tokens, config=config,
                                                        logprob_chunk=logprob_chunk))
        state_scores = (log_probs * weights).sum(axis=1) / weights.sum(axis=1)
        scores[:, state] = np.where(valid, state_scores, 0.0)
    token_lp = models.token_logprobs(config, params, jnp.asarray(tokens), chunk_size=logprob_chunk)
    if lengths is not None:
        keep = np.arange(length)[None, :] < (np.asarray(lengths)[:, None] - 1)
        token_lp = jnp.where(keep, token_lp, 0.0)
    return PrefixScores(jnp.asarray(scores), token_lp)
