"""A hostile fake of an OpenAI-compatible endpoint on 127.0.0.1, for the judge client's failure paths: each request
gets the next scripted `Reply` (status, headers, body, and optionally a slow drip), so tests can serve error bodies
of any shape, `Retry-After`, oversized and never-ending replies that `trace-jax serve` would never send. A script
entry may also be a function `(method, path, json_body) -> Reply` that answers from the request."""

from __future__ import annotations

import dataclasses
import http.server
import json
import threading
import time


@dataclasses.dataclass
class Reply:
    status: int = 200
    body: bytes | str | object = b""
    headers: dict = dataclasses.field(default_factory=dict)
    drip_s: float | None = None  # send the body one byte per drip_s seconds (no Content-Length)
    chunked: bool = False        # send the body without a Content-Length

    def payload(self) -> bytes:
        if isinstance(self.body, bytes):
            return self.body
        if isinstance(self.body, str):
            return self.body.encode()
        return json.dumps(self.body).encode()


def ok(content: str) -> Reply:
    """A well-formed chat completion whose message says `content`."""
    return Reply(body={"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                    "finish_reason": "stop"}]})


class FakeEndpoint:
    """`with FakeEndpoint(replies) as fake:` serves `replies` in order (the last one repeats); `fake.url` is the
    API root and `fake.requests` the (method, path, headers) of every request received."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.requests: list[tuple[str, str, dict]] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _serve(self):
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                owner.requests.append((self.command, self.path, dict(self.headers)))
                reply = owner.replies[min(len(owner.requests), len(owner.replies)) - 1]
                if callable(reply):
                    reply = reply(self.command, self.path, json.loads(raw) if raw else None)
                body = reply.payload()
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                streamed = reply.drip_s is not None or reply.chunked
                self.send_header("Content-Type", "application/json")
                if streamed:
                    self.send_header("Connection", "close")
                else:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    if reply.drip_s is None:
                        self.wfile.write(body)
                    else:
                        for byte in body:
                            self.wfile.write(bytes([byte]))
                            self.wfile.flush()
                            time.sleep(reply.drip_s)
                except OSError:  # the client gave up: that is what the test wants
                    pass
                if streamed:
                    self.close_connection = True

            do_GET = do_POST = _serve

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeEndpoint":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
