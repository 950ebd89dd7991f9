"""A local PagerDuty Events API v2: ``POST /v2/enqueue`` as PagerDuty documents it.

It validates what PagerDuty validates (routing key, ``event_action``, a ``dedup_key``
for acknowledge and resolve, a trigger's ``payload`` with ``summary``, ``source`` and a
known ``severity``) and answers as PagerDuty does: ``202 {"status": "success",
"message": "Event processed", "dedup_key": …}``, ``400 {"status": "invalid event",
"message": "Event object is invalid", "errors": […]}``. Tests inject answers
(``fail_next(429)``, ``fail_next(500)``) to see the client retry. It keeps one
incident per ``dedup_key`` (triggered, acknowledged, resolved), as PagerDuty does.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tests.fakes.loopback import ClosedOnExit, LoopbackServer, QuietHandler, read_body, reply_json

SEVERITIES = ("critical", "error", "warning", "info")
ACTIONS = ("trigger", "acknowledge", "resolve")


@dataclass
class Received:
    """One request the fake answered, with its answer's status."""

    body: dict[str, Any]
    status: int

    @property
    def action(self) -> str | None:
        return self.body.get("event_action")

    @property
    def dedup_key(self) -> str | None:
        return self.body.get("dedup_key")


@dataclass
class FakePagerDuty(ClosedOnExit):
    """The fake server; use it as a context manager. ``url`` is its base URL."""

    routing_key: str = "R0UTINGKEY0000000000000000000000"
    received: list[Received] = field(default_factory=list)
    #: dedup_key -> "triggered" | "acknowledged" | "resolved"
    incidents: dict[str, str] = field(default_factory=dict)
    _inject: deque[int] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: LoopbackServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "start the fake first"
        return self._server.url

    def fail_next(self, status: int, times: int = 1) -> None:
        """Answer the next ``times`` requests with ``status`` (429, 500 …)."""
        with self._lock:
            self._inject.extend([status] * times)

    def accepted(self) -> list[Received]:
        """The events answered 202, in order."""
        with self._lock:
            return [r for r in self.received if r.status == 202]

    def start(self) -> FakePagerDuty:
        fake = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                content_type = self.headers.get("Content-Type")
                reply_json(self, *fake._answer(self.path, content_type, read_body(self)))

        self._server = LoopbackServer(Handler)
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def __enter__(self) -> FakePagerDuty:
        return self.start()

    # ------------------------------------------------------------------ the API

    def _answer(self, path: str, content_type: str | None, raw: bytes) -> tuple[int, Any]:
        if path != "/v2/enqueue":
            return 404, {"status": "not found", "message": f"no such path {path}"}
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        with self._lock:
            injected = self._inject.popleft() if self._inject else None
            if injected is not None:
                self.received.append(Received(body if isinstance(body, dict) else {}, injected))
                if injected == 429:
                    return 429, {"status": "throttle event", "message": "Requests for this service are arriving too quickly. Please retry later."}  # fmt: skip
                return injected, {"status": "error", "message": "Internal server error"}
            if not isinstance(body, dict) or not (content_type or "").startswith(
                "application/json"
            ):
                self.received.append(Received({}, 400))
                return 400, _invalid(["Event object is not valid JSON"])
            errors = self._validate(body)
            status = 400 if errors else 202
            self.received.append(Received(body, status))
            if errors:
                return 400, _invalid(errors)
            key = body.get("dedup_key") or uuid.uuid4().hex
            action = body["event_action"]
            state = self.incidents.get(key)
            if action == "trigger" and state in (None, "resolved"):
                self.incidents[key] = "triggered"
            elif action == "acknowledge" and state == "triggered":
                self.incidents[key] = "acknowledged"
            elif action == "resolve" and state in ("triggered", "acknowledged"):
                self.incidents[key] = "resolved"
            return 202, {"status": "success", "message": "Event processed", "dedup_key": key}

    def _validate(self, body: dict[str, Any]) -> list[str]:
        errors: list[str] = []
        if body.get("routing_key") != self.routing_key:
            errors.append("'routing_key' is invalid")
        action = body.get("event_action")
        if action not in ACTIONS:
            errors.append("'event_action' is invalid (must be one of trigger, acknowledge, resolve)")  # fmt: skip
        key = body.get("dedup_key")
        if key is not None and (not isinstance(key, str) or len(key) > 255):
            errors.append("'dedup_key' must be a string of at most 255 characters")
        if action in ("acknowledge", "resolve") and not key:
            errors.append("'dedup_key' is missing or blank")
        if action == "trigger":
            payload = body.get("payload")
            if not isinstance(payload, dict):
                errors.append("'payload' is missing or blank")
            else:
                for name in ("summary", "source"):
                    if not payload.get(name):
                        errors.append(f"'payload.{name}' is missing or blank")
                if len(str(payload.get("summary", ""))) > 1024:
                    errors.append("'payload.summary' is longer than 1024 characters")
                if payload.get("severity") not in SEVERITIES:
                    errors.append("'payload.severity' is invalid (must be one of critical, error, warning, info)")  # fmt: skip
        return errors


def _invalid(errors: list[str]) -> dict[str, Any]:
    return {"status": "invalid event", "message": "Event object is invalid", "errors": errors}
