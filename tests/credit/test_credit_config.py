"""`CreditConfig`: one place for every default, self-validating, hashable; `compute_advantages` reads it."""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import credit
from trace_jax.credit.config import DEFAULTS, FORM_MIN_SCORES

from tests.credit.test_credit_tokens_and_registry import random_batch


def test_defaults_are_the_specs():
    config = credit.CreditConfig()
    assert (config.estimator, config.eps, config.horizon, config.gamma, config.terminal_fill) == (
        "trace", 0.1, 3, 0.8, 2.0)
    assert (config.alpha_out, config.alpha_turn, config.abc_gamma, config.gigpo_gamma, config.gigpo_omega) == (
        1.0, 0.2, 0.25, 0.95, 1.0)


@pytest.mark.parametrize("function, mapping", [
    (credit.trace_turn_credit, {"form": "form", "eps": "eps", "horizon": "horizon", "gamma": "gamma",
                                "terminal_fill": "terminal_fill", "min_score": "min_score"}),
    (credit.token_advantages, {"alpha_out": "alpha_out", "alpha_turn": "alpha_turn"}),
    (credit.grouped_outcome_advantages, {"std": "std", "eps": "std_eps"}),
    (credit.grouped_abc_grpo_advantages, {"gamma": "abc_gamma", "normalize": "abc_normalize", "eps": "std_eps"}),
    (credit.gigpo_step_advantages, {"gamma": "gigpo_gamma", "step_std": "gigpo_step_std", "eps": "std_eps"}),
])
def test_function_defaults_equal_the_config(function, mapping):
    """The array functions keep the spec's defaults as keyword defaults; they must never drift from the config."""
    parameters = inspect.signature(function).parameters
    for keyword, field in mapping.items():
        assert parameters[keyword].default == DEFAULTS[field], (function.__name__, keyword)


def test_config_is_hashable_and_a_static_jit_argument():
    inputs = random_batch(4)
    config = credit.CreditConfig(alpha_turn=0.5)
    assert hash(config) == hash(credit.CreditConfig(alpha_turn=0.5))
    jitted = jax.jit(lambda x, c: credit.compute_advantages(c, x).token_advantages, static_argnums=1)
    np.testing.assert_allclose(jitted(inputs, config),
                               credit.compute_advantages("trace", inputs, alpha_turn=0.5).token_advantages, atol=1e-6)


@pytest.mark.parametrize("changes, message", [
    ({"estimator": "nope"}, "not registered"), ({"form": "log"}, "form"), ({"horizon": 1.5}, "horizon"),
    ({"horizon": -1}, "horizon"), ({"eps": 0.0}, "eps"), ({"gamma": 1.5}, "gamma"),
    ({"alpha_turn": -0.1}, "alpha_turn"),
    ({"std": "pop"}, "std"), ({"abc_normalize": "x"}, "abc_normalize"), ({"gigpo_gamma": float("nan")}, "gigpo_gamma"),
    ({"min_score": 1.0}, "min_score"), ({"gigpo_step_std": "sample"}, "gigpo_step_std"),
])
def test_illegal_values_are_rejected_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        credit.CreditConfig(**changes)


def test_name_options_map_to_config_fields():
    assert credit.resolve_config("abc_grpo", gamma=0.5) == credit.CreditConfig(estimator="abc_grpo", abc_gamma=0.5)
    assert credit.resolve_config("gigpo", omega=0.3).gigpo_omega == 0.3
    with pytest.raises(ValueError, match="has no option 'horizon'"):
        credit.compute_advantages("grpo", random_batch(1), horizon=5)


def test_config_and_name_give_the_same_advantages():
    inputs = random_batch(6, with_abc=True)
    for name in credit.estimator_names():
        by_name = credit.compute_advantages(name, inputs).token_advantages
        by_config = credit.compute_advantages(credit.CreditConfig(estimator=name), inputs).token_advantages
        np.testing.assert_array_equal(by_name, by_config)


def test_minus_infinity_is_bounded_per_form():
    scores = jnp.array([[-jnp.inf, -0.0], [-0.0, -jnp.inf]])
    turns = jnp.array([1, 1])
    for form, bound in (("log_ratio", 11.52), ("raw_delta", 30.0), ("linear_gap", 300.0)):
        deltas = np.asarray(credit.td_deltas(scores, turns, form=form))
        assert np.all(np.isfinite(deltas)) and np.abs(deltas).max() <= bound + 1e-3, form
    assert FORM_MIN_SCORES["raw_delta"] == -30.0
    # the fixed-form ablations use their own form's floor
    inputs = random_batch(2)._replace(answer_scores=jnp.full((6, 5), -jnp.inf).at[:, 1:].set(-1.0))
    per_turn = np.asarray(credit.compute_advantages("trace_raw_delta", inputs, horizon=1, terminal_fill=0.0).per_turn)
    assert np.abs(per_turn).max() <= 30.0


def test_abc_grpo_zero_variance_group_gets_zero():
    rewards = jnp.full((2, 3, 4), 1.4)
    steps = jnp.array([[4, 2, 3], [1, 4, 4]])
    np.testing.assert_array_equal(credit.abc_grpo_advantages(rewards, steps), 0.0)
    np.testing.assert_array_equal(credit.abc_grpo_advantages(rewards, steps, normalize="per_step"), 0.0)
    grouped = credit.grouped_abc_grpo_advantages(rewards.reshape(6, 4), steps.reshape(6),
                                                 jnp.repeat(jnp.arange(2), 3), 2)
    np.testing.assert_array_equal(grouped, 0.0)
