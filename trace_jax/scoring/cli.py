"""`trace-jax credit`: TRACE turn credit for trajectories that already exist (JSONL in, JSONL + receipts out).

Input: a JSONL file, one trajectory per line (see docs/scoring.md for the schema):

    {"id": "q17-g3", "messages": [...OpenAI chat messages...], "answer": "gold answer",
     "reward": 1.0, "group": "q17", "tools": [...optional tool schemas...]}

`messages` are system/user/assistant (with `tool_calls`)/tool messages; they are rendered with the Qwen3 ChatML
format (`trace_jax.models.chat.ChatFormat`) using the reference checkpoint's tokenizer, which also gives the state
boundaries. The reference model (any directory `models.load_pretrained` reads) scores `template + answer` after
every state (`score_answer_prefixes`); the credit API turns the scores into values, TDs and look-ahead credit.

Output (in --out): `credit.jsonl` (one line per scored record), `receipts/<id>.html` and `credit_by_turn.png`.
Malformed records are reported on stderr with their line number and skipped; a summary line says how many were
scored. Exit status: 0 when at least one record was scored, 1 when none was, 2 for unusable arguments.

This module is host code: file handling, tokenisation and formatting. Device work is in `fork.py` and the credit API.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trace_jax.scoring.fork import LAYOUTS, METHODS

FORMS = ("log_ratio", "linear_gap", "raw_delta")
STD_MODES = ("population", "sample", "none")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="JSONL of trajectories (OpenAI chat messages + gold answer per record)")
    parser.add_argument("--reference", required=True,
                        help="reference checkpoint directory (Hugging Face layout, anything load_pretrained reads)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the reference directory)")
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    io = parser.add_argument_group("record fields")
    io.add_argument("--answer-key", default="answer", help="field holding the gold answer text")
    io.add_argument("--reward-key", default="reward", help="field holding the final reward (optional per record)")
    io.add_argument("--group-key", default="group",
                    help="field grouping trajectories of one prompt for outcome advantages (missing: a group of one)")
    io.add_argument("--answer-template", default="<answer>",
                    help="text conditioned on before the gold answer (not scored); '' for none")
    scoring = parser.add_argument_group("scoring")
    scoring.add_argument("--method", choices=METHODS, default="fork")
    scoring.add_argument("--layout", choices=LAYOUTS, default="auto")
    scoring.add_argument("--batch-size", type=int, default=8, help="trajectories per scoring pass")
    scoring.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                         help="reference params and compute dtype (log-softmax is always float32)")
    credit = parser.add_argument_group("TRACE credit (credit-spec section 2)")
    credit.add_argument("--form", choices=FORMS, default="log_ratio", help="TD form")
    credit.add_argument("--eps", type=float, default=0.1, help="gap offset in d_k = -l_k + eps")
    credit.add_argument("--min-score", type=float, default=-1e4, help="scores below this are clamped to it")
    credit.add_argument("--horizon", type=int, default=3, help="look-ahead K")
    credit.add_argument("--gamma", type=float, default=0.8, help="look-ahead discount")
    credit.add_argument("--terminal-fill", type=float, default=2.0, help="lambda_term, weight of A_out at the end")
    credit.add_argument("--alpha-out", type=float, default=1.0, help="weight of the outcome advantage")
    credit.add_argument("--alpha-turn", type=float, default=0.2, help="weight of the turn credit")
    credit.add_argument("--std", choices=STD_MODES, default="population", help="outcome advantage normalisation")
    credit.add_argument("--std-eps", type=float, default=1e-6, help="groups with std <= this get advantage 0")
    output = parser.add_argument_group("output")
    output.add_argument("--no-receipts", action="store_true", help="skip the HTML receipts")
    output.add_argument("--no-plot", action="store_true", help="skip the PNG summary plot")
    output.add_argument("--excerpt-chars", type=int, default=160, help="observation excerpt length in receipts")


# ---------------------------------------------------------------------------------------------------- records
class RecordError(ValueError):
    """A record that cannot be scored; the message says which field and what was expected."""


@dataclass
class Prepared:
    line: int
    record_id: str
    record: dict
    ids: np.ndarray
    boundaries: np.ndarray
    answer_ids: list[int]
    answer_mask: list[int]
    reward: float | None
    group: str | None
    turns: list[dict] = field(default_factory=list)
    question: str = ""


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


def prepare_record(line_number: int, text: str, chat, tokenizer, args) -> Prepared:
    """Parse and tokenise one JSONL line; raises RecordError naming the problem."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise RecordError(f"not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, got {type(record).__name__}")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise RecordError("field 'messages' must be a non-empty list of chat message objects")
    answer = record.get(args.answer_key)
    if not isinstance(answer, str) or not answer.strip():
        raise RecordError(f"field {args.answer_key!r} must be a non-empty string (the gold answer)")
    reward = record.get(args.reward_key)
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not math.isfinite(reward)):
        raise RecordError(f"field {args.reward_key!r} must be a finite number when present, got {reward!r}")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RecordError("field 'tools' must be a list of tool schemas when present")
    try:
        conversation = chat.messages_to_ids(messages, tools=tools)
    except (ValueError, TypeError, AttributeError) as error:
        raise RecordError(f"messages cannot be rendered: {error}") from None
    template = tokenizer.encode(args.answer_template, add_special_tokens=False) if args.answer_template else []
    gold = tokenizer.encode(answer, add_special_tokens=False)
    if not gold:
        raise RecordError(f"field {args.answer_key!r} encodes to no tokens")
    if conversation.boundaries[0] < 1:
        raise RecordError("the first assistant turn starts at token 0; a prompt must come before it")
    group = record.get(args.group_key)
    record_id = record.get("id", record.get("task_id", f"line-{line_number}"))
    num_turns = len(conversation.boundaries) - 1
    question = next((_content_text(m) for m in messages if m.get("role") == "user"), "")
    return Prepared(line=line_number, record_id=str(record_id), record=record, ids=conversation.ids,
                    boundaries=conversation.boundaries, answer_ids=list(template) + list(gold),
                    answer_mask=[0] * len(template) + [1] * len(gold),
                    reward=None if reward is None else float(reward), group=None if group is None else str(group),
                    turns=turn_summaries(messages, num_turns, args.excerpt_chars), question=question)


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
        m = max(len(p.answer_ids) for p in chunk)
        tokens = np.zeros((n, length), np.int32)
        boundaries = np.ones((n, slots), np.int32)
        answers = np.zeros((n, m), np.int32)
        masks = np.zeros((n, m), np.int32)
        for row, p in enumerate(chunk):
            tokens[row, :len(p.ids)] = p.ids
            boundaries[row, :len(p.boundaries)] = p.boundaries
            answers[row, :len(p.answer_ids)] = p.answer_ids
            masks[row, :len(p.answer_mask)] = p.answer_mask
        num_states = np.array([len(p.boundaries) for p in chunk], np.int32)
        result = score_answer_prefixes(config, params, tokens, boundaries, num_states, answers, masks,
                                       method=method, layout=layout)
        batch_scores = np.asarray(result.answer_scores)
        for row, index in enumerate(order[start:start + batch_size]):
            scores[index] = batch_scores[row, :num_states[row]]
    return scores


