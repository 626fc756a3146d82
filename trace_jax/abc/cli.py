"""`trace-jax abc-score`: ABC step rewards for trajectories that already exist, judged by an LLM over any
OpenAI-compatible endpoint (JSONL in, JSONL + receipts out).

Input: the record format of `trace-jax credit` (docs/scoring.md), one trajectory per line:

    {"id": "q17-g3", "messages": [...OpenAI chat messages...], "answer": "gold answer", "group": "q17",
     "aliases": ["optional", "other spellings"], "question": "optional; default: the first user message",
     "clues": [optional clue chain: {"docid", "entity", "relation", "value", "kind"}, ...]}

Steps are the assistant turns with the tool responses that followed them (the last may be the answer). Clues come
from the record's `clues` (generated tasks know their chain) or, with `--corpus`, are recovered by the clue-recovery
agent (`trace_jax.abc.recover`) once per (question, answer). The judge (`trace_jax.abc.judge`) scores each step;
`trace_jax.credit` turns counts into step rewards, ABC-SFT weights and ABC-GRPO advantages (grouped by `group`).

Output (in --out): `abc.jsonl` (one line per scored record), `clues.jsonl` (the clues used per question, recovered
or given), `receipts/<id>.html`, `judge_audit.jsonl` (every judge call), `judge_cache/` (reused by later runs) and
`summary.json` (the judge URL without credentials, never the key). Malformed lines (`trace_jax.jsonl`: not UTF-8,
not JSON, too deep, wrong types, malformed messages) and records too long for the judge's context are reported on
stderr with their line number and skipped; every other record is scored. Exit status: 0 when at
least one record was scored, 1 when none was, 2 for unusable arguments or an unreachable judge.

Host code only: files, HTTP through the judge and the recovery agent, and formatting.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from trace_jax.abc.rules import message_text, steps_from_messages
from trace_jax.abc.scorer import Step, StepCounts
from trace_jax.jsonl import jsonl_lines, parse_chat_record


class RecordError(ValueError):
    """A record that cannot be scored; the message names the field and what was expected."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from trace_jax.credit.config import ABC_NORMALIZE_MODES, DEFAULTS  # the ABC options' defaults are CreditConfig's

    parser.add_argument("input", help="JSONL of trajectories (the `trace-jax credit` record format)")
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    judge = parser.add_argument_group("judge endpoint (any OpenAI-compatible API)")
    judge.add_argument("--judge-url", "--judge_url", default=None, help="API root, e.g. http://127.0.0.1:8000/v1 "
                                                         "(default: $TRACE_JAX_JUDGE_URL)")
    judge.add_argument("--judge-model", "--judge_model", default=None,
                       help="model id (default: $TRACE_JAX_JUDGE_MODEL)")
    judge.add_argument("--judge-api-key", "--judge_api_key", default=None,
                       help="bearer key (default: $TRACE_JAX_JUDGE_API_KEY)")
    judge.add_argument("--timeout", type=float, default=60.0,
                       help="seconds one judge request may take in all (connect, send, the whole reply)")
    judge.add_argument("--deadline", type=float, default=None,
                       help="seconds for one step's judgement, every attempt and wait together "
                            "(default: JudgeConfig.deadline_s)")
    judge.add_argument("--max-attempts", "--max_attempts", type=int, default=3,
                       help="judge calls per step before neutral + flag")
    judge.add_argument("--backoff", type=float, default=0.5, help="first retry delay in seconds (doubles)")
    judge.add_argument("--concurrency", type=int, default=4, help="steps of a trajectory judged at once")
    judge.add_argument("--observation-chars", "--observation_chars", type=int, default=None,
                       help="each observation in a judge prompt is cut to this many characters "
                            "(default: JudgeConfig.observation_chars)")
    judge.add_argument("--cache-dir", "--cache_dir", default=None, help="judgement cache (default: OUT/judge_cache)")
    recover = parser.add_argument_group("clue recovery (records without clues)")
    recover.add_argument("--corpus", default=None, help="corpus (JSONL or Parquet) the recovery agent browses")
    recover.add_argument("--recover-url", "--recover_url", default=None,
                         help="endpoint of the recovery agent (default: judge's)")
    recover.add_argument("--recover-model", "--recover_model", default=None,
                         help="its model id (default: the judge model)")
    recover.add_argument("--recover-max-turns", "--recover_max_turns", type=int, default=16)
    fields = parser.add_argument_group("record fields")
    fields.add_argument("--answer-key", "--answer_key", default="answer")
    fields.add_argument("--aliases-key", "--aliases_key", default="aliases")
    fields.add_argument("--group-key", "--group_key", default="group")
    fields.add_argument("--clues-key", "--clues_key", default="clues")
    credit = parser.add_argument_group("ABC (credit-spec section 3)")
    credit.add_argument("--gamma", type=float, default=DEFAULTS["abc_gamma"],
                        help="ABC-GRPO backward accumulation (CreditConfig.abc_gamma)")
    credit.add_argument("--normalize", choices=ABC_NORMALIZE_MODES, default=DEFAULTS["abc_normalize"],
                        help="ABC-GRPO step-reward statistics (CreditConfig.abc_normalize)")
    output = parser.add_argument_group("output")
    output.add_argument("--no-receipts", "--no_receipts", action="store_true")
    output.add_argument("--excerpt-chars", "--excerpt_chars", type=int, default=160)


