"""Token broadcast rules, the estimator registry, GSPO's ratio and host-side validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trace_jax import credit
from trace_jax.credit import reference as ref

N, T, L, GROUP = 6, 4, 24, 3


def random_batch(seed, with_abc=False):
    """A batch laid out like a rollout: prompt, then per turn [assistant tokens, observation tokens], answer."""
    rng = np.random.default_rng(seed)
    num_turns = rng.integers(0, T + 1, size=N).astype(np.int32)
    turn_index = np.full((N, L), -1, np.int32)
    loss_mask = np.zeros((N, L), np.int32)
    for i in range(N):
        pos = 2  # prompt
        for k in range(num_turns[i] + 1):
            width = 2
            turn_index[i, pos:pos + width] = k
            loss_mask[i, pos:pos + width] = 1
            pos += width + (2 if k < num_turns[i] else 0)  # observation tokens after tool calls
    inputs = credit.CreditInputs(
        rewards=jnp.asarray(rng.integers(0, 2, size=N).astype(np.float32)),
        group_id=jnp.asarray(np.repeat(np.arange(N // GROUP), GROUP).astype(np.int32)),
        loss_mask=jnp.asarray(loss_mask), turn_index=jnp.asarray(turn_index), num_turns=jnp.asarray(num_turns),
        answer_scores=jnp.asarray(-rng.exponential(2.0, size=(N, T + 1)).astype(np.float32)),
        step_rewards=jnp.asarray(rng.uniform(0, 2, size=(N, T + 1)).astype(np.float32)) if with_abc else None,
        num_steps=jnp.asarray(num_turns + 1) if with_abc else None,
        anchor_keys=jnp.asarray(rng.integers(0, 3, size=(N, T + 1)).astype(np.int32)) if with_abc else None,
        correct=jnp.asarray(rng.integers(0, 2, size=N).astype(bool)) if with_abc else None,
        progress_gains=jnp.asarray(rng.uniform(0, 0.5, size=(N, T)).astype(np.float32)) if with_abc else None,
    )
    return inputs


@given(st.integers(0, 10_000), st.sampled_from([0.0, 0.1, 0.2, 0.5]))
def test_token_advantages_match_reference(seed, alpha_turn):
    inputs = random_batch(seed)
    outcome = credit.grouped_outcome_advantages(inputs.rewards, inputs.group_id, N)
    turn_credit = credit.trace_turn_credit(inputs.answer_scores, inputs.num_turns, outcome)
    got = credit.token_advantages(inputs.turn_index, inputs.loss_mask, turn_credit, outcome, inputs.num_turns,
                                  alpha_turn=alpha_turn)
    for i in range(N):
        want = ref.token_advantages_ref(np.asarray(inputs.turn_index[i]), np.asarray(inputs.loss_mask[i]),
                                        np.asarray(turn_credit[i]), float(outcome[i]), int(inputs.num_turns[i]),
                                        alpha_turn=alpha_turn)
        np.testing.assert_allclose(got[i], want, atol=1e-6)


@given(st.integers(0, 10_000))
def test_alpha_turn_zero_is_grpo_exactly(seed):
    inputs = random_batch(seed)
    grpo = credit.compute_advantages("grpo", inputs)
    for name in ("trace", "trace_raw_delta", "trace_linear_gap"):
        trace = credit.compute_advantages(name, inputs, alpha_turn=0.0)
        np.testing.assert_array_equal(trace.token_advantages, grpo.token_advantages)


def test_observation_prompt_and_padding_tokens_get_zero():
    inputs = random_batch(7)
    result = credit.compute_advantages("trace", inputs)
    untrained = np.asarray(inputs.loss_mask) == 0
    assert np.all(np.asarray(result.token_advantages)[untrained] == 0.0)


def test_trajectory_without_tool_calls_gets_outcome_on_every_token():
    outcome = jnp.array([0.7])
    tokens = credit.token_advantages(jnp.array([[-1, 0, 0, 0, -1]]), jnp.array([[0, 1, 1, 1, 0]]), jnp.zeros((1, 3)),
                                     outcome, jnp.array([0]))
    np.testing.assert_allclose(tokens, [[0.0, 0.7, 0.7, 0.7, 0.0]], atol=1e-7)


def test_registry_has_every_method_and_they_jit():
    assert {"grpo", "gspo", "trace", "trace_raw_delta", "trace_linear_gap", "abc_grpo", "gigpo"} <= set(
        credit.estimator_names())
    inputs = random_batch(11, with_abc=True)
    for name in credit.estimator_names():
        eager = credit.compute_advantages(name, inputs, check=True)
        jitted = jax.jit(lambda x, name=name: credit.compute_advantages(name, x).token_advantages)(inputs)
        np.testing.assert_allclose(jitted, eager.token_advantages, atol=1e-6)
        assert eager.token_advantages.shape == (N, L)
    assert credit.get_estimator("gspo").ratio == "sequence"
    assert credit.get_estimator("trace").ratio == "token"


def test_ablation_forms_match_trace_with_that_form():
    inputs = random_batch(12)
    for name, form in (("trace_raw_delta", "raw_delta"), ("trace_linear_gap", "linear_gap")):
        np.testing.assert_array_equal(credit.compute_advantages(name, inputs).token_advantages,
                                      credit.compute_advantages("trace", inputs, form=form).token_advantages)
    with pytest.raises(ValueError, match="fixes form"):
        credit.compute_advantages("trace_raw_delta", inputs, form="log_ratio")


def test_registering_a_name_twice_raises():
    with pytest.raises(ValueError, match="already registered"):
        credit.register_estimator("grpo")(lambda inputs, num_groups: None)


def test_custom_estimator_round_trip():
    @credit.register_estimator("test_constant")
    def _constant(inputs, num_groups, *, value=1.0):
        return credit.CreditResult(jnp.where(inputs.loss_mask != 0, value, 0.0))

    try:
        out = credit.compute_advantages("test_constant", random_batch(1), value=2.0)
        assert set(np.unique(out.token_advantages)) <= {0.0, 2.0}
    finally:
        credit.unregister_estimator("test_constant")
    with pytest.raises(ValueError, match="unknown credit estimator 'test_constant'"):
        credit.get_estimator("test_constant")


def test_estimator_missing_required_input_is_named():
    with pytest.raises(ValueError, match="needs CreditInputs.step_rewards"):
        credit.compute_advantages("abc_grpo", random_batch(2), check=True)


def test_abc_grpo_tokens_follow_steps():
    inputs = random_batch(5, with_abc=True)
    result = credit.compute_advantages("abc_grpo", inputs)
    for i in range(N):
        for j in range(L):
            k = int(inputs.turn_index[i, j])
            want = float(result.per_turn[i, k]) if inputs.loss_mask[i, j] and k >= 0 else 0.0
            assert float(result.token_advantages[i, j]) == pytest.approx(want, abs=1e-6)


@given(st.integers(0, 10_000), st.sampled_from(["joint", "per_step"]), st.sampled_from([0.0, 0.25, 0.9]))
def test_abc_grpo_matches_reference(seed, normalize, gamma):
    rng = np.random.default_rng(seed)
    rewards = rng.uniform(0, 2, size=(2, 4, 5)).astype(np.float32)
    steps = rng.integers(1, 6, size=(2, 4)).astype(np.int32)
    got = np.asarray(credit.abc_grpo_advantages(rewards, steps, gamma=gamma, normalize=normalize))
    for b in range(2):
        want = ref.abc_grpo_advantages_ref(rewards[b], steps[b], gamma=gamma, normalize=normalize)
        for g in range(4):
            np.testing.assert_allclose(got[b, g, :steps[b, g]], want[g], rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(got[b, g, steps[b, g]:], 0.0)


def test_abc_grpo_padding_and_permutation():
    rng = np.random.default_rng(9)
    rewards = rng.uniform(0, 2, size=(4, 5)).astype(np.float32)
    steps = np.array([5, 2, 3, 1], np.int32)
    base = np.asarray(credit.abc_grpo_advantages(rewards, steps))
    garbage = rewards.copy()
    garbage[np.arange(5)[None, :] >= steps[:, None]] = np.nan
    np.testing.assert_array_equal(credit.abc_grpo_advantages(garbage, steps), base)
    order = np.array([2, 0, 3, 1])
    np.testing.assert_allclose(credit.abc_grpo_advantages(rewards[order], steps[order]), base[order], atol=1e-6)


def test_abc_step_rewards_match_reference_and_sft_weights_are_monotone():
    rng = np.random.default_rng(0)
    counts = [rng.integers(0, 4, size=50) for _ in range(3)] + [rng.integers(-1, 2, size=50)]
    got = credit.abc_step_rewards(*counts)
    want = [ref.abc_step_reward_ref(*(int(c[i]) for c in counts)) for i in range(50)]
    np.testing.assert_allclose(got, want, atol=1e-6)
    weights = np.asarray(credit.abc_sft_weights(jnp.linspace(0.0, 2.0, 21)))
    assert np.all(np.diff(weights) > 0) and weights.min() > 0.238 and weights.max() < 1.762


def test_gspo_sequence_ratio():
    logprobs = jnp.array([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    old = jnp.array([[-1.5, -2.0, -9.0], [-1.0, -1.0, -1.0]])
    mask = jnp.array([[1, 1, 0], [0, 0, 0]])
    np.testing.assert_allclose(credit.gspo_sequence_ratio(logprobs, old, mask), [np.exp(0.25), 1.0], rtol=1e-6)


class TestValidation:
    def test_positive_log_probs_rejected(self):
        with pytest.raises(ValueError, match="positive values"):
            credit.validate_trace_inputs(np.array([[-1.0, 0.5]]), np.array([1]))

    def test_nan_in_real_states_rejected_but_allowed_in_padding(self):
        with pytest.raises(ValueError, match="NaN in real states of rows 1"):
            credit.validate_trace_inputs(np.array([[-1.0, -2.0], [np.nan, -1.0]]), np.array([1, 1]))
        credit.validate_trace_inputs(np.array([[-1.0, np.nan]]), np.array([0]))

    def test_num_turns_out_of_range_rejected(self):
        with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
            credit.validate_trace_inputs(np.array([[-1.0, -2.0]]), np.array([2]))
        with pytest.raises(ValueError, match="must lie in"):
            credit.validate_trace_inputs(np.array([[-1.0, -2.0]]), np.array([-1]))

    def test_minus_infinity_is_allowed(self):
        credit.validate_trace_inputs(np.array([[-np.inf, -2.0]]), np.array([1]))

    def test_mismatched_shapes_rejected(self):
        with pytest.raises(ValueError, match="batch size N=1"):
            credit.validate_trace_inputs(np.array([[-1.0, -2.0]]), np.array([1, 1]))

    def test_empty_group_and_bad_rewards_rejected(self):
        with pytest.raises(ValueError, match="empty group"):
            credit.validate_rewards(np.zeros((2, 0)))
        with pytest.raises(ValueError, match="non-finite"):
            credit.validate_rewards(np.array([1.0, np.nan]))
        with pytest.raises(ValueError, match="renumber groups"):
            credit.validate_rewards(np.array([1.0, 0.0]), np.array([0, 5]))

    def test_token_layout_errors(self):
        with pytest.raises(ValueError, match="turn_index must lie"):
            credit.validate_token_layout(np.array([[0, 3]]), np.array([[1, 1]]), np.array([1]))
        with pytest.raises(ValueError, match="every trained token"):
            credit.validate_token_layout(np.array([[-1, 0]]), np.array([[1, 1]]), np.array([0]))

    def test_check_flag_runs_validation(self):
        inputs = random_batch(3)._replace(answer_scores=jnp.full((N, T + 1), 0.5))
        with pytest.raises(ValueError, match="positive values"):
            credit.compute_advantages("trace", inputs, check=True)


@pytest.mark.parametrize("num_slots", [17, 40, 64])
def test_abc_grpo_long_trajectories_match_reference(num_slots):
    """Past 16 steps the backward accumulation runs blockwise; it must still equal the plain recursion."""
    rng = np.random.default_rng(num_slots)
    rewards = rng.uniform(0, 2, size=(1, 3, num_slots)).astype(np.float32)
    steps = np.array([[num_slots, num_slots - 5, 3]], np.int32)
    for gamma in (0.25, 1.0):
        got = np.asarray(credit.abc_grpo_advantages(rewards, steps, gamma=gamma))
        want = ref.abc_grpo_advantages_ref(rewards[0], steps[0], gamma=gamma)
        for g in range(3):
            np.testing.assert_allclose(got[0, g, :steps[0, g]], want[g], rtol=1e-4, atol=1e-4)
