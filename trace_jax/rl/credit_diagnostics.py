"""Credit diagnostics of one RL step: does an estimator's credit mark detours, follow progress, teach flat groups?

Computed from the step's scored rollouts (`pipeline.RLPipeline.step_metrics` logs them to `metrics.jsonl`; `trace-jax
study` averages them into `results.json`). Definitions (docs/credit.md, "Credit diagnostics"):

  * **turn credit** of tool turn `k` of a row: the mean advantage over that turn's trained tokens (what the update
    gives the tokens that emitted tool call `k+1`), for every estimator: GRPO's is the outcome advantage, TRACE's
    `alpha_out * A_out + alpha_turn * r_k`.
  * **on-path / detour** (`path_marks`): a `search` turn is on the path when its query names an entity or a value of
    the task's clue chain; any other tool turn (`open`, `find`, a scroll) is on the path when its observation shows
    a page of the chain (the page title is a clue's entity). Every other tool turn is a detour: a search for
    something off the chain, a page off the chain, a search-results page reopened, a call that did not parse or
    that the browser refused. Rows of tasks whose chain names no entity (external tasks) are left out.
  * **progress gain** of a turn: the share of the chain's clues that the turn's observation reveals for the first
    time, on the clue's own page: the oracle's progress measure (`envs.oracle.OracleResult.clue_progress`, clues
    confirmed / clues) as a per-turn difference, with the reveal rule of ABC's rule-based scorer
    (`abc.rules.RuleBasedStepScorer`, which counts it).
  * **credit/progress Spearman**: the rank correlation of turn credit with progress gain over every tool turn of
    the step's rows (average ranks for ties; NaN when either side is constant).
  * **zero-signal groups taught**: of the prompt groups whose rewards are all equal (group std <= `std_eps`, where
    GRPO's advantage is 0), the share in which some trained token still gets a non-zero advantage.

A step's metric with nothing to average over (no detour turn in the step, no zero-signal group) is left out of
`credit_diagnostics`'s dict (never logged as 0), so averages over steps count only the steps where it is defined.

This module knows episodes' tool calls and observations, clue chains and the credit layout (`turn_index`,
`loss_mask`); it knows nothing about models, the update or run directories.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from trace_jax.abc.rules import RuleBasedStepScorer, clues_from_records, observation_page, steps_from_episode


# The metrics `credit_diagnostics` leaves out of a step where they are undefined.
OPTIONAL_METRICS = ("credit/detour_turn_credit", "credit/on_path_turn_credit", "credit/detour_turn_share",
                    "credit/progress_spearman", "zero_signal_groups_with_turn_credit")


def path_marks(episode: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """`(on_path bool [T], progress_gain float64 [T])` of an episode's `T` tool turns (see the module docstring);
    None when its task has no clue chain with entities to judge against.

    `episode` is a rollout `EpisodeRecord` (`tool_calls`, `observations`, `turn_texts`, `clues`).
    """
    chain = clues_from_records(episode.clues)
    entities = {c.entity for c in chain if c.entity}
    if not entities:
        return None
    names = [name.lower() for name in entities | {c.value for c in chain if c.value}]
    num_tool_turns = len(episode.observations)
    on_path = np.zeros(num_tool_turns, bool)
    for k in range(num_tool_turns):
        call = episode.tool_calls[k] if k < len(episode.tool_calls) else None
        if isinstance(call, tuple) and call[0] == "search":
            query = str(call[1].get("query", "")).lower() if isinstance(call[1], dict) else ""
            on_path[k] = any(name in query for name in names)
        elif isinstance(call, tuple):
            title, _ = observation_page(episode.observations[k])
            on_path[k] = title in entities
    steps = steps_from_episode(episode)
    counts = RuleBasedStepScorer().score(question=episode.question, gold=episode.gold, clues=chain, steps=steps)
    gain = np.asarray([c.n_found + c.n_excluded for c in counts[:num_tool_turns]], np.float64) / len(chain)
    return on_path, np.pad(gain, (0, num_tool_turns - len(gain)))


def progress_gains(episodes: Sequence[Any], num_slots: int) -> np.ndarray:
    """float32 `[E, num_slots]`: each episode's progress gain per tool turn (`path_marks`), 0 past its tool turns and
    for an episode whose task has no clue chain to judge against (the `oracle_progress` estimator's input)."""
    out = np.zeros((len(episodes), num_slots), np.float32)
    for row, episode in enumerate(episodes):
        marks = path_marks(episode)
        if marks is not None:
            gain = marks[1][:num_slots]
            out[row, :len(gain)] = gain
    return out


def turn_credit(token_advantages: np.ndarray, loss_mask: np.ndarray, turn_index: np.ndarray,
                num_turns_max: int) -> np.ndarray:
    """float64 `[N, num_turns_max]`: the mean advantage over each turn's trained tokens (`loss_mask > 0` and
    `turn_index == k`); NaN for a turn without trained tokens. Inputs `[N, L]`."""
    advantages = np.asarray(token_advantages, np.float64)
    trained = np.asarray(loss_mask) > 0
    turn_index = np.asarray(turn_index)
    if advantages.shape != trained.shape or advantages.shape != turn_index.shape or advantages.ndim != 2:
        raise ValueError(f"turn_credit: token_advantages {advantages.shape}, loss_mask {trained.shape} and turn_index "
                         f"{turn_index.shape} must be the same [N, L]")
    out = np.full((advantages.shape[0], num_turns_max), np.nan)
    for k in range(num_turns_max):
        where = trained & (turn_index == k)
        count = where.sum(axis=1)
        total = np.where(where, advantages, 0.0).sum(axis=1)
        out[:, k] = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation of two equal-length samples (average ranks for ties); NaN with fewer than two
    points or when either sample is constant."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"spearman: x {x.shape} and y {y.shape} must be 1-D and of one length")
    if x.size < 2:
        return float("nan")
    rx, ry = _average_ranks(x), _average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = np.sqrt((rx * rx).sum() * (ry * ry).sum())
    return float((rx * ry).sum() / denominator) if denominator > 0 else float("nan")


def _average_ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    ranks = np.empty(values.size, np.float64)
    ranks[order] = np.arange(values.size, dtype=np.float64)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


def zero_signal_taught(rewards: np.ndarray, token_advantages: np.ndarray, loss_mask: np.ndarray, num_prompts: int,
                       std_eps: float) -> tuple[float, float]:
    """`(share of zero-signal groups, share of those in which some trained token has a non-zero advantage)`.

    Rows are `num_prompts` groups of equal size, group-major (the pipeline's layout); a group is zero-signal when
    the population std of its rewards is <= `std_eps`. The second share is NaN when no group is zero-signal."""
    rewards = np.asarray(rewards, np.float64)
    if rewards.ndim != 1 or num_prompts < 1 or rewards.size % num_prompts:
        raise ValueError(f"zero_signal_taught: {rewards.shape} rewards do not split into {num_prompts} equal groups")
    zero = rewards.reshape(num_prompts, -1).std(axis=1) <= std_eps
    nonzero = (np.abs(np.asarray(token_advantages, np.float64)) * (np.asarray(loss_mask) > 0) > 0).any(axis=1)
    taught = nonzero.reshape(num_prompts, -1).any(axis=1)
    return float(zero.mean()), (float((zero & taught).sum() / zero.sum()) if zero.any() else float("nan"))


def credit_diagnostics(episodes: Sequence[Any], token_advantages: np.ndarray, loss_mask: np.ndarray,
                       turn_index: np.ndarray, rewards: np.ndarray, *, num_prompts: int, num_turns_max: int,
                       std_eps: float) -> dict[str, float]:
    """The step's diagnostics as metrics (names as in `metrics.jsonl`; an undefined one is left out):

      credit/detour_turn_credit, credit/on_path_turn_credit: mean turn credit over detour / on-path tool turns;
      credit/detour_turn_share: detour tool turns / judged tool turns;
      credit/progress_spearman: Spearman of turn credit with progress gain over the judged tool turns;
      zero_signal_groups, zero_signal_groups_with_turn_credit: `zero_signal_taught`.
    """
    credit = turn_credit(token_advantages, loss_mask, turn_index, num_turns_max)
    detour, on_path, gain_credit, gain = [], [], [], []
    for row, episode in enumerate(episodes):
        marks = path_marks(episode)
        if marks is None:
            continue
        for k, (on, progress) in enumerate(zip(*marks)):
            value = credit[row, k] if k < num_turns_max else np.nan
            if not np.isfinite(value):  # the turn has no trained token (cut off)
                continue
            (on_path if on else detour).append(value)
            gain_credit.append(value)
            gain.append(progress)
    judged = len(detour) + len(on_path)
    zero, taught = zero_signal_taught(rewards, token_advantages, loss_mask, num_prompts, std_eps)
    out = {"credit/detour_turn_credit": float(np.mean(detour)) if detour else float("nan"),
           "credit/on_path_turn_credit": float(np.mean(on_path)) if on_path else float("nan"),
           "credit/detour_turn_share": len(detour) / judged if judged else float("nan"),
           "credit/progress_spearman": spearman(gain_credit, gain),
           "zero_signal_groups": zero, "zero_signal_groups_with_turn_credit": taught}
    return {name: value for name, value in out.items() if np.isfinite(value)}
