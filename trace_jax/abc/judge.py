"""ABC's LLM-judge step scorer: any OpenAI-compatible endpoint scores each step of a trajectory against the clue chain
with the rubric of credit-spec.md section 3.

For every step `k` the judge receives the question, the gold answer, the numbered clues and the trajectory up to and
including step `k` (observations cut to `observation_chars`), and must reply with exactly one JSON object
`{"n_found": int, "n_excluded": int, "n_rejected": int}` (an optional "reason" string is allowed) counting only what
step `k` itself adds: clues first revealed by its tool response, not ones an earlier step already showed. `ans` is
not asked of the model: it is checked locally on the last step (`trace_jax.abc.rules.answer_outcome`: +1 exact match
with the gold answer or an alias, -1 otherwise, `JudgeConfig.no_answer` (-1 by default) when the trajectory ended
without an answer), as the rule-based scorer does. A step whose tool call failed (`rules.is_tool_error`) is not sent
to the judge under `JudgeConfig.error_step = 0` (default): it is marked `tool_error` and scores the rubric's floor.

Robustness:
  * strict parsing (`parse_counts`): one JSON object, bare or in one ```json fence (the rule of
    `trace_jax.abc.replies`, shared with clue recovery), exactly those keys, non-negative ints no larger than the
    number of clues of the kind; anything else is malformed;
  * malformed replies and retryable endpoint failures (timeouts, 429, 5xx) are retried with exponential backoff
    and jitter (`trace_jax.abc.retry`), never sooner than the server's `Retry-After`, within `deadline_s` per step
    (all attempts and waits together); after `max_attempts`, or when the deadline would pass, the step is scored
    neutral (counts 0, so reward 1.0 unless `ans` applies) and flagged with a note; never fatal. A non-retryable
    failure (wrong key, unknown model, a reply over the size limit) is flagged at once;
  * a disk cache keyed by (rubric version, judge model, endpoint without credentials, temperature, max tokens,
    question, gold, clues, the step and the steps before it) prevents repeat calls; only well-formed judgements are
    cached, and a cached judgement is checked again when read (`validate_counts`, the rule of fresh replies): one
    out of range for the clue chain, or an unreadable entry, is judged again and overwritten, never trusted;
  * every HTTP attempt and cache hit is appended to an audit JSONL (request, reply, status, latency);
  * a step whose prompt the endpoint refuses as longer than its model's context raises `JudgeContextExceeded`:
    the trajectory is too long to judge, and `abc-score` reports and skips its record rather than scoring it;
  * the cache and the audit are conveniences: when one cannot be written (a full disk, a read-only directory) the
    scorer warns once (`JudgeStorageWarning`) and carries on without it.

`scripted_rubric_reply` is a deterministic stand-in judge: it reads the case from the prompt and applies the rubric
with the first-revealed rule to the clue chain. `trace-jax serve --scripted-judge` serves it, so `abc-score` can run
offline on tasks whose clue chain is known, and tests use it as the endpoint.

This module knows the rubric, the prompt and the answer checker; it knows nothing about models, tokenizers or
the credit arithmetic (`trace_jax.credit.abc_step_rewards`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import re
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Sequence

from trace_jax.abc.replies import MalformedReply, parse_json_object
from trace_jax.abc.retry import Deadline, retry_delay
from trace_jax.abc.rules import answer_outcome, check_episode_options, is_tool_error
from trace_jax.abc.scorer import Step, StepCounts
from trace_jax.envs.answers import answer_reward, extract_answer, normalize_answer
from trace_jax.envs.tasks import Clue, clue_matches
from trace_jax.serve.client import ChatClient, EndpointConfig, EndpointError

RUBRIC_VERSION = "abc-rubric-v1"
COUNT_KEYS = ("n_found", "n_excluded", "n_rejected")

RUBRIC = """You are a strict judge of one step of a research agent's trajectory. The agent answers a question by \
calling search tools; each step is its reasoning and tool call plus the tool response it received (the last step \
may give the final answer instead). You are given the question, the verified gold answer and the clues: the facts \
(each on a given document, about a given entity) that link the question to the answer. Clues of kind "support" lead \
to the answer; clues of kind "exclude" rule a wrong candidate out.

