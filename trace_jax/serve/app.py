"""The OpenAI-compatible HTTP API of `trace-jax serve`, as a FastAPI (ASGI) app.

Endpoints: `POST /v1/chat/completions` (messages with tools; `tool_calls` in the reply; `n`, `temperature`, `top_p`,
`max_tokens`, `stop`, `seed`, `stream` by server-sent events), `POST /v1/completions`, `GET /v1/models`,
`GET /health`. Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: bad input is a 4xx that
says what is wrong (400 invalid JSON or parameter, 401 missing/wrong API key, 404 unknown model, 429 queue full);
5xx means a bug or a device failure, never bad input.

Sampling: `temperature` 0 is greedy (argmax); otherwise the project's sampler with `temperature` and `top_p`.

This module knows HTTP, JSON and the OpenAI wire format; generation is the backend's (`trace_jax.serve.backend`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
import uuid
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from trace_jax.rollout.sampler import SamplingConfig
from trace_jax.serve.backend import GenerationParams, RequestError
from trace_jax.serve.engine import Failed, Finished, QueueFull, TextDelta

MAX_STOP_STRINGS = 4
# Requests with a body over this many bytes are rendered and tokenized on a worker thread, not on the event loop:
# a prompt of tens of thousands of characters takes milliseconds to tokenize, during which every other
# connection would wait (the tokenizer releases the GIL for long texts, `ChatFormat._encode`).
OFFLOAD_BYTES = 16 * 1024
# Accepted for compatibility but not implemented: a request that turns one on gets a 400 rather than silently
# different behaviour.
UNSUPPORTED = ("logprobs", "top_logprobs", "logit_bias", "response_format", "echo", "best_of", "suffix")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Server settings.

    Attributes:
      host: interface to bind; loopback by default (expose it deliberately with 0.0.0.0).
      port: TCP port (0 = any free port).
      api_key: when set, every /v1 request needs `Authorization: Bearer <api_key>`.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None

    def __post_init__(self):
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"ServeConfig.port must be an int in [0, 65535], got {self.port!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServeConfig.api_key must be a non-empty string or None (no authentication)")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code


def _error_response(status: int, message: str, param=None, kind="invalid_request_error", code=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    user: str | None = None


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    parallel_tool_calls: bool | None = None
    stream_options: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1)


def _params(body: _Common, max_tokens: int | None) -> GenerationParams:
    extra = body.model_extra or {}
    for name in UNSUPPORTED:
        if extra.get(name) not in (None, False, 0, {}, {"type": "text"}):
            raise ApiError(400, f"parameter {name!r} is not supported by this server; remove it", param=name)
    stop = () if body.stop is None else (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    if len(stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in stop):
        raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty "
                       "strings", param="stop")
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    sampling = SamplingConfig(greedy=True) if temperature == 0 else SamplingConfig(temperature=temperature,
                                                                                   top_p=top_p)
    return GenerationParams(max_tokens=max_tokens, sampling=sampling, n=body.n, stop=stop, seed=body.seed,
                            stream=body.stream)


def _parse_reply(text: str, with_tools: bool) -> tuple[str | None, list[dict], str | None]:
    """(content, tool_calls, finish override): tool calls become OpenAI `tool_calls` when every block parses."""
    from trace_jax.models.chat import TOOL_CALL_OPEN, ToolCall, parse_tool_calls

    if not with_tools or TOOL_CALL_OPEN not in text:
        return text, [], None
    calls = parse_tool_calls(text)
    if not calls or not all(isinstance(c, ToolCall) for c in calls):
        return text, [], None
    content = text[:text.find(TOOL_CALL_OPEN)].strip() or None
    tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                   "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                  for c in calls]
    return content, tool_calls, "tool_calls"


def create_app(backend, config: ServeConfig = ServeConfig()) -> FastAPI:
    """The FastAPI app serving `backend` (a `ModelBackend` or `ScriptedBackend`); starts and closes it with the app."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        backend.start()
        try:
            yield
        finally:
            backend.close()

    app = FastAPI(title="trace-jax serve", lifespan=lifespan)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(request, error: ApiError):
        return _error_response(error.status, error.message, error.param, error.kind, error.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, error: RequestValidationError):
        problems = error.errors()
        first = problems[0] if problems else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return _error_response(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
                                   .rstrip(": "))
        location = [str(p) for p in first.get("loc", ()) if p != "body"]
        field = ".".join(location) or None
        message = f"{field}: {first.get('msg')}" if field else str(first.get("msg"))
        if len(problems) > 1:
            message += f" (and {len(problems) - 1} more problem(s))"
        return _error_response(400, message, field)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, error: StarletteHTTPException):
        return _error_response(error.status_code, str(error.detail), kind="invalid_request_error")

    async def authenticate(request: Request):
        """A dependency of the /v1 routes (cheaper than an HTTP middleware on every request)."""
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           kind="authentication_error", code="invalid_api_key")

    v1 = [Depends(authenticate)]

    def check_model(name: str):
        if name != backend.name:
            raise ApiError(404, f"model {name!r} does not exist here; this server serves {backend.name!r} "
                           "(see GET /v1/models)", param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": backend.name}

    @app.get("/v1/models", dependencies=v1)
    async def list_models():
        return {"object": "list", "data": [{"id": backend.name, "object": "model", "created": created,
                                             "owned_by": "trace-jax"}]}

    async def submit(request: Request, call, *args):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(event):
            loop.call_soon_threadsafe(queue.put_nowait, event)

        try:
            if int(request.headers.get("content-length") or 0) > OFFLOAD_BYTES:
                submitted, handle = await asyncio.to_thread(call, *args, emit)
            else:
                submitted, handle = call(*args, emit)
        except RequestError as error:
            raise ApiError(400, str(error), param=error.param) from None
        except QueueFull as error:
            raise ApiError(429, str(error), kind="rate_limit_error", code="queue_full") from None
        except ValueError as error:
            raise ApiError(400, str(error)) from None
        return submitted, handle, queue

    async def collect(queue, n, handle):
        finished: dict[int, Finished] = {}
        try:
            while len(finished) < n:
                event = await queue.get()
                if isinstance(event, Failed):
                    raise ApiError(500, event.message, kind="server_error")
                if isinstance(event, Finished):
                    finished[event.choice] = event
        finally:
            if len(finished) < n:
                handle.cancelled = True
        return [finished[i] for i in range(n)]

    def usage(submitted, finished):
        completion = sum(len(f.token_ids) for f in finished)
        return {"prompt_tokens": submitted.prompt_tokens, "completion_tokens": completion,
                "total_tokens": submitted.prompt_tokens + completion}

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: ChatRequest, request: Request):
        check_model(body.model)
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = _params(body, max_tokens)
        with_tools = bool(body.tools) and body.tool_choice != "none"
        submitted, handle, queue = await submit(request, backend.submit_chat, body.messages, body.tools,
                                                body.tool_choice, params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        if body.stream:
            return EventSourceResponse(_stream_chat(queue, handle, submitted, body, request_id, now, with_tools),
                                       ping=15)
        finished = await collect(queue, body.n, handle)
        choices = []
        for f in finished:
            content, tool_calls, finish = _parse_reply(submitted.prefix + f.text, with_tools)
            message = {"role": "assistant", "content": content}
            if tool_calls:
                message["tool_calls"] = tool_calls
            choices.append({"index": f.choice, "message": message, "finish_reason": finish or f.reason,
                            "logprobs": None})
        # A Response as it is: FastAPI would otherwise walk the dict through jsonable_encoder first.
        return JSONResponse({"id": request_id, "object": "chat.completion", "created": now, "model": backend.name,
                             "choices": choices, "usage": usage(submitted, finished)})

    async def _stream_chat(queue, handle, submitted, body, request_id, now, with_tools):
        from trace_jax.models.chat import TOOL_CALL_OPEN

        def chunk(delta, index, finish=None):
            return json.dumps({"id": request_id, "object": "chat.completion.chunk", "created": now,
                               "model": backend.name,
                               "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                                            "logprobs": None}]}, ensure_ascii=False)

        texts = {i: submitted.prefix for i in range(body.n)}
        sent = {i: 0 for i in range(body.n)}
        done: list[Finished] = []
        try:
            for index in range(body.n):
                yield {"data": chunk({"role": "assistant", "content": ""}, index)}
            while len(done) < body.n:
                event = await queue.get()
                if isinstance(event, Failed):
                    yield {"data": json.dumps({"error": {"message": event.message, "type": "server_error"}})}
                    return
                if isinstance(event, TextDelta):
                    texts[event.choice] += event.text
                elif isinstance(event, Finished):
                    texts[event.choice] = submitted.prefix + event.text
                    done.append(event)
                text = texts[event.choice]
                # With tools, content stops at the first <tool_call>: calls are sent whole once they parse.
                visible = len(text)
                if with_tools:
                    at = text.find(TOOL_CALL_OPEN)
                    if at >= 0:
                        visible = at
                    elif not isinstance(event, Finished):
                        for size in range(len(TOOL_CALL_OPEN) - 1, 0, -1):
                            if text.endswith(TOOL_CALL_OPEN[:size]):
                                visible -= size
                                break
                if visible > sent[event.choice]:
                    yield {"data": chunk({"content": text[sent[event.choice]:visible]}, event.choice)}
                    sent[event.choice] = visible
                if isinstance(event, Finished):
                    content, tool_calls, finish = _parse_reply(text, with_tools)
                    if tool_calls:
                        calls = [dict(call, index=i) for i, call in enumerate(tool_calls)]
                        yield {"data": chunk({"tool_calls": calls}, event.choice)}
                    elif with_tools and visible < len(text):  # a call that did not parse stays content
                        yield {"data": chunk({"content": text[visible:]}, event.choice)}
                    yield {"data": chunk({}, event.choice, finish or event.reason)}
            if (body.stream_options or {}).get("include_usage"):
                yield {"data": json.dumps({"id": request_id, "object": "chat.completion.chunk", "created": now,
                                           "model": backend.name, "choices": [],
                                           "usage": usage(submitted, done)})}
            yield {"data": "[DONE]"}
        finally:
            if len(done) < body.n:
                handle.cancelled = True

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        params = _params(body, body.max_tokens)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt holds {len(prompt)} strings; send one prompt per request", param="prompt")
            prompt = prompt[0]
        submitted, handle, queue = await submit(request, backend.submit_completion, prompt, params)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        if body.stream:
            async def events():
                done = 0
                try:
                    while done < body.n:
                        event = await queue.get()
                        if isinstance(event, Failed):
                            yield {"data": json.dumps({"error": {"message": event.message, "type": "server_error"}})}
                            return
                        text = event.text if isinstance(event, TextDelta) else ""
                        finish = event.reason if isinstance(event, Finished) else None
                        done += isinstance(event, Finished)
                        yield {"data": json.dumps({"id": request_id, "object": "text_completion", "created": now,
                                                   "model": backend.name,
                                                   "choices": [{"index": event.choice, "text": text,
                                                                "finish_reason": finish, "logprobs": None}]},
                                                  ensure_ascii=False)}
                    yield {"data": "[DONE]"}
                finally:
                    if done < body.n:
                        handle.cancelled = True

            return EventSourceResponse(events(), ping=15)
        finished = await collect(queue, body.n, handle)
        return JSONResponse({"id": request_id, "object": "text_completion", "created": now, "model": backend.name,
                             "choices": [{"index": f.choice, "text": f.text, "finish_reason": f.reason,
                                          "logprobs": None} for f in finished],
                             "usage": usage(submitted, finished)})

    return app
