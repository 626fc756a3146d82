"""The functional credit API: pure, jittable, vmappable functions implementing shared/docs/credit-spec.md.

    outcome_advantages        group z-score of final rewards (GRPO), groups on the last axis
    trace_values / td_deltas / lookahead_credit / trace_turn_credit      TRACE
    token_advantages          per-token advantages from turn credit and outcome advantages
    abc_step_rewards / abc_sft_weights / abc_grpo_advantages             ABC
    fold_answer_steps         ABC: the answer turn joins the last tool step (credit-spec section 3)
    gspo_sequence_ratio       GSPO's sequence-level ratio
    gigpo_step_advantages     GiGPO's anchor-state step advantages (state_keys, anchor_key_ids on the host)
    progress_turn_credit      oracle_progress: the oracle's per-turn progress gain as the turn term
    turn_layout / episode_states / segment_token_advantages    episodes split into segment rows, counted once
    CreditConfig              the estimator name and every option, with their defaults (one place)
    compute_advantages        any registered estimator by config or name ("grpo", "gspo", "trace", ..., "gigpo")
    validate_*                host-side value checks with clear errors

Everything here works on arrays; nothing knows about models, tokenizers or tools.
"""

from trace_jax.credit.abc import (
    abc_grpo_advantages,
    abc_sft_weights,
    abc_step_rewards,
    fold_answer_steps,
    grouped_abc_grpo_advantages,
)
from trace_jax.credit.config import CreditConfig
from trace_jax.credit.gigpo import (
    anchor_key_ids,
    gigpo_step_advantages,
    history_state_keys,
    observation_state_keys,
    state_keys,
)
from trace_jax.credit.gspo import gspo_sequence_ratio
from trace_jax.credit.oracle import progress_turn_credit
from trace_jax.credit.outcome import grouped_outcome_advantages, outcome_advantages
from trace_jax.credit.registry import (
    CreditInputs,
    CreditResult,
    Estimator,
    compute_advantages,
    estimator_names,
    estimator_options,
    get_estimator,
    register_estimator,
    resolve_config,
    unregister_estimator,
    validate_credit_inputs,
)
from trace_jax.credit.segments import episode_states, segment_token_advantages, turn_layout
from trace_jax.credit.tokens import sequence_advantages_to_tokens, step_values_to_tokens, token_advantages
from trace_jax.credit.trace import lookahead_credit, td_deltas, trace_turn_credit, trace_values
from trace_jax.credit.validate import (
    validate_abc_inputs,
    validate_anchor_keys,
    validate_num_turns,
    validate_rewards,
    validate_token_layout,
    validate_trace_inputs,
)

__all__ = [
    "CreditConfig", "CreditInputs", "CreditResult", "Estimator", "abc_grpo_advantages", "anchor_key_ids",
    "estimator_options", "gigpo_step_advantages", "history_state_keys", "resolve_config", "validate_anchor_keys",
    "abc_sft_weights", "abc_step_rewards", "fold_answer_steps", "observation_state_keys", "state_keys",
    "compute_advantages", "episode_states", "estimator_names", "get_estimator", "grouped_abc_grpo_advantages",
    "grouped_outcome_advantages", "gspo_sequence_ratio", "progress_turn_credit", "lookahead_credit",
    "outcome_advantages",
    "register_estimator", "segment_token_advantages", "sequence_advantages_to_tokens", "step_values_to_tokens",
    "td_deltas", "token_advantages", "trace_turn_credit", "trace_values", "turn_layout", "unregister_estimator",
    "validate_abc_inputs", "validate_credit_inputs", "validate_num_turns", "validate_rewards",
    "validate_token_layout", "validate_trace_inputs",
]
