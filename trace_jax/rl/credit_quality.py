"""`trace-jax credit-quality`: how good is each estimator's credit, measured on the credit itself.

Held-out accuracy after training needs many runs to tell two estimators apart; the credit they give the same
episodes can be compared directly, on a few thousand tool turns. From a policy checkpoint and a run config this
command samples episodes on the config's tasks (until `--tool-turns` tool turns, default 5,000), scores them once per
answer template with the reference (`RLPipeline.score`, the pipeline's own scoring), and runs every estimator of the
credit registry on the same episodes: TRACE's three forms x K in {0, 1, 3, 5} (per template), GRPO, GiGPO,
ABC-GRPO and `oracle_progress` (the oracle's progress gain as the turn term: the ceiling). It reports, each with a
seeded bootstrap 95% CI over prompt groups (docs/credit.md, "Credit quality"):

  * value jump: AUC of the value change `delta_k` (per template and TD form) at the turns that first open a page of
    the task's clue chain against every other judged tool turn; and of each estimator's turn term the same way;
  * last-state separation: AUC of the last state's value `V_T` (the sum of the form's `delta_k`) between correct and
    wrong episodes of one prompt group (pairs within a group only), and the mean gap in nats;
  * Spearman of each estimator's turn term alone (TRACE: `r_k`, not `A_out + alpha r_k`) with the progress gain;
  * the mean turn term on detour and on on-path turns (`credit_diagnostics.path_marks`);
  * TRACE's alpha_turn (`--alphas`): TRACE log-ratio's per-turn advantage at each alpha of a grid (the estimator
    itself at `alpha_turn = alpha`), its ordering agreement with the progress gain over pairs of turns of one prompt
    group (the criterion) and of one episode, and its Spearman with it; the favoured alpha is the criterion's best
    (ties: the smallest), fixed before the powered study's phase 2 (docs/credit.md, "Choosing alpha_turn").

Outputs in `--out-dir`: `credit_quality.json`, `credit_quality.md` (three tables and the favoured alpha_turn),
`credit_quality.png` and `credit_quality_episodes.jsonl` (one line per episode: what the alpha table reads).

The metrics are pure numpy functions of per-turn arrays and bootstrap weights (`weighted_auc`, `weighted_spearman`,
`group_separation`, `ordering_agreement`), so they are tested against naive loops; this module knows the
pipeline, the registry and the run config, and nothing about the update.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from trace_jax.envs.oracle import answer_template as oracle_answer_template
from trace_jax.scoring.continuation import ANSWER_TAG_TEMPLATE

# The two templates compared: the answer tag alone, and the policy's own opening: the oracle's demonstrations end
# "<fact note>. The answer is X.", so a warm-started policy writes ' The' (with its space, another token than 'The'
# in the word tokenizer and in BPE) before the gold.
DEFAULT_TEMPLATES = (ANSWER_TAG_TEMPLATE, oracle_answer_template())
FORMS = ("log_ratio", "raw_delta", "linear_gap")
HORIZONS = (0, 1, 3, 5)
TRACE_NAMES = {"log_ratio": "trace", "raw_delta": "trace_raw_delta", "linear_gap": "trace_linear_gap"}
OTHER_ESTIMATORS = ("grpo", "gigpo", "abc_grpo", "oracle_progress")


# ------------------------------------------------------------------------------------------------ metrics
def group_counts(num_groups: int, resamples: int, seed: int) -> np.ndarray:
    """`[resamples, num_groups]` how often each group is drawn in each bootstrap resample (groups drawn with
    replacement, `num_groups` draws a resample), from `numpy.random.default_rng(seed)`."""
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, num_groups, size=(resamples, num_groups))
    return np.stack([np.bincount(row, minlength=num_groups) for row in draws]).astype(np.float64)


def _block_sums(values: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(sums [B, U], block [n])`: `weights [B, n]` summed over each block of tied `values`, blocks in increasing
    order of value, and each item's block (one sort, shared by every resample)."""
    order = np.argsort(values, kind="stable")
    new_block = np.r_[True, np.diff(values[order]) != 0]
    block = np.empty(values.size, np.int64)
    block[order] = np.cumsum(new_block) - 1
    return np.add.reduceat(weights[:, order], np.nonzero(new_block)[0], axis=1), block


