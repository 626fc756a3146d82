"""ABC (answer-backtracked credit) on the host side: step scorers that count, per step of a trajectory, the clues
found, candidates excluded and clues wrongly rejected (credit-spec.md section 3).

The arithmetic on those counts (`abc_step_rewards`, `abc_sft_weights`, `abc_grpo_advantages`) lives in
`trace_jax.credit`; this package turns trajectories and clue chains into counts. `scorer` holds the interface every
step scorer implements.
"""

from trace_jax.abc.scorer import ScoredStep, Step, StepCounts, StepScorer, counts_to_arrays

__all__ = ["ScoredStep", "Step", "StepCounts", "StepScorer", "counts_to_arrays"]
