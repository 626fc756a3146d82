"""Running the ASGI app with uvicorn: in the foreground (`trace-jax serve`) or on a background thread (tests,
benchmarks, the offline scripted judge).

This module knows nothing about models or the OpenAI format; it runs an app on a host and port.
"""

from __future__ import annotations

import socket
import threading
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ServerThread:
    """Serve `app` on `host:port` from a daemon thread; `start()` returns once it accepts connections.

    Use as a context manager or call `stop()`; both wait (bounded) for uvicorn to shut down, which also runs the
    app's lifespan exit (the engine thread stops).
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning"):
        import uvicorn

        self.host = host
        self.port = port or free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level=log_level,
                                                    lifespan="on", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name="trace-jax-serve-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server on {self.url} exited while starting (port in use?)")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the server on {self.url} did not start within {timeout} s")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
