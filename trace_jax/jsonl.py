"""Reading JSONL files line by line, where any line may be damaged, with reports that name the file and the line.

Host-side helper shared by `trace-jax credit`, `trace-jax abc-score`, the external-data importer and the corpus
reader. Lines are read as bytes and each is decoded on its own, so one damaged line never hides the others:

  * a line that is not UTF-8, not JSON, nested deeper than `MAX_DEPTH`, or holding a string that is not Unicode (a
    lone surrogate escape such as "\\ud800") is a `LineError` whose message says what is wrong and how to fix it;
  * a byte-order mark at the start of a line is dropped (editors write one at the start of a file, and
    concatenated files carry it into the middle); blank lines are skipped;
  * `parse_chat_record` and `chat_messages_problem` check the chat-record format of `trace-jax credit` and
    `abc-score` (OpenAI messages with text content parts and `tool_calls`) field by field.

Callers choose what a bad line means: `read_jsonl` raises at the first one (files that must be whole: a corpus);
`read_jsonl_skipping` and `jsonl_lines` + `parse_line` report it and go on with the next line.

This module knows JSON and the chat message format; it knows nothing about what the records are used for.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

MAX_DEPTH = 64  # JSON nesting a record may have; chat records need about 8 (+ tool-argument objects)
BOM = "\ufeff"
ROLES = ("system", "user", "assistant", "tool")


class LineError(ValueError):
    """One JSONL line cannot be read; the message says what is wrong and the fix (the caller adds file and line)."""


@dataclasses.dataclass(frozen=True)
class SkippedLine:
    """A line left out of a file's records, and why."""

    path: str
    line: int
    error: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: skipped: {self.error}"


def jsonl_lines(path: str | os.PathLike) -> Iterator[tuple[int, bytes]]:
    """`(line number, raw bytes)` of each non-blank line of `path`, lines counted from 1. Raises OSError when the
    file cannot be opened."""
    with open(path, "rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if raw.strip() and raw.strip() != BOM.encode():
                yield number, raw


def _check_value(value: Any) -> None:
    """Raise LineError when `value` nests deeper than MAX_DEPTH or holds a string that is not valid Unicode."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise LineError(f"a string holds {item[:40]!r}..., a lone surrogate escape (\\ud800-\\udfff) that is "
                                "not a Unicode character; fix the program that wrote the file") from None
            continue
        if isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise LineError(f"JSON nested more than {MAX_DEPTH} levels deep; a record is a flat object of "
                                "fields, check that the line is not corrupted")
            children = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in children:
                if isinstance(key, str):
                    stack.append((key, depth))
                stack.append((child, depth + 1))


def parse_line(raw: bytes | str) -> Any:
    """The JSON value of one line (any JSON type); raises `LineError` saying what is wrong and the fix."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise LineError(f"not UTF-8 (byte 0x{raw[error.start]:02x} at byte {error.start + 1}); save the file as "
                            "UTF-8") from None
    else:
        text = raw
    text = text.lstrip(BOM)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise LineError(f"invalid JSON ({error.msg} at column {error.colno}); each line must be one JSON "
                        "value") from None
    except ValueError as error:  # an integer of more digits than Python converts
        raise LineError(f"invalid JSON ({str(error)[:160]}); write such numbers as strings") from None
    except RecursionError:
        raise LineError(f"JSON nested too deeply to read (over {MAX_DEPTH} levels allowed); a record is a flat "
                        "object of fields, check that the line is not corrupted") from None
    _check_value(value)
    return value


def read_jsonl(path: str | os.PathLike, *, error: type[Exception] = ValueError) -> Iterator[tuple[str, Any]]:
    """Yield `(where, record)` for each non-blank line of `path`, `where` being `"PATH:LINE"` (lines count from 1).

    Raises `error` when the file is missing or at the first line that cannot be read (`parse_line`). A record may
    be any JSON value; callers check its shape and report problems with `where`.
    """
    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: file not found.")
    for number, raw in jsonl_lines(path):
        where = f"{path}:{number}"
        try:
            record = parse_line(raw)
        except LineError as problem:
            raise error(f"{where}: {problem}") from None
        yield where, record


