"""What a served model is to the HTTP layer: something that turns a chat or a raw prompt into streamed text.

Two implementations share the server (`trace_jax.serve.app`):

  * `ModelBackend`: a checkpoint (anything `trace_jax.models.load_pretrained` reads) with its tokenizer, rendered with
    the Qwen3 ChatML format (`trace_jax.models.chat.ChatFormat`, tools included) and decoded by the batching
    `Engine`. A named `tool_choice` (or "required") is honoured by writing the start of the `<tool_call>` block
    into the assistant turn before generation; the model writes the rest.
  * `ScriptedBackend`: a Python function from the request to the reply text, answered at once. It makes
    deterministic local endpoints (the scripted rubric judge of `trace_jax.abc.judge`, test doubles) that go through
    exactly the same validation, tool-call parsing and response formatting as a real model.

This module knows nothing about HTTP or JSON responses; it validates what only the model side can check (messages
that do not render, a prompt over the context) and raises `RequestError` with a message for the client.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Mapping, Sequence

from trace_jax.rollout.sampler import SamplingConfig
from trace_jax.serve.engine import Engine, EngineConfig, Event, Finished, GenerationRequest, TextDelta


class RequestError(ValueError):
    """Bad input the client can fix; `param` names the request field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    """The sampling part of a request, already validated by the HTTP layer."""

    max_tokens: int | None
    sampling: SamplingConfig
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = True  # False: only the finished text is needed (no `TextDelta` events)


@dataclasses.dataclass(frozen=True)
class Submitted:
    """What a backend accepted: the prompt size (for usage) and text to put before the generated text."""

    prompt_tokens: int
    prefix: str = ""


def forced_tool_prefix(tool_choice: Any, tools: Sequence[Mapping[str, Any]] | None) -> str:
    """The text that opens the assistant turn for an OpenAI `tool_choice`: "" for auto/none, the start of a
    `<tool_call>` block for "required" or a named function. Raises `RequestError` for a choice that names no tool."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return ""
    if not tools:
        raise RequestError("tool_choice forces a tool call but the request has no tools", "tool_choice")
    if tool_choice == "required":
        return '<tool_call>\n{"name": "'
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice.get("function"),
                                                                               Mapping) else None
        names = [(t.get("function") or {}).get("name") for t in tools if isinstance(t, Mapping)]
        if not isinstance(name, str) or name not in names:
            raise RequestError(f"tool_choice names function {name!r}, which is not among the request's tools "
                               f"{names}", "tool_choice")
        return '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments":'
    raise RequestError(f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'function': "
                       f"{{'name': ...}}}}, got {tool_choice!r}", "tool_choice")


class ModelBackend:
    """A checkpoint served through the batching engine.

    Args:
      config, params: the model.
      tokenizer: its tokenizer (must have `<|im_start|>`/`<|im_end|>` as single tokens for chat).
      name: the model id clients pass as `model`.
      engine: batching settings (`max_context` bounds prompt + generation).
    """

    def __init__(self, config, params, tokenizer, *, name: str, engine: EngineConfig = EngineConfig()):
        from trace_jax.models.chat import ChatFormat

        self.name = name
        self.tokenizer = tokenizer
        self.chat = ChatFormat(tokenizer)
        # Parallel tool calls end with <|im_end|>, so `</tool_call>` does not stop a served generation.
        stops = [self.chat.im_end_id, tokenizer.eos_token_id, self.chat.end_of_text_id]
        self.stop_ids = tuple(dict.fromkeys(int(i) for i in stops if i is not None))
        self.engine = Engine(config, params, tokenizer, self.stop_ids, engine)
        self.max_context = engine.max_context
        self.max_n = engine.max_batch

    @classmethod
    def from_checkpoint(cls, path: str, *, tokenizer_path: str | None = None, name: str | None = None,
                        dtype: str = "float32", engine: EngineConfig | None = None) -> "ModelBackend":
        """Load a Hugging Face checkpoint directory (and its tokenizer, by default from the same directory)."""
        import os

        from trace_jax import models
        from trace_jax.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_path or path)
        config, params = models.load_pretrained(path, dtype=dtype, config_overrides={"dtype": dtype})
        if len(tokenizer) > config.vocab_size:
            raise ValueError(f"the tokenizer in {tokenizer_path or path!r} has {len(tokenizer)} tokens but the model "
                             f"has vocab_size={config.vocab_size}; pass the checkpoint's own tokenizer (--tokenizer)")
        if engine is None:
            engine = EngineConfig(max_context=min(config.max_position_embeddings, 4096))
        elif engine.max_context > config.max_position_embeddings:
            raise ValueError(f"max_context={engine.max_context} is more than the model's max_position_embeddings="
                             f"{config.max_position_embeddings}")
        return cls(config, params, tokenizer, name=name or os.path.basename(os.path.normpath(path)), engine=engine)

    def start(self) -> None:
        self.engine.start()

    def close(self) -> None:
        self.engine.close()

    def health(self) -> dict:
        """The engine's liveness (`Engine.health`)."""
        return self.engine.health()

    def _submit(self, prompt_ids: list[int], params: GenerationParams, emit, prefix: str) -> Submitted:
        room = self.max_context - len(prompt_ids)
        if room < 1:
            raise RequestError(f"the prompt is {len(prompt_ids)} tokens; this model's context is "
                               f"{self.max_context} tokens (prompt + completion): shorten the prompt", "messages")
        if params.max_tokens is not None and params.max_tokens > room:
            raise RequestError(f"max_tokens={params.max_tokens} does not fit: the prompt is {len(prompt_ids)} tokens "
                               f"of a {self.max_context}-token context, so at most {room} can be generated",
                               "max_tokens")
        if params.n > self.max_n:
            raise RequestError(f"n={params.n} is more than this server's {self.max_n} rows; ask for fewer choices",
                               "n")
        request = GenerationRequest(prompt_ids=prompt_ids, max_tokens=params.max_tokens or room,
                                    sampling=params.sampling, emit=emit, n=params.n, stop=params.stop,
                                    seed=params.seed, stream=params.stream)
        self.engine.submit(request)
        return Submitted(prompt_tokens=len(prompt_ids), prefix=prefix), request

    def submit_chat(self, messages, tools, tool_choice, params: GenerationParams, emit):
        """Render and queue a chat request; returns `(Submitted, handle)` (set `handle.cancelled` to drop it)."""
        prefix = forced_tool_prefix(tool_choice, tools)
        try:
            ids = self.chat.render(messages, tools=tools if tool_choice != "none" else None,
                                   add_generation_prompt=True).ids
        except (ValueError, TypeError, AttributeError) as error:
            raise RequestError(f"messages cannot be rendered: {error}", "messages") from None
        if prefix:
            ids = ids + self.chat.assistant_content_ids(prefix)
        return self._submit(list(ids), params, emit, prefix)

    def submit_completion(self, prompt: str | list[int], params: GenerationParams, emit):
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        else:
            ids = [int(i) for i in prompt]
            if any(i < 0 or i >= len(self.tokenizer) for i in ids):
                raise RequestError(f"prompt token ids must be in [0, {len(self.tokenizer)})", "prompt")
        if not ids:
            raise RequestError("the prompt is empty; send at least one token", "prompt")
        return self._submit(ids, params, emit, "")