# ---------------------------------------------------------------------------------------------------- records
def _call_text(step: Step) -> str:
    if step.tool_call is None:
        return ""
    return f"{step.tool_call[0]}({json.dumps(step.tool_call[1], ensure_ascii=False)})"


def prepare_record(line_number: int, text: bytes | str, args) -> dict:
    """Parse one JSONL line into {record, id, question, gold, group, steps, clues | None}; raises RecordError."""
    from trace_jax.abc.judge import clue_records

    record, messages, answer = parse_chat_record(text, args.answer_key, error=RecordError)
    aliases = record.get(args.aliases_key) or []
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise RecordError(f"field {args.aliases_key!r} must be a list of strings when present")
    steps = steps_from_messages(messages)
    if not steps:
        raise RecordError("the record has no assistant message; expected at least one step")
    question = record.get("question")
    if question is None:
        question = next((message_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    if not isinstance(question, str) or not question.strip():
        raise RecordError("no question: give a 'question' field or a user message")
    clues = None
    if record.get(args.clues_key) is not None:
        if not isinstance(record[args.clues_key], list):
            raise RecordError(f"field {args.clues_key!r} must be a list of clue objects")
        try:
            clues = clue_records(record[args.clues_key])
        except ValueError as error:
            raise RecordError(f"field {args.clues_key!r}: {error}") from None
    group = record.get(args.group_key)
    return {"line": line_number, "record": record, "id": str(record.get("id", record.get("task_id",
                                                                                          f"line-{line_number}"))),
            "question": question, "gold": [answer, *aliases], "group": None if group is None else str(group),
            "steps": steps, "clues": clues}


# ---------------------------------------------------------------------------------------------------- credit
def abc_credit(per_record: Sequence[Sequence[StepCounts]], groups: Sequence[str | None], *, gamma: float,
               normalize: str) -> dict[str, list[np.ndarray]]:
    """Step rewards, ABC-SFT weights and ABC-GRPO advantages per record from the credit API."""
    import jax.numpy as jnp

    from trace_jax.abc.scorer import counts_to_arrays
    from trace_jax.credit import abc_sft_weights, abc_step_rewards, grouped_abc_grpo_advantages

    arrays = counts_to_arrays(per_record)
    rewards = abc_step_rewards(jnp.asarray(arrays["n_found"]), jnp.asarray(arrays["n_excluded"]),
                               jnp.asarray(arrays["n_rejected"]), jnp.asarray(arrays["ans"]),
                               jnp.asarray(arrays["tool_error"]))
    weights = abc_sft_weights(rewards)
    group_ids: dict[str, int] = {}
    ids = [group_ids.setdefault(g if g is not None else f"\0single-{i}", len(group_ids))
           for i, g in enumerate(groups)]
    advantages = grouped_abc_grpo_advantages(rewards, jnp.asarray(arrays["num_steps"]), jnp.asarray(ids, jnp.int32),
                                             len(group_ids), gamma=gamma, normalize=normalize)
    rewards, weights, advantages = (np.asarray(a) for a in (rewards, weights, advantages))
    out: dict[str, list[np.ndarray]] = {"step_rewards": [], "sft_weights": [], "advantages": []}
    for i, counts in enumerate(per_record):
        n = len(counts)
        out["step_rewards"].append(rewards[i, :n])
        out["sft_weights"].append(weights[i, :n])
        out["advantages"].append(advantages[i, :n])
    return out


def _floats(values) -> list[float]:
    return [round(float(v), 6) for v in values]


# ---------------------------------------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> int:
    from trace_jax.abc.judge import JudgeConfig, JudgeContextExceeded, LLMJudgeStepScorer
    from trace_jax.serve.client import ChatClient, EndpointConfig, EndpointError

    input_path, out_dir = Path(args.input), Path(args.out)
    if not input_path.is_file():
        print(f"abc-score: input {str(input_path)!r} is not a file; pass a JSONL of trajectories", file=sys.stderr)
        return 2
    if args.corpus is not None and not Path(args.corpus).is_file():
        print(f"abc-score: --corpus {args.corpus!r} is not a file; pass a corpus JSONL or Parquet", file=sys.stderr)
        return 2
    if args.excerpt_chars < 1 or args.recover_max_turns < 1:
        print("abc-score: --excerpt-chars and --recover-max-turns must be >= 1", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        endpoint = EndpointConfig.from_env("TRACE_JAX_JUDGE", base_url=args.judge_url, model=args.judge_model,
                                           api_key=args.judge_api_key, timeout_s=args.timeout)
        given = {name: value for name, value in (("deadline_s", args.deadline),
                                                 ("observation_chars", args.observation_chars)) if value is not None}
        config = JudgeConfig(endpoint=endpoint, max_attempts=args.max_attempts, backoff_s=args.backoff,
                             concurrency=args.concurrency, cache_dir=args.cache_dir or str(out_dir / "judge_cache"),
                             audit_path=str(out_dir / "judge_audit.jsonl"), **given)
    except ValueError as error:
        print(f"abc-score: judge: {error} (--judge-url, --judge-model, --timeout, --deadline, --observation-chars)",
              file=sys.stderr)
        return 2
    client = ChatClient(endpoint)
    try:
        served = client.models()
    except EndpointError as error:
        client.close()
        print(f"abc-score: the judge endpoint does not answer: {error}; start one (e.g. `trace-jax serve CKPT`) or "
              "fix --judge-url", file=sys.stderr)
        return 2
    if served and endpoint.model not in served:
        client.close()
        print(f"abc-score: the judge endpoint does not serve model {endpoint.model!r}; it serves {served}",
              file=sys.stderr)
        return 2

    start = time.perf_counter()
    prepared, errors, total = [], [], 0
    for line_number, text in jsonl_lines(input_path):
        total += 1
        try:
            prepared.append(prepare_record(line_number, text, args))
        except RecordError as error:
            errors.append((line_number, str(error)))
            print(f"abc-score: {input_path}:{line_number}: skipped: {error}", file=sys.stderr)

    recovered = _recover_missing(prepared, errors, args, endpoint, input_path)
    if recovered is None:
        client.close()
        return 2
    prepared = [p for p in prepared if p["clues"] is not None]

    scorer = LLMJudgeStepScorer(config, client)
    judged, counts = [], []
    try:
        for p in prepared:
            try:
                counts.append(scorer.score(question=p["question"], gold=p["gold"], clues=p["clues"],
                                           steps=p["steps"]))
            except JudgeContextExceeded as error:  # too long to judge: reported and skipped, never scored neutral
                errors.append((p["line"], str(error)))
                print(f"abc-score: {input_path}:{p['line']}: skipped: {error}", file=sys.stderr)
                continue
            judged.append(p)
    finally:
        scorer.close()
    prepared = judged
    errors.sort(key=lambda e: e[0])
    results = _write_outputs(prepared, counts, recovered, out_dir, args)
    # never the API key, and the URL without credentials (summary.json is shared with results)
    settings = {"gamma": args.gamma, "normalize": args.normalize, "judge_model": endpoint.model,
                "judge_url": endpoint.public_url, "max_attempts": args.max_attempts,
                "deadline_s": config.deadline_s}
    flagged = sum(sum(r["flagged"]) for r in results)
    summary = {"input": str(input_path), "records": total, "scored": len(results), "skipped": len(errors),
               "flagged_steps": flagged, "judge_calls": scorer.calls,
               "errors": [{"line": line, "error": message} for line, message in errors],
               "seconds": round(time.perf_counter() - start, 3), "settings": settings}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(f"abc-score: scored {len(results)} of {total} records ({len(errors)} skipped, {flagged} steps flagged, "
          f"{scorer.calls} judge calls) in {summary['seconds']:.1f} s -> {out_dir}")
    return 0 if results else 1


def _recover_missing(prepared, errors, args, endpoint, input_path) -> dict | None:
    """Fill in the clues of records without them (recovery agent, once per question); returns the recoveries."""
    from trace_jax.serve.client import ChatClient, EndpointConfig

    recovered: dict[tuple[str, str], Any] = {}
    missing = [p for p in prepared if p["clues"] is None]
    if not missing:
        return recovered
    if args.corpus is None:
        for p in missing:
            errors.append((p["line"], f"no {args.clues_key!r} field and no --corpus to recover clues from"))
            print(f"abc-score: {input_path}:{p['line']}: skipped: no {args.clues_key!r} field; pass --corpus to "
                  "recover clues with the recovery agent", file=sys.stderr)
            p["clues"] = None
        return recovered
    from trace_jax.abc.recover import ClueRecoveryAgent, RecoveryConfig
    from trace_jax.envs.corpus import Corpus

    try:
        corpus = Corpus.load(args.corpus)
        agent_endpoint = EndpointConfig(base_url=(args.recover_url or endpoint.base_url).rstrip("/"),
                                        model=args.recover_model or endpoint.model, api_key=endpoint.api_key,
                                        timeout_s=endpoint.timeout_s)
        config = RecoveryConfig(max_turns=args.recover_max_turns)
    except ValueError as error:
        print(f"abc-score: recovery: {error}", file=sys.stderr)
        return None
    with ChatClient(agent_endpoint) as client:
        agent = ClueRecoveryAgent(client, corpus, config)
        for p in missing:
            key = (p["question"], p["gold"][0])
            if key not in recovered:
                recovered[key] = agent.recover(p["question"], p["gold"][0], p["gold"][1:])
            result = recovered[key]
            if result.flagged:
                errors.append((p["line"], f"clue recovery failed: {result.note}"))
                print(f"abc-score: {input_path}:{p['line']}: skipped: clue recovery failed: {result.note}",
                      file=sys.stderr)
            else:
                p["clues"] = list(result.clues)
                p["clue_source"] = "recovered"
    return recovered


def _write_outputs(prepared, counts, recovered, out_dir: Path, args) -> list[dict]:
    from trace_jax.abc.receipts import write_abc_receipt
    from trace_jax.scoring.receipts import safe_filename

    results: list[dict] = []
    credit = abc_credit(counts, [p["group"] for p in prepared], gamma=args.gamma,
                        normalize=args.normalize) if prepared else {}
    receipts_dir = out_dir / "receipts"
    if not args.no_receipts and prepared:
        receipts_dir.mkdir(exist_ok=True)
    with (out_dir / "abc.jsonl").open("w", encoding="utf-8") as handle:
        for i, p in enumerate(prepared):
            step_counts = counts[i]
            result = {
                "id": p["id"], "line": p["line"], "group": p["group"], "answer": p["gold"][0],
                "num_steps": len(p["steps"]), "scorer": "judge", "clue_source": p.get("clue_source", "record"),
                "clues": [c.to_dict() for c in p["clues"]],
                "counts": [{"n_found": c.n_found, "n_excluded": c.n_excluded, "n_rejected": c.n_rejected,
                            "ans": c.ans, "tool_error": c.tool_error} for c in step_counts],
                "flagged": [c.flagged for c in step_counts], "notes": [c.note for c in step_counts],
                "step_rewards": _floats(credit["step_rewards"][i]), "sft_weights": _floats(credit["sft_weights"][i]),
                "advantages": _floats(credit["advantages"][i]),
            }
            if not args.no_receipts:
                name = safe_filename(f"{p['id']}-L{p['line']}", ".html")
                steps = [{"call": _call_text(s), "observation": s.observation, "assistant": s.assistant}
                         for s in p["steps"]]
                write_abc_receipt(receipts_dir / name, result, steps, question=p["question"],
                                  excerpt_chars=args.excerpt_chars)
                result["receipt"] = f"receipts/{name}"
            handle.write(json.dumps(result, ensure_ascii=False) + "\n")
            results.append(result)
    with (out_dir / "clues.jsonl").open("w", encoding="utf-8") as handle:
        seen = set()
        for p in prepared:
            key = (p["question"], p["gold"][0])
            if key in seen:
                continue
            seen.add(key)
            entry = {"question": p["question"], "answer": p["gold"][0], "source": p.get("clue_source", "record"),
                     "clues": [c.to_dict() for c in p["clues"]]}
            if key in recovered:
                entry["dropped"] = list(recovered[key].dropped)
            handle.write(json.dumps(entry, ensure_ascii=False) + "\n")
    return results


# ------------------------------------------------------------------------------ ABC parts of other commands
# `trace-jax credit` (trace_jax.scoring) and `trace-jax serve` (trace_jax.serve) sit below this package and never
# import it; the dispatcher (`trace_jax.cli.EXTENSIONS`) passes them these keyword arguments of their `run`.


def credit_step_counts(record: dict, messages: list, answer: str) -> list[StepCounts]:
    """ABC rubric counts per step of a `trace-jax credit` record, from its clue chain (`RuleBasedStepScorer`);
    ValueError names the missing or malformed field."""
    from trace_jax.abc.rules import RuleBasedStepScorer

    if not isinstance(record.get("clues"), list):
        raise ValueError("field 'clues' (the gold clue chain, a list of {docid, entity, relation, value, kind}) is "
                         "needed by the ABC estimators (abc_grpo, abc_sft_online); oracle records from "
                         "`trace-jax make-tasks --oracle` carry it")
    aliases = record.get("aliases") or []
    gold = [answer] + [str(a) for a in aliases if isinstance(a, str)]
    try:
        return RuleBasedStepScorer().score(question="", gold=gold, clues=record["clues"],
                                           steps=steps_from_messages(messages))
    except ValueError as error:
        raise ValueError(f"field 'clues': {error}") from None


def credit_extensions() -> dict[str, Any]:
    """`trace_jax.scoring.cli.run`'s ABC keyword: the rule-based step counts of its records."""
    from trace_jax.abc.scorer import counts_to_arrays
    from trace_jax.scoring.cli import StepCounting

    return {"step_counting": StepCounting(count=credit_step_counts, to_arrays=counts_to_arrays)}


def serve_extensions() -> dict[str, Any]:
    """`trace_jax.serve.cli.run`'s ABC keyword: the deterministic rubric judge `--scripted-judge` serves."""
    from trace_jax.abc.judge import scripted_rubric_reply

    return {"scripted_reply": scripted_rubric_reply}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trace-jax abc-score", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
