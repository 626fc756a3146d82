"""The host side of one RL step: rollouts -> rewards -> reference scoring -> credit -> `LossBatch` -> updates.

    tasks (P prompts)
      -> `run_episodes` (G samples each: N = P x G rows, fixed per step)             phase "rollout"
      -> the reference's answer scores after every state (`score_answer_prefixes`,
         one pass; only when the estimator `requires` answer_scores), on the answer
         continuation of `scoring.continuation.build_answer_continuation`              phase "scoring"
         (the builder `trace-jax credit` uses), ABC step counts from the step
         scorer of `UpdateConfig.abc` (rules or the LLM judge; abc_grpo, abc_sft_online)
         with the answer turn folded into the last step (`CreditConfig.
         abc_answer_step`), GiGPO anchor keys (gigpo, `CreditConfig.gigpo_anchor`),
         the oracle's progress gain per tool turn (oracle_progress)
      -> `compute_advantages(CreditConfig, ...)`: per-token advantages              phase "credit"
      -> `LossBatch` (token-aligned: behaviour log-probs are the sampler's
         `sampler_logprobs`; reference log-probs, for the KL term, the scorer's
         next-token-aligned ones through `models.alignment.to_token_aligned`)
      -> `UpdateConfig.epochs` x `UpdateConfig.mini_batches` train steps            phase "update"

Shapes: the update's are fixed by the run config (`update_shapes`), so it compiles once a run: `P x G` rows
(`x UpdateConfig.rows_per_episode` with context management), `UpdateConfig.max_length` tokens (default
`RolloutConfig.max_context`) and a `trained_index` of `UpdateConfig.max_trained_tokens` positions (default the most a
row can hold), each rounded up by `length_bucket` (the one bucketing rule) to `UpdateConfig.length_multiple`. Scoring
and credit run on the step's own length bucket (its longest row rounded up the same way); the `LossBatch` is then
padded with untrained zeros (`LossBatch.padded`). A step that does not fit a width the config lowered is padded to
the fallback that always fits (`max_context`; the trained-token bound; the next multiple of `P x G` rows): one more
compile, announced by an `UpdateShapeWarning` that names the field to raise, never a silent one. With
`UpdateConfig.packing` the scorer's trajectories and each update call's rows are packed end to end by segment ids
(`models.packing`; the packed-row count bucketed, so a bounded number of compiles) instead of padded to the width.

Context management (`RolloutConfig.context_budget`): an episode that compacted its context is several *segment* rows
(`rollout.batch`). Each row is scored on its own tokens (the contexts the policy saw); the scores are placed at the
episode's state numbers (`credit.episode_states`); the estimator runs once per episode on `credit.turn_layout` (one
reward per episode in its group's statistics, turns numbered across its rows), and its per-turn advantages are
broadcast onto the rows' tokens (`credit.segment_token_advantages`). The `LossBatch` has one row per segment,
padded with empty rows (loss mask 0) to `P x G x UpdateConfig.rows_per_episode`.

ABC-SFT online (ours; the paper's ABC-SFT is the warm start, `trace_jax.rl.warmstart`) is the estimator
`abc_sft_online`: its "advantages" are the per-token SFT weights `abc_sft_weights(step rewards)`,
it runs with `LossConfig.mode = 'sft'`, and by default it keeps only trajectories whose answer is verified correct
(`CreditResult.row_mask`: the dropped rows' loss mask is zeroed, so they count in neither sum nor count; a step
or a mini-batch whose rows are all dropped makes no optimizer step, logged as `skipped_mini_batches`).

The sampler-vs-trainer log-prob gap is logged as `sampler_trainer_gap`: the train step's `logprob_gap` on the first
mini-batch of the first epoch (trainer params equal the sampler's there), or, with `LossConfig.tis`, the mean
|trainer - sampler| over the whole batch from the trainer's recomputation of pi_old before the first update.

This module knows rollouts, scoring, credit and the train step; it knows nothing about gin, run directories,
checkpoints or evaluation (`trace_jax.rl.loop` owns those).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import models
from trace_jax.credit import (compute_advantages, episode_states, segment_token_advantages, trace_values,
                              turn_layout)
from trace_jax.credit.config import CreditConfig
from trace_jax.credit.gigpo import anchor_key_ids, state_keys
from trace_jax.credit.registry import CreditInputs, CreditResult, get_estimator
from trace_jax.models.alignment import to_token_aligned
from trace_jax.rl.abc_scoring import ABCScorerConfig, ABCStepScoring, step_rewards_from_counts
from trace_jax.rl.credit_diagnostics import credit_diagnostics, progress_gains
from trace_jax.rl.evaluate import episode_correct
from trace_jax.rl.warmstart import check_answer_template_choice, resolve_answer_template
from trace_jax.rollout.agent import Rollout, RolloutConfig, run_episodes
from trace_jax.rollout.batch import STATUSES, episode_view
from trace_jax.rollout.budget import GIB
from trace_jax.scoring.continuation import build_answer_continuation
from trace_jax.scoring.fork import score_answer_prefixes
from trace_jax.train import distributed
from trace_jax.train.config import LossConfig
from trace_jax.train.flops import flops_per_token
from trace_jax.train.loss import LossBatch, batch_logprobs, length_bucket, real_token_mask, trained_positions
from trace_jax.train.step import batch_shards, make_train_step

SCORING_METHODS = ("fork", "naive")
# The answer template TRACE scores after each state unless a run binds `UpdateConfig.answer_template`: the policy's
# own opening, which marked the turns that open evidence better than '<answer>' on all three study warm starts
# (credit-quality report, docs/results.md; docs/credit.md, "Which template").
DEFAULT_ANSWER_TEMPLATE = "policy"
# Rows packed by segment ids in scoring and the update (`UpdateConfig.packing`): exact, and on the tiny config no
# slower (docs/training.md, "Packed rows").
DEFAULT_PACKING = True


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """How one RL step turns its batch into updates.

    Attributes:
      epochs: passes over the step's batch (PPO epochs); the behaviour log-probs stay the sampler's.
      mini_batches: updates per epoch; the `P x G` rows are split into this many equal mini-batches (a fresh
        permutation per epoch, seeded by the step).
      length_multiple: the update's widths below, and the step's length bucket that scoring and credit run on (its
        longest row), are rounded up to a multiple of this (`length_bucket`).
      max_length: the update's token width: every step's `LossBatch` is padded to it, so the update compiles once
        a run; 0 = `RolloutConfig.max_context` (every row fits). A lower width spends less of the update on
        padding; a step with a longer row is then padded to `max_context` (one more compile, warned).
      max_trained_tokens: the update's `trained_index` width, the positions per row the LM head runs on; 0 = the
        most trained tokens a row can hold, `(max_turns + 1) x turn_token_budget` (at most the token width). A
        lower one spends less on the head; a step with a row over it falls back to that bound (warned).
      rows_per_episode: with context management (`RolloutConfig.context_budget`, an episode that compacts is
        several segment rows) the update's rows are `P x G x rows_per_episode`, padded with empty rows; a step
        with more segment rows is padded to the next multiple of `P x G` (one more compile, warned). Without
        context management the rows are `P x G`.
      scoring: "fork" (the one-pass prefix-fork scorer) or "naive" (one forward per state; for contrast only).
      scoring_batch: rows per scorer call (0 = all rows at once).
      answer_template: the text the reference is conditioned on before the gold answer it scores (after the chat
        format's `answer_prefix_text`): "answer_tag" (`<answer>{answer}`), "policy" (the policy's own opening,
        `warmstart.policy_answer_template`: " The answer is {answer}" for a policy warm-started on the oracle's
        demonstrations) or a literal template with `{answer}` at its end. Default `DEFAULT_ANSWER_TEMPLATE`.
      kl_metric: log `kl_ref`, the k3 estimate of KL(pi_old || pi_ref) on the sampled tokens, from the reference's
        log-probs of the trajectories; costs the reference's LM head over every token (with `LossConfig.kl_coef >
        0` the update computes those anyway and the train step logs `kl`).
      abc: the ABC step scorer of abc_grpo / abc_sft_online (`ABCScorerConfig`: `rules` or the LLM `judge`; bind
        `UpdateConfig.abc = @ABCScorerConfig()`).
      packing: run the reference scoring's trajectories and each update's rows packed end to end, by segment ids,
        into as few rows of the same width as first-fit decreasing gives (`models.packing`; the packed-row count
        bucketed to at most 16 sizes), instead of each row padded to the width: the same scores, log-probs, loss
        and gradients (within float32 rounding), fewer padding tokens through every layer. Default
        `DEFAULT_PACKING` (docs/training.md, "Packed rows").
    """

    epochs: int = 1
    mini_batches: int = 1
    length_multiple: int = 64
    max_length: int = 0
    max_trained_tokens: int = 0
    rows_per_episode: int = 1
    scoring: str = "fork"
    scoring_batch: int = 0
    answer_template: str = DEFAULT_ANSWER_TEMPLATE
    kl_metric: bool = False
    abc: ABCScorerConfig = ABCScorerConfig()
    packing: bool = DEFAULT_PACKING

    def __post_init__(self):
        for name in ("epochs", "mini_batches", "length_multiple", "rows_per_episode"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"UpdateConfig.{name} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("max_length", "max_trained_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"UpdateConfig.{name} must be an int >= 0 (0 = the bound every row fits), got "
                                 f"{getattr(self, name)!r}")
        if self.scoring not in SCORING_METHODS:
            raise ValueError(f"UpdateConfig.scoring must be one of {SCORING_METHODS}, got {self.scoring!r}")
        if not isinstance(self.scoring_batch, int) or self.scoring_batch < 0:
            raise ValueError(f"UpdateConfig.scoring_batch must be an int >= 0 (0 = all rows), got "
                             f"{self.scoring_batch!r}")
        check_answer_template_choice(self.answer_template, where="UpdateConfig.answer_template")
        if not isinstance(self.packing, bool):
            raise ValueError(f"UpdateConfig.packing must be True or False (pack rows by segment ids, or pad each "
                             f"row to the width), got {self.packing!r}")
        if not isinstance(self.abc, ABCScorerConfig):
            raise ValueError(f"UpdateConfig.abc must be an ABCScorerConfig (bind `UpdateConfig.abc = "
                             f"@ABCScorerConfig()`), got {self.abc!r}")


