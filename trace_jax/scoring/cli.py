"""`trace-jax credit`: any registered credit estimator on trajectories that already exist (JSONL in, JSONL +
receipts out).

Input: a JSONL file, one trajectory per line (see docs/scoring.md for the schema):

    {"id": "q17-g3", "messages": [...OpenAI chat messages...], "answer": "gold answer",
     "reward": 1.0, "group": "q17", "tools": [...optional tool schemas...], "clues": [...optional, for abc_grpo...]}

`messages` are system/user/assistant (with `tool_calls`, optional `reasoning_content`)/tool messages; they are
rendered with the Qwen3 ChatML format (`trace_jax.models.chat.ChatFormat`, think blocks as the tokenizer's chat
template says unless `--thinking`) using the reference checkpoint's tokenizer, which also gives the state boundaries.
A record that ends on a tool message (cut at max turns) keeps its last state: the generation prompt is appended and
the state after the last observation is scored too. The reference model (any directory `models.load_pretrained`
reads) scores the answer continuation (`continuation.build_answer_continuation`: the format's answer prefix, the
`--answer-template` text before `{answer}` and the gold answer tokenised jointly) after every state;
`credit.compute_advantages` runs the estimator chosen with `--estimator` on the whole file, with the options of
`CreditConfig` from the flags.

Groups: records sharing `--group-key` form a prompt group. A record without a group is a group of one (outcome
advantage 0, so TRACE's terminal fill is 0 too); a record without a reward gets reward 0 in a group of its own, so
it changes no other record's statistics; a group with a skipped (malformed) line is marked incomplete. Each is
flagged per record and counted, with a one-line warning, on stderr and in `summary.json`.

Output (in --out): `credit.jsonl` (one line per scored record), `receipts/<id>.html`, `credit_by_turn.png` and
`summary.json`. Non-finite numbers are never written: a record whose scores are not finite gets `null` for every
score-derived field and the flag `nonfinite_scores`. Malformed records are reported on stderr with their line number
and skipped. Exit status: 0 when at least one record was scored, 1 when none was, 2 for unusable arguments.

ABC estimators (abc_grpo, abc_sft_online) need step counts from a step scorer, which lives in `trace_jax.abc`,
above this package: the `trace-jax` dispatcher composes it in (`run(args, step_counting=...)`, built by
`trace_jax.abc.cli.credit_extensions`), so this package never imports `trace_jax.abc`.

This module is host code: file handling, tokenisation and formatting. Device work is in `fork.py` and the credit API.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from trace_jax.credit.config import DEFAULTS, CreditConfig
from trace_jax.jsonl import LineError, jsonl_lines, parse_chat_record, parse_line
from trace_jax.scoring.continuation import ANSWER_PLACEHOLDER, ANSWER_TAG_TEMPLATE, check_answer_template
from trace_jax.scoring.fork import LAYOUTS, METHODS

THINKING_CHOICES = ("auto", "none", "hybrid", "off", "always")
ANSWER_TAG_NAME = "answer_tag"  # the name `--answer-template` and `UpdateConfig.answer_template` share
# CreditConfig fields exposed as flags: (choices or None, help). Defaults come from CreditConfig, never from here.
_CREDIT_FLAGS = {
    "std": ("outcome advantage normalisation", ("population", "sample", "none")),
    "std_eps": ("groups with reward std <= this get outcome advantage 0", None),
    "form": ("TRACE TD form", ("log_ratio", "linear_gap", "raw_delta")),
    "eps": ("TRACE gap offset in d_k = -l_k + eps", None),
    "min_score": ("scores below this are clamped to it (default: per TD form)", None),
    "horizon": ("TRACE look-ahead K", None),
    "gamma": ("TRACE look-ahead discount", None),
    "terminal_fill": ("TRACE lambda_term, weight of A_out at the end", None),
    "alpha_out": ("weight of the outcome advantage", None),
    "alpha_turn": ("weight of TRACE's turn credit", None),
    "abc_gamma": ("ABC-GRPO backward accumulation factor", None),
    "abc_normalize": ("ABC-GRPO step statistics", ("joint", "per_step")),
    "gigpo_gamma": ("GiGPO step-return discount", None),
    "gigpo_omega": ("GiGPO weight of the step-level advantage", None),
    "gigpo_step_std": ("GiGPO step advantage normalisation", ("population", "none")),
    "gigpo_anchor": ("what makes GiGPO anchor states equal", ("observation", "history")),
    "abc_answer_step": ("ABC: the answer turn folds into the last tool step, or is its own", ("fold", "separate")),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from trace_jax.credit import estimator_names

    parser.add_argument("input", help="JSONL of trajectories (OpenAI chat messages + gold answer per record)")
    parser.add_argument("--reference", required=True,
                        help="reference checkpoint directory (Hugging Face layout, anything load_pretrained reads)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the reference directory)")
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    io = parser.add_argument_group("record fields")
    io.add_argument("--answer-key", "--answer_key", default="answer", help="field holding the gold answer text")
    io.add_argument("--reward-key", "--reward_key", default="reward",
                    help="field holding the final reward (optional per record)")
    io.add_argument("--group-key", "--group_key", default="group",
                    help="field grouping trajectories of one prompt for outcome advantages (missing: a group of one)")
    io.add_argument("--answer-template", "--answer_template", default=ANSWER_TAG_NAME,
                    help=f"what the reference is conditioned on before the gold answer it scores, after the chat "
                         f"format's answer prefix: '{ANSWER_TAG_NAME}' ({ANSWER_TAG_TEMPLATE!r}), or a template with "
                         f"{ANSWER_PLACEHOLDER} at its end (e.g. ' The answer is {ANSWER_PLACEHOLDER}', the opening "
                         "of a policy warm-started on the oracle's demonstrations); text without braces is an open "
                         "tag put right before the answer ('' for none)")
    io.add_argument("--score-close-tag", "--score_close_tag", action="store_true",
                    help="append </answer> to the continuation and score it with the answer")
    io.add_argument("--thinking", choices=THINKING_CHOICES, default="auto",
                    help="think-block layout of the chat format (auto: read from the tokenizer's chat template)")
    scoring = parser.add_argument_group("scoring")
    scoring.add_argument("--method", choices=METHODS, default="fork")
    scoring.add_argument("--layout", choices=LAYOUTS, default="auto")
    scoring.add_argument("--batch-size", "--batch_size", type=int, default=8, help="trajectories per scoring pass")
    scoring.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                         help="reference params and compute dtype (log-softmax is always float32)")
    credit = parser.add_argument_group("credit (CreditConfig; every default is CreditConfig's)")
    credit.add_argument("--estimator", choices=estimator_names(), default=DEFAULTS["estimator"],
                        help="registered credit estimator")
    for name, (text, choices) in _CREDIT_FLAGS.items():
        default = DEFAULTS[name]
        kind = int if name == "horizon" else (str if choices else float)
        spellings = dict.fromkeys(("--" + name.replace("_", "-"), "--" + name))  # kebab, then the snake alias
        credit.add_argument(*spellings, dest=name, type=kind, choices=choices, default=None,
                            help=f"{text} (default {default})")
    output = parser.add_argument_group("output")
    output.add_argument("--no-receipts", "--no_receipts", action="store_true", help="skip the HTML receipts")
    output.add_argument("--no-plot", "--no_plot", action="store_true", help="skip the PNG summary plot")
    output.add_argument("--excerpt-chars", "--excerpt_chars", type=int, default=160,
                        help="observation excerpt length in receipts")


def answer_template_from_flag(value: str) -> str:
    """The answer template `--answer-template VALUE` means: the name 'answer_tag' -> `ANSWER_TAG_TEMPLATE`; a value
    holding braces -> a template (`check_answer_template`); other text -> an open tag (the flag's older meaning:
    `X` -> `X{answer}`, '' -> `{answer}`). ValueError names the problem."""
    if value == ANSWER_TAG_NAME:
        return ANSWER_TAG_TEMPLATE
    if "{" not in value and "}" not in value:
        return value + ANSWER_PLACEHOLDER
    return check_answer_template(value, where="--answer-template")


def credit_config_from_args(args: argparse.Namespace) -> CreditConfig:
    """The `CreditConfig` the flags ask for (unset flags keep CreditConfig's defaults); ValueError if illegal."""
    given = {name: getattr(args, name) for name in _CREDIT_FLAGS if getattr(args, name, None) is not None}
    return CreditConfig(estimator=args.estimator, **given)


# ---------------------------------------------------------------------------------------------------- records
class RecordError(ValueError):
    """A record that cannot be scored; the message says which field and what was expected."""


@dataclass(frozen=True)
class StepCounting:
    """Where ABC step counts come from, for estimators that require `step_rewards` (abc_grpo, abc_sft_online). The
    `trace-jax` dispatcher passes one built by `trace_jax.abc.cli.credit_extensions`.

    Attributes:
      count: `(record, messages, answer) -> counts`, one per step, each with integer `n_found`, `n_excluded`,
        `n_rejected` and `ans`; ValueError (naming the field and the fix) for a record it cannot count.
      to_arrays: per-record counts -> `{"n_found", "n_excluded", "n_rejected", "ans": int [N, S], "num_steps":
        int [N]}`, zero-padded.
    """

    count: Callable[[dict, list, str], list]
    to_arrays: Callable[[list], dict]


@dataclass
class Prepared:
    line: int
    record_id: str
    record: dict
    ids: np.ndarray
    loss_mask: np.ndarray
    turn_index: np.ndarray
    boundaries: np.ndarray
    continuation: Any  # AnswerContinuation
    reward: float | None
    group: str | None
    state_keys: list[str]
    ended_on_tool: bool
    turns: list[dict] = field(default_factory=list)
    question: str = ""
    step_counts: list | None = None

    @property
    def num_turns(self) -> int:
        return len(self.boundaries) - 1


def _content_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return ""


def _call_text(call: Any) -> str:
    function = call.get("function", call) if isinstance(call, Mapping) else {}
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return f"{function.get('name', '?')}({arguments})"


def turn_summaries(messages: list, num_turns: int, excerpt_chars: int) -> list[dict]:
    """Per tool-calling turn k < num_turns: its tool call(s) and an excerpt of the observation that followed.

    Counts turns like `ChatFormat.messages_to_ids`: consecutive tool messages form one observation.
    """
    from trace_jax.scoring.receipts import excerpt

    turns = [{"calls": [], "observation": ""} for _ in range(num_turns)]
    tool_groups_seen = 0
    previous_role = None
    for message in messages:
        role = message.get("role")
        if role == "assistant" and tool_groups_seen < num_turns:
            turns[tool_groups_seen]["calls"] += [_call_text(c) for c in message.get("tool_calls") or ()]
        elif role == "tool":
            if previous_role != "tool":
                tool_groups_seen += 1
            k = tool_groups_seen - 1
            if k < num_turns:
                joined = (turns[k]["observation"] + " " + _content_text(message)).strip()
                turns[k]["observation"] = excerpt(joined, excerpt_chars)
        previous_role = role
    return turns


def _observations(messages: list) -> list[str]:
    """One observation per tool turn: consecutive tool messages joined, as `ChatFormat` renders them in one turn."""
    out: list[str] = []
    previous_role = None
    for message in messages:
        if message.get("role") == "tool":
            text = _content_text(message)
            if previous_role == "tool":
                out[-1] += "\n\n" + text
            else:
                out.append(text)
        previous_role = message.get("role")
    return out


def _finite_number(value: Any) -> bool:
    """A JSON number that is a finite float (an integer too large for a float is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def prepare_record(line_number: int, text: bytes | str, chat, tokenizer, args, config: CreditConfig, *,
                   max_positions: int | None = None, step_counting: StepCounting | None = None) -> Prepared:
    """Parse and tokenise one JSONL line; raises RecordError naming the problem.

    With `max_positions` (the reference's `max_position_embeddings`), a record whose scoring pass would use a
    position at or past it is refused: the model was never trained there, so its scores would mean nothing.
    `step_counting` gives the ABC step counts of estimators that need them (RecordError without it)."""
    from trace_jax.credit import get_estimator
    from trace_jax.credit.gigpo import state_keys
    from trace_jax.scoring.continuation import build_answer_continuation

    try:
        template = answer_template_from_flag(args.answer_template)
    except ValueError as error:  # `run` checks the flag first; a direct caller learns it here
        raise RecordError(str(error)) from None
    record, messages, answer = parse_chat_record(text, args.answer_key, error=RecordError)
    reward = record.get(args.reward_key)
    if reward is not None and not _finite_number(reward):
        raise RecordError(f"field {args.reward_key!r} must be a finite number when present, got {reward!r:.40}")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RecordError("field 'tools' must be a list of tool schemas when present")
    try:
        conversation = chat.messages_to_ids(messages, tools=tools)
    except (ValueError, TypeError, AttributeError) as error:
        raise RecordError(f"messages cannot be rendered: {error}") from None
    try:
        continuation = build_answer_continuation(tokenizer, chat, answer, template=template,
                                                 score_close_tag=args.score_close_tag)
    except ValueError as error:
        raise RecordError(f"field {args.answer_key!r}: {error}") from None
    if conversation.boundaries[0] < 1:
        raise RecordError("the first assistant turn starts at token 0; a prompt must come before it")
    ids, loss_mask = list(conversation.ids), list(conversation.loss_mask)
    turn_index, boundaries = list(conversation.turn_index), list(conversation.boundaries)
    ended_on_tool = messages[-1].get("role") == "tool"
    if ended_on_tool:  # cut after an observation: its state is real, open the generation that never came
        prompt = chat.generation_prompt_ids()
        ids += prompt
        loss_mask += [False] * len(prompt)
        turn_index += [-1] * len(prompt)
        boundaries.append(len(ids))
    num_turns = len(boundaries) - 1
    # the fork pass feeds the trajectory at positions [0, L) and answer copy k at b_k .. b_k + m - 2
    needed = max(len(ids), boundaries[-1] + len(continuation.ids) - 1)
    if max_positions is not None and needed > max_positions:
        raise RecordError(f"the record needs {needed} positions ({len(ids)} trajectory tokens, then the "
                          f"{len(continuation.ids)}-token answer after its last state); the reference model's context "
                          f"is {max_positions} (max_position_embeddings) and nothing past it is scored. Shorten the "
                          "record (fewer turns or shorter observations) or use a reference with a longer context")
    step_counts = None
    if "step_rewards" in get_estimator(config.estimator).requires:  # abc_grpo, abc_sft_online
        if step_counting is None:
            raise RecordError(f"--estimator {config.estimator} needs ABC step counts and none were given; run it as "
                              "`trace-jax credit`, which takes them from trace_jax.abc")
        try:
            step_counts = step_counting.count(record, messages, answer)
        except ValueError as error:
            raise RecordError(str(error)) from None
    group = record.get(args.group_key)
    record_id = record.get("id", record.get("task_id", f"line-{line_number}"))
    question = next((_content_text(m) for m in messages if m.get("role") == "user"), "")
    keys = state_keys(_observations(messages), config.gigpo_anchor)[: num_turns + 1]
    return Prepared(line=line_number, record_id=str(record_id), record=record, ids=np.asarray(ids, np.int32),
                    loss_mask=np.asarray(loss_mask, bool), turn_index=np.asarray(turn_index, np.int32),
                    boundaries=np.asarray(boundaries, np.int32), continuation=continuation,
                    reward=None if reward is None else float(reward), group=None if group is None else str(group),
                    state_keys=keys, ended_on_tool=ended_on_tool,
                    turns=turn_summaries(messages, num_turns, args.excerpt_chars), question=question,
                    step_counts=step_counts)


# ---------------------------------------------------------------------------------------------------- scoring
def score_records(config, params, prepared: list[Prepared], *, method: str, layout: str, batch_size: int):
    """Answer scores per record (list of float32 arrays [T_i + 1]), batched by similar length."""
    from trace_jax.scoring.fork import score_answer_prefixes

    order = sorted(range(len(prepared)), key=lambda i: len(prepared[i].ids))
    scores: list[np.ndarray | None] = [None] * len(prepared)
    for start in range(0, len(order), max(1, batch_size)):
        chunk = [prepared[i] for i in order[start:start + batch_size]]
        n = len(chunk)
        length = max(len(p.ids) for p in chunk)
        slots = max(len(p.boundaries) for p in chunk)
        m = max(len(p.continuation.ids) for p in chunk)
        tokens = np.zeros((n, length), np.int32)
        boundaries = np.ones((n, slots), np.int32)
        answers = np.zeros((n, m), np.int32)
        masks = np.zeros((n, m), np.int32)
        for row, p in enumerate(chunk):
            tokens[row, :len(p.ids)] = p.ids
            boundaries[row, :len(p.boundaries)] = p.boundaries
            answers[row, :len(p.continuation.ids)] = p.continuation.ids
            masks[row, :len(p.continuation.mask)] = p.continuation.mask
        num_states = np.array([len(p.boundaries) for p in chunk], np.int32)
        result = score_answer_prefixes(config, params, tokens, boundaries, num_states, answers, masks,
                                       method=method, layout=layout)
        batch_scores = np.asarray(result.answer_scores)
        for row, index in enumerate(order[start:start + batch_size]):
            scores[index] = batch_scores[row, :num_states[row]]
    return scores


@dataclass
class GroupInfo:
    """How the records were grouped, per record: the group id the estimator sees and what the output reports."""

    group_id: np.ndarray            # [N] int, in [0, N)
    rewards: np.ndarray             # [N] float32, 0 for records without a reward
    size: list[int]                 # rewarded members of the record's group (1 for a record without reward)
    mean: list[float | None]
    std: list[float | None]
    flags: list[list[str]]


def group_records(prepared: list[Prepared], incomplete_groups: set[str]) -> GroupInfo:
    """Group ids for the estimator: records sharing a group key and having a reward form a group; a record
    without a group key, or without a reward, is a group of its own (flagged `group_of_one` / `missing_reward`)."""
    keys: dict[Any, int] = {}
    group_id = np.zeros(len(prepared), np.int32)
    for i, p in enumerate(prepared):
        key = ("group", p.group) if (p.group is not None and p.reward is not None) else ("single", i)
        group_id[i] = keys.setdefault(key, len(keys))
    rewards = np.asarray([0.0 if p.reward is None else p.reward for p in prepared], np.float32)
    members = Counter(group_id.tolist())
    size, mean, std, flags = [], [], [], []
    for i, p in enumerate(prepared):
        same = rewards[group_id == group_id[i]].astype(np.float64)
        size.append(members[group_id[i]])
        mean.append(None if p.reward is None else round(float(same.mean()), 6))
        std.append(None if p.reward is None else round(float(same.std()), 6))
        record_flags = []
        if p.reward is None:
            record_flags.append("missing_reward")
        elif members[group_id[i]] == 1:
            record_flags.append("group_of_one")
        if p.group is not None and p.group in incomplete_groups:
            record_flags.append("group_incomplete")
        flags.append(record_flags)
    return GroupInfo(group_id, rewards, size, mean, std, flags)


def credit_inputs_for(prepared: list[Prepared], scores: list[np.ndarray], groups: GroupInfo, *,
                      answer_step: str = "fold", step_counting: StepCounting | None = None):
    """`CreditInputs` for the whole file, padded to the longest record (non-finite score rows zeroed; they are
    reported as null afterwards). ABC step counts (packed by `step_counting.to_arrays`) have their answer turn
    folded into the last tool step unless `answer_step` (`CreditConfig.abc_answer_step`) is "separate"."""
    import jax.numpy as jnp

    from trace_jax.credit import CreditInputs, abc_step_rewards, anchor_key_ids, fold_answer_steps

    n = len(prepared)
    length = max(len(p.ids) for p in prepared)
    slots = max(p.num_turns + 1 for p in prepared)
    loss_mask = np.zeros((n, length), np.float32)
    turn_index = np.full((n, length), -1, np.int32)
    answer_scores = np.zeros((n, slots), np.float32)
    for i, p in enumerate(prepared):
        loss_mask[i, :len(p.ids)] = p.loss_mask
        turn_index[i, :len(p.ids)] = p.turn_index
        if np.all(np.isfinite(scores[i])):
            answer_scores[i, :len(scores[i])] = scores[i]
    extra = {}
    if prepared[0].step_counts is not None:
        counts = step_counting.to_arrays([p.step_counts for p in prepared])
        arrays = [jnp.asarray(counts[k]) for k in ("n_found", "n_excluded", "n_rejected", "ans")]
        num_steps = jnp.asarray(counts["num_steps"])
        if answer_step == "fold":
            *arrays, num_steps = fold_answer_steps(*arrays, num_steps,
                                                   jnp.asarray([p.num_turns for p in prepared], jnp.int32))
        # an answer turn makes no tool call, so folding never moves a tool error
        extra["step_rewards"] = abc_step_rewards(*arrays, jnp.asarray(counts["tool_error"]))
        extra["num_steps"] = num_steps
        # ABC-SFT's filter: the answer step's own check (`ans` = +1 on an exact match with the gold answer)
        extra["correct"] = jnp.asarray([any(c.ans == 1 for c in p.step_counts) for p in prepared])
    return CreditInputs(rewards=jnp.asarray(groups.rewards), group_id=jnp.asarray(groups.group_id),
                        loss_mask=jnp.asarray(loss_mask), turn_index=jnp.asarray(turn_index),
                        num_turns=jnp.asarray([p.num_turns for p in prepared], jnp.int32),
                        answer_scores=jnp.asarray(answer_scores),
                        anchor_keys=jnp.asarray(anchor_key_ids([p.state_keys for p in prepared], slots)), **extra)


def turn_spans(turn_index: np.ndarray, loss_mask: np.ndarray) -> list[list[int]]:
    """`[start, end)` token offsets of each assistant turn's trained tokens, turn 0 first (the answer turn last)."""
    spans = []
    for k in range(int(turn_index.max(initial=-1)) + 1):
        where = np.nonzero((turn_index == k) & loss_mask)[0]
        spans.append([int(where[0]), int(where[-1]) + 1] if len(where) else [])
    return spans


def _number(value) -> float | None:
    value = float(value)
    return round(value, 6) if math.isfinite(value) else None


def _numbers(values) -> list[float | None]:
    return [_number(v) for v in values]


def record_results(prepared: list[Prepared], scores: list[np.ndarray], groups: GroupInfo, inputs, result,
                   config: CreditConfig, args) -> list[dict]:
    """One output dict per record; every float is finite or None."""
    from trace_jax.credit import get_estimator, td_deltas, trace_values
    from trace_jax.credit.config import default_min_score

    uses_scores = "answer_scores" in get_estimator(config.estimator).requires

    form = config.form if config.estimator == "trace" else {"trace_raw_delta": "raw_delta",
                                                             "trace_linear_gap": "linear_gap"}.get(
        config.estimator, config.form)
    min_score = config.min_score
    floor = default_min_score(form) if min_score is None else min_score
    values = np.asarray(trace_values(inputs.answer_scores, inputs.num_turns, eps=config.eps, min_score=min_score))
    deltas = np.asarray(td_deltas(inputs.answer_scores, inputs.num_turns, form=form, eps=config.eps,
                                  min_score=min_score)) if values.shape[1] > 1 else np.zeros((len(prepared), 0))
    tokens = np.asarray(result.token_advantages)
    per_turn = None if result.per_turn is None else np.asarray(result.per_turn)
    outcome = None if result.outcome_advantages is None else np.asarray(result.outcome_advantages)
    out = []
    for i, p in enumerate(prepared):
        t = p.num_turns
        finite = bool(np.all(np.isfinite(scores[i])))
        flags = list(groups.flags[i]) + ([] if finite else ["nonfinite_scores"])
        spans = turn_spans(p.turn_index, p.loss_mask)
        advantages = [_number(tokens[i, a]) if (a < b) else None for a, b in (s or (0, 0) for s in spans)]
        if not finite and uses_scores:  # the estimator saw placeholder scores for this row
            advantages = [None] * len(spans)
        credit = [] if per_turn is None else per_turn[i, :t]
        has_answer_turn = len(spans) > t
        scored = lambda xs: _numbers(xs) if finite else None  # noqa: E731 - a local formatting rule
        result_record = {
            "id": p.record_id, "line": p.line, "group": p.group, "reward": p.reward, "estimator": config.estimator,
            "answer": p.record.get(args.answer_key), "num_turns": t, "num_tokens": int(len(p.ids)),
            "ended_on_tool": p.ended_on_tool, "boundaries": [int(b) for b in p.boundaries],
            "group_size": groups.size[i], "group_reward_mean": groups.mean[i], "group_reward_std": groups.std[i],
            "flags": flags,
            "template_token_ids": p.continuation.template_ids, "answer_token_ids": p.continuation.answer_ids,
            "answer_scores": scored(scores[i]), "gaps": scored(config.eps - np.clip(scores[i], floor, 0.0)),
            "values": scored(values[i, :t + 1]), "td": scored(deltas[i, :t]),
            "turn_credit": scored(credit) if uses_scores else _numbers(credit),
            "outcome_advantage": None if outcome is None else _number(outcome[i]),
            "turn_spans": spans, "turn_advantages": advantages,
            "turn_advantage": advantages[:t], "final_advantage": advantages[t] if has_answer_turn else None,
        }
        if p.step_counts is not None:
            result_record["step_counts"] = [[c.n_found, c.n_excluded, c.n_rejected, c.ans] for c in p.step_counts]
            result_record["step_rewards"] = _numbers(np.asarray(inputs.step_rewards)[i, :int(inputs.num_steps[i])])
        out.append(result_record)
    return out


def _skipped_group(text: bytes, group_key: str) -> str | None:
    try:
        record = parse_line(text)
    except LineError:
        return None
    group = record.get(group_key) if isinstance(record, dict) else None
    return None if group is None else str(group)


# ---------------------------------------------------------------------------------------------------- main
def run(args: argparse.Namespace, *, step_counting: StepCounting | None = None) -> int:
    """`trace-jax credit` (see the module docstring); `step_counting` is what ABC estimators count steps with."""
    input_path, out_dir = Path(args.input), Path(args.out)
    if not input_path.is_file():
        print(f"credit: input {str(input_path)!r} is not a file; pass a JSONL of trajectories", file=sys.stderr)
        return 2
    if not Path(args.reference).is_dir():
        print(f"credit: --reference {args.reference!r} is not a directory; pass a Hugging Face checkpoint "
              "directory (config.json + model.safetensors)", file=sys.stderr)
        return 2
    if args.batch_size < 1 or args.excerpt_chars < 1:
        print("credit: --batch-size and --excerpt-chars must be >= 1", file=sys.stderr)
        return 2
    try:
        config = credit_config_from_args(args)
        answer_template_from_flag(args.answer_template)
    except ValueError as error:
        print(f"credit: {error}", file=sys.stderr)
        return 2
    from trace_jax.credit import get_estimator

    if "step_rewards" in get_estimator(config.estimator).requires and step_counting is None:
        print(f"credit: --estimator {config.estimator} needs ABC step counts, which come from trace_jax.abc; run it "
              "as `trace-jax credit` (the dispatcher composes them in)", file=sys.stderr)
        return 2

    from trace_jax import models
    from trace_jax.credit import compute_advantages
    from trace_jax.models.chat import ChatFormat
    from trace_jax.models.tokenizer import load_tokenizer
    from trace_jax.scoring.receipts import plot_credit_by_turn, safe_filename, write_receipt

    start = time.perf_counter()
    tokenizer = load_tokenizer(args.tokenizer or args.reference)
    chat = ChatFormat(tokenizer, thinking=None if args.thinking == "auto" else args.thinking)
    model_config, params = models.load_pretrained(args.reference, dtype=args.dtype,
                                                  config_overrides={"dtype": args.dtype})

    prepared: list[Prepared] = []
    errors: list[tuple[int, str]] = []
    incomplete_groups: set[str] = set()
    total = 0
    for line_number, text in jsonl_lines(input_path):
        total += 1
        try:
            prepared.append(prepare_record(line_number, text, chat, tokenizer, args, config,
                                           max_positions=model_config.max_position_embeddings,
                                           step_counting=step_counting))
        except RecordError as error:
            errors.append((line_number, str(error)))
            group = _skipped_group(text, args.group_key)
            if group is not None:
                incomplete_groups.add(group)
            print(f"credit: {input_path}:{line_number}: skipped: {error}", file=sys.stderr)

    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    groups = group_records(prepared, incomplete_groups) if prepared else None
    if prepared:
        scores = score_records(model_config, params, prepared, method=args.method, layout=args.layout,
                               batch_size=args.batch_size)
        inputs = credit_inputs_for(prepared, scores, groups, answer_step=config.abc_answer_step,
                                   step_counting=step_counting)
        try:
            result = compute_advantages(config, inputs, check=True)
        except ValueError as error:
            print(f"credit: {input_path}: estimator {config.estimator!r} rejected the inputs: {error}",
                  file=sys.stderr)
            return 1
        results = record_results(prepared, scores, groups, inputs, result, config, args)
        receipts_dir = out_dir / "receipts"
        if not args.no_receipts:
            receipts_dir.mkdir(exist_ok=True)
        with (out_dir / "credit.jsonl").open("w", encoding="utf-8") as handle:
            for p, record in zip(prepared, results):
                if not args.no_receipts:
                    name = safe_filename(f"{p.record_id}-L{p.line}", ".html")
                    write_receipt(receipts_dir / name, record, p.turns, question=p.question)
                    record["receipt"] = f"receipts/{name}"
                handle.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
        if not args.no_plot:
            plot_credit_by_turn(results, out_dir / "credit_by_turn.png")
    else:
        (out_dir / "credit.jsonl").write_text("", encoding="utf-8")
    flag_counts = Counter(flag for record in results for flag in record["flags"])
    settings = {"credit": config.to_dict(), **{k: getattr(args, k) for k in (
        "answer_template", "score_close_tag", "thinking", "method", "layout", "dtype")}, "chat_thinking": chat.thinking,
        "scored_template": answer_template_from_flag(args.answer_template)}
    summary = {"input": str(input_path), "reference": str(args.reference), "estimator": config.estimator,
               "records": total, "scored": len(results), "skipped": len(errors),
               "groups": len(set(groups.group_id.tolist())) if groups else 0,
               "groups_of_one": flag_counts["group_of_one"], "missing_reward": flag_counts["missing_reward"],
               "incomplete_group_records": flag_counts["group_incomplete"],
               "nonfinite_scores": flag_counts["nonfinite_scores"],
               "errors": [{"line": line, "error": message} for line, message in errors],
               "seconds": round(time.perf_counter() - start, 3), "settings": settings}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    warnings = [f"{summary['groups_of_one']} in a group of one", f"{summary['missing_reward']} without a reward",
                f"{summary['incomplete_group_records']} in a group with a skipped line",
                f"{summary['nonfinite_scores']} with non-finite scores"]
    shown = [w for w, key in zip(warnings, ("groups_of_one", "missing_reward", "incomplete_group_records",
                                            "nonfinite_scores")) if summary[key]]
    if shown:
        print(f"credit: warning: of {len(results)} records, " + ", ".join(shown)
              + " (their outcome advantage is 0 or their credit is null; see 'flags' in credit.jsonl)",
              file=sys.stderr)
    print(f"credit: {config.estimator}: scored {len(results)} of {total} records ({len(errors)} malformed, skipped) "
          f"in {summary['seconds']:.1f} s -> {out_dir}")
    return 0 if results else 1


def main(argv: list[str] | None = None) -> int:
    """This module alone: every estimator but the ABC ones (`trace-jax credit` composes their step counts in)."""
    parser = argparse.ArgumentParser(prog="trace-jax credit", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
