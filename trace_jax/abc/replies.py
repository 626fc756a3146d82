"""Reading one JSON object out of a model's reply: the single parser of the LLM judge (`trace_jax.abc.judge`), the
clue-recovery agent (`trace_jax.abc.recover`) and the scripted judge that reads its case from the prompt.

The rule, the same for every caller:
  * the reply is one JSON object: either the whole reply (surrounding whitespace aside), or the content of one
    Markdown fenced block, ```` ```json ```` or a bare ```` ``` ````, with free text allowed before the opening fence and
    after the closing one;
  * the fenced block runs from the first fence to the last one, so a fence quoted inside a JSON string (a web page
    in an observation) does not cut it short; two separate fenced blocks therefore do not parse, which is right:
    the reply is ambiguous;
  * an object inside prose without a fence is refused: the model did not follow the format, and guessing where an
    object starts in prose is how a parser picks up an example the model quoted;
  * anything else (empty, not JSON, a JSON list or number, a fence tagged with another language, an unclosed fence)
    raises `MalformedReply` with a message that says what is wrong.

What the object must hold is the caller's business (the judge's counts, the recovery's clue list).

This module knows JSON and Markdown fences; it knows nothing about rubrics, clues, endpoints or retries.
"""

from __future__ import annotations

import json
import re
from typing import Any

FENCE = "```"
_TAG = re.compile(r"[A-Za-z0-9_+-]*")


class MalformedReply(ValueError):
    """A model's reply is not one JSON object in the accepted form; the message says why."""


def json_body(text: str, what: str = "the reply") -> str:
    """The text that must be the JSON object: the fenced block's content, or the whole stripped reply.

    Raises `MalformedReply` for an unclosed fence or a fence tagged with a language other than json.
    """
    body = text.strip()
    first = body.find(FENCE)
    if first < 0:
        return body
    last = body.rfind(FENCE)
    if last == first:
        raise MalformedReply(f"{what} opens a ``` fence but never closes it")
    inner = body[first + len(FENCE):last]
    tag = _TAG.match(inner).group(0)
    if tag and tag.lower() != "json":
        raise MalformedReply(f"{what} holds a ```{tag} block; the JSON object must be bare or in a ```json block")
    return inner[len(tag):].strip()


def parse_json_object(text: Any, what: str = "the reply") -> dict:
    """The JSON object of a model reply (see the module's rule); raises `MalformedReply` saying what is wrong.

    Args:
      text: the reply's content (None or a non-string is malformed: a reply with no text).
      what: how messages name the reply, e.g. "the judge's reply" or "the final message".
    """
    if not isinstance(text, str) or not text.strip():
        raise MalformedReply(f"{what} is empty; expected one JSON object")
    body = json_body(text, what)
    try:
        value = json.loads(body)
    except ValueError as error:  # also a number too long to convert
        raise MalformedReply(f"{what} is not one JSON object, bare or in a ```json block ({str(error)[:200]})") from None
    except RecursionError:
        raise MalformedReply(f"{what} is JSON nested too deeply to read; expected one flat JSON object") from None
    if not isinstance(value, dict):
        raise MalformedReply(f"{what} is a JSON {type(value).__name__}, not an object")
    return value
