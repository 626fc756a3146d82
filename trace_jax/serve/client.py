"""A minimal client for any OpenAI-compatible chat endpoint (`trace-jax serve`, vLLM, a hosted API), used by the ABC
judge and the clue-recovery agent.

One call is one HTTP request: no retries here (the caller owns its retry and backoff policy, and records every
attempt). Failures raise `EndpointError` with `retryable` set for what a later attempt may fix (timeouts,
connection errors, 429 and 5xx) and unset for what it cannot (401, 404, 400: a wrong key, model or request), and
`retry_after` holding the server's `Retry-After` in seconds when it sent one.

A hostile or broken endpoint cannot hang or crash the caller: each request has one overall deadline
(`timeout_s`, covering connect, upload and the whole reply, not per read), the reply is read up to
`max_response_bytes` and refused beyond it, and an error or reply body of any shape (a JSON list, string, number,
deep nesting, not JSON at all) becomes an `EndpointError`. Messages name the endpoint by `public_url`, which never
shows credentials (`user:pass@` or secret-looking query parameters).

This module knows nothing about rubrics, clues or trajectories.
"""

from __future__ import annotations

import dataclasses
import email.utils
import json
import math
import os
import re
import threading
import time
from typing import Any, Mapping, Sequence
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

# Query parameters whose values are credentials (`?api_key=...`, `?token=...`, `?sig=...`).
_SECRET_PARAMETER = ("key", "token", "secret", "pass", "auth", "sig", "credential")
_USERINFO = re.compile(r"//[^/@\s]+@")


def redact_url(url: str) -> str:
    """`url` without credentials: `user:pass@` removed, secret-looking query values replaced by `REDACTED`."""
    try:
        parsed = urlparse(url)
        netloc = parsed.netloc.rpartition("@")[2]
        query = urlencode([(name, "REDACTED" if any(s in name.lower() for s in _SECRET_PARAMETER) else value)
                           for name, value in parse_qsl(parsed.query, keep_blank_values=True)], safe="/:")
        return urlunparse(parsed._replace(netloc=netloc, query=query))
    except ValueError:  # not parseable: show nothing of it
        return "<unparseable url>"


