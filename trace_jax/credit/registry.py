"""Advantage estimators by name: one common input structure in, per-token advantages out.

The trainer and the CLI pick an estimator with a string from the config (`grpo`, `gspo`, `trace`,
`trace_raw_delta`, `trace_linear_gap`, `abc_grpo`); research code can register its own. Registering a name twice
raises: a silent override is how a sweep ends up running the wrong method.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp

from trace_jax.credit import validate
from trace_jax.credit.abc import grouped_abc_grpo_advantages
from trace_jax.credit.outcome import grouped_outcome_advantages
from trace_jax.credit.tokens import sequence_advantages_to_tokens, step_values_to_tokens, token_advantages
from trace_jax.credit.trace import DEFAULT_MIN_SCORE, trace_turn_credit


class CreditInputs(NamedTuple):
    """What every estimator may read (a pytree; unused optional fields stay None).

    Attributes:
      rewards: `[N]` float final reward per trajectory.
      group_id: `[N]` int prompt group of each trajectory, in `[0, N)`.
      loss_mask: `[N, L]` nonzero on tokens the policy produced.
      turn_index: `[N, L]` int assistant turn of each token (tool-call turns `0..T_g-1`, answer turn `T_g`), -1 else.
      num_turns: `[N]` int tool calls per trajectory.
      answer_scores: `[N, T+1]` float gold-answer mean log-prob per state (TRACE).
      step_rewards: `[N, S]` float ABC step rewards.
      num_steps: `[N]` int ABC steps per trajectory.
    """

    rewards: Any
    group_id: Any
    loss_mask: Any
    turn_index: Any
    num_turns: Any
    answer_scores: Any = None
    step_rewards: Any = None
    num_steps: Any = None


class CreditResult(NamedTuple):
    """An estimator's output: `token_advantages [N, L]` for the loss, plus diagnostics.

    `outcome_advantages [N]` (None for ABC-GRPO, which has no separate outcome term) and `per_turn [N, T]`
    (TRACE turn credit or ABC step advantages; None for sequence-level estimators).
    """

    token_advantages: Any
    outcome_advantages: Any = None
    per_turn: Any = None


@dataclasses.dataclass(frozen=True)
class Estimator:
    """A registered estimator: `fn(inputs, num_groups, **options) -> CreditResult`.

    `requires` names the optional `CreditInputs` fields it reads; `ratio` says which importance ratio the loss
    should use with it (`"token"` or `"sequence"`, GSPO).
    """

    name: str
    fn: Callable[..., CreditResult]
    requires: tuple[str, ...] = ()
    ratio: str = "token"
    description: str = ""


_REGISTRY: dict[str, Estimator] = {}


def register_estimator(name: str, *, requires: tuple[str, ...] = (), ratio: str = "token", description: str = ""):
    """Decorator registering `fn(inputs: CreditInputs, num_groups: int, **options) -> CreditResult` under `name`.

    Raises `ValueError` if the name is taken; use `unregister_estimator` first to replace one on purpose.
    """
    if ratio not in ("token", "sequence"):
        raise ValueError(f"ratio must be 'token' or 'sequence', got {ratio!r}")
    unknown = set(requires) - set(CreditInputs._fields)
    if unknown:
        raise ValueError(f"requires names unknown CreditInputs fields {sorted(unknown)}")

    def decorator(fn):
        if name in _REGISTRY:
            raise ValueError(f"estimator {name!r} is already registered; pick another name or call "
                             f"unregister_estimator({name!r}) first")
        _REGISTRY[name] = Estimator(name, fn, tuple(requires), ratio, description or (fn.__doc__ or "").strip())
        return fn

    return decorator


def unregister_estimator(name: str) -> None:
    """Remove a registered estimator (raises `KeyError` naming the known ones if absent)."""
    if name not in _REGISTRY:
        raise KeyError(f"no estimator {name!r}; registered: {sorted(_REGISTRY)}")
    del _REGISTRY[name]


def get_estimator(name: str) -> Estimator:
    """The estimator registered under `name`; `ValueError` listing the registered names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown credit estimator {name!r}; registered: {sorted(_REGISTRY)}") from None


def estimator_names() -> list[str]:
    """Sorted names of all registered estimators."""
    return sorted(_REGISTRY)


