"""A minimal client for any OpenAI-compatible chat endpoint (`trace-jax serve`, vLLM, a hosted API), used by the ABC
judge and the clue-recovery agent.

One call is one HTTP request: no retries here (the caller owns its retry and backoff policy, and records every
attempt). Failures raise `EndpointError` with `retryable` set for what a later attempt may fix (timeouts,
connection errors, 429 and 5xx) and unset for what it cannot (401, 404, 400: a wrong key, model or request).

This module knows nothing about rubrics, clues or trajectories.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence
from urllib.parse import urlparse


class EndpointError(RuntimeError):
    def __init__(self, message: str, *, retryable: bool, status: int | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.status = status


@dataclasses.dataclass(frozen=True)
class EndpointConfig:
    """Where the model is.

    Attributes:
      base_url: the API root, e.g. `http://127.0.0.1:8000/v1`.
      model: the model id to send.
      api_key: bearer token (None: no Authorization header).
      timeout_s: seconds per HTTP request.
    """

    base_url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 60.0

    def __post_init__(self):
        parsed = urlparse(self.base_url or "")
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"base_url {self.base_url!r} is not an http(s) URL; pass the API root, e.g. "
                             "http://127.0.0.1:8000/v1")
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("model must be a non-empty model id (see GET <base_url>/models)")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")

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

    def _post(self, path: str, payload: Mapping[str, Any]) -> dict:
        import httpx

        try:
            response = self._http.post(path, json=payload)
        except httpx.TimeoutException:
            raise EndpointError(f"{self.endpoint.base_url}{path}: no reply within {self.endpoint.timeout_s} s",
                                retryable=True) from None
        except httpx.HTTPError as error:
            raise EndpointError(f"{self.endpoint.base_url}{path}: {type(error).__name__}: {error}",
                                retryable=True) from None
        if response.status_code != 200:
            try:
                detail = response.json().get("error", {}).get("message") or response.text
            except ValueError:
                detail = response.text
            status = response.status_code
            raise EndpointError(f"{self.endpoint.base_url}{path}: HTTP {status}: {str(detail)[:300]}",
                                retryable=status == 429 or status >= 500, status=status)
        try:
            return response.json()
        except ValueError:
            raise EndpointError(f"{self.endpoint.base_url}{path}: the reply is not JSON", retryable=True) from None

    def models(self) -> list[str]:
        """The model ids the endpoint serves (a cheap reachability check)."""
        import httpx

        try:
            response = self._http.get("/models")
        except httpx.HTTPError as error:
            raise EndpointError(f"{self.endpoint.base_url}/models: {type(error).__name__}: {error}",
                                retryable=True) from None
        if response.status_code != 200:
            raise EndpointError(f"{self.endpoint.base_url}/models: HTTP {response.status_code}", retryable=False,
                                status=response.status_code)
        return [m.get("id") for m in response.json().get("data", [])]

    def chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
             temperature: float = 0.0, max_tokens: int | None = None, seed: int | None = None) -> dict:
        payload: dict[str, Any] = {"model": self.endpoint.model, "messages": list(messages),
                                   "temperature": temperature}
        if tools:
            payload["tools"] = list(tools)
        if max_tokens is not None:
            payload["max_tokens"] = max_tokens
        if seed is not None:
            payload["seed"] = seed
        body = self._post("/chat/completions", payload)
        try:
            return dict(body["choices"][0]["message"])
        except (KeyError, IndexError, TypeError):
            raise EndpointError(f"{self.endpoint.base_url}/chat/completions: the reply has no choices[0].message",
                                retryable=True) from None