class EndpointError(RuntimeError):
    """A failed endpoint call; `retryable` says whether a later attempt may succeed, `retry_after` (seconds) is
    the server's `Retry-After` when it sent one, `status` the HTTP status (None without a reply), and
    `over_context` marks a request the server refused as longer than its model's context (HTTP 413, or a 400 whose
    reason speaks of the context, as vLLM, OpenAI and `trace-jax serve` word it)."""

    def __init__(self, message: str, *, retryable: bool, status: int | None = None,
                 retry_after: float | None = None, over_context: bool = False):
        super().__init__(_USERINFO.sub("//", message))  # a URL echoed by httpx or the server keeps no password
        self.retryable = retryable
        self.status = status
        self.retry_after = retry_after
        self.over_context = over_context


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a `Retry-After` header (delta-seconds or an HTTP date); None when absent or unreadable."""
    if not value or not value.strip():
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return max(0.0, seconds) if math.isfinite(seconds) else None


def error_detail(body: bytes) -> str:
    """A short, printable reason from an error body of any shape: OpenAI's `{"error": {"message"}}`, `{"error":
    "..."}`, `{"detail": ...}`, or else the body itself (JSON of any type, or text), cut to 300 characters."""
    text = body.decode("utf-8", errors="replace")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = None
    detail: Any = None
    if isinstance(value, dict):
        error = value.get("error")
        if isinstance(error, dict):
            detail = error.get("message")
        elif isinstance(error, str):
            detail = error
        if not isinstance(detail, str) or not detail.strip():
            detail = value.get("detail") if isinstance(value.get("detail"), str) else None
    if not isinstance(detail, str) or not detail.strip():
        detail = text
    detail = " ".join(detail.split())
    return detail[:300] + ("..." if len(detail) > 300 else "") if detail else "(empty body)"


@dataclasses.dataclass(frozen=True)
class EndpointConfig:
    """Where the model is.

    Attributes:
      base_url: the API root, e.g. `http://127.0.0.1:8000/v1` (`user:pass@` in it is sent as basic auth and never
        printed; see `public_url`).
      model: the model id to send.
      api_key: bearer token (None: no Authorization header).
      timeout_s: seconds one request may take in all: connecting, sending and reading the whole reply.
      max_response_bytes: a reply body larger than this is refused (`EndpointError`, not retryable).
    """

    base_url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 60.0
    max_response_bytes: int = 8 << 20

    def __post_init__(self):
        parsed = urlparse(self.base_url or "")
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"base_url {redact_url(str(self.base_url))!r} is not an http(s) URL; pass the API root, "
                             "e.g. http://127.0.0.1:8000/v1")
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("model must be a non-empty model id (see GET <base_url>/models)")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s!r}")
        if (not isinstance(self.max_response_bytes, int) or isinstance(self.max_response_bytes, bool)
                or self.max_response_bytes < 1):
            raise ValueError(f"max_response_bytes must be an int >= 1, got {self.max_response_bytes!r}")

    @property
    def public_url(self) -> str:
        """`base_url` as it may be printed or written to files: without credentials."""
        return redact_url(self.base_url)

    @classmethod
    def from_env(cls, prefix: str, *, base_url: str | None = None, model: str | None = None,
                 api_key: str | None = None, timeout_s: float = 60.0) -> "EndpointConfig":
        """Arguments first, then `$<prefix>_URL`, `$<prefix>_MODEL`, `$<prefix>_API_KEY` (e.g. TRACE_JAX_JUDGE)."""
        base_url = base_url or os.environ.get(f"{prefix}_URL")
        model = model or os.environ.get(f"{prefix}_MODEL")
        if not base_url:
            raise ValueError(f"no endpoint URL: pass one or set ${prefix}_URL")
        if not model:
            raise ValueError(f"no model id: pass one or set ${prefix}_MODEL")
        return cls(base_url=base_url.rstrip("/"), model=model,
                   api_key=api_key or os.environ.get(f"{prefix}_API_KEY") or None, timeout_s=timeout_s)


class ChatClient:
    """`chat(messages, ...)` -> the reply message dict of `POST {base_url}/chat/completions`."""

    def __init__(self, endpoint: EndpointConfig):
        import httpx

        self.endpoint = endpoint
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        self._http = httpx.Client(base_url=endpoint.base_url.rstrip("/"), headers=headers,
                                  timeout=endpoint.timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ChatClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, path: str, payload: Mapping[str, Any] | None = None, *,
                 timeout_s: float | None = None) -> Any:
        """One HTTP request under one overall deadline; the reply's JSON value (any type), or `EndpointError`.

        The request runs on a helper thread and the caller waits at most `timeout_s` for it: httpx's own timeouts
        apply per phase and per read, so a server that drips a byte at a time would otherwise hold the caller for
        as long as it likes. An abandoned helper stops at its next read (it checks the deadline between chunks)."""
        where = f"{self.endpoint.public_url}{path}"
        timeout_s = self.endpoint.timeout_s if timeout_s is None else min(timeout_s, self.endpoint.timeout_s)
        deadline = time.monotonic() + timeout_s
        outcome: dict[str, Any] = {}
        worker = threading.Thread(target=self._exchange, args=(method, path, payload, deadline, outcome),
                                  name="endpoint-request", daemon=True)
        worker.start()
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive() or "timeout" in outcome:
            outcome.get("response", _Closed).close()
            raise EndpointError(f"{where}: no complete reply within {timeout_s:g} s", retryable=True)
        if "error" in outcome:
            raise outcome["error"]
        if "status" not in outcome:  # the helper ended without a word (cannot happen; never a KeyError here)
            raise EndpointError(f"{where}: no reply", retryable=True)
        status, headers, body = outcome["status"], outcome["headers"], outcome["body"]
        if status != 200:
            detail = error_detail(body)
            raise EndpointError(f"{where}: HTTP {status}: {detail}", retryable=status in (408, 429) or status >= 500,
                                status=status, retry_after=parse_retry_after(headers.get("retry-after")),
                                over_context=status == 413 or (status == 400 and "context" in detail.lower()))
        try:
            return json.loads(body)
        except (ValueError, RecursionError):
            raise EndpointError(f"{where}: the reply is not JSON (or is nested too deeply): {error_detail(body)[:80]}",
                                retryable=True) from None

    def _exchange(self, method: str, path: str, payload, deadline: float, outcome: dict) -> None:
        """The helper thread of `_request`: fills `outcome` with status, headers and body, or an error."""
        import httpx

        where = f"{self.endpoint.public_url}{path}"
        limit = self.endpoint.max_response_bytes
        try:
            # httpx's limits apply per phase and per read: no single wait of an abandoned helper outlasts the deadline
            request = self._http.build_request(method, path, json=payload,
                                               timeout=max(0.001, deadline - time.monotonic()))
            response = self._http.send(request, stream=True)
            outcome["response"] = response
            try:
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise _TooLarge(int(declared))
                body = bytearray()
                for chunk in response.iter_bytes():
                    body += chunk
                    if len(body) > limit:
                        raise _TooLarge(len(body))
                    if time.monotonic() > deadline:
                        outcome["timeout"] = True
                        return
            finally:
                response.close()
            outcome.update(status=response.status_code, headers=response.headers, body=bytes(body))
        except _TooLarge as error:
            outcome["error"] = EndpointError(f"{where}: the reply is larger than {limit} bytes ({error.size} read or "
                                             "declared); raise max_response_bytes if that is expected",
                                             retryable=False)
        except httpx.TimeoutException:
            outcome["timeout"] = True
        except (httpx.HTTPError, OSError) as error:
            message = str(error).replace(self.endpoint.base_url, self.endpoint.public_url)[:300]
            outcome["error"] = EndpointError(f"{where}: {type(error).__name__}: {message}", retryable=True)
        except Exception as error:  # noqa: BLE001 - a thread boundary: e.g. a payload JSON cannot encode, a closed client
            message = str(error).replace(self.endpoint.base_url, self.endpoint.public_url)[:300]
            outcome["error"] = EndpointError(f"{where}: the request could not be made: {type(error).__name__}: "
                                             f"{message}", retryable=False)

    def models(self) -> list[str]:
        """The model ids the endpoint serves (a cheap reachability check)."""
        body = self._request("GET", "/models")
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise EndpointError(f"{self.endpoint.public_url}/models: the reply has no 'data' list", retryable=False)
        return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]

    def chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
             temperature: float = 0.0, max_tokens: int | None = None, seed: int | None = None,
             timeout_s: float | None = None) -> dict:
        """The reply message of one chat completion; `timeout_s` shortens the endpoint's deadline for this call."""
        payload: dict[str, Any] = {"model": self.endpoint.model, "messages": list(messages),
                                   "temperature": temperature}
        if tools:
            payload["tools"] = list(tools)
        if max_tokens is not None:
            payload["max_tokens"] = max_tokens
        if seed is not None:
            payload["seed"] = seed
        body = self._request("POST", "/chat/completions", payload, timeout_s=timeout_s)
        try:
            message = body["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            message = None
        if not isinstance(message, dict):
            raise EndpointError(f"{self.endpoint.public_url}/chat/completions: the reply has no choices[0].message "
                                "object", retryable=True)
        return dict(message)


class _Closed:
    """Stands in for a response not received yet (nothing to close)."""

    @staticmethod
    def close() -> None:
        pass


class _TooLarge(Exception):
    def __init__(self, size: int):
        super().__init__(size)
        self.size = size
