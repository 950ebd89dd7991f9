"""Where the runner's events go: the sink interface, the null sink, the line encoding."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

from runner.errors import RunnerError, WireError
from runner.wire import Event, json_safe


class SpoolError(RunnerError):
    """The telemetry spool cannot be used (wrong attempt, unwritable, already closed)."""


class EventSink(Protocol):
    """Where the runner's events go. ``emit`` validates and raises WireError on bad data."""

    def emit(
        self, type: str, data: Mapping[str, Any], *, time: float | None = None
    ) -> Event | None: ...

    def close(self, timeout: float = 10.0) -> None: ...


class NullSink(EventSink):
    """Drops everything: for runs without a control plane (local scripts, tests)."""

    def emit(
        self, type: str, data: Mapping[str, Any], *, time: float | None = None
    ) -> Event | None:
        return None

    def close(self, timeout: float = 10.0) -> None:
        return None


def dump_line(obj: Mapping[str, Any]) -> bytes:
    try:
        text = json.dumps(json_safe(obj), allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise WireError(f"data: not JSON-able ({exc}); pass only JSON types") from exc
    return text.encode("utf-8") + b"\n"
