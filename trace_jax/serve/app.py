"""The OpenAI-compatible HTTP API of `trace-jax serve`, as a FastAPI (ASGI) app.

Endpoints: `POST /v1/chat/completions` (messages with tools; `tool_calls` in the reply; `n`, `temperature`, `top_p`,
`max_tokens`, `stop`, `seed`, `stream` by server-sent events), `POST /v1/completions`, `GET /v1/models`,
`GET /health` (503 when the engine is dead). Errors use OpenAI's shape `{"error": {"message", "type", "param",
"code"}}`: bad input is a 4xx that says what is wrong and names the field (400 invalid JSON or parameter, 401
missing/wrong API key, 403 a Host header a loopback server does not answer to, 404 unknown model, 413 body too
large, 429 queue full, with `Retry-After`); 5xx means a bug, a device failure or a dead engine, never bad input.

Every field is bounded (`n`, `max_tokens`, `seed` to int64, stop strings' count and length, the tools against the
OpenAI function-tool schema, `tool_choice`). An ASGI middleware (`_Guard`) runs before anything reads the body:
the Host check on loopback binds (DNS rebinding: a web page must not reach a loopback server through a name it
controls), the API key on every path but `/health` (the OpenAPI docs included), and the body-size limit.

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

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from trace_jax.rollout.sampler import SamplingConfig
from trace_jax.serve.backend import GenerationParams, RequestError
from trace_jax.serve.engine import EngineDead, Failed, Finished, QueueFull, TextDelta

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_N = 128
MAX_TOOLS = 128
INT32_MAX = (1 << 31) - 1
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
RETRY_AFTER_S = 1
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
      api_key: when set, every request but `/health` (the OpenAPI docs included) needs
        `Authorization: Bearer <api_key>`.
      max_body_bytes: larger request bodies get a 413 (before they are read).
      allowed_hosts: names a loopback-bound server answers to besides 127.0.0.1, localhost and ::1 (any other
        Host header is refused: DNS rebinding). Servers bound elsewhere check no Host.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"ServeConfig.port must be an int in [0, 65535], got {self.port!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError("ServeConfig.api_key must be a non-empty string or None (no authentication); an empty "
                             "key is a mistake, not a way to turn authentication off")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ValueError(f"ServeConfig.max_body_bytes must be an int >= 1024, got {self.max_body_bytes!r}")
        if isinstance(self.allowed_hosts, str) or not all(isinstance(h, str) and h for h in self.allowed_hosts):
            raise ValueError(f"ServeConfig.allowed_hosts must be a tuple of host names, got {self.allowed_hosts!r}")

    @property
    def loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers


def _error_response(status: int, message: str, param=None, kind="invalid_request_error", code=None,
                    headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status,
                        headers=headers)


def _host_name(host_header: str) -> str:
    """The name in a Host header, without the port ("[::1]:80" -> "::1")."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class _BodyTooLarge(Exception):
    pass


class _Guard:
    """ASGI middleware that runs before the app reads anything: the Host check (loopback binds), the API key
    (every path but /health) and the body-size limit (Content-Length, then the bytes as they arrive)."""

    def __init__(self, app, config: "ServeConfig"):
        self.app = app
        self.config = config
        self.hosts = {h.lower() for h in LOOPBACK_HOSTS + tuple(config.allowed_hosts)} if config.loopback else None
        self.key = None if config.api_key is None else config.api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for name, value in scope.get("headers", ()):
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        if self.hosts is not None and "host" in headers and _host_name(headers["host"]) not in self.hosts:
            return await _error_response(
                403, f"Host {headers['host']!r} is not a name of this loopback server (it answers to "
                f"{sorted(self.hosts)}; add more with --allowed-host)", "host", code="host_not_allowed")(
                scope, receive, send)
        if self.key is not None and scope.get("path") != "/health":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.key):
                return await _error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                             kind="authentication_error", code="invalid_api_key")(
                    scope, receive, send)
        limit = self.config.max_body_bytes
        too_large = _error_response(413, f"the request body is larger than this server's limit of {limit} bytes",
                                    code="body_too_large")
        try:
            declared = int(headers.get("content-length") or 0)
        except ValueError:
            return await _error_response(400, "the Content-Length header is not an integer")(scope, receive, send)
        if declared > limit:
            return await too_large(scope, receive, send)
        received, rejected = 0, False

        async def limited_receive():
            nonlocal received, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # a chunked body over the limit: answer 413 and end the request for the app
                    rejected = True
                    await too_large(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            if not rejected:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    user: str | None = None


# The OpenAI function-tool schema (what its API accepts in `tools`); unknown keys are refused, as OpenAI does.
class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    class Function(BaseModel):
        model_config = ConfigDict(extra="forbid")

        name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")

    type: Literal["function"]
    function: Function


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    # Validated as `FunctionTool`s but kept as sent: the chat format renders each tool's JSON as the client wrote it.
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    parallel_tool_calls: bool | None = None
    stream_options: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _tools_follow_the_function_tool_schema(cls, tools):
        names = set()
        for index, tool in enumerate(tools or ()):
            try:
                name = FunctionTool.model_validate(tool).function.name
            except ValidationError as error:
                problem = error.errors()[0]
                where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in problem["loc"])
                raise ValueError(f"tools[{index}]{where}: {problem['msg']} (a tool is {{'type': 'function', "
                                 "'function': {'name': ..., 'description': ..., 'parameters': {...}}}, as in "
                                 "OpenAI's API)") from None
            if name in names:
                raise ValueError(f"two tools are named {name!r}; tool names must be unique")
            names.add(name)
        return tools


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)