class _Handle:
    cancelled = False


class ScriptedBackend:
    """A deterministic model: `respond(request)` returns the reply text (or one text per choice).

    `request` is a dict with `messages`, `tools`, `tool_choice`, `n`, `prompt` (completions) and `sampling`. Every
    call is counted in `calls` (tests use it to prove a cache avoided a call).
    """

    def __init__(self, respond: Callable[[dict], str | Sequence[str]], *, name: str = "scripted",
                 max_context: int = 1 << 20, max_n: int = 16):
        self.name = name
        self.respond = respond
        self.max_context = max_context
        self.max_n = max_n
        self.calls = 0

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def health(self) -> dict:
        return {"alive": True, "heartbeat_age_s": 0.0, "reason": None}  # answers on the caller's thread

    def _answer(self, request: dict, params: GenerationParams, emit, prefix: str):
        self.calls += 1
        reply = self.respond(request)
        texts = [reply] * params.n if isinstance(reply, str) else list(reply)
        if len(texts) != params.n:
            raise RuntimeError(f"scripted backend returned {len(texts)} texts for n={params.n}")
        for choice, text in enumerate(texts):
            for stop in params.stop:
                if stop and stop in text:
                    text = text[:text.find(stop)]
            if params.max_tokens is not None:
                words = text.split(" ")
                if len(words) > params.max_tokens:
                    emit(TextDelta(choice, " ".join(words[:params.max_tokens])))
                    emit(Finished(choice, "length", " ".join(words[:params.max_tokens]), ()))
                    continue
            emit(TextDelta(choice, text))
            emit(Finished(choice, "stop", text, ()))
        return Submitted(prompt_tokens=0, prefix=prefix), _Handle()

    def submit_chat(self, messages, tools, tool_choice, params: GenerationParams, emit):
        prefix = forced_tool_prefix(tool_choice, tools)
        request = {"messages": messages, "tools": tools, "tool_choice": tool_choice, "n": params.n, "prompt": None,
                   "sampling": params.sampling}
        return self._answer(request, params, emit, "")

    def submit_completion(self, prompt, params: GenerationParams, emit):
        request = {"messages": None, "tools": None, "tool_choice": None, "n": params.n, "prompt": prompt,
                   "sampling": params.sampling}
        return self._answer(request, params, emit, "")


Backend = ModelBackend | ScriptedBackend
__all__ = ["Backend", "Event", "GenerationParams", "ModelBackend", "RequestError", "ScriptedBackend", "Submitted",
           "forced_tool_prefix"]