def read_jsonl_skipping(path: str | os.PathLike, skipped: list[SkippedLine], *,
                        error: type[Exception] = ValueError) -> Iterator[tuple[int, Any]]:
    """`(line number, record)` of each readable line; a line that cannot be read is appended to `skipped` and the
    next line is read. Raises `error` only when the file is missing."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: file not found.")
    for number, raw in jsonl_lines(path):
        try:
            record = parse_line(raw)
        except LineError as problem:
            skipped.append(SkippedLine(str(path), number, str(problem)))
            continue
        yield number, record


# ---------------------------------------------------------------------------------------------------- chat records
def _text_problem(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return None
    if not isinstance(content, list):
        return f"{where} must be a string, a list of text parts or null, got {type(content).__name__}"
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or not isinstance(part.get("text"), str):  # the renderer's rule
            return (f"{where}[{j}] must be a text part {{\"type\": \"text\", \"text\": \"...\"}}, got {part!r:.60}; "
                    "only text can be scored")
    return None


def chat_messages_problem(messages: Any) -> str | None:
    """What is wrong with a record's `messages` (OpenAI chat format, text only), or None when it is well formed.

    Each message is an object with `role` in `ROLES`; `content` a string, null or a list of text parts;
    `reasoning_content` a string or null; `tool_calls` (assistant) a list of `{"function": {"name": str,
    "arguments": object | JSON string}}` (or the bare `{"name", "arguments"}`)."""
    if not isinstance(messages, list) or not messages:
        return "field 'messages' must be a non-empty list of chat message objects"
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            return f"{where} must be an object with 'role' and 'content', got {type(message).__name__}"
        role = message.get("role")
        if role not in ROLES:
            return f"{where}.role is {role!r:.40}; expected one of {list(ROLES)}"
        problem = _text_problem(message.get("content"), f"{where}.content")
        if problem:
            return problem
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            return f"{where}.reasoning_content must be a string or null, got {type(reasoning).__name__}"
        calls = message.get("tool_calls")
        if calls is None:
            continue
        if not isinstance(calls, list):
            return f"{where}.tool_calls must be a list of tool calls, got {type(calls).__name__}"
        for j, call in enumerate(calls):
            function = call.get("function", call) if isinstance(call, Mapping) else None
            label = f"{where}.tool_calls[{j}]"
            if not isinstance(function, Mapping):
                return f"{label} must be {{\"function\": {{\"name\": str, \"arguments\": ...}}}}, got {call!r:.60}"
            if not isinstance(function.get("name"), str) or not function["name"].strip():
                return f"{label}.function.name must be a non-empty string (the tool's name), got {function.get('name')!r:.40}"
            arguments = function.get("arguments", {})
            if not isinstance(arguments, (str, Mapping)):
                return (f"{label}.function.arguments must be an object or a JSON string, got "
                        f"{type(arguments).__name__}")
    return None


def parse_chat_record(text: bytes | str, answer_key: str, *,
                      error: type[Exception] = ValueError) -> tuple[dict, list, str]:
    """Parse one trajectory line (OpenAI chat `messages` + a gold answer field) into `(record, messages, answer)`.

    The record format of `trace-jax credit` and `trace-jax abc-score`. Raises `error` saying what is wrong when
    the line cannot be read (`parse_line`), is not a JSON object, its `messages` are malformed
    (`chat_messages_problem`) or `answer_key` is not a non-empty string; the caller adds the file and line.
    """
    try:
        record = parse_line(text)
    except LineError as problem:
        raise error(str(problem)) from None
    if not isinstance(record, dict):
        raise error(f"expected a JSON object, got {type(record).__name__}")
    problem = chat_messages_problem(record.get("messages"))
    if problem:
        raise error(problem)
    answer = record.get(answer_key)
    if not isinstance(answer, str) or not answer.strip():
        raise error(f"field {answer_key!r} must be a non-empty string (the gold answer)")
    return record, record["messages"], answer