def outcome_advantages_for(prepared: list[Prepared], *, std: str, std_eps: float) -> np.ndarray:
    """GRPO outcome advantages over records with a reward, grouped by the group key (missing: a group of one).

    Records without a reward get 0.
    """
    import jax.numpy as jnp

    from trace_jax.credit import grouped_outcome_advantages

    advantages = np.zeros(len(prepared), np.float32)
    rewarded = [i for i, p in enumerate(prepared) if p.reward is not None]
    if not rewarded:
        return advantages
    group_ids: dict[str, int] = {}
    ids = []
    for i in rewarded:
        key = prepared[i].group if prepared[i].group is not None else f"\0single-{i}"
        ids.append(group_ids.setdefault(key, len(group_ids)))
    rewards = jnp.asarray([prepared[i].reward for i in rewarded], jnp.float32)
    values = grouped_outcome_advantages(rewards, jnp.asarray(ids, jnp.int32), len(group_ids), std=std, eps=std_eps)
    advantages[rewarded] = np.asarray(values)
    return advantages


def trace_credit(scores: list[np.ndarray], outcome_adv: np.ndarray, args) -> dict[str, list[np.ndarray]]:
    """Values, TDs, look-ahead credit and turn-token advantages per record, from the credit API."""
    import jax.numpy as jnp

    from trace_jax.credit import lookahead_credit, td_deltas, trace_values

    n = len(scores)
    slots = max(len(s) for s in scores)
    padded = np.zeros((n, slots), np.float32)
    for i, s in enumerate(scores):
        padded[i, :len(s)] = s
    num_turns = jnp.asarray([len(s) - 1 for s in scores], jnp.int32)
    answer_scores = jnp.asarray(padded)
    values = np.asarray(trace_values(answer_scores, num_turns, eps=args.eps, min_score=args.min_score))
    if slots > 1:
        deltas = td_deltas(answer_scores, num_turns, form=args.form, eps=args.eps, min_score=args.min_score)
        credit = np.asarray(lookahead_credit(deltas, num_turns, jnp.asarray(outcome_adv), horizon=args.horizon,
                                             gamma=args.gamma, terminal_fill=args.terminal_fill))
        deltas = np.asarray(deltas)
    else:  # every trajectory has T = 0: no turns to credit
        deltas = credit = np.zeros((n, 0), np.float32)
    out: dict[str, list[np.ndarray]] = {"values": [], "td": [], "turn_credit": [], "turn_advantage": []}
    for i, s in enumerate(scores):
        t = len(s) - 1
        out["values"].append(values[i, :t + 1])
        out["td"].append(deltas[i, :t])
        out["turn_credit"].append(credit[i, :t])
        out["turn_advantage"].append(args.alpha_out * outcome_adv[i] + args.alpha_turn * credit[i, :t])
    return out