def validate_credit_inputs(name: str, inputs: CreditInputs) -> None:
    """Host-side value checks of everything estimator `name` reads (see `trace_jax.credit.validate`)."""
    estimator = get_estimator(name)
    validate.validate_rewards(inputs.rewards, inputs.group_id)
    for field in estimator.requires:
        if getattr(inputs, field) is None:
            raise ValueError(f"estimator {name!r} needs CreditInputs.{field}; it is None")
    validate.validate_token_layout(inputs.turn_index, inputs.loss_mask, inputs.num_turns)
    if "answer_scores" in estimator.requires:
        validate.validate_trace_inputs(inputs.answer_scores, inputs.num_turns)
    if "step_rewards" in estimator.requires:
        validate.validate_abc_inputs(inputs.step_rewards, inputs.num_steps)


def compute_advantages(name: str, inputs: CreditInputs, *, num_groups: int | None = None, check: bool = False,
                       **options) -> CreditResult:
    """Run estimator `name` on `inputs` (jittable with `name`, `num_groups` and options static).

    Args:
      name: a registered estimator name.
      inputs: `CreditInputs`.
      num_groups: static upper bound on group ids (default N, always enough when ids lie in `[0, N)`).
      check: run `validate_credit_inputs` first (host only: needs concrete arrays, not inside jit).
      **options: the estimator's keyword options (e.g. `alpha_turn=0.1`, `horizon=5`).

    Returns:
      `CreditResult` with `token_advantages [N, L]` float32.
    """
    estimator = get_estimator(name)
    if check:
        validate_credit_inputs(name, inputs)
    if num_groups is None:
        num_groups = inputs.rewards.shape[0]
    return estimator.fn(inputs, num_groups, **options)


def _outcome(inputs: CreditInputs, num_groups: int, std: str, std_eps: float):
    return grouped_outcome_advantages(jnp.asarray(inputs.rewards), jnp.asarray(inputs.group_id), num_groups,
                                      std=std, eps=std_eps)


@register_estimator("grpo", description="GRPO: group z-scored outcome reward on every assistant token.")
def _grpo(inputs, num_groups, *, std="population", std_eps=1e-6):
    outcome = _outcome(inputs, num_groups, std, std_eps)
    return CreditResult(sequence_advantages_to_tokens(outcome, inputs.loss_mask), outcome)


@register_estimator("gspo", ratio="sequence",
                    description="GSPO: GRPO advantages with a sequence-level importance ratio in the loss.")
def _gspo(inputs, num_groups, *, std="population", std_eps=1e-6):
    return _grpo(inputs, num_groups, std=std, std_eps=std_eps)


@register_estimator("trace", requires=("answer_scores",),
                    description="TRACE: GRPO + alpha_turn * look-ahead TD of the reference's answer scores.")
def _trace(inputs, num_groups, *, form="log_ratio", eps=0.1, horizon=3, gamma=0.8, terminal_fill=2.0,
           alpha_out=1.0, alpha_turn=0.2, std="population", std_eps=1e-6, min_score=DEFAULT_MIN_SCORE):
    outcome = _outcome(inputs, num_groups, std, std_eps)
    credit = trace_turn_credit(jnp.asarray(inputs.answer_scores), jnp.asarray(inputs.num_turns), outcome, form=form,
                               eps=eps, horizon=horizon, gamma=gamma, terminal_fill=terminal_fill,
                               min_score=min_score)
    tokens = token_advantages(inputs.turn_index, inputs.loss_mask, credit, outcome, inputs.num_turns,
                              alpha_out=alpha_out, alpha_turn=alpha_turn)
    return CreditResult(tokens, outcome, credit)


def _register_trace_form(name: str, form: str, description: str) -> None:
    def estimator(inputs, num_groups, **options):
        if "form" in options and options["form"] != form:
            raise ValueError(f"estimator {name!r} fixes form={form!r}; use 'trace' to choose the form")
        options.pop("form", None)
        return _trace(inputs, num_groups, form=form, **options)

    register_estimator(name, requires=("answer_scores",), description=description)(
        functools.wraps(_trace)(estimator))


_register_trace_form("trace_raw_delta", "raw_delta", "TRACE ablation: TD of the raw answer score.")
_register_trace_form("trace_linear_gap", "linear_gap", "TRACE ablation: TD divided by the current gap.")


@register_estimator("abc_grpo", requires=("step_rewards", "num_steps"),
                    description="ABC-GRPO: group-normalised step rewards accumulated backwards.")
def _abc_grpo(inputs, num_groups, *, gamma=0.25, normalize="joint", std_eps=1e-6):
    steps = grouped_abc_grpo_advantages(jnp.asarray(inputs.step_rewards), jnp.asarray(inputs.num_steps),
                                        jnp.asarray(inputs.group_id), num_groups, gamma=gamma, normalize=normalize,
                                        eps=std_eps)
    tokens = step_values_to_tokens(steps, inputs.turn_index, inputs.loss_mask, inputs.num_steps)
    return CreditResult(tokens, None, steps)
