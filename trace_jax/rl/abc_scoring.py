"""ABC step scoring inside the RL step: which step scorer the trainer uses (`rules` or the LLM `judge`), where the
clue chain of each episode comes from, and the step counts of a batch of episodes.

`ABCScorerConfig` selects the scorer (credit-spec section 3; docs/abc.md):

    rules   `trace_jax.abc.RuleBasedStepScorer`: counts from the observations against the task's own clue chain
            (generated tasks know it exactly). No network.
    judge   `trace_jax.abc.judge.LLMJudgeStepScorer` at any OpenAI-compatible endpoint (`judge_url`, `judge_model`,
            or `$TRACE_JAX_JUDGE_URL` / `_MODEL`; the key only from `$TRACE_JAX_JUDGE_API_KEY`, never a config file).
            A task without a clue chain (an external task: no clues, or evidence-document placeholders without
            values) gets one from the clue-recovery agent
            (`trace_jax.abc.recover`) at the same endpoint, over the rollouts' corpus, once per (question, answer).

Episodes that fail without answering and failed tool calls (credit-spec section 3, "ours"; docs/abc.md): the last
step of an episode that ends without an answer (turn cap, context overflow) gets `ans = ABCScorerConfig.no_answer`
(-1, as a wrong answer, by default; 0 is the old neutral reading), and a step whose tool call failed scores the
rubric's floor `r = 0` (`ABCScorerConfig.error_step = 0`, default; 'neutral' scores it as any step). Both scorers
apply them.

`ABCStepScoring.score(episodes)` returns one list of `StepCounts` per episode (steps as `steps_from_episode` cuts
them: one per generated turn) and the batch's scoring statistics. `step_rewards_from_counts` turns them into the
step rewards the credit estimators read, calling the credit arithmetic (`trace_jax.credit.fold_answer_steps`, which
folds the answer turn into the last tool step, and `abc_step_rewards`); the RL step and the ABC-SFT warm start
(`trace_jax.rl.warmstart`) both use it.

This module knows the ABC scorers, clue recovery and the episode records; it knows nothing about models, arrays on
device or the train step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

SCORERS = ("rules", "judge")


@dataclasses.dataclass(frozen=True)
class ABCScorerConfig:
    """The ABC step scorer of `abc_grpo` / `abc_sft_online` training (see the module docstring).

    Attributes:
      scorer: "rules" (the rule-based scorer on the task's clue chain) or "judge" (the LLM judge).
      judge_url: the judge's API root, e.g. `http://127.0.0.1:8000/v1`; '' = `$TRACE_JAX_JUDGE_URL`.
      judge_model: the judge's model id; '' = `$TRACE_JAX_JUDGE_MODEL`.
      timeout_s: seconds per judge (and recovery) request.
      max_attempts: judge calls per step before the step is scored neutral and flagged.
      backoff_s: first retry delay (doubles).
      concurrency: steps of one trajectory judged at the same time.
      cache_dir: the judgement cache ('' = none; a judged step is then never reused across steps of training).
      audit_path: JSONL of every judge call ('' = none).
      recover_clues: give tasks without a clue chain one from the clue-recovery agent (judge only).
      recover_max_turns: model calls the recovery agent may make per question.
      no_answer: `ans` of the last step of an episode that ends without an answer (turn cap, context overflow): -1
        (default: it has failed, as a wrong answer) or 0 (neutral; then running out of turns scores 1.0 where a
        wrong answer scores 0, and group normalisation pays the policy never to answer).
      error_step: 0 (default): a step whose tool call failed (an error observation) scores the rubric's floor
        r = 0; 'neutral': it is scored as any other step (1.0 when it reveals nothing).
    """

    scorer: str = "rules"
    judge_url: str = ""
    judge_model: str = ""
    timeout_s: float = 60.0
    max_attempts: int = 3
    backoff_s: float = 0.5
    concurrency: int = 4
    cache_dir: str = ""
    audit_path: str = ""
    recover_clues: bool = True
    recover_max_turns: int = 16
    no_answer: int = -1
    error_step: int | str = 0

    def __post_init__(self):
        from trace_jax.abc.rules import check_episode_options

        check_episode_options("ABCScorerConfig", self.no_answer, self.error_step)
        if self.scorer not in SCORERS:
            raise ValueError(f"ABCScorerConfig.scorer must be one of {SCORERS}, got {self.scorer!r}")
        for name in ("max_attempts", "concurrency", "recover_max_turns"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ABCScorerConfig.{name} must be an int >= 1, got {value!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"ABCScorerConfig.timeout_s must be > 0, got {self.timeout_s!r}")
        if self.backoff_s < 0:
            raise ValueError(f"ABCScorerConfig.backoff_s must be >= 0, got {self.backoff_s!r}")

    def endpoint(self):
        """The judge's `EndpointConfig` (fields first, then the environment); ValueError naming the binding."""
        from trace_jax.serve.client import EndpointConfig

        try:
            return EndpointConfig.from_env("TRACE_JAX_JUDGE", base_url=self.judge_url or None,
                                           model=self.judge_model or None, timeout_s=self.timeout_s)
        except ValueError as error:
            raise ValueError(f"ABCScorerConfig.scorer = 'judge' needs an endpoint: {error} (bind "
                             "ABCScorerConfig.judge_url and ABCScorerConfig.judge_model)") from None


class ABCStepScoring:
    """The step scorer of a pipeline and the clue chains it scores against (see the module docstring).

    Args:
      config: the `ABCScorerConfig`.
      corpus: the rollouts' `Corpus`, which the clue-recovery agent browses (only read with `scorer = 'judge'`
        and `recover_clues`); None = no recovery (tasks without a chain are scored against no clue).
    """

    def __init__(self, config: ABCScorerConfig, corpus=None):
        self.config = config
        self.corpus = corpus
        self._recovered: dict[tuple[str, str], Any] = {}
        self._client = None
        if config.scorer == "rules":
            from trace_jax.abc.rules import RuleBasedStepScorer

            self.scorer = RuleBasedStepScorer(no_answer=config.no_answer, error_step=config.error_step)
        else:
            from trace_jax.abc.judge import JudgeConfig, LLMJudgeStepScorer

            self.endpoint = config.endpoint()
            self.scorer = LLMJudgeStepScorer(JudgeConfig(
                endpoint=self.endpoint, max_attempts=config.max_attempts, backoff_s=config.backoff_s,
                concurrency=config.concurrency, cache_dir=config.cache_dir or None,
                audit_path=config.audit_path or None, no_answer=config.no_answer, error_step=config.error_step))

    @property
    def recovers(self) -> bool:
        return self.config.scorer == "judge" and self.config.recover_clues and self.corpus is not None

    def clues(self, episode) -> tuple[tuple, str]:
        """`(clue chain, source)` of an episode: its task's own ("task"), a recovered one ("recovered"), or none
        ("none": no chain and no recovery, or a recovery that failed). A task whose clues carry no fact (an
        external task's evidence-document placeholders, `value == ""`) has no chain: it is recovered when the
        scorer recovers, else scored against what it has."""
        given = tuple(episode.clues)
        if any(getattr(clue, "value", "") for clue in given) or (given and not self.recovers):
            return given, "task"
        if not self.recovers:
            return (), "none"
        key = (episode.question, episode.gold[0])
        if key not in self._recovered:
            from trace_jax.abc.recover import ClueRecoveryAgent, RecoveryConfig
            from trace_jax.serve.client import ChatClient

            if self._client is None:
                self._client = ChatClient(self.endpoint)
            agent = ClueRecoveryAgent(self._client, self.corpus,
                                      RecoveryConfig(max_turns=self.config.recover_max_turns,
                                                     backoff_s=self.config.backoff_s))
            self._recovered[key] = agent.recover(episode.question, episode.gold[0], episode.gold[1:])
        result = self._recovered[key]
        return (tuple(result.clues), "recovered") if not result.flagged else ((), "none")

    def score(self, episodes: Sequence[Any]) -> tuple[list[list], dict[str, float]]:
        """Step counts of every episode (one per generated turn) and the batch's statistics: `abc/flagged_steps`
        (share of steps a judge failure left neutral; a trajectory too long for the judge's context is scored
        neutral and flagged whole, its answer still checked), `abc/recovered_clues` and `abc/no_clues` (shares of
        episodes scored against a recovered chain, or against none)."""
        from trace_jax.abc.rules import steps_from_episode

        too_long: tuple = ()
        if self.config.scorer == "judge":
            from trace_jax.abc.judge import JudgeContextExceeded

            too_long = (JudgeContextExceeded,)

        counts, sources = [], []
        for episode in episodes:
            clues, source = self.clues(episode)
            sources.append(source)
            steps = steps_from_episode(episode)
            try:
                counts.append(self.scorer.score(question=episode.question, gold=episode.gold, clues=clues,
                                                steps=steps))
            except too_long as error:  # one episode the judge cannot read must not stop a training run
                counts.append(self._neutral(episode, steps, str(error), self.config))
        steps = [c for row in counts for c in row]
        n = max(1, len(episodes))
        metrics = {"abc/flagged_steps": sum(c.flagged for c in steps) / max(1, len(steps)),
                   "abc/recovered_clues": sources.count("recovered") / n, "abc/no_clues": sources.count("none") / n}
        return counts, metrics

    @staticmethod
    def _neutral(episode, steps, note: str, config: ABCScorerConfig) -> list:
        from trace_jax.abc.rules import answer_outcome, is_tool_error
        from trace_jax.abc.scorer import StepCounts

        gold = list(episode.gold)
        return [StepCounts(ans=answer_outcome(gold, steps, k, no_answer=config.no_answer), flagged=True, note=note,
                           tool_error=config.error_step == 0 and is_tool_error(step))
                for k, step in enumerate(steps)]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        close = getattr(self.scorer, "close", None)
        if close is not None:
            close()


def step_rewards_from_counts(counts: Sequence[Sequence[Any]], num_turns: Sequence[int], *, answer_step: str = "fold",
                             num_steps_max: int | None = None):
    """ABC step rewards `[N, S]` (float32) and steps per episode `[N]` (int32) from per-episode `StepCounts`.

    The counts are packed (`trace_jax.abc.counts_to_arrays`), the answer turn is folded into the last tool step
    when `answer_step == 'fold'` (`CreditConfig.abc_answer_step`; `trace_jax.credit.fold_answer_steps`, given each
    episode's tool calls `num_turns`) and the rubric is applied (`trace_jax.credit.abc_step_rewards`, failed tool
    calls included). `S` is `num_steps_max` or the longest episode's step count.
    """
    import jax.numpy as jnp
    import numpy as np

    from trace_jax.abc.scorer import counts_to_arrays
    from trace_jax.credit import abc_step_rewards, fold_answer_steps

    arrays = counts_to_arrays(counts, num_steps_max=num_steps_max)
    found, excluded, rejected, ans = (jnp.asarray(arrays[k]) for k in ("n_found", "n_excluded", "n_rejected", "ans"))
    num_steps = jnp.asarray(arrays["num_steps"])
    if answer_step == "fold":
        found, excluded, rejected, ans, num_steps = fold_answer_steps(
            found, excluded, rejected, ans, num_steps, jnp.asarray(np.asarray(num_turns, np.int32)))
    # an answer turn makes no tool call, so folding it never moves a tool error: the array stays as packed
    rewards = abc_step_rewards(found, excluded, rejected, ans, jnp.asarray(arrays["tool_error"]))
    return np.asarray(rewards, np.float32), np.asarray(num_steps, np.int32)
