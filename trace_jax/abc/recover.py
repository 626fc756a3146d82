"""ABC clue recovery for external tasks: an LLM agent with the same browser tools as the policy works backwards from
the verified answer and reports the chain of facts that links the question to it (credit-spec.md section 3, "Clues").

The agent runs against any OpenAI-compatible endpoint (`trace_jax.serve.client.ChatClient`) with the browser's
tool schemas; its tool calls run locally on a `Browser` over the task's corpus. It ends with one message holding
`{"clues": [{"url" or "docid", "relation", "value", "kind"}, ...]}`. Every clue is then checked against the corpus:
its page must exist and its value must occur verbatim on it (whitespace-collapsed); the entity is set to the page's
title (the step scorers recognise a clue's page by it). Clues that fail are dropped and listed; a recovery without
one valid clue is flagged, never fatal.

This module knows the browser and the corpus; it knows nothing about models, tokenizers or step scoring.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Sequence

from trace_jax.abc.replies import MalformedReply, parse_json_object
from trace_jax.abc.retry import retry_delay
from trace_jax.envs.corpus import Corpus
from trace_jax.envs.tasks import Clue
from trace_jax.serve.client import ChatClient, EndpointError

RECOVERY_PROMPT = """You recover the evidence chain of a question whose answer is already verified. Use the tools \
to find the pages that prove the answer, working backwards: search for the answer, open its page, find the fact \
that links it to the next entity towards what the question names, open that entity's page, and so on until the \
chain reaches the question. Then reply WITHOUT a tool call, with only this JSON object:
{"clues": [{"url": "<url of the page>", "relation": "<short name of the fact>", "value": "<text copied exactly \
from that page>", "kind": "support"}]}
List the clues in chain order. Use kind "exclude" for a fact that rules a wrong candidate out. Every value must \
appear verbatim on the page of its url."""


@dataclasses.dataclass(frozen=True)
class RecoveryConfig:
    """The recovery agent's budget.

    Attributes:
      max_turns: model calls before giving up (each may run tools).
      temperature, max_tokens: of the agent's generations.
      observation_chars: tool responses are cut to this many characters.
      max_attempts, backoff_s, backoff_max_s: per model call, for retryable endpoint failures
        (`trace_jax.abc.retry.retry_delay`: jittered exponential backoff, never sooner than `Retry-After`).
    """

    max_turns: int = 16
    temperature: float = 0.0
    max_tokens: int = 1024
    observation_chars: int = 8000
    max_attempts: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0

    def __post_init__(self):
        for name in ("max_turns", "max_tokens", "observation_chars", "max_attempts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"RecoveryConfig.{name} must be an int >= 1, got {value!r}")
        if not (0 <= self.backoff_s < float("inf") and 0 <= self.backoff_max_s < float("inf")
                and 0 <= self.temperature <= 2):
            raise ValueError("RecoveryConfig.backoff_s and backoff_max_s must be finite and >= 0, and temperature in "
                             "[0, 2]")


@dataclasses.dataclass(frozen=True)
class RecoveryResult:
    """Recovered clues, whether recovery failed (`flagged`, with `note`), the dropped clues and the transcript."""

    clues: tuple[Clue, ...]
    flagged: bool
    note: str
    dropped: tuple[dict, ...] = ()
    transcript: tuple[dict, ...] = ()

    def to_dict(self) -> dict:
        return {"clues": [c.to_dict() for c in self.clues], "flagged": self.flagged, "note": self.note,
                "dropped": list(self.dropped)}


def parse_clue_reply(text: str | None) -> list[Any]:
    """The `clues` list of the agent's final message; raises `MalformedReply` (a ValueError) saying what is wrong.

    The object is read by `trace_jax.abc.replies.parse_json_object` (bare, or in one ```json fence)."""
    value = parse_json_object(text, "the final message")
    if not isinstance(value.get("clues"), list):
        raise MalformedReply("the final message must be a JSON object with a list under \"clues\"")
    return value["clues"]


def verify_clues(raw: Sequence[Any], corpus: Corpus) -> tuple[list[Clue], list[dict]]:
    """Keep the clues whose page exists and shows their value; returns (clues, dropped with a reason each)."""
    kept, dropped = [], []
    for entry in raw:
        if not isinstance(entry, Mapping):
            dropped.append({"clue": entry, "reason": "not a JSON object"})
            continue
        document = None
        if isinstance(entry.get("docid"), str):
            document = corpus.get(entry["docid"])
        if document is None and isinstance(entry.get("url"), str):
            document = corpus.by_url(entry["url"].strip())
        value = entry.get("value")
        kind = entry.get("kind", "support")
        if document is None:
            dropped.append({"clue": entry, "reason": "its url/docid is not a page of the corpus"})
        elif not isinstance(value, str) or not value.strip():
            dropped.append({"clue": entry, "reason": "value must be a non-empty string"})
        elif kind not in ("support", "exclude"):
            dropped.append({"clue": entry, "reason": f"kind {kind!r} is not 'support' or 'exclude'"})
        elif " ".join(value.split()) not in " ".join(document.text.split()):
            dropped.append({"clue": entry, "reason": f"value {value!r:.60} does not occur on page {document.docid}"})
        else:
            clue = Clue(docid=document.docid, entity=document.title, relation=str(entry.get("relation", "")),
                        value=" ".join(value.split()), kind=kind)
            if clue not in kept:
                kept.append(clue)
    return kept, dropped


class ClueRecoveryAgent:
    """Runs the recovery loop for one question at a time (see the module docstring)."""

    def __init__(self, client: ChatClient, corpus: Corpus, config: RecoveryConfig = RecoveryConfig()):
        self.client = client
        self.corpus = corpus
        self.config = config

    def _chat(self, messages, tools):
        for attempt in range(self.config.max_attempts):
            try:
                return self.client.chat(messages, tools=tools, temperature=self.config.temperature,
                                        max_tokens=self.config.max_tokens)
            except EndpointError as error:
                if not error.retryable or attempt == self.config.max_attempts - 1:
                    raise
                time.sleep(retry_delay(attempt + 1, backoff_s=self.config.backoff_s,
                                       backoff_max_s=self.config.backoff_max_s, retry_after=error.retry_after))
        raise AssertionError("unreachable")

    def recover(self, question: str, answer: str, aliases: Sequence[str] = ()) -> RecoveryResult:
        from trace_jax.envs.browser import Browser, tool_schemas

        browser = Browser(self.corpus)
        tools = tool_schemas()
        also = f" (also written: {', '.join(aliases)})" if aliases else ""
        messages: list[dict] = [{"role": "system", "content": RECOVERY_PROMPT},
                                {"role": "user", "content": f"Question: {question}\nVerified answer: {answer}{also}"}]
        for _ in range(self.config.max_turns):
            try:
                reply = self._chat(messages, tools)
            except EndpointError as error:
                return RecoveryResult((), True, f"endpoint error: {error}", transcript=tuple(messages))
            calls = reply.get("tool_calls") or []
            if not isinstance(calls, list) or not all(isinstance(c, Mapping) and isinstance(c.get("function"), Mapping)
                                                      for c in calls):
                return RecoveryResult((), True, f"the agent's tool_calls are not a list of {{'function': {{...}}}} "
                                      f"objects: {calls!r:.80}", transcript=tuple(messages))
            message = {"role": "assistant", "content": reply.get("content")}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
            if not calls:
                try:
                    raw = parse_clue_reply(reply.get("content"))
                except ValueError as error:
                    return RecoveryResult((), True, f"malformed clue list: {error}", transcript=tuple(messages))
                clues, dropped = verify_clues(raw, self.corpus)
                note = "" if clues else "no clue survived verification against the corpus"
                return RecoveryResult(tuple(clues), not clues, note, tuple(dropped), tuple(messages))
            for call in calls:
                function = call.get("function") or {}
                observation = browser.execute(function.get("name"), function.get("arguments"))
                if len(observation) > self.config.observation_chars:
                    observation = observation[:self.config.observation_chars] + "\n[... cut]"
                messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": observation})
        return RecoveryResult((), True, f"no clue list within {self.config.max_turns} turns",
                              transcript=tuple(messages))
