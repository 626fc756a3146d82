"""The retry schedule of ABC's endpoint callers (the LLM judge and the clue-recovery agent): exponential backoff
with jitter, never shorter than the server's `Retry-After`, inside an overall deadline per call.

Jitter ("equal jitter": a delay drawn uniformly from [d/2, d]) keeps the parallel steps of a trajectory from
retrying in lockstep against a server that is already overloaded. A `Retry-After` longer than what is left of the
deadline ends the retries at once rather than sleeping past it.

This module knows time and randomness; it knows nothing about HTTP, rubrics or clues.
"""

from __future__ import annotations

import random
import time


def retry_delay(retry: int, *, backoff_s: float, backoff_max_s: float, retry_after: float | None = None,
                rng: random.Random | None = None) -> float:
    """Seconds to sleep before retry number `retry` (1 for the first retry).

    `min(backoff_s * 2**(retry - 1), backoff_max_s)` drawn down to as little as half at random, and never less than
    `retry_after` (the server's `Retry-After`, which is honoured even above `backoff_max_s`)."""
    if retry < 1:
        raise ValueError(f"retry counts from 1 (the first retry), got {retry}")
    ceiling = min(backoff_s * 2 ** (retry - 1), backoff_max_s)
    delay = ceiling * (0.5 + 0.5 * (rng or random).random())
    return max(delay, retry_after or 0.0)


class Deadline:
    """An overall time limit, started at construction (`time.monotonic`)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        return self.remaining() <= 0.0
