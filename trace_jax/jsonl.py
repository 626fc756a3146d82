"""Reading JSONL files record by record, with errors that name the file and the line.

Host-side helper shared by the corpus reader and the dataset importers; it knows nothing about what the records
mean (callers check their fields).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator


def read_jsonl(path: str | os.PathLike, *, error: type[Exception] = ValueError) -> Iterator[tuple[str, Any]]:
    """Yield `(where, record)` for each non-blank line of `path`, `where` being `"PATH:LINE"` (lines count from 1).

    Raises `error` when the file is missing or a line is not valid JSON. A record may be any JSON value; callers
    check its shape and report problems with `where`.
    """
    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: file not found.")
    with path.open("r", encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); each line must be one JSON "
                            "value.") from None
            yield where, record


def parse_chat_record(text: str, answer_key: str, *, error: type[Exception] = ValueError) -> tuple[dict, list, str]:
    """Parse one trajectory line (OpenAI chat `messages` + a gold answer field) into `(record, messages, answer)`.

    The record format of `trace-jax credit` and `trace-jax abc-score`. Raises `error` naming the field when the
    line is not a JSON object, `messages` is not a non-empty list of message objects, or `answer_key` is not a
    non-empty string; the caller adds the file and line.
    """
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise error(f"expected a JSON object, got {type(record).__name__}")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise error("field 'messages' must be a non-empty list of chat message objects")
    answer = record.get(answer_key)
    if not isinstance(answer, str) or not answer.strip():
        raise error(f"field {answer_key!r} must be a non-empty string (the gold answer)")
    return record, messages, answer
