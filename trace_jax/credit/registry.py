"""Advantage estimators by name: one common input structure in, per-token advantages out.

The trainer and the CLI pick an estimator with a `CreditConfig` (or just its name): `grpo`, `gspo`, `trace`,
`trace_raw_delta`, `trace_linear_gap`, `abc_grpo`, `abc_sft_online`, `gigpo`, `oracle_progress`, `grpo_scaled`;
research code can register its own.
Registering a name twice raises: a silent override is how a sweep ends up running the wrong method. Built-in
estimators take their options from `CreditConfig` (the one place their defaults are written) through
`Estimator.options`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

import jax.numpy as jnp
import numpy as np

from trace_jax.credit import validate
from trace_jax.credit._checks import compute_dtype
from trace_jax.credit.abc import abc_sft_weights, grouped_abc_grpo_advantages
from trace_jax.credit.config import CreditConfig
from trace_jax.credit.gigpo import gigpo_step_advantages
from trace_jax.credit.oracle import progress_turn_credit
from trace_jax.credit.outcome import grouped_outcome_advantages
from trace_jax.credit.tokens import sequence_advantages_to_tokens, step_values_to_tokens, token_advantages
from trace_jax.credit.trace import trace_turn_credit


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
      anchor_keys: `[N, T+1]` int key of the environment state `S_k` each assistant turn `k = 0..T_g` starts from
        (GiGPO's anchor states; equal states, equal keys; `gigpo.state_keys` + `gigpo.anchor_key_ids` build them).
      correct: `[N]` bool, the final answer verified correct (exact match with the gold answer or an alias);
        ABC-SFT's filter.
      progress_gains: `[N, T]` float the oracle's progress gain of each tool turn (`oracle_progress`; the RL
        pipeline computes them with `rl.credit_diagnostics.progress_gains`).
    """

    rewards: Any
    group_id: Any
    loss_mask: Any
    turn_index: Any
    num_turns: Any
    answer_scores: Any = None
    step_rewards: Any = None
    num_steps: Any = None
    anchor_keys: Any = None
    correct: Any = None
    progress_gains: Any = None


class CreditResult(NamedTuple):
    """An estimator's output: `token_advantages [N, L]` for the loss, plus diagnostics.

    `outcome_advantages [N]` (None for ABC-GRPO, which has no separate outcome term) and `per_turn [N, T]`
    (TRACE turn credit or ABC step advantages; None for sequence-level estimators). `row_mask [N]` float32, when
    not None, marks the trajectories the loss trains on (1) and those it drops (0: ABC-SFT's incorrect ones); the
    trainer zeroes the dropped rows' loss mask, so they count in neither the loss's sum nor its count.
    """

    token_advantages: Any
    outcome_advantages: Any = None
    per_turn: Any = None
    row_mask: Any = None


@dataclasses.dataclass(frozen=True)
class Estimator:
    """A registered estimator: `fn(inputs, num_groups, **options) -> CreditResult`.

    `requires` names the optional `CreditInputs` fields it reads; `ratio` says which importance ratio the loss
    should use with it (`"token"` or `"sequence"`, GSPO); `aggregation`, when set, the loss aggregation its
    objective is defined with (GSPO: `"seq-mean-token-mean"`, one term per sequence); None = any. `options`
    maps each keyword of `fn` to the `CreditConfig` field it is read from (built-in estimators); None means `fn`
    takes whatever keywords `compute_advantages` is given and no `CreditConfig` field (estimators registered by
    research code).
    `fixed` holds options the estimator pins (the TRACE ablations pin `form`), whatever the config says.
    """

    name: str
    fn: Callable[..., CreditResult]
    requires: tuple[str, ...] = ()
    ratio: str = "token"
    description: str = ""
    options: Mapping[str, str] | None = None
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    aggregation: str | None = None


_REGISTRY: dict[str, Estimator] = {}