def _params(body: _Common, max_tokens: int | None) -> GenerationParams:
    extra = body.model_extra or {}
    for name in UNSUPPORTED:
        if extra.get(name) not in (None, False, 0, {}, {"type": "text"}):
            raise ApiError(400, f"parameter {name!r} is not supported by this server; remove it", param=name)
    stop = () if body.stop is None else (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    if (len(stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in stop)
            or any(len(s) > MAX_STOP_CHARS for s in stop)):
        raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty "
                       f"strings of at most {MAX_STOP_CHARS} characters", param="stop")
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
    app.add_middleware(_Guard, config=config)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(request, error: ApiError):
        return _error_response(error.status, error.message, error.param, error.kind, error.code, error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, error: RequestValidationError):
        problems = error.errors()
        first = problems[0] if problems else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return _error_response(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
                                   .rstrip(": "))
        location = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(location) or None
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        if len(problems) > 1:
            message += f" (and {len(problems) - 1} more problem(s))"
        return _error_response(400, message, location[0] if location else None)  # param: the request's field

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, error: StarletteHTTPException):
        return _error_response(error.status_code, str(error.detail), kind="invalid_request_error")

    def check_model(name: str):
        if name != backend.name:
            raise ApiError(404, f"model {name!r} does not exist here; this server serves {backend.name!r} "
                           "(see GET /v1/models)", param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        engine = backend.health()
        return JSONResponse({"status": "ok" if engine["alive"] else "dead", "model": backend.name, "engine": engine},
                            status_code=200 if engine["alive"] else 503)

    @app.get("/v1/models")
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
            raise ApiError(429, str(error), kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineDead as error:
            raise ApiError(503, f"the server cannot generate: {error}", kind="server_error",
                           code="engine_dead") from None
        except ValueError as error:
            raise ApiError(400, str(error)) from None
        return submitted, handle, queue

    async def collect(request: Request, queue, n, handle):
        """The `n` finished choices. A client that disconnects first cancels the request (its rows are freed at
        the engine's next slice) instead of leaving it to decode for nobody."""
        finished: dict[int, Finished] = {}

        async def watch_disconnect():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            handle.cancelled = True
            queue.put_nowait(None)

        watcher = asyncio.create_task(watch_disconnect())
        try:
            while len(finished) < n:
                event = await queue.get()
                if event is None:
                    raise ApiError(499, "the client closed the connection")  # nobody reads this
                if isinstance(event, Failed):
                    raise ApiError(500, event.message, kind="server_error")
                if isinstance(event, Finished):
                    finished[event.choice] = event
        finally:
            watcher.cancel()
            if len(finished) < n:
                handle.cancelled = True
        return [finished[i] for i in range(n)]

    def usage(submitted, finished):
        completion = sum(len(f.token_ids) for f in finished)
        return {"prompt_tokens": submitted.prompt_tokens, "completion_tokens": completion,
                "total_tokens": submitted.prompt_tokens + completion}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_model(body.model)
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = _params(body, max_tokens)
        with_tools = bool(body.tools) and body.tool_choice != "none"
        tool_choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel) else body.tool_choice
        submitted, handle, queue = await submit(request, backend.submit_chat, body.messages, body.tools,
                                                tool_choice, params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        if body.stream:
            return EventSourceResponse(_stream_chat(queue, handle, submitted, body, request_id, now, with_tools),
                                       ping=15)
        finished = await collect(request, queue, body.n, handle)
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

    @app.post("/v1/completions")
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
        finished = await collect(request, queue, body.n, handle)
        return JSONResponse({"id": request_id, "object": "text_completion", "created": now, "model": backend.name,
                             "choices": [{"index": f.choice, "text": f.text, "finish_reason": f.reason,
                                          "logprobs": None} for f in finished],
                             "usage": usage(submitted, finished)})

    return app
