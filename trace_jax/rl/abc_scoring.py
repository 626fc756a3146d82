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

`ABCStepScoring.score(episodes)` returns one list of `StepCounts` per episode (steps as `steps_from_episode` cuts
them: one per generated turn) and the batch's scoring statistics. Folding the answer turn into the last tool step
is credit arithmetic (`trace_jax.credit.fold_answer_steps`), done by the caller on the count arrays.

This module knows the ABC scorers, clue recovery and the episode records; it knows nothing about models, arrays on
device or the train step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

SCORERS = ("rules", "judge")


@dataclasses.dataclass(frozen=True)
class ABCScorerConfig:
    """The ABC step scorer of `abc_grpo` / `abc_sft` training (see the module docstring).

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

    def __post_init__(self):
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

            self.scorer = RuleBasedStepScorer()
        else:
            from trace_jax.abc.judge import JudgeConfig, LLMJudgeStepScorer

            self.endpoint = config.endpoint()
            self.scorer = LLMJudgeStepScorer(JudgeConfig(
                endpoint=self.endpoint, max_attempts=config.max_attempts, backoff_s=config.backoff_s,
                concurrency=config.concurrency, cache_dir=config.cache_dir or None,
                audit_path=config.audit_path or None))

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
                counts.append(self._neutral(episode, steps, str(error)))
        steps = [c for row in counts for c in row]
        n = max(1, len(episodes))
        metrics = {"abc/flagged_steps": sum(c.flagged for c in steps) / max(1, len(steps)),
                   "abc/recovered_clues": sources.count("recovered") / n, "abc/no_clues": sources.count("none") / n}
        return counts, metrics

    @staticmethod
    def _neutral(episode, steps, note: str) -> list:
        from trace_jax.abc.judge import answer_outcome
        from trace_jax.abc.scorer import StepCounts

        gold = list(episode.gold)
        return [StepCounts(ans=answer_outcome(gold, steps, k), flagged=True, note=note) for k in range(len(steps))]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        close = getattr(self.scorer, "close", None)
        if close is not None:
            close()