def register_estimator(name: str, *, requires: tuple[str, ...] = (), ratio: str = "token", description: str = "",
                       options: Mapping[str, str] | None = None, fixed: Mapping[str, Any] | None = None,
                       aggregation: str | None = None):
    """Decorator registering `fn(inputs: CreditInputs, num_groups: int, **options) -> CreditResult` under `name`.

    `options` (keyword of `fn` -> `CreditConfig` field) makes the estimator read its options from a
    `CreditConfig`; without it, `compute_advantages` passes its keywords through unchanged.
    Raises `ValueError` if the name is taken; use `unregister_estimator` first to replace one on purpose.
    """
    if ratio not in ("token", "sequence"):
        raise ValueError(f"ratio must be 'token' or 'sequence', got {ratio!r}")
    unknown = set(requires) - set(CreditInputs._fields)
    if unknown:
        raise ValueError(f"requires names unknown CreditInputs fields {sorted(unknown)}")
    if options is not None:
        fields = {f.name for f in dataclasses.fields(CreditConfig)}
        bad = sorted(set(options.values()) - fields)
        if bad:
            raise ValueError(f"options map to unknown CreditConfig fields {bad}")

    def decorator(fn):
        if name in _REGISTRY:
            raise ValueError(f"estimator {name!r} is already registered; pick another name or call "
                             f"unregister_estimator({name!r}) first")
        _REGISTRY[name] = Estimator(name, fn, tuple(requires), ratio, description or (fn.__doc__ or "").strip(),
                                    None if options is None else dict(options), dict(fixed or {}), aggregation)
        return fn

    return decorator


def unregister_estimator(name: str) -> None:
    """Remove a registered estimator (raises `KeyError` naming the known ones if absent)."""
    if name not in _REGISTRY:
        raise KeyError(f"no estimator {name!r}; registered: {sorted(_REGISTRY)}")
    del _REGISTRY[name]


# Names an estimator had before, with what to say instead of "unknown".
RENAMED = {
    "abc_sft": "'abc_sft' was renamed 'abc_sft_online' (weighted SFT on the policy's own rollouts, an online arm of "
               "ours); the paper's ABC-SFT is the supervised warm start, WarmStartConfig.weighting = 'abc' "
               "(configs/credit/abc_pipeline.gin runs it before ABC-GRPO)",
}


def get_estimator(name: str) -> Estimator:
    """The estimator registered under `name`; `ValueError` naming the new name of a renamed one, or listing the
    registered names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        if name in RENAMED:
            raise ValueError(f"credit estimator {RENAMED[name]}") from None
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
    if "anchor_keys" in estimator.requires:
        validate.validate_anchor_keys(inputs.anchor_keys, inputs.num_turns)
    if "progress_gains" in estimator.requires:
        gains = np.asarray(inputs.progress_gains)
        turns = np.asarray(inputs.num_turns)
        if gains.ndim != 2 or gains.shape[0] != turns.shape[0] or (turns.size and gains.shape[1] < turns.max()):
            raise ValueError(f"progress_gains has shape {gains.shape}; expected [N={turns.shape[0]}, T >= "
                             f"{int(turns.max()) if turns.size else 0}] (one gain per tool turn)")
        if not np.isfinite(gains.astype(np.float64)).all():
            raise ValueError("progress_gains has non-finite values; a turn that reveals nothing gains 0")
    if "correct" in estimator.requires and tuple(inputs.correct.shape) != tuple(inputs.rewards.shape):
        raise ValueError(f"correct has shape {tuple(inputs.correct.shape)}; expected one flag per trajectory, "
                         f"{tuple(inputs.rewards.shape)} like rewards")


def resolve_config(config_or_name: CreditConfig | str, **options) -> CreditConfig:
    """A `CreditConfig` from a config or an estimator name, with `options` (the estimator's keyword names, e.g.
    `gamma=0.5` for abc_grpo means `abc_gamma`) applied. Raises `ValueError` for an option the estimator does not
    read, naming the ones it does."""
    if isinstance(config_or_name, CreditConfig):
        config = config_or_name
    elif isinstance(config_or_name, str):
        get_estimator(config_or_name)
        config = None
    else:
        raise TypeError(f"expected a CreditConfig or an estimator name, got {type(config_or_name).__name__}")
    name = config.estimator if config is not None else config_or_name
    estimator = get_estimator(name)
    changes = {}
    if estimator.options is not None:
        for key, value in options.items():
            if key not in estimator.options:
                raise ValueError(f"estimator {name!r} has no option {key!r}; its options are "
                                 f"{sorted(estimator.options)}")
            if key in estimator.fixed and value != estimator.fixed[key]:
                raise ValueError(f"estimator {name!r} fixes {key}={estimator.fixed[key]!r}; use 'trace' to choose "
                                 f"the {key}")
            changes[estimator.options[key]] = value
    if config is None:
        return CreditConfig(estimator=name, **changes)
    return config.replace(**changes) if changes else config


def estimator_options(config: CreditConfig) -> dict[str, Any]:
    """The keyword options `config.estimator`'s function is called with (read from `config`)."""
    estimator = get_estimator(config.estimator)
    if estimator.options is None:
        return {}
    values = {key: getattr(config, field) for key, field in estimator.options.items()}
    values.update(estimator.fixed)  # min_score None is resolved per form by the TRACE functions themselves
    return values


