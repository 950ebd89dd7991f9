"""The plumbing every loopback HTTP fake shares: a server on 127.0.0.1 in a daemon thread,
a handler that keeps quiet, and answers with a length (HEAD without a body).

The fakes differ in what they answer, never in how they listen or stop, so that lives here
once; a fake is its routes and its state.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self

JSON = "application/json"


class QuietHandler(BaseHTTPRequestHandler):
    """Logs nothing: a test's output shows what the test says, not a line per request."""

    def log_message(self, format: str, *args: object) -> None:
        pass


def read_body(req: BaseHTTPRequestHandler) -> bytes:
    """The request's body (empty without a ``Content-Length``)."""
    length = int(req.headers.get("Content-Length") or 0)
    return req.rfile.read(length) if length else b""


def reply(
    req: BaseHTTPRequestHandler,
    status: int,
    body: bytes,
    content_type: str | None,
    *,
    headers: Iterable[tuple[str, str]] = (),
    reason: str | None = None,
) -> None:
    """One whole answer; to a HEAD the headers alone, with a zero length."""
    req.send_response(status, reason)
    if content_type is not None:
        req.send_header("Content-Type", content_type)
    for name, value in headers:
        req.send_header(name, value)
    head = req.command == "HEAD"
    req.send_header("Content-Length", "0" if head else str(len(body)))
    req.end_headers()
    if not head:
        req.wfile.write(body)


def reply_json(req: BaseHTTPRequestHandler, status: int, answer: Any) -> None:
    reply(req, status, json.dumps(answer).encode(), JSON)


class ClosedOnExit:
    """For a fake with a ``close()``: ``with fake:`` closes it at the end of the block."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class LoopbackServer(ClosedOnExit):
    """``handler`` served on 127.0.0.1 (``port`` 0: a free one) until :meth:`close`."""

    def __init__(
        self,
        handler: Callable[..., BaseHTTPRequestHandler],
        *,
        port: int = 0,
        poll_interval: float = 0.05,
    ) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self.server.serve_forever, args=(poll_interval,), daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


@contextmanager
def serving(handler: Callable[..., BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` on a loopback port for the ``with`` block; yields its base URL."""
    with LoopbackServer(handler) as server:
        yield server.url