def check_compatible(credit: CreditConfig, loss: LossConfig, update: UpdateConfig, rows: int) -> None:
    """Raise ValueError naming the bindings when the estimator, the loss and the update cannot work together."""
    estimator = get_estimator(credit.estimator)
    if credit.estimator == "abc_sft_online" and loss.mode != "sft":
        raise ValueError("CreditConfig.estimator = 'abc_sft_online' is weighted SFT: bind LossConfig.mode = 'sft' "
                         "(configs/credit/abc_sft_online.gin does)")
    if loss.mode == "sft" and credit.estimator != "abc_sft_online":
        raise ValueError(f"LossConfig.mode = 'sft' trains on the estimator's output as SFT weights; only "
                         f"'abc_sft_online' produces weights, got CreditConfig.estimator = {credit.estimator!r}; bind "
                         "LossConfig.mode = 'rl'")
    if loss.mode == "rl" and estimator.ratio != loss.ratio_level:
        raise ValueError(f"estimator {credit.estimator!r} is meant for LossConfig.ratio_level = "
                         f"{estimator.ratio!r}, got {loss.ratio_level!r}; bind LossConfig.ratio_level = "
                         f"'{estimator.ratio}'")
    if loss.mode == "rl" and estimator.aggregation is not None and loss.aggregation != estimator.aggregation:
        raise ValueError(f"estimator {credit.estimator!r} is defined with LossConfig.aggregation = "
                         f"'{estimator.aggregation}' (one loss term per sequence), got {loss.aggregation!r}; bind "
                         f"LossConfig.aggregation = '{estimator.aggregation}' (configs/credit/gspo.gin does)")
    if "step_rewards" in estimator.requires and update.abc.scorer == "judge":
        update.abc.endpoint()  # a judge without an endpoint fails here, before any compute
    if rows % update.mini_batches:
        raise ValueError(f"UpdateConfig.mini_batches = {update.mini_batches} must divide the rows per step "
                         f"(prompts_per_step x group_size = {rows})")
    if (rows // update.mini_batches) % loss.micro_batches:
        raise ValueError(f"LossConfig.micro_batches = {loss.micro_batches} must divide the rows per mini-batch "
                         f"({rows // update.mini_batches})")


class UpdateShapeWarning(UserWarning):
    """A step's batch did not fit a width the run config lowered (`UpdateConfig.max_length`, `max_trained_tokens`,
    `rows_per_episode`): it was padded to the fallback instead, and the update compiles once more for it."""


@dataclasses.dataclass(frozen=True)
class UpdateShapes:
    """The shape every step's `LossBatch` is padded to: `[rows, length]` arrays and a `[rows, head_width]`
    `trained_index`."""

    rows: int
    length: int
    head_width: int


def update_shapes(rollout: RolloutConfig, update: UpdateConfig, episodes: int, *,
                  length: int | None = None) -> UpdateShapes:
    """The update's shapes for `episodes` (`P x G`) episodes a step, from the config alone, each rounded up by
    `length_bucket` to `UpdateConfig.length_multiple`: rows `episodes` (`x rows_per_episode` with context
    management), the token width `UpdateConfig.max_length` (0: `RolloutConfig.max_context`) and the
    `trained_index` width `max_trained_tokens` (0: `(max_turns + 1) x turn_token_budget`, the most a row can hold:
    one turn budget per tool turn and the answer turn), at most the token width. `length` overrides the token width
    (the fallback of a step with a longer row)."""
    multiple, context = update.length_multiple, rollout.max_context
    length = length_bucket(length or update.max_length or context, multiple, context)
    most_trained = (rollout.max_turns + 1) * rollout.turn_token_budget
    head_width = length_bucket(min(update.max_trained_tokens or most_trained, length), multiple, length)
    rows = episodes * (update.rows_per_episode if rollout.context_budget else 1)
    return UpdateShapes(rows=rows, length=length, head_width=head_width)


def packing_shards(mesh, rules, rows: int, micro_batches: int) -> int:
    """The batch shards an update call of `rows` rows is packed within (`LossBatch.packed`): those of its rows on
    the update's mesh (`train.step.batch_shards`), or 1 where each micro-batch's rows do not split evenly over them
    (then the gathers cross shards; the values are the same)."""
    shards = batch_shards(mesh, rules, rows)
    return shards if rows % (micro_batches * shards) == 0 else 1


def _fallback(message: str) -> None:
    warnings.warn(message + " (one more compile of the update)", UpdateShapeWarning, stacklevel=3)


class BehaviourProgram:
    """The trainer's recomputation of pi_old (`batch_logprobs`) as one jitted program: `program(params, batch)`,
    `program.lower(params, batch)` (`rl.programs` lists it); `jitted` is the jitted function. Both trace under
    `jax.set_mesh(mesh)` (the update's mesh), as the train step does: without it the Pallas TPU attention, a
    per-device kernel, does not lower on a mesh of several chips (`trace-jax plan` found this)."""

    def __init__(self, jitted, mesh):
        self.jitted, self.mesh = jitted, mesh

    def _context(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def __call__(self, params, batch):
        with self._context():
            return self.jitted(params, batch)

    def lower(self, params, batch):
        with self._context():
            return self.jitted.lower(params, batch)


@functools.lru_cache(maxsize=16)
def behaviour_program(model_config, loss: LossConfig, mesh=None) -> BehaviourProgram:
    """The program `RLPipeline.with_trainer_behaviour` runs on each chunk of the batch (`LossConfig.tis`), on the
    update's `mesh`: one object per (model, loss config, mesh), so the pipeline and `rl.programs` hold the same
    one."""
    return BehaviourProgram(jax.jit(functools.partial(batch_logprobs, model_config, loss)), mesh)


@dataclasses.dataclass
class Prepared:
    """One step's batch, ready for updates, with what it took to build it.

    Attributes:
      rollout: the `Rollout` (device batch at full `max_context` width, episodes).
      loss_batch: the `LossBatch`, padded to the update's fixed shapes (`update_shapes`).
      credit: the `CreditResult` (token advantages `[N, Lb]`, outcome, per-turn values); for a segmented batch the
        estimator's result on its episodes' `turn_layout` (`[E, T+1]`, one pseudo-token per turn).
      answer_scores: `[E, T+1]` reference scores per episode state, or None when the estimator does not need them.
      step_rewards: `[E, T+1]` ABC step rewards, or None.
      metrics: rollout, credit and scoring statistics of the step (host floats).
      timing: seconds of rollout, scoring and credit.
      width: the step's length bucket, the tokens per row scoring and credit ran on (the `loss_batch` is wider).
    """

    rollout: Rollout
    loss_batch: LossBatch
    credit: CreditResult
    answer_scores: np.ndarray | None
    step_rewards: np.ndarray | None
    metrics: dict[str, float]
    timing: dict[str, float]
    width: int = 0


class RLPipeline:
    """The RL step of one policy on one environment (see the module docstring).

    Args:
      model_config: the policy's (and reference's) `ModelConfig`.
      chat: the policy's `ChatFormat`.
      browser: the rollouts' `Browser` (or `task -> Browser`).
      rollout, credit, loss, update: the configs.
      optimizer: the optax optimizer of the train step.
      mesh, rules: optional mesh for the sampler, scorer and train step (a run's whole mesh, over every process:
        each process collects and scores its own rows in programs over all of it), and the train layout's
        logical-axis rules (the scorer's and the train step's; a run passes `MeshConfig.train_rules()`; None =
        `models.DEFAULT_RULES`).
      rollout_rules: the sampler's rules (the rollout layout the params of `collect` are in; a run passes
        `MeshConfig.rollout_rules()`); None = `models.rollout_rules(rules)`.
      train_step: a compiled `make_train_step(model_config, loss, optimizer, ...)` to reuse (pipelines that share
        model, loss and optimizer then compile the update once); None builds one.
      warm_started: the policy was fine-tuned on the oracle's demonstrations (`RunConfig.warm_started`); it decides
        what the answer template "policy" is (`UpdateConfig.answer_template`).
    """

    def __init__(self, model_config, chat, browser, rollout: RolloutConfig, credit: CreditConfig, loss: LossConfig,
                 update: UpdateConfig, optimizer, *, mesh=None, rules=None, rollout_rules=None, train_step=None,
                 warm_started: bool = False):
        self.model_config, self.chat, self.browser = model_config, chat, browser
        self.rollout, self.credit, self.loss, self.update_config = rollout, credit, loss, update
        self.mesh, self.rules = mesh, rules
        self.rollout_rules = rollout_rules if rollout_rules is not None else \
            models.rollout_rules(models.DEFAULT_RULES if rules is None else rules)
        self.estimator = get_estimator(credit.estimator)
        self.train_step = train_step or make_train_step(model_config, loss, optimizer, mesh=mesh, rules=rules)
        self.warm_started = warm_started
        self._continuations: dict[str, Any] = {}
        self._credit_fns: dict[int, Any] = {}
        self.step_rewards_needed = "step_rewards" in self.estimator.requires
        self.scores_needed = "answer_scores" in self.estimator.requires
        # resolved here, so a template this policy cannot use fails before any compute
        self.answer_template = resolve_answer_template(update.answer_template, chat, warm_started=warm_started) \
            if self.scores_needed else None
        self._abc_scoring: ABCStepScoring | None = None
        self._logprob_fn = None

    # ---------------------------------------------------------------------------------------------- pieces
    def continuation(self, gold: str):
        """The answer continuation of `gold` (cached; `build_answer_continuation`, the one builder) under
        `UpdateConfig.answer_template`."""
        if gold not in self._continuations:
            template = self.answer_template or resolve_answer_template(
                self.update_config.answer_template, self.chat, warm_started=self.warm_started)
            self._continuations[gold] = build_answer_continuation(self.chat.tokenizer, self.chat, gold,
                                                                  template=template)
        return self._continuations[gold]

    def collect(self, params, tasks: Sequence[Any], rng, *, row_offset: int | None = None) -> Rollout:
        """`len(tasks) x group_size` episodes of the current policy. On a mesh over several processes each process
        collects its own tasks, all together, and by default its rows' keys count from its first row of the step
        (process p's tasks are the p-th equal share: `row_offset = p x len(tasks) x group_size`), so every row
        draws what it draws in a one-process run with the same `rng`; `row_offset` (`run_episodes`) says otherwise
        (0 by default on one process)."""
        if row_offset is None:
            together = distributed.spans_processes(self.mesh)
            row_offset = jax.process_index() * len(tasks) * self.rollout.group_size if together else 0
        return run_episodes(self.model_config, params, self.chat, tasks, self.browser, self.rollout, rng,
                            mesh=self.mesh, rules=self.rollout_rules, row_offset=row_offset)

    def score(self, reference_params, rollout: Rollout, width: int, *, token_logprobs: bool = False):
        """The reference's answer scores `[N, T+1]` and (with `token_logprobs`) its next-token log-probs
        `[N, width]` of the batch's rows (else None); a segment row's column j is its episode's state
        `first_turn + j`."""
        batch = rollout.batch
        conts = [self.continuation(rollout.episodes[e].gold[0]) for e in np.asarray(batch.episode)]
        m = max(len(c.ids) for c in conts)
        answers = np.zeros((len(conts), m), np.int32)
        masks = np.zeros((len(conts), m), np.int32)
        for row, c in enumerate(conts):
            answers[row, :len(c.ids)] = c.ids
            masks[row, :len(c.mask)] = c.mask
        tokens = np.asarray(batch.tokens)[:, :width]
        boundaries = np.asarray(batch.boundaries)
        num_states = np.asarray(batch.num_states)
        lengths = np.asarray(batch.lengths)
        n = tokens.shape[0]
        chunk = self.update_config.scoring_batch or n
        scores, token_lp = [], []
        for start in range(0, n, chunk):
            part = slice(start, start + chunk)
            result = score_answer_prefixes(self.model_config, reference_params, tokens[part], boundaries[part],
                                           num_states[part], answers[part], masks[part], lengths=lengths[part],
                                           method=self.update_config.scoring, mesh=self.mesh, rules=self.rules,
                                           token_logprobs=token_logprobs, pack_rows=self.update_config.packing)
            scores.append(np.asarray(result.answer_scores))
            if token_logprobs:
                token_lp.append(np.asarray(result.token_logprobs))
        return np.concatenate(scores), (np.concatenate(token_lp) if token_logprobs else None)

    @property
    def abc_scoring(self) -> ABCStepScoring:
        """The ABC step scorer of `UpdateConfig.abc` (built on first use; the judge's clue recovery browses the
        rollouts' corpus)."""
        if self._abc_scoring is None:
            corpus = getattr(self.browser, "corpus", None)
            config = self.update_config.abc
            if config.scorer == "judge" and config.recover_clues and corpus is None:
                raise ValueError("ABCScorerConfig.recover_clues needs the rollouts' Browser (its corpus) to recover "
                                 "clue chains; this pipeline has a per-task browser factory: set "
                                 "ABCScorerConfig.recover_clues = False or give tasks their clue chains")
            self._abc_scoring = ABCStepScoring(config, corpus)
        return self._abc_scoring

    def abc_step_rewards(self, rollout: Rollout) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
        """ABC step rewards `[N, T+1]`, step counts `[N]` and scoring statistics, from the step scorer of
        `UpdateConfig.abc` on each episode; with `CreditConfig.abc_answer_step = 'fold'` the answer turn is part of
        the last tool step (`fold_answer_steps`)."""
        counts, metrics = self.abc_scoring.score(rollout.episodes)
        rewards, num_steps = step_rewards_from_counts(counts, episode_view(rollout.batch).num_turns,
                                                      answer_step=self.credit.abc_answer_step,
                                                      num_steps_max=self.rollout.max_turns + 1)
        return rewards, num_steps, metrics

    def _credit_fn(self, num_groups: int):
        if num_groups not in self._credit_fns:
            self._credit_fns[num_groups] = jax.jit(functools.partial(compute_advantages, self.credit,
                                                                     num_groups=num_groups))
        return self._credit_fns[num_groups]

    # ---------------------------------------------------------------------------------------------- the step
    def prepare(self, rollout: Rollout, reference_params, *, num_prompts: int) -> Prepared:
        """Everything after the rollout and before the update (scoring, credit, the `LossBatch`)."""
        timing = {"scoring": 0.0, "credit": 0.0}
        batch = rollout.batch
        view = episode_view(batch)
        segmented = batch.segmented
        lengths = np.asarray(batch.lengths)
        width = length_bucket(int(lengths.max()), self.update_config.length_multiple, self.rollout.max_context)
        answer_scores = ref_token_lp = step_rewards = num_steps = None
        start = time.perf_counter()
        want_token_lp = self.loss.needs_reference or self.update_config.kl_metric
        if self.scores_needed or want_token_lp:
            answer_scores, ref_token_lp = self.score(reference_params, rollout, width, token_logprobs=want_token_lp)
            if segmented:  # each state scored on its row, placed at the episode's state number
                answer_scores = np.asarray(episode_states(answer_scores, view.episode, view.first_turn,
                                                          np.asarray(batch.num_states), view.num_episodes))
        abc_metrics = {}
        if self.step_rewards_needed:
            step_rewards, num_steps, abc_metrics = self.abc_step_rewards(rollout)
        timing["scoring"] = time.perf_counter() - start

        start = time.perf_counter()
        extra = {}
        if answer_scores is not None and self.scores_needed:
            extra["answer_scores"] = jnp.asarray(answer_scores)
        if step_rewards is not None:
            extra["step_rewards"], extra["num_steps"] = jnp.asarray(step_rewards), jnp.asarray(num_steps)
        if "anchor_keys" in self.estimator.requires:
            slots = self.rollout.max_turns + 1
            keys = [state_keys(e.observations, self.credit.gigpo_anchor)[:slots] for e in rollout.episodes]
            extra["anchor_keys"] = jnp.asarray(anchor_key_ids(keys, slots))
        if "correct" in self.estimator.requires:
            extra["correct"] = jnp.asarray([episode_correct(e) for e in rollout.episodes])
        if "progress_gains" in self.estimator.requires:  # oracle_progress: one gain per tool turn of each episode
            extra["progress_gains"] = jnp.asarray(progress_gains(rollout.episodes, self.rollout.max_turns + 1))
        loss_mask = batch.loss_mask[:, :width]
        turn_index = batch.turn_index[:, :width]
        if segmented:  # once per episode, one pseudo-token per turn, then onto the segment rows' tokens
            num_turns = jnp.asarray(view.num_turns, jnp.int32)
            layout_index, layout_mask = turn_layout(num_turns, self.rollout.max_turns + 1)
            inputs = CreditInputs(rewards=jnp.asarray(view.reward), group_id=jnp.asarray(view.group_id, jnp.int32),
                                  loss_mask=layout_mask, turn_index=layout_index, num_turns=num_turns, **extra)
            credit = self._credit_fn(num_prompts)(inputs)
            advantages = np.asarray(segment_token_advantages(credit.token_advantages, view.episode, turn_index,
                                                             loss_mask), np.float32)
            row_mask = None if credit.row_mask is None else credit.row_mask[jnp.asarray(view.episode)]
        else:
            inputs = batch.credit_inputs(**extra)._replace(loss_mask=loss_mask, turn_index=turn_index)
            credit = self._credit_fn(num_prompts)(inputs)
            advantages = np.asarray(credit.token_advantages, np.float32)
            row_mask = credit.row_mask
        if row_mask is not None:  # trajectories the estimator drops count in neither the loss nor its count
            loss_mask = loss_mask * row_mask[:, None].astype(loss_mask.dtype)
        timing["credit"] = time.perf_counter() - start

        reference_lp = None
        if self.loss.needs_reference and ref_token_lp is not None:
            reference_lp = to_token_aligned(jnp.asarray(ref_token_lp))
        shapes = self.update_shapes(num_prompts, width, loss_mask)
        loss_batch = LossBatch(tokens=batch.tokens[:, :width], positions=batch.positions[:, :width],
                               loss_mask=loss_mask, advantages=jnp.asarray(advantages),
                               behaviour_logprobs=batch.sampler_logprobs[:, :width],
                               reference_logprobs=reference_lp,
                               sampler_logprobs=(batch.sampler_logprobs[:, :width]
                                                 if self.loss.needs_sampler_logprobs else None),
                               token_mask=real_token_mask(lengths, width),
                               trained_index=jnp.asarray(trained_positions(
                                   loss_mask, head_width=min(shapes.head_width, width))))
        loss_batch = loss_batch.padded(shapes.rows, shapes.length, shapes.head_width)
        metrics = self.step_metrics(rollout, credit, answer_scores, ref_token_lp, width, num_prompts,
                                    advantages=advantages)
        metrics.update(abc_metrics)
        if credit.row_mask is not None:
            metrics["credit/kept_rows"] = float(np.asarray(credit.row_mask).mean())
        return Prepared(rollout, loss_batch, credit, answer_scores, step_rewards, metrics, timing, width=width)

    def update_shapes(self, num_prompts: int, width: int, loss_mask) -> UpdateShapes:
        """The shapes a step's `LossBatch` is padded to: the run's (`update_shapes`), or where the step's rows do
        not fit a width the config lowered, the fallback that fits, with an `UpdateShapeWarning` naming the
        field (the module doc). `width` is the step's length bucket and `loss_mask` its `[rows, width]` mask."""
        config, episodes = self.update_config, num_prompts * self.rollout.group_size
        shapes = update_shapes(self.rollout, config, episodes)
        if width > shapes.length:
            _fallback(f"a row of {width} tokens (length bucket) is longer than the update's width {shapes.length} "
                      f"(UpdateConfig.max_length = {config.max_length}): padded to RolloutConfig.max_context = "
                      f"{self.rollout.max_context}; raise UpdateConfig.max_length to {width} or more")
            shapes = update_shapes(self.rollout, config, episodes, length=self.rollout.max_context)
        most_trained = int((np.asarray(loss_mask) > 0).sum(axis=1).max(initial=0))
        if most_trained > shapes.head_width:
            bound = update_shapes(self.rollout, dataclasses.replace(config, max_trained_tokens=0), episodes,
                                  length=shapes.length).head_width
            _fallback(f"a row has {most_trained} trained tokens, more than the update's trained_index width "
                      f"{shapes.head_width} (UpdateConfig.max_trained_tokens = {config.max_trained_tokens}): "
                      f"padded to the bound {bound}; raise UpdateConfig.max_trained_tokens to {most_trained} or more")
            shapes = dataclasses.replace(shapes, head_width=bound)
        rows = int(np.asarray(loss_mask).shape[0])
        if rows > shapes.rows:
            padded = -(-rows // episodes) * episodes
            _fallback(f"{rows} segment rows for {episodes} episodes, more than the update's {shapes.rows} "
                      f"(UpdateConfig.rows_per_episode = {config.rows_per_episode}): padded to {padded}; raise "
                      f"UpdateConfig.rows_per_episode to {-(-rows // episodes)} or more")
            shapes = dataclasses.replace(shapes, rows=padded)
        return shapes

    def update(self, state, prepared: Prepared, reference_params=None, *, seed: int = 0):
        """`epochs x mini_batches` train steps on the prepared batch, less the mini-batches whose rows the estimator
        dropped entirely; returns `(state, metrics)` (means over the updates, plus `sampler_trainer_gap` from the
        first one, `updates` and, when the estimator drops rows, `skipped_mini_batches`)."""
        loss_batch = prepared.loss_batch
        n = loss_batch.shape[0]
        per = n // self.update_config.mini_batches
        ref = reference_params if (self.loss.needs_reference and loss_batch.reference_logprobs is None) else None
        if not float(jnp.sum(loss_batch.loss_mask)):  # every row dropped (ABC-SFT with no correct answer)
            return state, {"updates": 0.0}
        gap = None
        if self.loss.needs_sampler_logprobs:
            loss_batch, gap = self.with_trainer_behaviour(state.params, loss_batch)
        collected: list[dict] = []
        skipped = 0
        may_drop = (prepared.credit is not None and prepared.credit.row_mask is not None
                    and self.update_config.mini_batches > 1)
        for epoch in range(self.update_config.epochs):
            order = (np.arange(n) if self.update_config.mini_batches == 1
                     else np.random.default_rng([seed, epoch]).permutation(n))
            for k in range(self.update_config.mini_batches):
                index = jnp.asarray(order[k * per:(k + 1) * per])
                mini = loss_batch if self.update_config.mini_batches == 1 else jax.tree_util.tree_map(
                    lambda x: x[index], loss_batch)
                # a mini-batch whose rows were all dropped has no loss; an optimizer step on its zero gradient
                # would still move the params (AdamW's momentum) and advance the schedule
                if may_drop and not float(jnp.sum(mini.loss_mask)):
                    skipped += 1
                    continue
                if self.update_config.packing:
                    mini = self.packed(mini)
                state, metrics = self.train_step(state, mini, ref)
                collected.append(metrics)
        collected = jax.device_get(collected)
        out = {name: float(np.mean([m[name] for m in collected])) for name in collected[0]}
        if may_drop:
            out["skipped_mini_batches"] = float(skipped)
        if gap is not None:
            out["sampler_trainer_gap"] = gap
        elif "logprob_gap" in collected[0]:  # rl mode only (sft has no behaviour policy)
            out["sampler_trainer_gap"] = float(collected[0]["logprob_gap"])
        out["updates"] = float(len(collected))
        return state, out

    def packed(self, batch: LossBatch) -> LossBatch:
        """One update call's batch with its rows packed (`LossBatch.packed`) in the groups the train step splits
        it in: `LossConfig.micro_batches`, and the batch shards of the update's mesh. On a mesh over several
        processes the batch is a global array no process reads whole: it stays padded (no lock-step plan yet)."""
        mesh = getattr(self.train_step, "mesh", None)
        if distributed.spans_processes(mesh):
            return batch
        shards = packing_shards(mesh, self.rules, batch.shape[0], self.loss.micro_batches)
        return batch.packed(micro_batches=self.loss.micro_batches, shards=shards)

    def with_trainer_behaviour(self, params, loss_batch: LossBatch) -> tuple[LossBatch, float]:
        """The batch with `behaviour_logprobs` recomputed by the trainer under `params` (pi_old for the clipped
        ratio, the numerator of the TIS weights; `LossConfig.tis`), and the mean |trainer - sampler| gap over
        its trained tokens. Runs in chunks of one micro-batch's rows, so it needs no more memory than an update."""
        if self._logprob_fn is None:
            mesh = getattr(self.train_step, "mesh", None)  # the update's: the batch is global on it
            self._logprob_fn = behaviour_program(self.model_config, self.loss, mesh)
        n = loss_batch.shape[0]
        chunk = max(1, n // (self.update_config.mini_batches * self.loss.micro_batches))
        parts = [self._logprob_fn(params, jax.tree_util.tree_map(lambda x: x[start:start + chunk], loss_batch))
                 for start in range(0, n, chunk)]
        trainer = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
        mask = loss_batch.loss_mask.astype(jnp.float32)
        gap = float(jnp.sum(jnp.abs(trainer - loss_batch.sampler_logprobs) * mask) / jnp.maximum(jnp.sum(mask), 1))
        return loss_batch.replace(behaviour_logprobs=trainer), gap

    # ---------------------------------------------------------------------------------------------- metrics
    def step_metrics(self, rollout: Rollout, credit: CreditResult, answer_scores, ref_token_lp, width: int,
                     num_prompts: int, *, advantages=None) -> dict[str, float]:
        """Rollout and credit statistics of one step (see docs/running.md, "The loop"), each episode counted once.

        `credit` is the estimator's result on the batch's rows, or, for a segmented batch, on its episodes'
        `turn_layout`; `advantages [N, width]` are then the rows' token advantages (default: `credit`'s)."""
        batch, episodes = rollout.batch, rollout.episodes
        view = episode_view(batch)
        rewards = np.asarray(view.reward, np.float64)
        num_turns = np.asarray(view.num_turns)
        n = len(episodes)
        out: dict[str, float] = {
            "reward": float(rewards.mean()),
            "accuracy": float(np.mean([episode_correct(e) for e in episodes])),
            "turns": float(np.mean([len(e.turn_texts) for e in episodes])),
            "tool_calls": float(np.mean([len(e.tool_calls) for e in episodes])),
            "tool_errors": float(np.mean([e.num_tool_errors for e in episodes])),
            "length": float(np.asarray(batch.lengths).mean()),
            "length_bucket": float(width),
            "generated_tokens": float(rollout.generated_tokens),
            "rows_at_once": float(rollout.rows_at_once),
            "kv_cache_gib": rollout.kv_cache_bytes / GIB,
        }
        stats = getattr(rollout, "stats", None)
        if stats is not None:  # the engine's (`engine.PagedRollout`; a `Rollout` built by hand has none)
            out["rollout_useful_row_steps"] = stats.useful_row_steps / max(stats.row_steps, 1)
            out["rollout_preemptions"] = float(stats.preemptions)
        for name in STATUSES[1:]:
            out[f"status/{name}"] = float(np.mean([e.status == name for e in episodes]))
        # the diagnostics read one layout row per episode: the batch's own, or the episodes' `turn_layout`
        credit_adv = np.asarray(credit.token_advantages, np.float64)
        if batch.segmented:
            layout_index, layout_mask = (np.asarray(x) for x in turn_layout(num_turns, credit_adv.shape[1]))
            credit_mask = layout_mask.astype(bool)
        else:
            layout_index = np.asarray(batch.turn_index)[:, :width]
            credit_mask = np.asarray(batch.loss_mask, bool)[:, :width]
        if credit.row_mask is not None:  # rows the estimator drops are not trained
            credit_mask = credit_mask & np.asarray(credit.row_mask, bool)[:, None]
        out.update(credit_diagnostics(episodes, credit_adv, credit_mask, layout_index, rewards,
                                      num_prompts=num_prompts, num_turns_max=self.rollout.max_turns,
                                      std_eps=self.credit.std_eps))
        adv = credit_adv if advantages is None else np.asarray(advantages, np.float64)
        per_turn = None if credit.per_turn is None else np.asarray(credit.per_turn, np.float64)
        tool_turn = np.arange(self.rollout.max_turns)[None, :] < num_turns[:, None]
        if per_turn is not None and self.scores_needed:
            per_turn = per_turn[:, :tool_turn.shape[1]]
            out["credit/mean_abs_turn_credit"] = float(np.abs(per_turn)[tool_turn].mean()) if tool_turn.any() else 0.0
            k = np.arange(tool_turn.shape[1])[None, :]
            horizon = self.credit.horizon
            reaches = (k == num_turns[:, None] - 1) if horizon == 0 else (k + horizon - 1 >= num_turns[:, None] - 1)
            out["credit/terminal_fill_share"] = float(reaches[tool_turn].mean()) if tool_turn.any() else 0.0
        if answer_scores is not None:
            values = np.asarray(trace_values(jnp.asarray(answer_scores), jnp.asarray(num_turns), eps=self.credit.eps,
                                             min_score=self.credit.min_score))
            out["credit/last_state_value"] = float(values[np.arange(n), num_turns].mean())
            out["credit/first_state_score"] = float(np.asarray(answer_scores)[:, 0].mean())
        if ref_token_lp is not None:
            # KL(pi_old || pi_ref) on the sampled tokens, k3 estimator (the update's KL when kl_coef = 0)
            ref_lp = np.asarray(to_token_aligned(jnp.asarray(ref_token_lp)), np.float64)
            old_lp = np.asarray(batch.sampler_logprobs, np.float64)[:, :width]
            mask = np.asarray(batch.loss_mask, bool)[:, :width]
            log_ratio = ref_lp - old_lp
            k3 = np.exp(log_ratio) - log_ratio - 1.0
            out["kl_ref"] = float(k3[mask].mean()) if mask.any() else 0.0
        mask = np.asarray(batch.loss_mask, bool)[:, :width]
        out["credit/mean_abs_token_advantage"] = float(np.abs(adv[mask]).mean()) if mask.any() else 0.0
        if credit.outcome_advantages is not None:
            out["credit/mean_abs_outcome_advantage"] = float(np.abs(np.asarray(credit.outcome_advantages)).mean())
        return out

    def throughput(self, prepared: Prepared, update_seconds: float, rollout_seconds: float, *,
                   peak_flops: float | None) -> dict[str, float]:
        """tokens/s of rollouts and updates, TFLOP/s of the updates and MFU against `peak_flops`."""
        rows, width = prepared.loss_batch.shape
        trained = rows * width * self.update_config.epochs
        out = {"rollout_tokens_per_s": prepared.rollout.generated_tokens / max(rollout_seconds, 1e-9),
               "update_tokens_per_s": trained / max(update_seconds, 1e-9)}
        flops = flops_per_token(self.model_config, width) * trained
        if prepared.loss_batch.trained_index is not None:  # the LM head ran on the trained tokens only
            head = 6.0 * self.model_config.hidden_size * self.model_config.vocab_size
            # a device reduction: the batch may be a global array over several processes (replicated scalar out)
            scored = float(jnp.sum(prepared.loss_batch.loss_mask > 0)) * self.update_config.epochs
            flops -= head * (trained - scored)
        out["update_tflops"] = flops / max(update_seconds, 1e-9) / 1e12
        if peak_flops:
            out["mfu"] = flops / max(update_seconds, 1e-9) / peak_flops
        return out
