"""ABC (answer-backtracked credit) on the host side: step scorers that count, per step of a trajectory, the clues
found, candidates excluded and clues wrongly rejected (credit-spec.md section 3), clue recovery for external tasks,
and `trace-jax abc-score`.

The arithmetic on those counts (`abc_step_rewards`, `abc_sft_weights`, `abc_grpo_advantages`) lives in
`trace_jax.credit`; this package turns trajectories and clue chains into counts.

    scorer    the interface every step scorer implements (Step, StepCounts, StepScorer)
    rules     RuleBasedStepScorer ("rules"): generated tasks, whose clue chain is known exactly
    judge     LLMJudgeStepScorer ("judge"): any OpenAI-compatible endpoint applying the rubric
    recover   the clue-recovery agent for external tasks
    replies   the one parser of a JSON object in a model reply (judge and recovery)
    retry     the retry schedule of both endpoint callers (jittered backoff, Retry-After, deadline)
    cli       `trace-jax abc-score`
"""

from trace_jax.abc.rules import RuleBasedStepScorer, steps_from, steps_from_episode, steps_from_messages
from trace_jax.abc.scorer import ScoredStep, Step, StepCounts, StepScorer, counts_to_arrays

__all__ = ["RuleBasedStepScorer", "ScoredStep", "Step", "StepCounts", "StepScorer", "counts_to_arrays", "steps_from",
           "steps_from_episode", "steps_from_messages"]
