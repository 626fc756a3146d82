"""The step-scorer interface of ABC: one trajectory's steps and its question's clue chain in, one count record per
step out.

A *step* is one assistant turn (reasoning + tool call) with the tool response it received; the last step of an
answered trajectory is the answer turn and has no observation (credit-spec.md section 3). A scorer returns, for every
step, the counts of the rubric: `n_found` (gold clues discovered or verified in the step), `n_excluded` (wrong
candidates correctly ruled out), `n_rejected` (gold clues wrongly rejected) and `ans` (+1 correct final answer, -1
wrong, 0 no answer in this step; the last step of a trajectory that ended without an answer gets the scorer's
`no_answer`, -1 by default), plus `tool_error` (the step's tool call failed; with the scorer's `error_step = 0`,
the default, such a step scores the rubric's floor). `trace_jax.credit.abc_step_rewards` turns counts into rewards.

Implementations: a rule-based scorer for generated tasks, whose clue chain is known exactly, and an LLM judge for
external tasks. Both take the same inputs and return the same records, so the trainer's ABC-GRPO and ABC-SFT modes
take either by config. This module knows nothing about models, tokenizers, HTTP or the environment's internals:
clues are `trace_jax.envs.tasks.Clue` records (docid, entity, relation, value, kind) passed through unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a trajectory as text.

    Attributes:
      assistant: the assistant's text of the turn (reasoning, tool call or final answer), as generated.
      observation: the tool response the turn received; None for the answer turn (and for a turn cut off).
      tool_call: the parsed call as `(name, arguments)`, or None (answer turn, or a call that did not parse).
      docid: the document the observation shows, when the environment knows it (lets a scorer require that a clue
        was read on its own page); None otherwise.
    """

    assistant: str
    observation: str | None = None
    tool_call: tuple[str, dict[str, Any]] | None = None
    docid: str | None = None


@dataclasses.dataclass(frozen=True)
class StepCounts:
    """The rubric's counts for one step, plus an audit flag.

    `tool_error` marks a step whose tool call failed, scored at the rubric's floor (`abc_step_rewards` subtracts
    its `w_error`; a scorer sets it only under `error_step = 0`, and leaves that step's other counts 0).
    `flagged` marks a record the scorer could not produce normally (for example malformed judge output that fell
    back to neutral); `note` says why. A neutral step (all counts 0) has reward 1.0.
    """

    n_found: int = 0
    n_excluded: int = 0
    n_rejected: int = 0
    ans: int = 0
    flagged: bool = False
    note: str = ""
    tool_error: bool = False

    def __post_init__(self):
        for name in ("n_found", "n_excluded", "n_rejected"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"StepCounts.{name} must be a non-negative int, got {value!r}")
        if self.ans not in (-1, 0, 1):
            raise ValueError(f"StepCounts.ans must be -1 (wrong answer), 0 (no answer) or +1 (correct), got {self.ans!r}")
        if not isinstance(self.tool_error, (bool, np.bool_)):
            raise ValueError(f"StepCounts.tool_error must be True or False, got {self.tool_error!r}")


@dataclasses.dataclass(frozen=True)
class ScoredStep:
    """A step and its counts, as written to receipts and JSONL."""

    step: Step
    counts: StepCounts


@runtime_checkable
class StepScorer(Protocol):
    """Anything that scores the steps of one trajectory against a question's clue chain."""

    name: str

    def score(self, *, question: str, gold: Sequence[str], clues: Sequence[Any],
              steps: Sequence[Step]) -> list[StepCounts]:
        """One `StepCounts` per step, in order (`len(result) == len(steps)`).

        Args:
          question: the question text.
          gold: the gold answer followed by its aliases.
          clues: the question's clue chain (`trace_jax.envs.tasks.Clue` records; `kind` "support" or "exclude").
          steps: the trajectory's steps; the last one carries the final answer when the trajectory answered.
        """
        ...


def counts_to_arrays(per_trajectory: Sequence[Sequence[StepCounts]], num_steps_max: int | None = None) -> dict[str, np.ndarray]:
    """Pack per-trajectory counts into padded arrays for `trace_jax.credit.abc_step_rewards`.

    Returns a dict with `n_found`, `n_excluded`, `n_rejected`, `ans`, `tool_error` (int32 `[N, S]`, zero-padded),
    `num_steps` (int32 `[N]`) and `flagged` (bool `[N, S]`). `S` is `num_steps_max` or the longest trajectory (at least 1).
    """
    longest = max((len(steps) for steps in per_trajectory), default=0)
    width = max(1, longest if num_steps_max is None else num_steps_max)
    if longest > width:
        raise ValueError(f"counts_to_arrays: a trajectory has {longest} steps, more than num_steps_max={width}")
    n = len(per_trajectory)
    names = ("n_found", "n_excluded", "n_rejected", "ans", "tool_error")
    out = {name: np.zeros((n, width), np.int32) for name in names}
    out["flagged"] = np.zeros((n, width), bool)
    out["num_steps"] = np.array([len(steps) for steps in per_trajectory], np.int32)
    for row, steps in enumerate(per_trajectory):
        for col, counts in enumerate(steps):
            for name in names:
                out[name][row, col] = getattr(counts, name)
            out["flagged"][row, col] = counts.flagged
    return out
