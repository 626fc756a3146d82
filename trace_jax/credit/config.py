"""`CreditConfig`: the one place where every credit estimator's options and their defaults are written.

The registry (`compute_advantages`), `trace-jax credit`'s flags and the trainer's gin all read this dataclass, so a
default changes in one line. It is frozen and hashable (a static `jax.jit` argument) and checks itself on
construction: an illegal value raises `ValueError` naming the field and the allowed range.

Options are grouped by the estimator that reads them; each registered estimator names the fields it reads
(`Estimator.options`), so `CreditConfig(estimator="grpo", horizon=5)` is legal (unused) while
`compute_advantages("grpo", inputs, horizon=5)` is an error (the option does nothing there).

This module knows nothing about arrays, models or the CLI; it must not import gin (the trainer registers it with
`gin.external_configurable`).
"""

from __future__ import annotations

import dataclasses
import math

STD_MODES = ("population", "sample", "none")
FORMS = ("log_ratio", "linear_gap", "raw_delta")
ABC_NORMALIZE_MODES = ("joint", "per_step")
ABC_ANSWER_STEPS = ("fold", "separate")
GIGPO_STEP_STD_MODES = ("population", "none")
GIGPO_ANCHORS = ("observation", "history")

# Per-form floor for gold-answer scores (mean log-prob per token) when `min_score` is None. A score of -inf (an
# impossible answer) is clamped to it, which bounds every TD: log_ratio |delta| <= log((1e4 + eps) / eps) = 11.5;
# raw_delta |delta| <= 30; linear_gap delta in [-30 / eps, 1) = [-300, 1) with eps = 0.1. A mean per-token
# log-prob of -30 (probability 1e-13 per token) is far below what any trained reference gives a real answer (a
# uniform guess over Qwen3's 151k vocabulary is -11.9), so the floor only ever binds on degenerate scores.
FORM_MIN_SCORES = {"log_ratio": -1e4, "linear_gap": -30.0, "raw_delta": -30.0}


def default_min_score(form: str) -> float:
    """The score floor `form` uses when `min_score` is None (see `FORM_MIN_SCORES`)."""
    if form not in FORM_MIN_SCORES:
        raise ValueError(f"form={form!r} is not one of {sorted(FORM_MIN_SCORES)}")
    return FORM_MIN_SCORES[form]