Count, for the step to judge ONLY:
- n_found: support clues that this step's tool response reveals for the first time: the response shows the clue's \
own document (its title is the clue's entity, or its docid is the clue's docid) and contains the clue's value. \
Search-result lists and error messages reveal nothing. A clue an earlier step already revealed does not count again.
- n_excluded: exclude clues revealed for the first time by this step's tool response, under the same rule.
- n_rejected: on the final answer step only: 1 if the final answer is wrong although an earlier step revealed a \
support clue whose value is the gold answer; otherwise 0.

Reply with exactly one JSON object and nothing else:
{"n_found": <int>, "n_excluded": <int>, "n_rejected": <int>}"""


# ---------------------------------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """How the judge calls its endpoint.

    Attributes:
      endpoint: base URL, model, API key and per-request timeout (`EndpointConfig.from_env("TRACE_JAX_JUDGE")`
        reads them from `$TRACE_JAX_JUDGE_URL`, `_MODEL`, `_API_KEY`).
      max_attempts: calls per step before it is scored neutral and flagged (>= 1).
      backoff_s, backoff_max_s: sleep up to `min(backoff_s * 2**retry, backoff_max_s)` between attempts (at least
        half of it, at random; never less than the server's `Retry-After`).
      deadline_s: overall seconds for one step's judgement: every attempt and wait together. Each request gets what
        is left of it (at most the endpoint's `timeout_s`).
      temperature, max_tokens: of the judge's generation.
      observation_chars: each observation in the prompt is cut to this many characters.
      concurrency: steps of one trajectory judged at the same time (their prompts do not depend on each other).
      cache_dir: directory of the judgement cache (None: no cache).
      audit_path: JSONL file every call is appended to (None: no audit).
      no_answer: `ans` of the last step of a trajectory that ended without an answer (-1, as a wrong answer; or 0).
      error_step: 0: a step whose tool call failed is not judged, it scores the floor r = 0 (`tool_error`);
        'neutral': it is judged as any other step.
    """

    endpoint: EndpointConfig
    max_attempts: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    deadline_s: float = 300.0
    temperature: float = 0.0
    max_tokens: int = 128
    observation_chars: int = 6000
    concurrency: int = 4
    cache_dir: str | None = None
    audit_path: str | None = None
    no_answer: int = -1
    error_step: int | str = 0

    def __post_init__(self):
        check_episode_options("JudgeConfig", self.no_answer, self.error_step)
        if not isinstance(self.endpoint, EndpointConfig):
            raise ValueError("JudgeConfig.endpoint must be an EndpointConfig (base_url, model, api_key, timeout_s)")
        for name in ("max_attempts", "max_tokens", "observation_chars", "concurrency"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"JudgeConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("backoff_s", "backoff_max_s", "deadline_s"):
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                    or value < 0 or (name == "deadline_s" and value == 0)):
                raise ValueError(f"JudgeConfig.{name} must be a finite number {'> 0' if name == 'deadline_s' else '>= 0'}"
                                 f", got {value!r}")
        if not 0 <= self.temperature <= 2:
            raise ValueError(f"JudgeConfig.temperature must be in [0, 2], got {self.temperature!r}")

    @classmethod
    def from_env(cls, *, base_url: str | None = None, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 60.0, **fields) -> "JudgeConfig":
        """The endpoint from the arguments or `$TRACE_JAX_JUDGE_URL`, `_MODEL`, `_API_KEY`; other fields as given."""
        endpoint = EndpointConfig.from_env("TRACE_JAX_JUDGE", base_url=base_url, model=model, api_key=api_key,
                                           timeout_s=timeout_s)
        return cls(endpoint=endpoint, **fields)


# ---------------------------------------------------------------------------------------------------- prompt
def clue_records(clues: Sequence[Any]) -> list[Clue]:
    """`Clue`s from `Clue`s or their dicts; raises ValueError naming the bad entry."""
    out = []
    for index, clue in enumerate(clues or ()):
        if isinstance(clue, Clue):
            out.append(clue)
        elif isinstance(clue, Mapping) and isinstance(clue.get("docid"), str):
            kind = str(clue.get("kind", "support"))
            if kind not in ("support", "exclude"):
                raise ValueError(f"clues[{index}].kind is {kind!r}; expected 'support' or 'exclude'")
            out.append(Clue(docid=clue["docid"], entity=str(clue.get("entity", "")),
                            relation=str(clue.get("relation", "")), value=str(clue.get("value", "")), kind=kind))
        else:
            raise ValueError(f"clues[{index}] is {clue!r:.80}; expected a dict with a string 'docid' (and entity, "
                             "relation, value, kind)")
    return out


def _cut(text: str | None, limit: int) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} more characters cut]"


def case_payload(question: str, gold: Sequence[str], clues: Sequence[Clue], steps: Sequence[Step], k: int,
                 observation_chars: int) -> dict:
    """The JSON case of step `k` (0-based): everything the judge may look at, and nothing after step `k`."""
    return {
        "question": question,
        "gold_answers": list(gold),
        "clues": [{"id": i + 1, **c.to_dict()} for i, c in enumerate(clues)],
        "steps": [{"step": j + 1, "assistant": s.assistant,
                   "tool_call": None if s.tool_call is None else {"name": s.tool_call[0], "arguments": s.tool_call[1]},
                   "observation": _cut(s.observation, observation_chars), "docid": s.docid}
                  for j, s in enumerate(steps[:k + 1])],
        "judge_step": k + 1,
        "final_step": k == len(steps) - 1,
    }


def judge_messages(payload: Mapping[str, Any]) -> list[dict]:
    """The chat messages of one judgement: the rubric, then the case as JSON."""
    user = (f"Judge step {payload['judge_step']} of this trajectory (steps before it are context). The case:\n"
            f"```json\n{json.dumps(payload, ensure_ascii=False, indent=1)}\n```\n"
            'Reply with only {"n_found": <int>, "n_excluded": <int>, "n_rejected": <int>}.')
    return [{"role": "system", "content": RUBRIC}, {"role": "user", "content": user}]


class MalformedJudgement(MalformedReply):
    """The judge's reply is not exactly the counts object the rubric asks for."""


def parse_counts(text: Any, clues: Sequence[Clue]) -> tuple[int, int, int]:
    """`(n_found, n_excluded, n_rejected)` from a judge reply, strictly; raises `MalformedJudgement` saying why.

    The object is read by `trace_jax.abc.replies.parse_json_object` (bare, or in one ```json fence) and checked by
    `validate_counts`."""
    try:
        value = parse_json_object(text, "the judge's reply")
    except MalformedReply as error:
        raise MalformedJudgement(str(error)) from None
    return validate_counts(value, clues)


def validate_counts(value: Mapping[str, Any], clues: Sequence[Clue]) -> tuple[int, int, int]:
    """The counts of a judgement object, checked against the clue chain; raises `MalformedJudgement` saying why.

    Exactly the keys `COUNT_KEYS` (+ an optional "reason"), each a non-negative int no larger than the number of
    clues of its kind (`n_rejected` at most 1 when there is no support clue). Fresh replies and cache entries are
    both held to this rule."""
    if not isinstance(value, Mapping):
        raise MalformedJudgement(f"expected an object with the keys {list(COUNT_KEYS)}, got {type(value).__name__}")
    missing = [k for k in COUNT_KEYS if k not in value]
    extra = sorted(set(value) - set(COUNT_KEYS) - {"reason"})
    if missing or extra:
        raise MalformedJudgement(f"the object must have exactly the keys {list(COUNT_KEYS)} (+ optional 'reason'); "
                                 f"missing {missing}, unexpected {extra}")
    support = sum(c.kind != "exclude" for c in clues)
    limits = {"n_found": support, "n_excluded": len(clues) - support, "n_rejected": max(1, support)}
    counts = []
    for key in COUNT_KEYS:
        count = value[key]
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= limits[key]:
            raise MalformedJudgement(f"{key} must be an int in [0, {limits[key]}], got {count!r}")
        counts.append(count)
    return tuple(counts)


# ---------------------------------------------------------------------------------------------------- scorer
class LLMJudgeStepScorer:
    """The `StepScorer` "judge": one endpoint call per step (cached), counts parsed strictly, failures neutral."""

    name = "judge"

    def __init__(self, config: JudgeConfig, client: ChatClient | None = None):
        self.config = config
        self.client = client or ChatClient(config.endpoint)
        self._lock = threading.Lock()
        self._rng = random.Random()
        self.calls = 0  # HTTP attempts made (cache hits excluded)
        self.cache_dir: Path | None = Path(config.cache_dir) if config.cache_dir else None
        self.audit_path: Path | None = Path(config.audit_path) if config.audit_path else None
        if self.cache_dir is not None:
            try:
                self.cache_dir.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                self._disable_cache(error)

    def close(self) -> None:
        self.client.close()

    def score(self, *, question: str, gold: Sequence[str], clues: Sequence[Any],
              steps: Sequence[Step]) -> list[StepCounts]:
        """One `StepCounts` per step (see `trace_jax.abc.scorer.StepScorer`).

        Raises `JudgeContextExceeded` when a step's prompt does not fit the judge model's context."""
        gold = [gold] if isinstance(gold, str) else list(gold)
        if not gold:
            raise ValueError("gold must hold the gold answer (and its aliases)")
        chain = clue_records(clues)
        if len(steps) <= 1 or self.config.concurrency == 1:
            return [self._score_step(question, gold, chain, steps, k) for k in range(len(steps))]
        with ThreadPoolExecutor(min(self.config.concurrency, len(steps))) as pool:
            return list(pool.map(lambda k: self._score_step(question, gold, chain, steps, k), range(len(steps))))

    def _score_step(self, question, gold, chain, steps, k) -> StepCounts:
        ans = answer_outcome(gold, steps, k, no_answer=self.config.no_answer)
        if self.config.error_step == 0 and is_tool_error(steps[k]):
            return StepCounts(ans=ans, tool_error=True)  # the floor; an error message reveals nothing to judge
        payload = case_payload(question, gold, chain, steps, k, self.config.observation_chars)
        key = self._cache_key(payload)
        cached = self._cache_read(key, chain, k)
        if cached is not None:
            self._audit({"key": key, "step": k + 1, "status": "cache_hit", "counts": list(cached)})
            return StepCounts(*cached, ans=ans)
        messages = judge_messages(payload)
        problem, attempts, retry_after = "no attempt made", 0, None
        deadline = Deadline(self.config.deadline_s)
        for attempt in range(self.config.max_attempts):
            if attempt:
                delay = retry_delay(attempt, backoff_s=self.config.backoff_s, backoff_max_s=self.config.backoff_max_s,
                                    retry_after=retry_after, rng=self._rng)
                if delay >= deadline.remaining():
                    problem += (f"; no retry: waiting {delay:.3g} s would pass the {self.config.deadline_s:g} s "
                                "deadline (JudgeConfig.deadline_s)")
                    break
                time.sleep(delay)
            started = time.perf_counter()
            attempts += 1
            with self._lock:
                self.calls += 1
            record = {"key": key, "step": k + 1, "attempt": attempt + 1, "request": messages}
            text = None
            try:
                reply = self.client.chat(messages, temperature=self.config.temperature,
                                         max_tokens=self.config.max_tokens, timeout_s=deadline.remaining())
                text = reply.get("content")
                counts = parse_counts(text, chain)
            except EndpointError as error:
                problem, retry_after = f"endpoint error: {error}", error.retry_after
                self._audit({**record, "status": "endpoint_error", "error": str(error),
                             "retry_after_s": error.retry_after,
                             "latency_s": round(time.perf_counter() - started, 4)})
                if error.over_context:
                    raise JudgeContextExceeded(k + 1, len(steps), str(error)) from None
                if not error.retryable:
                    break
                continue
            except MalformedJudgement as error:
                problem, retry_after = f"malformed judge output: {error}", None
                self._audit({**record, "status": "malformed", "reply": text, "error": str(error),
                             "latency_s": round(time.perf_counter() - started, 4)})
                continue
            self._audit({**record, "status": "ok", "reply": text, "counts": list(counts),
                         "latency_s": round(time.perf_counter() - started, 4)})
            self._cache_write(key, counts, text)
            return StepCounts(*counts, ans=ans)
        note = f"{problem} (after {attempts} attempt(s)); scored neutral"
        return StepCounts(ans=ans, flagged=True, note=note)

    # -- cache and audit -----------------------------------------------------------------------------------------
    def _cache_key(self, payload: Mapping[str, Any]) -> str:
        """The judgement's identity: everything that changes what the judge would reply."""
        identity = {"rubric": RUBRIC_VERSION, "model": self.config.endpoint.model,
                    "endpoint": self.config.endpoint.public_url, "temperature": self.config.temperature,
                    "max_tokens": self.config.max_tokens, "case": payload}
        return hashlib.sha256(json.dumps(identity, sort_keys=True, ensure_ascii=True).encode()).hexdigest()

    def _cache_read(self, key: str, chain: Sequence[Clue], k: int) -> tuple[int, int, int] | None:
        """The cached counts, checked as a fresh reply is; None (judge again) when absent, unreadable or invalid."""
        if self.cache_dir is None:
            return None
        path = self.cache_dir / f"{key}.json"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            self._audit({"key": key, "step": k + 1, "status": "cache_invalid", "error": f"unreadable: {error}"})
            return None
        try:
            entry = json.loads(raw)
            counts = entry["counts"] if isinstance(entry, dict) else None
            if not isinstance(counts, list) or len(counts) != len(COUNT_KEYS):
                raise MalformedJudgement(f"'counts' must be a list of {len(COUNT_KEYS)} ints, got {counts!r:.80}")
            return validate_counts(dict(zip(COUNT_KEYS, counts)), chain)
        except (ValueError, RecursionError, KeyError) as error:  # MalformedJudgement is a ValueError
            self._audit({"key": key, "step": k + 1, "status": "cache_invalid",
                         "error": f"{type(error).__name__}: {error}"[:300]})
            return None

    def _cache_write(self, key: str, counts, reply: str) -> None:
        cache_dir = self.cache_dir
        if cache_dir is None:
            return
        path = cache_dir / f"{key}.json"
        # unique per process and thread: two scorers sharing a cache never write into one temporary file
        temporary = cache_dir / f"{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        entry = {"counts": list(counts), "reply": reply, "model": self.config.endpoint.model,
                 "rubric": RUBRIC_VERSION}
        try:
            temporary.write_bytes(json.dumps(entry, ensure_ascii=True).encode())
            temporary.replace(path)  # atomic: a reader never sees half a file
        except OSError as error:
            try:
                temporary.unlink(missing_ok=True)
            except OSError:
                pass
            self._disable_cache(error)

    def _disable_cache(self, error: OSError) -> None:
        with self._lock:
            if self.cache_dir is None:
                return
            where, self.cache_dir = self.cache_dir, None
        warnings.warn(f"judge cache {where} cannot be written ({type(error).__name__}: {error}); judging on without "
                      "a cache (every step is judged again next run). Free space or pass a writable --cache-dir.",
                      JudgeStorageWarning, stacklevel=3)

    def _audit(self, record: dict) -> None:
        if self.audit_path is None:
            return
        line = json.dumps({"time": round(time.time(), 3), "model": self.config.endpoint.model, **record},
                          ensure_ascii=False, default=str)
        data = (line + "\n").encode("utf-8", "backslashreplace")  # a lone surrogate becomes its JSON escape
        with self._lock:
            path = self.audit_path
            if path is None:
                return
            try:
                with open(path, "ab") as handle:
                    handle.write(data)
                return
            except OSError as error:
                self.audit_path, problem = None, f"{type(error).__name__}: {error}"
        warnings.warn(f"judge audit {path} cannot be written ({problem}); scoring on without "
                      "an audit. Free space or write --out somewhere writable.", JudgeStorageWarning, stacklevel=3)


class JudgeContextExceeded(ValueError):
    """A step's judge prompt is longer than the judge model's context, so the trajectory cannot be judged: the
    record is at fault, not the endpoint (`score` raises it rather than scoring the step neutral)."""

    def __init__(self, step: int, num_steps: int, reason: str):
        super().__init__(f"step {step} of {num_steps}: the judge prompt is longer than the judge model's context "
                         f"(the endpoint said: {reason}); lower --observation-chars or use a judge with a longer "
                         "context")
        self.step = step


class JudgeStorageWarning(UserWarning):
    """The judge's cache or audit file could not be written; scoring goes on without it."""


# ---------------------------------------------------------------------------------------------------- scripted judge
_HEADER = re.compile(r"^\[\d+\] (?P<title>.*) \((?P<url>[^()\s]*)\)\s*$")
_FIND = re.compile(r"^Find results for text: `.*` in `(?P<title>.*)`$")


def _page_of(observation: str | None) -> tuple[str | None, str]:
    """(title of the document a browser observation shows, or None for lists and errors; its text without header)."""
    if not observation:
        return None, ""
    first, _, rest = observation.partition("\n")
    match = _HEADER.match(first)
    if match is None:
        return None, observation
    title = match.group("title")
    if title.startswith("Search results for"):
        return None, rest
    find = _FIND.match(title)
    return (find.group("title") if find else title), rest


def _revealed(clues: Sequence[Clue], step: Mapping[str, Any]) -> set[int]:
    title, body = _page_of(step.get("observation"))
    if step.get("docid"):
        return set(clue_matches(clues, body, docid=step["docid"]))
    if title is None:
        return set()
    return {i for i in clue_matches(clues, body) if clues[i].entity and clues[i].entity == title}


def rubric_counts(payload: Mapping[str, Any]) -> dict[str, int]:
    """The rubric applied mechanically to a judge case (`case_payload`): what a perfect judge replies."""
    clues = clue_records([{k: v for k, v in c.items() if k != "id"} for c in payload["clues"]])
    steps = payload["steps"]
    k = payload["judge_step"] - 1
    before: set[int] = set()
    for step in steps[:k]:
        before |= _revealed(clues, step)
    new = _revealed(clues, steps[k]) - before
    rejected = 0
    last = steps[k]
    if payload.get("final_step") and last.get("observation") is None:
        answer = extract_answer(last.get("assistant") or "")
        gold = payload["gold_answers"]
        gold_norm = {normalize_answer(g) for g in gold if normalize_answer(g)}
        if answer is not None and not answer_reward(last["assistant"], gold).exact:
            rejected = int(any(clues[i].kind != "exclude" and normalize_answer(clues[i].value) in gold_norm
                               for i in before))
    return {"n_found": sum(clues[i].kind != "exclude" for i in new),
            "n_excluded": sum(clues[i].kind == "exclude" for i in new), "n_rejected": rejected}


def case_from_messages(messages: Sequence[Mapping[str, Any]]) -> dict:
    """The JSON case inside a judge prompt (the last user message's ```json block)."""
    user = next(m for m in reversed(messages) if m.get("role") == "user")
    return parse_json_object(user.get("content"), "the judge prompt")


def scripted_rubric_reply(request: Mapping[str, Any]) -> str:
    """A `ScriptedBackend` reply function: the rubric's counts for the case in the prompt, as the judge's JSON."""
    try:
        counts = rubric_counts(case_from_messages(request.get("messages") or []))
    except (ValueError, KeyError, TypeError, StopIteration) as error:
        return f"I cannot judge this: {error}"
    return json.dumps(counts)
