"""A local runner ingest API: real HTTP on 127.0.0.1, the control plane's protocol.

It checks the bearer token, decodes with ``runner.wire.decode_batch``, deduplicates by
(attempt, seq) and answers ``200 {"accepted": n, "duplicates": m}``, ``400 {"error"}`` on
a WireError, ``401`` on a bad token. Tests can take it down (the listening socket is
really closed, so clients get connection refused) and bring it back on the same port,
queue error answers (503, 429 with Retry-After …), cap the body size (413), or reject
batches that hold a given event (400).
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from time import monotonic
from typing import Any

from runner.errors import WireError
from runner.wire import Event, decode_batch
from tests.fakes.loopback import JSON, ClosedOnExit, LoopbackServer, QuietHandler, read_body, reply

INGEST_PATH = "/v1/events"


@dataclass(frozen=True)
class Injected:
    """One queued answer that replaces the normal handling of the next request."""

    status: int
    retry_after: str | None = None
    body: str = "injected failure"


@dataclass(frozen=True)
class RequestLog:
    """One request the server answered."""

    #: time.monotonic() when it arrived.
    at: float
    status: int


class _Handler(QuietHandler):
    fake: FakeIngest

    def do_POST(self) -> None:
        status, payload, headers = self.fake._handle(self.path, self.headers, read_body(self))
        reply(self, status, json.dumps(payload).encode(), JSON, headers=headers.items())


class FakeIngest(ClosedOnExit):
    """The ingest API on 127.0.0.1:<port>; use as a context manager."""

    def __init__(
        self, token: str = "attempt-token", *, max_events: int = 10_000, max_body_bytes: int = 0
    ) -> None:
        self.token = token
        self.max_events = max_events
        #: Bodies larger than this get 413; 0 means no limit.
        self.max_body_bytes = max_body_bytes
        #: A batch holding an event for which this returns True is refused with 400.
        self.reject_if: Callable[[Event], bool] | None = None
        self.port = 0
        self.cond = threading.Condition()
        #: Every accepted event, once per (attempt, seq), in arrival order.
        self.accepted: list[Event] = []
        #: Every seq of every decoded batch, duplicates included.
        self.received_seqs: list[int] = []
        self.duplicates = 0
        self.requests: list[RequestLog] = []
        self._seen: set[tuple[str, int]] = set()
        self._injected: deque[Injected] = deque()
        self._server: LoopbackServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{INGEST_PATH}"

    def start(self) -> FakeIngest:
        """Listen (again) — on the same port as before, once one was chosen."""
        handler = type("Handler", (_Handler,), {"fake": self})
        self._server = LoopbackServer(handler, port=self.port, poll_interval=0.02)
        self.port = self._server.port
        return self

    def go_down(self) -> None:
        """Close the listening socket: clients get connection refused until come_up()."""
        if self._server is not None:
            self._server.close()
            self._server = None

    def come_up(self) -> None:
        self.start()

    def close(self) -> None:
        self.go_down()

    def fail_next(self, status: int, times: int = 1, *, retry_after: str | None = None) -> None:
        """Answer the next ``times`` requests with ``status``, before any other check."""
        with self.cond:
            self._injected.extend(Injected(status, retry_after) for _ in range(times))

    @property
    def injected_left(self) -> int:
        with self.cond:
            return len(self._injected)

    def accepted_seqs(self) -> list[int]:
        with self.cond:
            return [event.seq for event in self.accepted]

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until ``predicate()`` holds (checked after each request) or timeout."""
        with self.cond:
            return self.cond.wait_for(predicate, timeout)

    def _handle(
        self, path: str, headers: Any, body: bytes
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        with self.cond:
            status, payload, extra = self._answer(path, headers, body)
            self.requests.append(RequestLog(monotonic(), status))
            self.cond.notify_all()
            return status, payload, extra

    def _answer(
        self, path: str, headers: Any, body: bytes
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        if self._injected:
            injected = self._injected.popleft()
            extra = {"Retry-After": injected.retry_after} if injected.retry_after else {}
            return injected.status, {"error": injected.body}, extra
        if path != INGEST_PATH:
            return 404, {"error": f"no route {path}"}, {}
        if headers.get("Authorization") != f"Bearer {self.token}":
            return 401, {"error": "invalid or revoked runner token"}, {}
        if headers.get("Content-Type") != "application/json":
            return 415, {"error": "send application/json"}, {}
        if self.max_body_bytes and len(body) > self.max_body_bytes:
            return 413, {"error": f"body over {self.max_body_bytes} bytes"}, {}
        try:
            events = decode_batch(body, max_events=self.max_events)
        except WireError as exc:
            return 400, {"error": str(exc)}, {}
        for index, event in enumerate(events):
            if self.reject_if is not None and self.reject_if(event):
                return 400, {"error": f"events[{index}]: rejected by the test server"}, {}
        accepted = duplicates = 0
        for event in events:
            self.received_seqs.append(event.seq)
            key = (event.attempt, event.seq)
            if key in self._seen:
                duplicates += 1
                continue
            self._seen.add(key)
            self.accepted.append(event)
            accepted += 1
        self.duplicates += duplicates
        return 200, {"accepted": accepted, "duplicates": duplicates}, {}

    def __enter__(self) -> FakeIngest:
        return self.start() if self._server is None else self
