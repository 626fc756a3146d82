"""Reference answer scoring for TRACE: the gold answer's mean log-prob after every state boundary, in one pass.

    score_answer_prefixes     fork (packed or cached-prefix layout) or naive; answer_scores [N, T+1] + token log-probs
    PrefixScores              its result (answer_scores, token_logprobs)
    choose_layout, bucket_size, packed_length, validate_scoring_inputs, compiled_memory   helpers

`trace-jax credit` (trace_jax.scoring.cli) applies it to JSONL trajectories in the OpenAI chat format and writes
TRACE credit, HTML receipts and a summary plot. See docs/scoring.md.

This package knows the model API and the credit API; it knows nothing about rollouts, training, environments or
ABC (`trace_jax.abc` sits above it: the `trace-jax` dispatcher composes ABC step counts into `trace-jax credit`).
"""

from trace_jax.scoring.fork import (
    DEFAULT_PACKED_MAX_LEN,
    DEFAULT_PACKED_MAX_TOKENS,
    LAYOUTS,
    METHODS,
    PrefixScores,
    bucket_size,
    choose_layout,
    compiled_memory,
    packed_length,
    score_answer_prefixes,
    validate_scoring_inputs,
)
from trace_jax.scoring.naive import score_answer_prefixes_naive

__all__ = [
    "DEFAULT_PACKED_MAX_LEN", "DEFAULT_PACKED_MAX_TOKENS", "LAYOUTS", "METHODS", "PrefixScores", "bucket_size",
    "choose_layout", "compiled_memory", "packed_length", "score_answer_prefixes", "score_answer_prefixes_naive",
    "validate_scoring_inputs",
]