def compute_advantages(config_or_name: CreditConfig | str, inputs: CreditInputs, *, num_groups: int | None = None,
                       check: bool = False, **options) -> CreditResult:
    """Run an estimator on `inputs` (jittable with the config/name, `num_groups` and options static).

    Args:
      config_or_name: a `CreditConfig` (estimator and every option), or a registered estimator name (options
        from `CreditConfig`'s defaults).
      inputs: `CreditInputs`.
      num_groups: static upper bound on group ids (default N, always enough when ids lie in `[0, N)`).
      check: run `validate_credit_inputs` first (host only: needs concrete arrays, not inside jit).
      **options: overrides in the estimator's own keyword names (e.g. `alpha_turn=0.1`, `horizon=5`; for
        abc_grpo `gamma`/`normalize`, for gigpo `gamma`/`omega`/`step_std`). Estimators registered without
        `options` receive these keywords unchanged.

    Returns:
      `CreditResult` with `token_advantages [N, L]` float32.
    """
    name = config_or_name.estimator if isinstance(config_or_name, CreditConfig) else config_or_name
    estimator = get_estimator(name)
    if check:
        validate_credit_inputs(name, inputs)
    if num_groups is None:
        num_groups = inputs.rewards.shape[0]
    if estimator.options is None:
        return estimator.fn(inputs, num_groups, **options)
    config = resolve_config(config_or_name, **options)
    return estimator.fn(inputs, num_groups, **estimator_options(config))


def _outcome(inputs: CreditInputs, num_groups: int, std: str, std_eps: float):
    return grouped_outcome_advantages(jnp.asarray(inputs.rewards), jnp.asarray(inputs.group_id), num_groups,
                                      std=std, eps=std_eps)


_OUTCOME_OPTIONS = {"std": "std", "std_eps": "std_eps"}
_TRACE_OPTIONS = {**_OUTCOME_OPTIONS, "form": "form", "eps": "eps", "horizon": "horizon", "gamma": "gamma",
                  "terminal_fill": "terminal_fill", "alpha_out": "alpha_out", "alpha_turn": "alpha_turn",
                  "min_score": "min_score"}


@register_estimator("grpo", options=_OUTCOME_OPTIONS,
                    description="GRPO: group z-scored outcome reward on every assistant token.")
def _grpo(inputs, num_groups, *, std, std_eps):
    outcome = _outcome(inputs, num_groups, std, std_eps)
    return CreditResult(sequence_advantages_to_tokens(outcome, inputs.loss_mask), outcome)