@dataclasses.dataclass(frozen=True)
class CreditConfig:
    """A credit estimator and all its options (credit-spec.md; GiGPO from Feng et al. 2025, arXiv 2505.10978).

    Attributes:
      estimator: a registered estimator name (`trace_jax.credit.estimator_names()`).

      std: outcome-advantage normalisation, `"population"` (divide by G), `"sample"` (ddof 1) or `"none"`
        (Dr.GRPO: centre only). Read by grpo, gspo, trace*, gigpo (episode term).
      std_eps: a group whose reward std is `<= std_eps` (zero variance, a group of one) gets outcome advantage 0;
        also the zero-variance guard of ABC-GRPO and GiGPO's step groups.

      form: TRACE TD form, `"log_ratio"` (default), `"linear_gap"` or `"raw_delta"` (the ablation).
      eps: TRACE gap offset in `d_k = -l_k + eps` (> 0).
      min_score: floor for gold-answer scores (`-inf` included); None = the per-form default `FORM_MIN_SCORES`.
      horizon: TRACE look-ahead `K >= 0` (an int).
      gamma: TRACE look-ahead and terminal-fill discount, in [0, 1].
      terminal_fill: `lambda_term`, weight of `A_out` in windows that reach the last turn.
      alpha_out: weight of the outcome advantage on every assistant token (trace*, oracle_progress).
      alpha_turn: weight of the turn credit on tool-call turns (0 reproduces GRPO exactly; trace*, oracle_progress).

      abc_gamma: ABC-GRPO backward accumulation factor, in [0, 1].
      abc_normalize: ABC-GRPO step-reward statistics, `"joint"` (all steps of the group) or `"per_step"`.
      abc_answer_step: `"fold"` (default; credit-spec section 3, "the last step includes the answer"): the final
        answer turn is part of the last tool step, judged with it and trained with its value; `"separate"`: the
        answer turn is a step of its own. Read where step counts become step rewards (the trainer's pipeline,
        `fold_answer_steps`).
      abc_sft_correct_only: ABC-SFT online (`abc_sft_online`) trains only on trajectories whose final answer is
        verified correct (default; ABC backtracks from a correct answer); False admits every trajectory.

      gigpo_gamma: GiGPO discount of step returns, in [0, 1] (paper default 0.95).
      gigpo_omega: GiGPO weight of the step-level advantage, `A = A_episode + omega * A_step` (>= 0).
      gigpo_step_std: `"population"` divides step advantages by their anchor group's std; `"none"` only centres
        (the paper's "w/o std" variant).
      gigpo_anchor: what makes two steps' anchor states equal: `"observation"` (default; the paper's and
        verl-agent's `build_step_group`: the identical *current* observation, the prompt for the first step) or
        `"history"` (the whole observation history so far). Read where anchor keys are built
        (`gigpo.state_keys`).
    """

    estimator: str = "trace"
    std: str = "population"
    std_eps: float = 1e-6
    form: str = "log_ratio"
    eps: float = 0.1
    min_score: float | None = None
    horizon: int = 3
    gamma: float = 0.8
    terminal_fill: float = 2.0
    alpha_out: float = 1.0
    alpha_turn: float = 0.2
    abc_gamma: float = 0.25
    abc_normalize: str = "joint"
    abc_answer_step: str = "fold"
    abc_sft_correct_only: bool = True
    gigpo_gamma: float = 0.95
    gigpo_omega: float = 1.0
    gigpo_step_std: str = "population"
    gigpo_anchor: str = "observation"

    def __post_init__(self):
        from trace_jax.credit.registry import RENAMED, estimator_names

        if self.estimator in RENAMED:
            raise ValueError(f"CreditConfig.estimator: {RENAMED[self.estimator]}")
        if self.estimator not in estimator_names():
            raise ValueError(f"CreditConfig.estimator={self.estimator!r} is not registered; choose one of "
                             f"{estimator_names()} (or register_estimator your own first)")
        for name, choices in (("std", STD_MODES), ("form", FORMS), ("abc_normalize", ABC_NORMALIZE_MODES),
                              ("gigpo_step_std", GIGPO_STEP_STD_MODES), ("abc_answer_step", ABC_ANSWER_STEPS),
                              ("gigpo_anchor", GIGPO_ANCHORS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"CreditConfig.{name}={getattr(self, name)!r} is not one of {list(choices)}")
        for name in ("std_eps", "eps", "gamma", "terminal_fill", "alpha_out", "alpha_turn", "abc_gamma",
                     "gigpo_gamma", "gigpo_omega"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"CreditConfig.{name} must be a finite number, got {value!r}")
        if isinstance(self.horizon, bool) or not isinstance(self.horizon, int) or self.horizon < 0:
            raise ValueError(f"CreditConfig.horizon must be a non-negative int (the look-ahead K), got "
                             f"{self.horizon!r}")
        if self.eps <= 0:
            raise ValueError(f"CreditConfig.eps must be > 0 (it keeps the gap d_k positive), got {self.eps!r}")
        if self.std_eps < 0:
            raise ValueError(f"CreditConfig.std_eps must be >= 0, got {self.std_eps!r}")
        for name in ("gamma", "abc_gamma", "gigpo_gamma"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"CreditConfig.{name} must lie in [0, 1], got {getattr(self, name)!r}")
        for name in ("terminal_fill", "alpha_out", "alpha_turn", "gigpo_omega"):
            if getattr(self, name) < 0:
                raise ValueError(f"CreditConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        if not isinstance(self.abc_sft_correct_only, bool):
            raise ValueError(f"CreditConfig.abc_sft_correct_only must be True or False, got "
                             f"{self.abc_sft_correct_only!r}")
        if self.min_score is not None:
            if isinstance(self.min_score, bool) or not isinstance(self.min_score, (int, float)) \
                    or not math.isfinite(self.min_score) or self.min_score >= 0:
                raise ValueError(f"CreditConfig.min_score must be a finite negative number or None (per-form "
                                 f"default), got {self.min_score!r}")

    def replace(self, **changes) -> "CreditConfig":
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """JSON-able dict of every field (for summaries and receipts)."""
        return dataclasses.asdict(self)


DEFAULTS = {f.name: f.default for f in dataclasses.fields(CreditConfig)}
"""Every option's default, by field name (read by the CLI's flags)."""
