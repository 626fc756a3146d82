"""Qwen3's ChatML chat format, rendered straight to token ids, and a tool-call parser that never raises.

Layout (Qwen3's `chat_template`, written out here because no template ships offline; indented lines continue a turn)::

    <|im_start|>system\\n{system}\\n\\n# Tools\\n\\nYou may call one or more functions ...
        <tools>\\n{schema}\\n...</tools>
    ... <tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n{question}<|im_end|>\\n
    <|im_start|>assistant\\n{content}\\n<tool_call>\\n{"name": "search", "arguments": {"query": "x"}}\\n</tool_call>
        <|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n{observation}\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n{final answer}<|im_end|>\\n

(the system turn is written only when there is a system message or tools; consecutive tool messages share one user
turn, one `<tool_response>` block each.)

Token ids, not text, are the source of truth (verl's lesson: text round trips are lossy). A conversation is the
concatenation of independently tokenised segments: turn headers (`<|im_start|>role\\n`), contents, and turn ends
(`<|im_end|>\\n`). So appending a turn never re-tokenises history, and `render(messages).ids` is exactly the
concatenation of the incremental pieces (`system_ids`, `user_ids`, `generation_prompt_ids`, the generated assistant
ids, `tool_response_ids`, ...). For ordinary content this also equals `tokenizer.encode(rendered_text)`; it can
differ where a content begins or ends with whitespace that a BPE would merge across a segment boundary.

Content of system, user and tool messages, and the tools block (tool names, descriptions and schemas come from
whoever wrote the tools), is encoded as plain text: a literal `<|im_end|>` inside a web page or a tool description
becomes ordinary text tokens, never a control token (`split_special_tokens`). The tool tags are, as in Qwen3,
added-but-not-special tokens and are recognised anywhere. Assistant text is encoded with all tags recognised
(it is the model's own output format).

Differences from Qwen3's template, on purpose: assistant content is rendered verbatim (Qwen3 strips `<think>`
blocks from assistant turns before the last user query and re-wraps reasoning after it); RL trains on the tokens
the policy generated, so history is never rewritten. `ChatFormat(tokenizer, enable_thinking=False)` writes Qwen3's
empty think block `<think>\n\n</think>\n\n` after every assistant header (Qwen3 adds it to the generation
prompt only), so the prompt of every turn, not just the first, disables thinking and history stays append-only.

Think blocks (`ChatFormat(thinking=...)`, one of `THINKING_MODES`, matching the checkpoint's own chat template):

    "none"    no think blocks (SmolLM2, Qwen3-*-Instruct-2507); `reasoning_content` has no place and is ignored
    "hybrid"  Qwen3's hybrid template with thinking on: the model opens `<think>` itself after the header; a
              message's `reasoning_content` is rendered as `<think>\n{reasoning}\n</think>\n\n{content}`
    "off"     Qwen3's hybrid template with thinking off (`enable_thinking=False`, see above)
    "always"  Qwen3-*-Thinking-2507: every assistant header is followed by `<think>\n`, which the model closes;
              `reasoning_content` is rendered as `{reasoning}\n</think>\n\n{content}`
    None      "off" when `enable_thinking=False`, else read from `tokenizer.chat_template` (no template or no
              `<think>`: "none"; a generation prompt that opens `<think>`: "always"; otherwise "hybrid")

`answer_prefix_text` is what a model of that format writes between an assistant header and a direct answer (an
empty think block where the format expects one); the answer continuation scored by TRACE starts with it, then the
run's answer template (`trace_jax.scoring.continuation`).

This module knows nothing about models, sampling, rewards or answer checking.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

# Qwen3's tools preamble, verbatim.
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

THINKING_MODES = ("none", "hybrid", "off", "always")
EMPTY_THINK_BLOCK = "<think>\n\n</think>\n\n"

# Per-token role codes used by `messages_to_ids` (`TokenizedConversation.roles`).
ROLE_CODES: dict[str, int] = {"system": 0, "user": 1, "assistant": 2, "tool": 3}


@dataclasses.dataclass(frozen=True)
class TurnSpan:
    """Token offsets of one rendered turn, half-open `[start, end)`.

    Attributes:
      role: "system" | "user" | "assistant" | "tool" (a tool turn is rendered as a user turn holding
        `<tool_response>` blocks) | "generation_prompt" (the trailing `<|im_start|>assistant\\n`).
      start: offset of the turn's `<|im_start|>`.
      end: offset just after the turn (after `<|im_end|>\\n`).
      content_start: first token after the header `<|im_start|>role\\n`. For an assistant turn, this is where
        the policy's generation begins.
      content_end: offset of the closing `<|im_end|>` (== end for the generation prompt).
      message_index: index of the (first) message rendered in this turn; -1 for the generation prompt.
    """

    role: str
    start: int
    end: int
    content_start: int
    content_end: int
    message_index: int


@dataclasses.dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation: token ids and the span of every turn, in order."""

    ids: list[int]
    turns: tuple[TurnSpan, ...]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A parsed tool call: `name` and a JSON-object `arguments` dict."""

    name: str
    arguments: dict[str, Any]

    def to_json(self) -> str:
        """The call as Qwen3 writes it between the tags: `{"name": ..., "arguments": {...}}`."""
        return json.dumps({"name": self.name, "arguments": self.arguments}, ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """Why a generation holds no usable tool call; `message` is meant to be shown to the policy as an observation."""

    message: str


@dataclasses.dataclass(frozen=True)
class TokenizedConversation:
    """A chat-format record as token ids plus the masks and state boundaries credit assignment needs.

    Shapes: `L` = number of tokens, `T` = number of tool-response turns that are followed by an assistant turn.

    Attributes:
      ids: int32 [L] token ids.
      roles: int8 [L] role code of the turn each token belongs to (`ROLE_CODES`: system 0, user 1, assistant 2,
        tool 3); header and `<|im_end|>\\n` tokens carry their turn's role.
      loss_mask: bool [L] True on tokens the policy generated: every assistant turn's content (text and tool calls),
        plus the closing `<|im_end|>` of an assistant turn without tool calls (the final answer ends there). A
        tool-calling turn's generation stops at `</tool_call>`; its `<|im_end|>\\n` is appended by the agent loop
        (`ChatFormat.tool_response_ids`) and is not in the mask.
      turn_index: int32 [L] for loss-mask tokens, the index k of the state S_k their generation started from
        (number of tool responses before it); -1 elsewhere. The final-answer turn has index T.
      boundaries: int32 [T + 1] token offset of each state S_k: S_0 = end of the prompt (first assistant
        generation starts here, after `<|im_start|>assistant\\n`); S_k = start of the assistant generation that
        follows the k-th tool response. `ids[:boundaries[k]]` is the exact context the policy saw at state k.
      turns: every turn's span (see `TurnSpan`).
    """

    ids: np.ndarray
    roles: np.ndarray
    loss_mask: np.ndarray
    turn_index: np.ndarray
    boundaries: np.ndarray
    turns: tuple[TurnSpan, ...]


def tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """Qwen3's tools section of the system prompt: one `json.dumps(schema)` line per tool inside `<tools></tools>`.

    Schemas are written as given (OpenAI style `{"type": "function", "function": {...}}` is what Qwen3 expects),
    serialised like the template's `tojson` (`ensure_ascii=False`, default separators).
    """
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_HEADER + lines + TOOLS_FOOTER


def format_tool_call(name: str, arguments: Mapping[str, Any] | str) -> str:
    """One `<tool_call>` block exactly as Qwen3's template writes it (string arguments are inserted verbatim)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return TOOL_CALL_OPEN + '\n{"name": "' + name + '", "arguments": ' + args + "}\n" + TOOL_CALL_CLOSE


def assistant_text(content: str | None, tool_calls: Sequence[Mapping[str, Any]] = ()) -> str:
    """The text of an assistant turn between its header and `<|im_end|>`: content, then its tool calls.

    `tool_calls` entries are OpenAI style (`{"function": {"name", "arguments"}}`) or bare `{"name", "arguments"}`.
    """
    text = content or ""
    for position, call in enumerate(tool_calls):
        function = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(
                f"tool call {position} is {call!r}; expected {{'function': {{'name': str, 'arguments': dict | str}}}}"
            )
        if text or position > 0:
            text += "\n"
        text += format_tool_call(function["name"], function.get("arguments", {}))
    return text


def _message_text(message: Mapping[str, Any], index: int) -> str:
    """A message's content as one string (None -> "", OpenAI content parts -> their text joined)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise ValueError(f"message {index}: content part {part!r} is not {{'type': 'text', 'text': str}}")
        return "".join(parts)
    raise ValueError(f"message {index}: content must be a string, a list of text parts or None, got {content!r}")


def thinking_mode_of(tokenizer) -> str:
    """The `THINKING_MODES` entry a tokenizer's own chat template implies ("none" without a template)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if not isinstance(template, str) or "<think>" not in template:
        return "none"
    if "assistant\\n<think>\\n" in template or "assistant\n<think>\n" in template:
        return "always"
    return "hybrid"


# Above this length `ChatFormat._encode` tokenizes with the GIL released (a batch of one).
_GIL_FREE_CHARS = 4096
# `ChatFormat` caches the ids of markup texts up to this many characters (headers, tags: the same few strings on
# every turn), at most this many of them: short assistant contents from clients pass through the same path, and a
# server must not keep every one.
_MARKUP_CACHE_CHARS = 64
_MARKUP_CACHE_SIZE = 512


def _fast_encoders(tokenizer):
    """`{split_special_tokens: tokenizers.Tokenizer}`: two private copies of a fast tokenizer's backend, one that
    recognises special-token strings and one that splits them, with truncation and padding off (as the wrapper
    calls them); None for a tokenizer without a Rust backend. Copies, so that encoding never flips the shared
    backend's `encode_special_tokens` flag (the wrapper does) under another thread's call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    from tokenizers import Tokenizer

    encoders = {}
    for split in (False, True):
        copy = Tokenizer.from_str(backend.to_str())
        copy.no_truncation()
        copy.no_padding()
        copy.encode_special_tokens = split
        encoders[split] = copy
    return encoders


class ChatFormat:
    """Renders Qwen3 ChatML conversations as token ids for a Hugging Face tokenizer.

    The tokenizer must have `<|im_start|>` and `<|im_end|>` as single tokens (Qwen3, SmolLM2 and
    `build_word_tokenizer` tokenizers do). Tool tags may be single tokens (Qwen3, word tokenizer) or plain text
    (SmolLM2); `assistant_stop_ids` / `assistant_stop_strings` tell the sampler how to stop either way.

    Example (one agent episode, token-in/token-out)::

        chat = ChatFormat(tokenizer)
        ids = chat.prompt_ids(system, question, tools)          # ends with <|im_start|>assistant\\n
        boundaries = [len(ids)]                                  # S_0
        generated = sample(ids, stop=chat.assistant_stop_ids)    # ... </tool_call>
        ids += generated
        ids += chat.tool_response_ids(observation, previous_ids=generated)
        boundaries.append(len(ids))                              # S_1

    Args:
      tokenizer: a Hugging Face tokenizer (`load_tokenizer`).
      enable_thinking: False appends Qwen3's empty think block to every assistant header (see module docstring).
      thinking: the think-block layout, one of `THINKING_MODES` (see module docstring); None reads it from the
        tokenizer's chat template (or "off" when `enable_thinking=False`).
    """

    def __init__(self, tokenizer, *, enable_thinking: bool = True, thinking: str | None = None):
        self.tokenizer = tokenizer
        if thinking is None:
            thinking = "off" if not enable_thinking else thinking_mode_of(tokenizer)
        if thinking not in THINKING_MODES:
            raise ValueError(f"ChatFormat thinking={thinking!r} is not one of {list(THINKING_MODES)}; pick the one "
                             "matching the checkpoint's chat template")
        if not enable_thinking and thinking != "off":
            raise ValueError(f"ChatFormat: enable_thinking=False means thinking='off', not {thinking!r}")
        self.thinking = thinking
        self.enable_thinking = thinking != "off"
        self._fast = _fast_encoders(tokenizer)
        self._short_markup: collections.OrderedDict[str, tuple[int, ...]] = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self.im_start_id = self._single_token_id(IM_START, required=True)
        self.im_end_id = self._single_token_id(IM_END, required=True)
        self.end_of_text_id = self._single_token_id(END_OF_TEXT, required=False)
        self.tool_call_close_id = self._single_token_id(TOOL_CALL_CLOSE, required=False)
        self._newline_ids = self._markup("\n")

        stops = [self.tool_call_close_id, self.im_end_id, tokenizer.eos_token_id, self.end_of_text_id]
        self.assistant_stop_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in stops if i is not None))
        """Token ids that end an assistant generation: `</tool_call>` (when it is one token), `<|im_end|>`, eos."""
        self.assistant_stop_strings: tuple[str, ...] = () if self.tool_call_close_id is not None else (TOOL_CALL_CLOSE,)
        """Stop strings for tags that are not single tokens (e.g. `</tool_call>` for SmolLM2): check decoded text."""

    def _single_token_id(self, token: str, *, required: bool) -> int | None:
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        if len(ids) == 1:
            return int(ids[0])
        if required:
            raise ValueError(
                f"tokenizer encodes {token!r} as {len(ids)} tokens {ids}; the ChatML format needs it as one token "
                "(add it as a special token, or build the tokenizer with build_word_tokenizer)"
            )
        return None

    # -- encoding primitives -------------------------------------------------------------------------------------

    def _markup(self, text: str) -> list[int]:
        """Template text and assistant text: special and added tokens are recognised."""
        if not text:
            return []
        if len(text) <= _MARKUP_CACHE_CHARS:  # headers and tags: the same few strings on every turn
            with self._cache_lock:  # a server renders on its event loop and on worker threads
                cached = self._short_markup.get(text)
                if cached is not None:
                    self._short_markup.move_to_end(text)
                    return list(cached)
            cached = tuple(self._encode(text, split_special=False))
            with self._cache_lock:
                self._short_markup[text] = cached
                if len(self._short_markup) > _MARKUP_CACHE_SIZE:  # least recently used out
                    self._short_markup.popitem(last=False)
            return list(cached)
        return self._encode(text, split_special=False)

    def _plain(self, text: str) -> list[int]:
        """Untrusted content: literal special-token strings are split into ordinary tokens."""
        if not text:
            return []
        return self._encode(text, split_special=True)

    def _encode(self, text: str, *, split_special: bool) -> list[int]:
        """`tokenizer(text, add_special_tokens=False, split_special_tokens=split_special)["input_ids"]`, through
        the fast tokenizer's Rust backend when there is one (the Python wrapper costs ~0.2 ms a call). Texts of
        more than `_GIL_FREE_CHARS` characters go through `encode_batch`, which releases the GIL while it works
        (`encode` holds it: a 30k-character prompt would stop every other thread of a server for ~10 ms)."""
        if self._fast is not None:
            encoder = self._fast[split_special]
            if len(text) > _GIL_FREE_CHARS:
                return encoder.encode_batch([text], add_special_tokens=False)[0].ids
            return encoder.encode(text, add_special_tokens=False).ids
        encoded = self.tokenizer(text, add_special_tokens=False, split_special_tokens=split_special)
        return list(encoded["input_ids"])

    def _header(self, role: str) -> list[int]:
        return [self.im_start_id, *self._markup(role + "\n")]

    def _turn_end(self) -> list[int]:
        return [self.im_end_id, *self._newline_ids]

    # -- incremental pieces --------------------------------------------------------------------------------------

    def system_ids(self, system: str | None = None, tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The system turn (empty list when there is neither a system prompt nor tools)."""
        return self._system_turn(system, tools)[0]

    def _system_turn(self, system: str | None, tools) -> tuple[list[int], int, int]:
        if system is None and not tools:
            return [], 0, 0
        ids = self._header("system")
        content_start = len(ids)
        if system is not None:
            ids += self._plain(system)
        if tools:  # Qwen3 writes the "\n\n" separator whenever there is a system message, even an empty one
            # Plain: the block holds no special token of its own, and a tool's text must not inject one.
            ids += self._plain(("\n\n" if system is not None else "") + tools_block(tools))
        content_end = len(ids)
        return ids + self._turn_end(), content_start, content_end

    def user_ids(self, text: str) -> list[int]:
        """A user turn `<|im_start|>user\\n{text}<|im_end|>\\n`."""
        return self._header("user") + self._plain(text) + self._turn_end()

    def generation_prompt_ids(self) -> list[int]:
        """`<|im_start|>assistant\\n` (+ `<think>\\n\\n</think>\\n\\n` when thinking is "off", + `<think>\\n` when
        it is "always"): the assistant header the policy's generation follows."""
        header = self._header("assistant")
        if self.thinking == "off":
            header += self._markup(EMPTY_THINK_BLOCK)
        elif self.thinking == "always":
            header += self._markup("<think>\n")
        return header

    @property
    def answer_prefix_text(self) -> str:
        """What this format's model writes after an assistant header before answering without reasoning: the
        empty think block for "hybrid", its closing part for "always" (the header opened it), "" otherwise."""
        return {"hybrid": EMPTY_THINK_BLOCK, "always": "\n</think>\n\n"}.get(self.thinking, "")

    def assistant_message_text(self, message: Mapping[str, Any], index: int = 0) -> str:
        """An assistant message's content with its `reasoning_content` placed where this format puts reasoning
        (hybrid: a think block before the content; always: before the closing `</think>` of the header's block);
        formats without think blocks ignore `reasoning_content`."""
        content = _message_text(message, index)
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"message {index}: reasoning_content must be a string, got {type(reasoning).__name__}")
        if self.thinking == "hybrid" and reasoning:
            return "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
        if self.thinking == "always" and (reasoning or "</think>" not in content):
            return (reasoning or "").strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
        return content

    def prompt_ids(
        self, system: str | None, user: str, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """System turn (with tools) + user turn + generation prompt: the context of state S_0."""
        return self.system_ids(system, tools) + self.user_ids(user) + self.generation_prompt_ids()

    def assistant_content_ids(self, content: str | None, tool_calls: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        """Token ids of an assistant turn's content as if the policy had generated it (no header, no `<|im_end|>`)."""
        return self._markup(assistant_text(content, tool_calls))

    def end_of_turn_ids(self, previous_ids: Sequence[int] = ()) -> list[int]:
        """What closes the current assistant turn: `<|im_end|>\\n`, or just `\\n` if `previous_ids` end with it."""
        if len(previous_ids) and int(previous_ids[-1]) == self.im_end_id:
            return list(self._newline_ids)
        return self._turn_end()

    def _tool_turn(self, responses: Sequence[str]) -> tuple[list[int], int, int]:
        ids = [self.im_start_id, *self._markup("user")]
        content_start = len(ids) + len(self._newline_ids)  # after "user\n", as for any turn
        for response in responses:
            ids += self._markup("\n" + TOOL_RESPONSE_OPEN + "\n")
            ids += self._plain(response)
            ids += self._markup("\n" + TOOL_RESPONSE_CLOSE)
        content_end = len(ids)
        return ids + self._turn_end(), content_start, content_end

    def tool_response_ids(
        self, responses: str | Sequence[str], *, previous_ids: Sequence[int] = (), add_generation_prompt: bool = True
    ) -> list[int]:
        """Ids to append after an assistant generation that called tools.

        Closes the assistant turn (`<|im_end|>\\n`, or only `\\n` when `previous_ids` -- the generated ids --
        already end with `<|im_end|>`), writes one user turn with a `<tool_response>` block per response, and
        opens the next generation with `<|im_start|>assistant\\n`. The offset after these ids is the next state
        boundary.

        Args:
          responses: one tool observation, or several (one per call, in order).
          previous_ids: the ids generated in the turn being closed (only the last id is looked at).
          add_generation_prompt: append `<|im_start|>assistant\\n` (default True).
        """
        if isinstance(responses, str):
            responses = [responses]
        ids = self.end_of_turn_ids(previous_ids) + self._tool_turn(list(responses))[0]
        if add_generation_prompt:
            ids += self.generation_prompt_ids()
        return ids

    # -- whole conversations -------------------------------------------------------------------------------------

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> RenderedChat:
        """Render OpenAI-style messages (roles system/user/assistant/tool) as token ids with turn spans.

        Assistant messages may carry `tool_calls` (`[{"function": {"name": str, "arguments": dict | str}}]`);
        `tool` messages carry the observation in `content`. Every assistant turn is closed with `<|im_end|>\\n`.

        Raises:
          ValueError: a message has an unknown role or malformed content/tool_calls (the error names its index).
        """
        ids: list[int] = []
        turns: list[TurnSpan] = []
        for position, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ValueError(f"message {position} is {message!r}; expected a dict with 'role' and 'content'")
        first_is_system = bool(messages) and messages[0].get("role") == "system"
        if first_is_system or tools:
            system = _message_text(messages[0], 0) if first_is_system else None
            turn, content_start, content_end = self._system_turn(system, tools)
            turns.append(TurnSpan("system", 0, len(turn), content_start, content_end, 0 if first_is_system else -1))
            ids += turn
        index = 1 if first_is_system else 0
        while index < len(messages):
            message = messages[index]
            role = message.get("role")
            start = len(ids)
            if role in ("system", "user"):
                header = self._header(role)
                body = self._plain(_message_text(message, index))
                ids += header + body + self._turn_end()
                content_start = start + len(header)
                turns.append(TurnSpan(role, start, len(ids), content_start, content_start + len(body), index))
                index += 1
            elif role == "assistant":
                header = self.generation_prompt_ids()
                try:
                    body = self.assistant_content_ids(self.assistant_message_text(message, index),
                                                      message.get("tool_calls") or ())
                except ValueError as error:
                    raise ValueError(f"message {index}: {error}") from None
                ids += header + body + self._turn_end()
                turns.append(
                    TurnSpan("assistant", start, len(ids), start + len(header), start + len(header) + len(body), index)
                )
                index += 1
            elif role == "tool":
                first = index
                responses = []
                while index < len(messages) and messages[index].get("role") == "tool":
                    responses.append(_message_text(messages[index], index))
                    index += 1
                turn, content_start, content_end = self._tool_turn(responses)
                ids += turn
                turns.append(TurnSpan("tool", start, len(ids), start + content_start, start + content_end, first))
            else:
                raise ValueError(
                    f"message {index} has role {role!r}; expected one of 'system', 'user', 'assistant', 'tool'"
                )
        if add_generation_prompt:
            start = len(ids)
            ids += self.generation_prompt_ids()
            turns.append(TurnSpan("generation_prompt", start, len(ids), len(ids), len(ids), -1))
        return RenderedChat(ids=ids, turns=tuple(turns))

    def messages_to_ids(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> TokenizedConversation:
        """Tokenise one chat-format trajectory record (e.g. a JSONL line's `messages`) for credit assignment.

        The record is rendered with `render(..., add_generation_prompt=False)`; see `TokenizedConversation` for
        the masks and state boundaries. States are the start of the first assistant generation (S_0) and of each
        assistant generation that directly follows a tool response (S_1..S_T).

        Raises:
          ValueError: malformed messages, or a record without any assistant message.
        """
        rendered = self.render(messages, tools=tools, add_generation_prompt=False)
        length = len(rendered.ids)
        roles = np.zeros(length, np.int8)
        loss_mask = np.zeros(length, bool)
        turn_index = np.full(length, -1, np.int32)
        boundaries: list[int] = []
        tool_responses_seen = 0
        previous_role = None
        for turn in rendered.turns:
            roles[turn.start : turn.end] = ROLE_CODES[turn.role]
            if turn.role == "tool":
                tool_responses_seen += 1
            elif turn.role == "assistant":
                if not boundaries or previous_role == "tool":
                    boundaries.append(turn.content_start)
                has_calls = bool(messages[turn.message_index].get("tool_calls"))
                generated_end = turn.content_end if has_calls else turn.content_end + 1  # + its <|im_end|>
                loss_mask[turn.content_start : generated_end] = True
                turn_index[turn.content_start : generated_end] = tool_responses_seen
            previous_role = turn.role
        if not boundaries:
            raise ValueError("the record has no assistant message; expected at least one generated turn")
        return TokenizedConversation(
            ids=np.asarray(rendered.ids, np.int32),
            roles=roles,
            loss_mask=loss_mask,
            turn_index=turn_index,
            boundaries=np.asarray(boundaries, np.int32),
            turns=rendered.turns,
        )


# -- parsing generations -----------------------------------------------------------------------------------------


def _parse_call_json(payload: str) -> ToolCall | ToolCallError:
    try:
        call = json.loads(payload)
    except (ValueError, RecursionError) as error:
        return ToolCallError(f"the text inside <tool_call></tool_call> is not valid JSON ({error})")
    if not isinstance(call, dict):
        return ToolCallError(
            f'the tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, got {type(call).__name__}'
        )
    name = call.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallError('the tool call has no "name" (a non-empty string naming the function)')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI-style double-encoded arguments
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as error:
            return ToolCallError(f'"arguments" is a string that is not valid JSON ({error}); give a JSON object')
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCallError(f'"arguments" must be a JSON object, got {type(arguments).__name__}')
    return ToolCall(name=name.strip(), arguments=arguments)


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Parse every `<tool_call>...</tool_call>` block of a generation, in order (never raises).

    An unclosed final `<tool_call>` yields a `ToolCallError`. Text outside the tags is ignored.
    """
    if not isinstance(text, str):
        return [ToolCallError(f"expected the generated text as a string, got {type(text).__name__}")]
    results: list[ToolCall | ToolCallError] = []
    position = 0
    while True:
        open_at = text.find(TOOL_CALL_OPEN, position)
        if open_at < 0:
            return results
        body_start = open_at + len(TOOL_CALL_OPEN)
        close_at = text.find(TOOL_CALL_CLOSE, body_start)
        nested_open = text.find(TOOL_CALL_OPEN, body_start)
        if close_at < 0 or (0 <= nested_open < close_at):
            results.append(ToolCallError("a <tool_call> tag is not closed with </tool_call>"))
            if close_at < 0:
                return results
            position = nested_open
            continue
        results.append(_parse_call_json(text[body_start:close_at].strip()))
        position = close_at + len(TOOL_CALL_CLOSE)


def parse_tool_call(text: str) -> ToolCall | ToolCallError:
    """Parse the single tool call of an assistant generation (never raises).

    Accepts Qwen3's `<tool_call>\\n{"name": str, "arguments": {...}}\\n</tool_call>`, with arguments also as a
    JSON-encoded string (OpenAI style) or missing (-> `{}`); text before or after the block is ignored.

    Returns:
      `ToolCall(name, arguments)`, or `ToolCallError(message)` when there is no call, the tag is unclosed, the
      JSON is invalid, the name is missing/empty, the arguments are not an object, or there is more than one
      call (this agent loop runs one tool per assistant turn).
    """
    calls = parse_tool_calls(text)
    if not calls:
        return ToolCallError(
            'no <tool_call> found; call a tool as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>'
        )
    if len(calls) > 1:
        return ToolCallError(f"found {len(calls)} tool calls; make exactly one call per turn")
    return calls[0]