def _floats(values) -> list[float]:
    return [round(float(v), 6) for v in values]


# ---------------------------------------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> int:
    input_path, out_dir = Path(args.input), Path(args.out)
    if not input_path.is_file():
        print(f"credit: input {str(input_path)!r} is not a file; pass a JSONL of trajectories", file=sys.stderr)
        return 2
    if not Path(args.reference).is_dir():
        print(f"credit: --reference {args.reference!r} is not a directory; pass a Hugging Face checkpoint "
              "directory (config.json + model.safetensors)", file=sys.stderr)
        return 2
    if args.batch_size < 1 or args.horizon < 0 or args.excerpt_chars < 1:
        print("credit: --batch-size and --excerpt-chars must be >= 1 and --horizon >= 0", file=sys.stderr)
        return 2

    from trace_jax import models
    from trace_jax.models.chat import ChatFormat
    from trace_jax.models.tokenizer import load_tokenizer
    from trace_jax.scoring.receipts import plot_credit_by_turn, safe_filename, write_receipt

    start = time.perf_counter()
    tokenizer = load_tokenizer(args.tokenizer or args.reference)
    chat = ChatFormat(tokenizer)
    config, params = models.load_pretrained(args.reference, dtype=args.dtype,
                                            config_overrides={"dtype": args.dtype})

    prepared: list[Prepared] = []
    errors: list[tuple[int, str]] = []
    total = 0
    with input_path.open(encoding="utf-8") as handle:
        for line_number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            total += 1
            try:
                prepared.append(prepare_record(line_number, text, chat, tokenizer, args))
            except RecordError as error:
                errors.append((line_number, str(error)))
                print(f"credit: {input_path}:{line_number}: skipped: {error}", file=sys.stderr)

    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    if prepared:
        scores = score_records(config, params, prepared, method=args.method, layout=args.layout,
                               batch_size=args.batch_size)
        outcome_adv = outcome_advantages_for(prepared, std=args.std, std_eps=args.std_eps)
        credit = trace_credit(scores, outcome_adv, args)
        receipts_dir = out_dir / "receipts"
        if not args.no_receipts:
            receipts_dir.mkdir(exist_ok=True)
        with (out_dir / "credit.jsonl").open("w", encoding="utf-8") as handle:
            for i, p in enumerate(prepared):
                result = {
                    "id": p.record_id, "line": p.line, "group": p.group, "reward": p.reward,
                    "answer": p.record.get(args.answer_key), "num_turns": len(p.boundaries) - 1,
                    "num_tokens": int(len(p.ids)), "boundaries": [int(b) for b in p.boundaries],
                    "answer_scores": _floats(scores[i]), "values": _floats(credit["values"][i]),
                    "td": _floats(credit["td"][i]), "turn_credit": _floats(credit["turn_credit"][i]),
                    "outcome_advantage": round(float(outcome_adv[i]), 6),
                    "turn_advantage": _floats(credit["turn_advantage"][i]),
                    "final_advantage": round(float(args.alpha_out * outcome_adv[i]), 6),
                }
                if not args.no_receipts:
                    name = safe_filename(f"{p.record_id}-L{p.line}", ".html")
                    write_receipt(receipts_dir / name, result, p.turns, question=p.question)
                    result["receipt"] = f"receipts/{name}"
                handle.write(json.dumps(result, ensure_ascii=False) + "\n")
                results.append(result)
        if not args.no_plot:
            plot_credit_by_turn(results, out_dir / "credit_by_turn.png")
    else:
        (out_dir / "credit.jsonl").write_text("", encoding="utf-8")
    settings = {k: getattr(args, k) for k in ("form", "eps", "min_score", "horizon", "gamma", "terminal_fill",
                                              "alpha_out", "alpha_turn", "std", "std_eps", "answer_template",
                                              "method", "layout", "dtype")}
    summary = {"input": str(input_path), "reference": str(args.reference), "records": total,
               "scored": len(results), "skipped": len(errors),
               "errors": [{"line": line, "error": message} for line, message in errors],
               "seconds": round(time.perf_counter() - start, 3), "settings": settings}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(f"credit: scored {len(results)} of {total} records ({len(errors)} malformed, skipped) "
          f"in {summary['seconds']:.1f} s -> {out_dir}")
    return 0 if results else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trace-jax credit", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