@register_estimator("gspo", ratio="sequence", aggregation="seq-mean-token-mean", options=_OUTCOME_OPTIONS,
                    description="GSPO: GRPO advantages with a sequence-level importance ratio, clipped per "
                                "sequence, one loss term per sequence.")
def _gspo(inputs, num_groups, *, std, std_eps):
    return _grpo(inputs, num_groups, std=std, std_eps=std_eps)


@register_estimator("trace", requires=("answer_scores",), options=_TRACE_OPTIONS,
                    description="TRACE: GRPO + alpha_turn * look-ahead TD of the reference's answer scores.")
def _trace(inputs, num_groups, *, form, eps, horizon, gamma, terminal_fill, alpha_out, alpha_turn, std, std_eps,
           min_score):
    outcome = _outcome(inputs, num_groups, std, std_eps)
    credit = trace_turn_credit(jnp.asarray(inputs.answer_scores), jnp.asarray(inputs.num_turns), outcome, form=form,
                               eps=eps, horizon=horizon, gamma=gamma, terminal_fill=terminal_fill,
                               min_score=min_score)
    tokens = token_advantages(inputs.turn_index, inputs.loss_mask, credit, outcome, inputs.num_turns,
                              alpha_out=alpha_out, alpha_turn=alpha_turn)
    return CreditResult(tokens, outcome, credit)


def mean_abs_scale(advantages, target, loss_mask):
    """The factor `s` that gives `s * advantages` the mean |A| of `target` over the trained tokens (`loss_mask != 0`):
    `sum |target| / sum |advantages|` over those tokens (counts cancel); 1 where `advantages` is 0 on all of them
    (nothing to scale). A scalar in the advantages' float type."""
    trained = loss_mask != 0
    dtype = compute_dtype(advantages, target)
    size = jnp.sum(jnp.where(trained, jnp.abs(advantages.astype(dtype)), 0.0))
    wanted = jnp.sum(jnp.where(trained, jnp.abs(target.astype(dtype)), 0.0))
    return jnp.where(size > 0, wanted / jnp.where(size > 0, size, 1.0), 1.0)


@register_estimator("grpo_scaled", requires=("answer_scores",), options=_TRACE_OPTIONS,
                    description="GRPO's advantage scaled so that its mean |A| over the batch's trained tokens equals "
                                "TRACE's (CreditConfig's TRACE options) on the same batch: the step-size control.")
def _grpo_scaled(inputs, num_groups, **trace_options):
    """TRACE's turn credit makes its advantages larger than GRPO's (mean |A| per token 1.10-1.33x GRPO's on the
    study's batches), so at one learning rate it also takes larger steps. This arm keeps GRPO's direction (the
    outcome advantage on every trained token, the same sign pattern) and takes TRACE's step size: one factor per
    batch, TRACE's mean |A| over GRPO's (`mean_abs_scale`), TRACE computed with the config's TRACE options on these
    inputs (hence the reference's answer scores). alpha_turn = 0 gives GRPO exactly. On a segmented batch
    (`RolloutConfig.context_budget`) the estimator sees one pseudo-token per turn (`segments.turn_layout`), so the
    magnitudes matched are per turn, not per token."""
    trace = _trace(inputs, num_groups, **trace_options)
    outcome = trace.outcome_advantages
    grpo = sequence_advantages_to_tokens(outcome, inputs.loss_mask)
    scale = mean_abs_scale(grpo, trace.token_advantages, jnp.asarray(inputs.loss_mask))
    return CreditResult(grpo * scale, outcome * scale)


def _register_trace_form(name: str, form: str, description: str) -> None:
    register_estimator(name, requires=("answer_scores",), options=_TRACE_OPTIONS, fixed={"form": form},
                       description=description)(_trace)


_register_trace_form("trace_raw_delta", "raw_delta", "TRACE ablation: TD of the raw answer score.")
_register_trace_form("trace_linear_gap", "linear_gap", "TRACE ablation: TD divided by the current gap.")