def weighted_auc(scores: np.ndarray, positive: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """P(score of a positive > score of a negative) + 0.5 P(tie), each item counted `weights[b, i]` times.

    `scores [n]`, `positive bool [n]`, `weights [B, n]` -> `[B]` (NaN where a side has no weight). With integer
    weights it equals the AUC of the data set in which item i appears `weights[b, i]` times."""
    scores, positive = np.asarray(scores, np.float64), np.asarray(positive, bool)
    weights = np.atleast_2d(np.asarray(weights, np.float64))
    out = np.full(weights.shape[0], np.nan)
    if scores.size == 0:
        return out
    pos, _ = _block_sums(scores, weights * positive)
    neg, _ = _block_sums(scores, weights * ~positive)
    below = np.cumsum(neg, axis=1) - neg  # negatives strictly below each tie block (blocks are sorted)
    wins = (pos * (below + 0.5 * neg)).sum(axis=1)
    total = pos.sum(axis=1) * neg.sum(axis=1)
    np.divide(wins, total, out=out, where=total > 0)
    return out


def _weighted_ranks(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """`[B, n]` average ranks (1-based) of `values` in the data set where item i appears `weights[b, i]` times."""
    mass, block = _block_sums(values, weights)
    before = np.cumsum(mass, axis=1) - mass
    return (before + (mass + 1.0) / 2.0)[:, block]


def weighted_spearman(x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Spearman's rank correlation (average ranks for ties) of `x [n]` and `y [n]`, each item counted
    `weights[b, i]` times -> `[B]` (NaN when either side is constant or fewer than two items count)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    weights = np.atleast_2d(np.asarray(weights, np.float64))
    out = np.full(weights.shape[0], np.nan)
    if x.size < 2:
        return out
    rx, ry = _weighted_ranks(x, weights), _weighted_ranks(y, weights)
    total = weights.sum(axis=1, keepdims=True)
    safe = np.maximum(total, 1e-300)
    mx, my = (weights * rx).sum(1, keepdims=True) / safe, (weights * ry).sum(1, keepdims=True) / safe
    cov = (weights * (rx - mx) * (ry - my)).sum(axis=1)
    var = (weights * (rx - mx) ** 2).sum(axis=1) * (weights * (ry - my) ** 2).sum(axis=1)
    ok = (var > 1e-12) & (total[:, 0] >= 2)
    np.divide(cov, np.sqrt(np.where(ok, var, 1.0)), out=out, where=ok)
    return out


def weighted_mean(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """`[B]` means of `values [n]` with item weights `weights [B, n]` (NaN where no weight)."""
    values = np.asarray(values, np.float64)
    weights = np.atleast_2d(np.asarray(weights, np.float64))
    total = weights.sum(axis=1)
    out = np.full(weights.shape[0], np.nan)
    np.divide(weights @ values if values.size else np.zeros(len(total)), total, out=out, where=total > 0)
    return out


def group_separation(values: np.ndarray, correct: np.ndarray, group: np.ndarray, counts: np.ndarray):
    """Correct-vs-wrong separation of `values [E]` within prompt groups, with group weights `counts [B, G]`.

    AUC: over the pairs (a correct, a wrong episode) of one group, P(value correct > value wrong) + 0.5 P(tie),
    every pair of a group drawn c times counted c times. Gap: the mean over mixed groups (both kinds present) of
    mean value of its correct episodes - mean value of its wrong ones (nats for the log-ratio value). Returns
    `(auc [B], gap [B])`, NaN where no mixed group is drawn."""
    values, correct, group = np.asarray(values, np.float64), np.asarray(correct, bool), np.asarray(group)
    counts = np.atleast_2d(np.asarray(counts, np.float64))
    num_groups = counts.shape[1]
    wins, pairs, gaps, mixed = (np.zeros(num_groups) for _ in range(4))
    for g in np.unique(group):
        right, wrong = values[(group == g) & correct], values[(group == g) & ~correct]
        if right.size and wrong.size:
            diff = right[:, None] - wrong[None, :]
            wins[g] = (diff > 0).sum() + 0.5 * (diff == 0).sum()
            pairs[g] = diff.size
            gaps[g], mixed[g] = right.mean() - wrong.mean(), 1.0
    auc, gap = np.full(counts.shape[0], np.nan), np.full(counts.shape[0], np.nan)
    np.divide(counts @ wins, counts @ pairs, out=auc, where=counts @ pairs > 0)
    np.divide(counts @ (gaps * mixed), counts @ mixed, out=gap, where=counts @ mixed > 0)
    return auc, gap


def estimate(values: np.ndarray) -> dict[str, float | None]:
    """`{"value", "low", "high", "defined"}`: `values[0]` (the full sample, weights 1), the 2.5/97.5 percentiles of
    the bootstrap resamples `values[1:]` where the figure is defined (None where nothing is), and how many resamples
    that is: a figure resting on a few turns or groups (one first opening) is undefined in many resamples and its
    interval is then too narrow; read `defined` with it."""
    point = float(values[0])
    rest = values[1:][np.isfinite(values[1:])]
    low, high = (np.percentile(rest, [2.5, 97.5]) if rest.size else (np.nan, np.nan))
    out = {k: (float(v) if math.isfinite(v) else None) for k, v in
           (("value", point), ("low", float(low)), ("high", float(high)))}
    return {**out, "defined": int(rest.size)}


# ------------------------------------------------------------------------------------------------ turn marks
def chain_page_opens(episode: Any) -> np.ndarray | None:
    """bool `[T]`: tool turn k opens a page of the task's clue chain (its observation is that page, a clue's entity
    as title) that no earlier turn of the episode showed; None for a task whose chain names no entity."""
    from trace_jax.abc.rules import clues_from_records, observation_page

    entities = {c.entity for c in clues_from_records(episode.clues) if c.entity}
    if not entities:
        return None
    seen: set[str] = set()
    opens = np.zeros(len(episode.observations), bool)
    for k, observation in enumerate(episode.observations):
        title, _ = observation_page(observation)
        if title in entities and title not in seen:
            opens[k] = True
            seen.add(title)
    return opens


# ------------------------------------------------------------------------------------------------ templates
def check_template(template: str) -> None:
    """Raise ValueError naming `--templates` unless `template` is a literal answer template (`{answer}` exactly
    once, at its end: `scoring.continuation.check_answer_template`)."""
    from trace_jax.scoring.continuation import check_answer_template

    check_answer_template(template, where="--templates")


def template_pipelines(run_config, environment, placement, templates: Sequence[str]) -> dict:
    """One `RLPipeline` per answer template (`UpdateConfig.answer_template` set to it): the loop's own
    (`loop.make_rl_step`, with its checks of rows and KV budget), on the run's model, mesh and rules."""
    from trace_jax.rl.loop import make_rl_step
    from trace_jax.train.optimizer import make_optimizer

    optimizer = make_optimizer(run_config.optimizer)
    return {template: make_rl_step(dataclasses.replace(run_config, update=dataclasses.replace(
        run_config.update, answer_template=template)), environment, placement=placement, optimizer=optimizer).pipeline
        for template in templates}


def score_states(pipeline, reference_params, rollout) -> np.ndarray:
    """float64 `[E, T+1]`: the reference's answer score after every state of each episode under the pipeline's
    answer template (`RLPipeline.score`, one pass; segment rows placed at their episode's state numbers)."""
    from trace_jax.credit import episode_states
    from trace_jax.rollout.batch import episode_view
    from trace_jax.train.loss import length_bucket

    batch = rollout.batch
    lengths = np.asarray(batch.lengths)
    width = length_bucket(int(lengths.max()), pipeline.update_config.length_multiple, pipeline.rollout.max_context)
    scores, _ = pipeline.score(reference_params, rollout, width)
    if batch.segmented:
        view = episode_view(batch)
        scores = np.asarray(episode_states(scores, view.episode, view.first_turn, np.asarray(batch.num_states),
                                           view.num_episodes))
    return np.asarray(scores, np.float64)


# ------------------------------------------------------------------------------------------------ estimators
@dataclasses.dataclass(frozen=True)
class Arm:
    """One estimator setting: its label, registry name, template (None when it reads no scores), form, K."""

    label: str
    estimator: str
    template: str | None = None
    form: str | None = None
    horizon: int | None = None


def arms(templates: Sequence[str]) -> list[Arm]:
    """TRACE's forms x `HORIZONS` per template, then GRPO, GiGPO, ABC-GRPO and oracle progress."""
    out = [Arm(f"{TRACE_NAMES[form]} K={k} [{template}]", TRACE_NAMES[form], template, form, k)
           for template in templates for form in FORMS for k in HORIZONS]
    return out + [Arm(name, name) for name in OTHER_ESTIMATORS]


def batch_turn_terms(pipeline, rollout, scores: dict[str, np.ndarray], all_arms: Sequence[Arm],
                     num_prompts: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Each arm's `(turn term, turn credit)`, float64 `[E, max_turns]` (NaN past an episode's tool turns), from the
    registry's estimator on the batch's episodes (one pseudo-token per turn, `credit.turn_layout`; every estimator
    gives a turn's tokens one value, so this is the mean over the turn's tokens). Turn term: TRACE `r_k`, GiGPO
    `omega A_step`, ABC-GRPO the step advantage, oracle the progress gain; GRPO has none (NaN)."""
    import jax.numpy as jnp

    from trace_jax.credit import CreditInputs, compute_advantages, turn_layout
    from trace_jax.credit.gigpo import anchor_key_ids, state_keys
    from trace_jax.rl.credit_diagnostics import progress_gains, turn_credit
    from trace_jax.rollout.batch import episode_view

    view = episode_view(rollout.batch)
    slots = pipeline.rollout.max_turns
    num_turns = jnp.asarray(view.num_turns, jnp.int32)
    layout_index, layout_mask = turn_layout(num_turns, slots + 1)
    base = CreditInputs(rewards=jnp.asarray(view.reward, jnp.float32), group_id=jnp.asarray(view.group_id, jnp.int32),
                        loss_mask=layout_mask, turn_index=layout_index, num_turns=num_turns)
    step_rewards, num_steps, _ = pipeline.abc_step_rewards(rollout)
    keys = [state_keys(e.observations, pipeline.credit.gigpo_anchor)[:slots + 1] for e in rollout.episodes]
    extra = {"step_rewards": jnp.asarray(step_rewards), "num_steps": jnp.asarray(num_steps),
             "anchor_keys": jnp.asarray(anchor_key_ids(keys, slots + 1)),
             "progress_gains": jnp.asarray(progress_gains(rollout.episodes, slots + 1))}
    real = np.arange(slots)[None, :] < np.asarray(view.num_turns)[:, None]
    terms, credits = {}, {}
    for arm in all_arms:
        config = pipeline.credit.replace(estimator=arm.estimator, **(
            {"form": arm.form, "horizon": arm.horizon} if arm.form else {}))
        fields = dict(extra, answer_scores=jnp.asarray(scores[arm.template], jnp.float32) if arm.template else None)
        result = compute_advantages(config, base._replace(**fields), num_groups=num_prompts, check=True)
        per_turn = None if result.per_turn is None else np.asarray(result.per_turn, np.float64)[:, :slots]
        if arm.estimator == "grpo":
            term = np.full(real.shape, np.nan)
        elif arm.estimator == "gigpo":
            term = per_turn - np.asarray(result.outcome_advantages, np.float64)[:, None]
        else:
            term = per_turn
        terms[arm.label] = np.where(real, term, np.nan)
        credits[arm.label] = turn_credit(np.asarray(result.token_advantages), np.asarray(layout_mask),
                                         np.asarray(layout_index), slots)
    return terms, credits


# ------------------------------------------------------------------------------------------------ alpha_turn
# TRACE's turn weight, chosen by a criterion fixed before the powered study's phase 2 (docs/credit.md, "Choosing
# alpha_turn"). The grid holds the paper's default 0.2 and the first study's ablations (0.05, 0.2, 1, 3).
DEFAULT_ALPHAS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 3.0)
ALPHA_CRITERION = "within_group_ordering"
# Point estimates closer than this count as tied (rounding, not evidence); the smallest tied alpha wins.
ALPHA_TIE_TOLERANCE = 1e-9


def parse_alphas(text: str) -> tuple[float, ...]:
    """`--alphas`: comma-separated finite numbers >= 0 (`alpha_turn = 0` is GRPO), no repeats -> sorted tuple;
    ValueError naming the flag otherwise."""
    parts = [p.strip() for p in str(text).split(",")]
    if not text or not all(parts):
        raise ValueError(f"--alphas {text!r}: give comma-separated numbers >= 0, e.g. --alphas 0.05,0.2,1")
    values = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"--alphas: {part!r} is not a number; give comma-separated numbers >= 0, e.g. "
                             f"--alphas 0.05,0.2,1") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"--alphas: {part!r} must be a finite number >= 0 (alpha_turn = 0 is GRPO)")
        values.append(value)
    if len(set(values)) != len(values):
        raise ValueError(f"--alphas {text!r}: a value is repeated; list each alpha once")
    return tuple(sorted(values))


def ordering_agreement(values: np.ndarray, reference: np.ndarray, group: np.ndarray, unit: np.ndarray,
                       counts: np.ndarray) -> np.ndarray:
    """Pairwise ordering agreement of `values [n]` with `reference [n]`, with group weights `counts [B, G]`.

    Over the pairs of items of one `unit [n]` (units nest in `group [n]`: an episode id, or the group itself) whose
    reference differs: 1 when `values` order the pair as `reference` does, 0.5 when `values` tie, 0 otherwise;
    every pair of a group drawn c times counted c times. Pairs the reference ties are left out (it orders nothing
    there). Returns `[B]`, NaN where no pair is drawn."""
    values, reference = np.asarray(values, np.float64), np.asarray(reference, np.float64)
    group, unit = np.asarray(group), np.asarray(unit)
    counts = np.atleast_2d(np.asarray(counts, np.float64))
    wins, pairs = np.zeros(counts.shape[1]), np.zeros(counts.shape[1])
    for g in np.unique(group):
        at = group == g
        v, r, u = values[at], reference[at], unit[at]
        order_v, order_r = np.sign(v[:, None] - v[None, :]), np.sign(r[:, None] - r[None, :])
        counted = np.triu(u[:, None] == u[None, :], k=1) & (order_r != 0)
        wins[g] = (counted & (order_v == order_r)).sum() + 0.5 * (counted & (order_v == 0)).sum()
        pairs[g] = counted.sum()
    out = np.full(counts.shape[0], np.nan)
    np.divide(counts @ wins, counts @ pairs, out=out, where=counts @ pairs > 0)
    return out


def favoured_alpha(alphas: Sequence[float], criterion: Sequence[float | None]) -> float | None:
    """The alpha with the highest criterion point estimate; among those within `ALPHA_TIE_TOLERANCE` of the best,
    the smallest (the smaller turn weight: closer to GRPO and to its step size). None when no value is defined."""
    defined = [(a, c) for a, c in zip(alphas, criterion) if c is not None and math.isfinite(c)]
    if not defined:
        return None
    best = max(c for _, c in defined)
    return min(a for a, c in defined if c >= best - ALPHA_TIE_TOLERANCE)


def trace_alpha_advantages(credit_config, scores: np.ndarray, rewards: np.ndarray, group: np.ndarray,
                           num_turns: np.ndarray, alpha: float) -> np.ndarray:
    """float64 `[E, T]`: TRACE log-ratio's per-turn advantage `alpha_out A_out + alpha r_k` of each tool turn (NaN
    past an episode's turns), from the registry's estimator with `credit_config` at `alpha_turn = alpha` (its other
    options, K included, as given), on one pseudo-token per turn (`credit.turn_layout`), as `batch_turn_terms` runs
    the arms. `scores [E, T+1]` (padding past `num_turns` ignored), `rewards [E]`, `group [E]` (prompt groups, ids in
    `[0, G)`; GRPO's statistic is per group, so pooled batches give the per-batch advantages)."""
    import jax.numpy as jnp

    from trace_jax.credit import CreditInputs, compute_advantages, turn_layout
    from trace_jax.rl.credit_diagnostics import turn_credit

    scores = np.asarray(scores, np.float64)
    slots = scores.shape[1] - 1
    num_turns = np.asarray(num_turns)
    real_states = np.arange(slots + 1)[None, :] <= num_turns[:, None]
    index, mask = turn_layout(jnp.asarray(num_turns, jnp.int32), slots + 1)
    inputs = CreditInputs(rewards=jnp.asarray(rewards, jnp.float32), group_id=jnp.asarray(group, jnp.int32),
                          loss_mask=mask, turn_index=index, num_turns=jnp.asarray(num_turns, jnp.int32),
                          answer_scores=jnp.asarray(np.where(real_states, scores, 0.0), jnp.float32))
    config = credit_config.replace(estimator="trace", form="log_ratio", alpha_turn=float(alpha))
    num_groups = int(np.max(group)) + 1 if len(group) else 1
    result = compute_advantages(config, inputs, num_groups=num_groups, check=True)
    per_turn = turn_credit(np.asarray(result.token_advantages), np.asarray(mask), np.asarray(index), slots)
    return np.where(np.arange(slots)[None, :] < num_turns[:, None], per_turn, np.nan)


def alpha_table(data: dict, templates: Sequence[str], credit_config, alphas: Sequence[float], counts: np.ndarray,
                *, run_template: str | None = None) -> dict:
    """TRACE log-ratio's per-turn advantage at each alpha of `alphas`, against the oracle's progress gain.

    Per template and alpha, over the judged tool turns of the pooled sample `data` (`Sample.arrays()`), each with
    bootstrap CIs from the prompt-group weights `counts [B+1, G]` (row 0 the full sample):
      * `within_group_ordering` (the criterion): `ordering_agreement` over pairs of turns of one prompt group;
      * `within_episode_ordering`: the same over pairs of one episode; alpha cannot change it (`A_out` is constant
        in an episode, so the turn term alone orders its turns): it is the turn term's quality, shown beside;
      * `progress_spearman`: Spearman with the progress gain over every judged turn (the report's credit Spearman);
      * `mean_abs_advantage`: mean |advantage| over every tool turn (the size of the step alpha buys);
      * `difference_from_config_alpha`: the criterion minus its value at the config's `alpha_turn` (same resamples;
        None when that alpha is not in the grid).
    The reference is alpha-free: the progress gain `g_k`, the `oracle_progress` estimator's turn term (its
    `per_turn`). The favoured alpha (`favoured_alpha` of the criterion) is given per template, and as `favoured`
    for `run_template` (the template the run config's `UpdateConfig.answer_template` names) when it was scored."""
    episode_w = counts[:, data["group"]]
    num_slots = data["judged"].shape[1]
    turn_w = np.repeat(episode_w[:, :, None], num_slots, 2)
    group_of = np.repeat(data["group"][:, None], num_slots, 1)
    episode_of = np.repeat(np.arange(len(data["group"]))[:, None], num_slots, 1)
    base = float(credit_config.alpha_turn)
    out = {"criterion": ALPHA_CRITERION, "tie_rule": f"highest point estimate; within {ALPHA_TIE_TOLERANCE:g} of "
           "it counts as tied, and the smallest tied alpha wins", "reference": "progress gain (oracle_progress's "
           "turn term)", "estimator": "trace", "form": "log_ratio", "horizon": credit_config.horizon,
           "alpha_out": credit_config.alpha_out, "config_alpha_turn": base, "alphas": [float(a) for a in alphas],
           "run_template": run_template, "templates": {}}
    for template in templates:
        rows, criteria = [], {}
        for alpha in alphas:
            advantage = trace_alpha_advantages(credit_config, data["scores"][template], data["reward"],
                                               data["group"], data["num_turns"], alpha)
            padded = np.full(data["judged"].shape, np.nan)
            padded[:, :advantage.shape[1]] = advantage[:, :num_slots]
            judged = data["judged"] & np.isfinite(padded)
            values, reference = padded[judged], data["progress"][judged]
            criteria[alpha] = ordering_agreement(values, reference, group_of[judged], group_of[judged], counts)
            real = np.isfinite(padded)
            rows.append({"alpha": float(alpha), ALPHA_CRITERION: estimate(criteria[alpha]),
                         "within_episode_ordering": estimate(ordering_agreement(
                             values, reference, group_of[judged], episode_of[judged], counts)),
                         "progress_spearman": estimate(weighted_spearman(values, reference, turn_w[:, judged])),
                         "mean_abs_advantage": estimate(weighted_mean(np.abs(padded[real]), turn_w[:, real]))})
        for row in rows:
            row["difference_from_config_alpha"] = (estimate(criteria[row["alpha"]] - criteria[base])
                                                   if base in criteria else None)
        out["templates"][template] = {"rows": rows, "favoured": favoured_alpha(
            [r["alpha"] for r in rows], [r[ALPHA_CRITERION]["value"] for r in rows])}
    out["favoured"] = out["templates"][run_template]["favoured"] if run_template in out["templates"] else None
    return out


# ------------------------------------------------------------------------------------------------ the run
@dataclasses.dataclass
class Sample:
    """The pooled episodes of every batch (`E` episodes, `T` = `RolloutConfig.max_turns` turn slots)."""

    group: list = dataclasses.field(default_factory=list)          # [E] prompt group (unique over batches)
    correct: list = dataclasses.field(default_factory=list)        # [E] bool
    reward: list = dataclasses.field(default_factory=list)         # [E] the environment's reward (GRPO's input)
    num_turns: list = dataclasses.field(default_factory=list)      # [E]
    judged: list = dataclasses.field(default_factory=list)         # [E, T] tool turn of an episode with a chain
    first_page: list = dataclasses.field(default_factory=list)     # [E, T] opens a chain page first
    on_path: list = dataclasses.field(default_factory=list)        # [E, T]
    progress: list = dataclasses.field(default_factory=list)       # [E, T] progress gain
    scores: dict = dataclasses.field(default_factory=dict)         # template -> [[T+1]] per episode
    terms: dict = dataclasses.field(default_factory=dict)          # arm label -> [E, T] blocks
    credits: dict = dataclasses.field(default_factory=dict)

    def arrays(self) -> dict[str, Any]:
        out = {name: np.concatenate(getattr(self, name)) for name in
               ("group", "correct", "reward", "num_turns", "judged", "first_page", "on_path", "progress")}
        out["scores"] = {t: np.concatenate(v) for t, v in self.scores.items()}
        out["terms"] = {a: np.concatenate(v) for a, v in self.terms.items()}
        out["credits"] = {a: np.concatenate(v) for a, v in self.credits.items()}
        return out


def add_batch(sample: Sample, rollout, scores: dict[str, np.ndarray], terms, credits, group_offset: int,
              slots: int) -> int:
    """Append one batch's episodes to `sample`; returns its tool turns."""
    from trace_jax.rl.credit_diagnostics import path_marks
    from trace_jax.rl.evaluate import episode_correct
    from trace_jax.rollout.batch import episode_view

    view = episode_view(rollout.batch)
    n = len(rollout.episodes)
    judged, first, on_path, progress = (np.zeros((n, slots), bool), np.zeros((n, slots), bool),
                                        np.zeros((n, slots), bool), np.zeros((n, slots)))
    for row, episode in enumerate(rollout.episodes):
        marks, opens = path_marks(episode), chain_page_opens(episode)
        if marks is None or opens is None:
            continue
        t = min(int(view.num_turns[row]), slots, len(marks[0]))
        judged[row, :t] = True
        on_path[row, :t], progress[row, :t], first[row, :t] = marks[0][:t], marks[1][:t], opens[:t]
    sample.group.append(np.asarray(view.group_id) + group_offset)
    sample.correct.append(np.asarray([episode_correct(e) for e in rollout.episodes]))
    sample.reward.append(np.asarray(view.reward, np.float64))
    sample.num_turns.append(np.asarray(view.num_turns))
    for name, value in (("judged", judged), ("first_page", first), ("on_path", on_path), ("progress", progress)):
        getattr(sample, name).append(value)
    for template, value in scores.items():
        padded = np.full((n, slots + 1), np.nan)
        padded[:, :value.shape[1]] = value[:, :slots + 1]
        sample.scores.setdefault(template, []).append(padded)
    for label in terms:
        sample.terms.setdefault(label, []).append(terms[label])
        sample.credits.setdefault(label, []).append(credits[label])
    return int(np.asarray(view.num_turns).sum())


EPISODES_FILE = "credit_quality_episodes.jsonl"


def write_episodes(path: Path, data: dict, templates: Sequence[str]) -> None:
    """One JSON line per sampled episode of `data` (`Sample.arrays()`): group, reward, correct, num_turns T, the
    turn marks (judged, first_page, on_path, progress: T entries) and each template's scores (T+1): what the alpha
    table needs to be recomputed on another grid without sampling again (`alpha_table_from_record`)."""
    slots = data["judged"].shape[1]
    with open(path, "w", encoding="utf-8") as out:
        for e in range(len(data["group"])):
            t = int(data["num_turns"][e])
            turns = min(t, slots)
            record = {"group": int(data["group"][e]), "reward": float(data["reward"][e]),
                      "correct": bool(data["correct"][e]), "num_turns": t,
                      **{name: data[name][e, :turns].tolist() for name in ("judged", "first_page", "on_path")},
                      "progress": [float(g) for g in data["progress"][e, :turns]],
                      "scores": {tp: [float(v) for v in data["scores"][tp][e, :t + 1]] for tp in templates}}
            out.write(json.dumps(record) + "\n")


def read_episodes(path: Path) -> dict:
    """The pooled sample `write_episodes` wrote, as `Sample.arrays()` holds it (turn arrays padded to the longest
    episode; scores padded with NaN). The per-arm terms are not recorded (they need the rollouts)."""
    records = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{path}: no episodes recorded")
    slots = max(max(r["num_turns"] for r in records), 1)
    data = {"group": np.asarray([r["group"] for r in records]), "correct": np.asarray([r["correct"] for r in records]),
            "reward": np.asarray([r["reward"] for r in records], np.float64),
            "num_turns": np.asarray([r["num_turns"] for r in records])}
    for name, dtype in (("judged", bool), ("first_page", bool), ("on_path", bool), ("progress", np.float64)):
        data[name] = np.zeros((len(records), slots), dtype)
        for e, r in enumerate(records):
            data[name][e, :len(r[name])] = r[name]
    data["scores"] = {}
    for template in records[0]["scores"]:
        data["scores"][template] = np.full((len(records), slots + 1), np.nan)
        for e, r in enumerate(records):
            data["scores"][template][e, :len(r["scores"][template])] = r["scores"][template]
    return data


def favoured_over_reports(directories: Sequence[Path]) -> tuple[float | None, dict[float, float | None]]:
    """The favoured alpha over several warm starts (one finished report each, e.g. a study's seeds): every report's
    criterion for its run's template, averaged over the reports per alpha (each warm start counts once), then
    `favoured_alpha`'s rule. Returns `(alpha or None, {alpha: mean criterion or None})`; ValueError naming the file
    when a report has no alpha table, no run-template row, or another grid or template than the first."""
    tables = []
    for directory in directories:
        path = Path(directory) / "credit_quality.json"
        if not path.exists():
            raise FileNotFoundError(f"--favoured-from {directory}: no credit_quality.json there")
        alpha = json.loads(path.read_text(encoding="utf-8")).get("alpha")
        if alpha is None:
            raise ValueError(f"{path}: no alpha table (a report from before --alphas); rerun `trace-jax "
                             "credit-quality` on its policy")
        if alpha["run_template"] not in alpha["templates"]:
            raise ValueError(f"{path}: the run's template {alpha['run_template']!r} was not scored; rerun with it in "
                             "--templates")
        if tables and (alpha["alphas"], alpha["run_template"]) != (tables[0]["alphas"], tables[0]["run_template"]):
            raise ValueError(f"{path}: grid {alpha['alphas']} / template {alpha['run_template']!r} differ from the "
                             f"first report's ({tables[0]['alphas']} / {tables[0]['run_template']!r}); rerun with one "
                             "--alphas and one config")
        tables.append(alpha)
    if not tables:
        raise ValueError("--favoured-from: give at least one report directory")
    means = {}
    for i, a in enumerate(tables[0]["alphas"]):
        values = [t["templates"][t["run_template"]]["rows"][i][ALPHA_CRITERION]["value"] for t in tables]
        means[a] = None if any(v is None for v in values) else float(np.mean(values))
    return favoured_alpha(list(means), list(means.values())), means


def alpha_table_from_record(directory: Path, alphas: Sequence[float] = DEFAULT_ALPHAS) -> dict:
    """The alpha table of a finished report directory (`credit_quality.json` + `EPISODES_FILE`) on the grid
    `alphas`, with the report's credit config, bootstrap resamples and seed: the same table the run wrote when
    `alphas` is its grid."""
    from trace_jax.credit import CreditConfig

    directory = Path(directory)
    report = json.loads((directory / "credit_quality.json").read_text(encoding="utf-8"))
    if not (directory / EPISODES_FILE).exists():
        raise FileNotFoundError(f"{directory / EPISODES_FILE}: this report predates the per-episode record; rerun "
                                "`trace-jax credit-quality` to get it")
    data = read_episodes(directory / EPISODES_FILE)
    groups = int(data["group"].max()) + 1
    counts = np.vstack([np.ones((1, groups)), group_counts(groups, report["bootstrap"], report["seed"])])
    return alpha_table(data, report["templates_scored"], CreditConfig(**report["credit"]), alphas, counts,
                       run_template=report["alpha"]["run_template"])


def turn_metrics(values: np.ndarray, data: dict, weights: np.ndarray) -> dict[str, dict]:
    """First-page AUC, progress Spearman, detour and on-path means of per-turn `values [E, T]` over judged turns."""
    judged = data["judged"] & np.isfinite(values)
    v, w = values[judged], weights[:, judged]
    return {"first_page_auc": estimate(weighted_auc(v, data["first_page"][judged], w)),
            "progress_spearman": estimate(weighted_spearman(v, data["progress"][judged], w)),
            "detour_mean": estimate(weighted_mean(v, w * ~data["on_path"][judged])),
            "on_path_mean": estimate(weighted_mean(v, w * data["on_path"][judged]))}


def analyse(data: dict, all_arms: Sequence[Arm], templates: Sequence[str], credit_config, *, resamples: int,
            seed: int, alphas: Sequence[float] = DEFAULT_ALPHAS, run_template: str | None = None) -> dict:
    """Every figure of the report from the pooled sample `data` (`Sample.arrays()`), with bootstrap CIs over
    prompt groups (`resamples` resamples from `seed`; row 0 of each weight matrix is the full sample); the alpha
    table (`alpha_table`) on the same resamples."""
    import jax.numpy as jnp

    from trace_jax.credit import td_deltas

    groups = int(data["group"].max()) + 1 if data["group"].size else 0
    counts = np.vstack([np.ones((1, groups)), group_counts(groups, resamples, seed)])
    episode_w = counts[:, data["group"]]                                   # [B+1, E]
    turn_w = np.repeat(episode_w[:, :, None], data["judged"].shape[1], 2)  # [B+1, E, T]
    num_turns = jnp.asarray(data["num_turns"], jnp.int32)
    out = {"templates": {}, "arms": [],
           "alpha": alpha_table(data, templates, credit_config, alphas, counts, run_template=run_template)}
    for template in templates:
        scores = data["scores"][template]
        last = scores[np.arange(len(scores)), data["num_turns"]]
        right = last[data["correct"]]
        entry = {"median_p_gold_last_state_correct": float(np.median(np.exp(right))) if right.size else None,
                 "mean_first_state_score": float(np.nanmean(scores[:, 0])) if len(scores) else None, "forms": {}}
        for form in FORMS:
            clean = np.where(np.isfinite(scores), scores, -1.0)  # padding only; td_deltas ignores k > T
            deltas = np.asarray(td_deltas(jnp.asarray(clean, jnp.float32), num_turns, form=form,
                                          eps=credit_config.eps, min_score=credit_config.min_score), np.float64)
            deltas = np.where(np.arange(deltas.shape[1])[None, :] < data["num_turns"][:, None], deltas, np.nan)
            padded = np.full(data["judged"].shape, np.nan)
            padded[:, :deltas.shape[1]] = deltas[:, :padded.shape[1]]
            judged = data["judged"] & np.isfinite(padded)
            value_t = np.nansum(padded, axis=1)
            auc, gap = group_separation(value_t, data["correct"], data["group"], counts)
            entry["forms"][form] = {
                "value_jump_auc": estimate(weighted_auc(padded[judged], data["first_page"][judged],
                                                        turn_w[:, judged])),
                "last_value_auc": estimate(auc), "last_value_gap": estimate(gap)}
        out["templates"][template] = entry
    for arm in all_arms:
        out["arms"].append({**dataclasses.asdict(arm),
                            "turn_term": turn_metrics(data["terms"][arm.label], data, turn_w),
                            "turn_credit": turn_metrics(data["credits"][arm.label], data, turn_w)})
    return out


# ------------------------------------------------------------------------------------------------ reports
def _fmt(e: dict | None, digits: int = 3) -> str:
    if not e or e.get("value") is None:
        return "-"
    if e.get("low") is None:
        return f"{e['value']:.{digits}f}"
    return f"{e['value']:.{digits}f} [{e['low']:.{digits}f}, {e['high']:.{digits}f}]"


def favoured_line(alpha: dict) -> str:
    """The one line that states the favoured alpha_turn (the run's template's, else each scored template's)."""
    rule = "highest within-group ordering agreement with the progress gain; ties -> the smallest alpha"
    if alpha["favoured"] is not None:
        row = next(r for r in alpha["templates"][alpha["run_template"]]["rows"] if r["alpha"] == alpha["favoured"])
        versus = "" if row["difference_from_config_alpha"] is None else (
            f"; {_fmt(row[ALPHA_CRITERION])}, minus its value at the config's {alpha['config_alpha_turn']:g}: "
            f"{_fmt(row['difference_from_config_alpha'])}")
        return (f"**Favoured alpha_turn: {alpha['favoured']:g}** (TRACE log-ratio K={alpha['horizon']}, template "
                f"`{alpha['run_template']}`; {rule}{versus}).")
    per = ", ".join(f"`{t}`: {'-' if e['favoured'] is None else format(e['favoured'], 'g')}"
                    for t, e in alpha["templates"].items())
    return f"**Favoured alpha_turn per template** ({per}; the run's template was not scored; {rule})."


def alpha_markdown(alpha: dict) -> list[str]:
    """The alpha table: one row per template x alpha."""
    lines = [f"## TRACE log-ratio's alpha_turn (K={alpha['horizon']}, alpha_out={alpha['alpha_out']:g}) against the "
             "progress gain", "", "Per-turn advantage `alpha_out A_out + alpha r_k` from the estimator itself; "
             "ordering: pairs of judged tool turns whose progress gains differ (1 same order, 0.5 a tie); the "
             "criterion is the within-group ordering; within an episode alpha cannot change the order. Difference: "
             f"the criterion minus its value at the config's alpha_turn = {alpha['config_alpha_turn']:g}.", "",
             "| template | alpha_turn | within-group ordering | difference | within-episode ordering | "
             "Spearman with progress | mean \\|A\\| per tool turn |", "|---|---|---|---|---|---|---|"]
    for template, entry in alpha["templates"].items():
        for row in entry["rows"]:
            mark = " (favoured)" if row["alpha"] == entry["favoured"] else ""
            lines.append(f"| `{template}` | {row['alpha']:g}{mark} | {_fmt(row[ALPHA_CRITERION])} | "
                         f"{_fmt(row['difference_from_config_alpha'])} | {_fmt(row['within_episode_ordering'])} | "
                         f"{_fmt(row['progress_spearman'])} | {_fmt(row['mean_abs_advantage'])} |")
    return lines


def markdown(report: dict) -> str:
    """The report's tables (values per template x form; turn terms per estimator; TRACE's alpha_turn) and the
    favoured alpha_turn on one line."""
    lines = [f"# Credit quality: {report['policy']}", "",
             f"{report['episodes']} episodes in {report['groups']} prompt groups, {report['tool_turns']} tool turns "
             f"({report['judged_turns']} judged, {report['first_page_turns']} first openings of a chain page); "
             f"95% CIs: {report['bootstrap']} bootstrap resamples of prompt groups (seed {report['seed']}).", "",
             favoured_line(report["alpha"]), "",
             "## Values (per answer template and TD form)", "",
             "| template | form | value-jump AUC | last-state AUC | last-state gap (nats) | median p(gold) last, "
             "correct |", "|---|---|---|---|---|---|"]
    for template, entry in report["templates"].items():
        median = entry["median_p_gold_last_state_correct"]
        for form, figures in entry["forms"].items():
            lines.append(f"| `{template}` | {form} | {_fmt(figures['value_jump_auc'])} | "
                         f"{_fmt(figures['last_value_auc'])} | {_fmt(figures['last_value_gap'])} | "
                         f"{'-' if median is None else f'{median:.3f}'} |")
    lines += ["", "## Turn terms (TRACE: r_k; GiGPO: omega A_step; ABC-GRPO: step advantage; oracle: progress gain)",
              "", "| estimator | first-page AUC | Spearman with progress | detour mean | on-path mean | "
              "credit Spearman |", "|---|---|---|---|---|---|"]
    for arm in report["arms"]:
        term, credit = arm["turn_term"], arm["turn_credit"]
        lines.append(f"| {arm['label']} | {_fmt(term['first_page_auc'])} | {_fmt(term['progress_spearman'])} | "
                     f"{_fmt(term['detour_mean'])} | {_fmt(term['on_path_mean'])} | "
                     f"{_fmt(credit['progress_spearman'])} |")
    lines += ["", *alpha_markdown(report["alpha"])]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Four panels: value-jump AUC and last-state AUC per template x form; Spearman with progress and detour vs
    on-path mean of each estimator's turn term; bars are point estimates, whiskers the bootstrap 95% CIs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def bars(ax, labels, entries, title, color=None, offset=0.0, width=0.8, label=None):
        values = [np.nan if not e or e["value"] is None else e["value"] for e in entries]
        low = [0 if not e or e["low"] is None else max(v - e["low"], 0) for v, e in zip(values, entries)]
        high = [0 if not e or e["high"] is None else max(e["high"] - v, 0) for v, e in zip(values, entries)]
        ax.barh(np.arange(len(labels)) + offset, values, height=width, xerr=[low, high], color=color, label=label,
                capsize=2)
        ax.set_yticks(np.arange(len(labels)), labels, fontsize=6)
        ax.set_title(title, fontsize=8)

    fig, axes = plt.subplots(2, 2, figsize=(13, 10))
    pairs = [(t, f) for t in report["templates"] for f in FORMS]
    names = [f"{f} [{t}]" for t, f in pairs]
    bars(axes[0, 0], names, [report["templates"][t]["forms"][f]["value_jump_auc"] for t, f in pairs],
         "value-jump AUC: delta_k at first chain-page openings vs other turns")
    bars(axes[0, 1], names, [report["templates"][t]["forms"][f]["last_value_auc"] for t, f in pairs],
         "last-state value AUC, correct vs wrong within a group")
    for ax in axes[0]:
        ax.axvline(0.5, color="grey", lw=0.5)
    labels = [a["label"] for a in report["arms"]]
    bars(axes[1, 0], labels, [a["turn_term"]["progress_spearman"] for a in report["arms"]],
         "Spearman of the turn term with progress gain")
    bars(axes[1, 1], labels, [a["turn_term"]["detour_mean"] for a in report["arms"]], "mean turn term",
         color="tab:red", offset=-0.2, width=0.4, label="detour")
    bars(axes[1, 1], labels, [a["turn_term"]["on_path_mean"] for a in report["arms"]], "mean turn term",
         color="tab:green", offset=0.2, width=0.4, label="on path")
    axes[1, 1].legend(fontsize=7)
    fig.suptitle(f"credit quality: {report['episodes']} episodes, {report['tool_turns']} tool turns", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ loading
def load_params(spec: str, run_config, environment, placement):
    """Params in the train layout: `init` (the config's initial policy), a Hugging Face directory, or a run
    directory `'<run dir>[@step]'` (default: its latest checkpoint, else its initial policy, step 0 of
    `reference/`)."""
    from trace_jax import models
    from trace_jax.rl.gin_setup import reference_checkpoint_parts
    from trace_jax.rl.loop import REFERENCE_DIR
    from trace_jax.train.checkpoint import Checkpointer, restore_params_from_copies
    from trace_jax.train.config import CheckpointConfig

    if spec == "init":
        return placement.policy(environment.params)
    path, step = reference_checkpoint_parts(spec)
    if step is None and (Path(path) / "config.json").exists():
        return placement.policy(models.load_pretrained(path)[1])
    directories = [Path(path) / REFERENCE_DIR, Path(path) / run_config.checkpoint.directory]
    copies = [Checkpointer(CheckpointConfig(directory=str(d), every_steps=1, keep_last=None, async_save=False))
              for d in directories if d.is_dir()]
    if not copies:
        raise FileNotFoundError(f"--policy/--reference {spec!r}: not a run directory (no {REFERENCE_DIR}/ or "
                                f"{run_config.checkpoint.directory}/), nor a Hugging Face directory (config.json), "
                                "nor 'init'")
    try:
        if step is None:
            step = max(max(c.all_steps(), default=-1) for c in copies)
            if step < 0:
                raise FileNotFoundError(f"--policy/--reference {spec!r}: no saved step there")
        return restore_params_from_copies(copies, step, shardings=placement.train_shardings, what=spec)
    finally:
        for copy in copies:
            copy.close()


def run_credit_quality(run_config, policy: str, out_dir: Path, *, reference: str | None = None,
                       templates: Sequence[str] = DEFAULT_TEMPLATES, tool_turns: int = 5000,
                       prompts: int | None = None, split: str = "train", resamples: int = 1000, seed: int = 0,
                       max_batches: int = 200, alphas: Sequence[float] = DEFAULT_ALPHAS, log=print) -> dict:
    """Sample, score, credit and analyse (the module docstring); writes the four files and returns the report."""
    import jax

    from trace_jax.rl.loop import Placement, build_environment
    from trace_jax.rl.warmstart import resolve_answer_template

    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for template in templates:  # before any compute
        check_template(template)
    environment = build_environment(run_config, out_dir)
    placement = Placement(run_config, environment.model_config)
    params = load_params(policy, run_config, environment, placement)
    reference_params = placement.frozen(params if reference is None else
                                        load_params(reference, run_config, environment, placement))
    rollout_params = placement.rollout_params(params)
    pipelines = template_pipelines(run_config, environment, placement, templates)
    pipeline = pipelines[templates[0]]  # rollouts, credit and ABC steps: the same under every template
    run_template = resolve_answer_template(run_config.update.answer_template, pipeline.chat,
                                           warm_started=pipeline.warm_started)
    tasks = list(environment.train_tasks if split == "train" else environment.eval_tasks)
    if not tasks:
        raise ValueError(f"--split {split}: the config has no {split} tasks")
    order = np.random.default_rng(seed).permutation(len(tasks))
    prompts = prompts or run_config.train.prompts_per_step
    all_arms = arms(templates)
    sample, turns, batches, seconds = Sample(), 0, 0, {"rollout": 0.0, "scoring": 0.0, "credit": 0.0}
    while turns < tool_turns and batches < max_batches:
        picked = [tasks[order[(batches * prompts + i) % len(tasks)]] for i in range(prompts)]
        t0 = time.perf_counter()
        rollout = pipeline.collect(rollout_params, picked, jax.random.fold_in(jax.random.PRNGKey(seed), batches))
        t1 = time.perf_counter()
        scores = {t: score_states(pipelines[t], reference_params, rollout) for t in templates}
        t2 = time.perf_counter()
        terms, credits = batch_turn_terms(pipeline, rollout, scores, all_arms, prompts)
        seconds["rollout"] += t1 - t0
        seconds["scoring"] += t2 - t1
        seconds["credit"] += time.perf_counter() - t2
        turns += add_batch(sample, rollout, scores, terms, credits, batches * prompts, run_config.rollout.max_turns)
        batches += 1
        log(f"credit-quality: batch {batches}: {sum(len(g) for g in sample.group)} episodes, {turns} of "
            f"{tool_turns} tool turns")
    data = sample.arrays()
    t0 = time.perf_counter()
    report = {"policy": policy, "reference": reference or policy, "split": split, "templates_scored": list(templates),
              "episodes": int(len(data["group"])), "groups": int(batches * prompts), "batches": batches,
              "tool_turns": int(data["num_turns"].sum()), "judged_turns": int(data["judged"].sum()),
              "first_page_turns": int(data["first_page"].sum()), "accuracy": float(data["correct"].mean()),
              "bootstrap": resamples, "seed": seed, "credit": run_config.credit.to_dict()}
    report.update(analyse(data, all_arms, templates, run_config.credit, resamples=resamples, seed=seed,
                          alphas=alphas, run_template=run_template))
    seconds["analysis"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - started
    report["seconds"] = seconds
    (out_dir / "credit_quality.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (out_dir / "credit_quality.md").write_text(markdown(report), encoding="utf-8")
    plot(report, out_dir / "credit_quality.png")
    write_episodes(out_dir / EPISODES_FILE, data, templates)
    log(f"credit-quality: {favoured_line(report['alpha'])}")
    log(f"credit-quality: wrote {out_dir / 'credit_quality.json'}, .md and .png ({seconds['total']:.0f} s)")
    return report


# ------------------------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default=None,
                        help="'<run dir>[@step]' (default its latest checkpoint), a Hugging Face directory, or 'init' "
                             "(the config's initial policy); required unless --favoured-from")
    parser.add_argument("--reference", default=None, help="the reference, in --policy's forms (default: the policy)")
    parser.add_argument("--gin-file", "--gin_file", action="append", default=[],
                        help="gin config file (repeatable; default: the run directory's config.gin, else "
                             "configs/tiny.gin)")
    parser.add_argument("--gin-param", "--gin_param", action="append", default=[],
                        help="extra binding, e.g. 'RolloutConfig.max_turns = 8' (repeatable)")
    parser.add_argument("--out-dir", "--out_dir", default=None,
                        help="output directory (default runs/credit-quality-<time>)")
    parser.add_argument("--templates", nargs="+", default=list(DEFAULT_TEMPLATES),
                        help="answer templates scored side by side, each with {answer} at its end (default: "
                             "'<answer>{answer}' and ' The answer is {answer}', the policy's own opening)")
    parser.add_argument("--tool-turns", "--tool_turns", type=int, default=5000,
                        help="sample batches until this many tool turns (default 5000)")
    parser.add_argument("--prompts", type=int, default=None,
                        help="prompts per batch (default TrainConfig.prompts_per_step; x RolloutConfig.group_size)")
    parser.add_argument("--split", choices=("train", "heldout"), default="train", help="which tasks to sample")
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of prompt groups")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task order, the rollouts and the bootstrap")
    parser.add_argument("--max-batches", "--max_batches", type=int, default=200,
                        help="stop after this many batches even short of --tool-turns")
    parser.add_argument("--alphas", default=",".join(f"{a:g}" for a in DEFAULT_ALPHAS),
                        help="TRACE alpha_turn grid of the alpha table, comma-separated numbers >= 0 (default "
                             f"{','.join(f'{a:g}' for a in DEFAULT_ALPHAS)})")
    parser.add_argument("--favoured-from", "--favoured_from", nargs="+", default=None, metavar="DIR",
                        help="sample nothing: print the favoured alpha_turn over these finished report directories "
                             "(one per warm start; each alpha's criterion averaged over them) and exit")


def run(args: argparse.Namespace) -> int:
    from trace_jax.rl.gin_setup import ConfigError, parse

    if args.favoured_from:
        try:
            alpha, means = favoured_over_reports([Path(d) for d in args.favoured_from])
        except (FileNotFoundError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        print("alpha_turn: mean within-group ordering over " + f"{len(args.favoured_from)} reports: " + ", ".join(
            f"{a:g}: {'-' if m is None else f'{m:.4f}'}" for a, m in means.items()))
        print(f"favoured alpha_turn: {'none (criterion undefined)' if alpha is None else f'{alpha:g}'}")
        return 0
    if args.policy is None:
        print("error: --policy is required (or --favoured-from DIR... to combine finished reports)", file=sys.stderr)
        return 2
    gin_files = list(args.gin_file)
    if not gin_files:
        own = Path(args.policy.rsplit("@", 1)[0]) / "config.gin"
        gin_files = [str(own)] if own.exists() else ["configs/tiny.gin"]
    for name in ("tool_turns", "bootstrap", "max_batches"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        alphas = parse_alphas(args.alphas)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        config = parse(gin_files, args.gin_param)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir or f"runs/credit-quality-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        run_credit_quality(config, args.policy, out_dir, reference=args.reference, templates=args.templates,
                           tool_turns=args.tool_turns, prompts=args.prompts, split=args.split,
                           resamples=args.bootstrap, seed=args.seed, max_batches=args.max_batches, alphas=alphas)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