@register_estimator("abc_grpo", requires=("step_rewards", "num_steps"),
                    options={"gamma": "abc_gamma", "normalize": "abc_normalize", "std_eps": "std_eps"},
                    description="ABC-GRPO: group-normalised step rewards accumulated backwards.")
def _abc_grpo(inputs, num_groups, *, gamma, normalize, std_eps):
    steps = grouped_abc_grpo_advantages(jnp.asarray(inputs.step_rewards), jnp.asarray(inputs.num_steps),
                                        jnp.asarray(inputs.group_id), num_groups, gamma=gamma, normalize=normalize,
                                        eps=std_eps)
    tokens = step_values_to_tokens(steps, inputs.turn_index, inputs.loss_mask, inputs.num_steps)
    return CreditResult(tokens, None, steps)


@register_estimator("abc_sft_online", requires=("step_rewards", "num_steps", "correct"),
                    options={"correct_only": "abc_sft_correct_only"},
                    description="ABC-SFT online (ours): per-token SFT weights 2 sigmoid(2 (r - 1)) of the ABC step "
                                "rewards of the policy's own rollouts, on trajectories whose answer is verified "
                                "correct (LossConfig.mode = 'sft'). The paper's ABC-SFT is the warm start "
                                "(WarmStartConfig.weighting = 'abc').")
def _abc_sft(inputs, num_groups, *, correct_only):
    del num_groups
    weights = abc_sft_weights(jnp.asarray(inputs.step_rewards, jnp.float32))
    tokens = step_values_to_tokens(weights, inputs.turn_index, inputs.loss_mask, inputs.num_steps)
    keep = jnp.asarray(inputs.correct).astype(bool) if correct_only else jnp.ones(tokens.shape[0], bool)
    row_mask = keep.astype(jnp.float32)
    return CreditResult(tokens * row_mask[:, None], None, weights, row_mask)


@register_estimator("gigpo", requires=("anchor_keys",),
                    options={**_OUTCOME_OPTIONS, "gamma": "gigpo_gamma", "omega": "gigpo_omega",
                             "step_std": "gigpo_step_std"},
                    description="GiGPO: episode-level group advantage + omega * anchor-state step advantage.")
def _gigpo(inputs, num_groups, *, std, std_eps, gamma, omega, step_std):
    outcome = _outcome(inputs, num_groups, std, std_eps)
    num_turns = jnp.asarray(inputs.num_turns)
    steps = gigpo_step_advantages(jnp.asarray(inputs.anchor_keys), num_turns, jnp.asarray(inputs.rewards),
                                  jnp.asarray(inputs.group_id), num_groups, gamma=gamma, step_std=step_std,
                                  eps=std_eps)
    per_turn = jnp.where(jnp.arange(steps.shape[1])[None, :] <= num_turns[:, None],
                         outcome[:, None] + omega * steps, 0.0)
    tokens = step_values_to_tokens(per_turn, inputs.turn_index, inputs.loss_mask, num_turns + 1)
    return CreditResult(tokens, outcome, per_turn)


@register_estimator("oracle_progress", requires=("progress_gains",),
                    options={**_OUTCOME_OPTIONS, "alpha_out": "alpha_out", "alpha_turn": "alpha_turn"},
                    description="Oracle progress: GRPO + alpha_turn * the oracle's progress gain of each tool turn "
                                "(TRACE's mixing; the ceiling for a turn credit).")
def _oracle_progress(inputs, num_groups, *, std, std_eps, alpha_out, alpha_turn):
    outcome = _outcome(inputs, num_groups, std, std_eps)
    turn = progress_turn_credit(jnp.asarray(inputs.progress_gains), jnp.asarray(inputs.num_turns))
    tokens = token_advantages(inputs.turn_index, inputs.loss_mask, turn, outcome, inputs.num_turns,
                              alpha_out=alpha_out, alpha_turn=alpha_turn)
    return CreditResult(tokens, outcome, turn)
