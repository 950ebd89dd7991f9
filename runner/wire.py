"""The telemetry wire format, shared by the runner and the control plane.

It lives in ``runner/`` because the runner must never import ``jobs/``; the control
plane's ingest API imports this module to decode what runners send, so both sides agree
on one definition and one set of checks.

A batch is the body of one ``POST`` to the ingest API, a JSON object::

    {"v": 1, "attempt": "<attempt id>", "run": "<run id>",
     "events": [{"seq": 0, "type": "metrics", "time": 1700000000.0, "data": {...}}, ...]}

``(attempt, seq)`` identifies an event, so a batch can be retried after a timeout and the
server drops what it already has. Only standard JSON travels: a float that is not finite
is sent as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` and decoded back to a
float, because a diverging loss is NaN and losing it would hide the most important
alert. Fields declared as strings below keep such strings as they are; everywhere else
in ``data`` (extra fields, the dry-run report) the three strings decode to floats.

Payload of each event type. Required fields are checked; extra fields are allowed and
passed through. "number" accepts an int or a float and decodes to a float.

``metrics``
    ``step`` int >= 0; ``loss`` number or null; ``step_time_s`` number;
    ``data_wait_fraction`` number in [0, 1] or null (time blocked on the next batch
    divided by step time); ``metrics`` object of name -> number (user metrics).
``system``
    ``gpu_util`` number in [0, 100] or null (null: no GPU); ``gpu_count`` int >= 0;
    ``disk_used``, ``disk_total`` int >= 0 bytes; ``disk_path`` string (the volume).
``checkpoint_committed``
    ``step`` int >= 0; ``bytes`` int >= 0; ``write_s`` number; ``uri`` string.
``checkpoint_failed``
    ``step`` int (-1 when the failure is not tied to a step); ``error`` string.
``restored``
    ``step`` int >= 0 (0: fresh start); ``fallback_from`` int or null (the step whose
    checkpoint was corrupt); ``restore_s`` number.
``preemption_notice``
    ``source`` string (``sigterm``, ``aws``, ``gcp`` …); ``time_left_s`` number or null.
``exit``
    ``code`` int (negative: killed by that signal); ``reason`` one of ``succeeded``,
    ``preempted``, ``failed``, ``stopped``.
``heartbeat``
    ``step`` int >= 0 or null (null: not training yet).
``log``
    ``level`` string; ``message`` string.
``dry_run``
    ``report`` object (the preflight dry-run figures).
``started``
    ``pid`` int >= 0; ``host`` string.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from runner.errors import WireError

__all__ = [
    "EVENT_TYPES",
    "EXIT_REASONS",
    "WIRE_VERSION",
    "Event",
    "decode_batch",
    "encode_batch",
    "event_from_wire",
    "event_to_wire",
    "json_safe",
    "restore_floats",
    "validate_payload",
]

WIRE_VERSION = 1
EVENT_TYPES = frozenset(
    {
        "metrics",
        "system",
        "checkpoint_committed",
        "checkpoint_failed",
        "restored",
        "preemption_notice",
        "exit",
        "heartbeat",
        "log",
        "dry_run",
        "started",
    }
)
EXIT_REASONS = frozenset({"succeeded", "preempted", "failed", "stopped"})

#: How non-finite floats travel; standard JSON has no literal for them.
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


@dataclass(frozen=True)
class Event:
    """One telemetry event of one attempt."""

    #: Attempt id; one instance, one attempt.
    attempt: str
    #: >= 0, unique per attempt, assigned by the Reporter; the server dedups on it.
    seq: int
    #: One of EVENT_TYPES.
    type: str
    #: Unix seconds when it happened (not when it was sent).
    time: float
    #: Run id.
    run: str
    #: JSON-able payload; the fields per type are in the module docstring.
    data: dict[str, Any]


# --- field checks -------------------------------------------------------------------

_Check = Callable[[Any, str], Any]


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _integer(*, minimum: int | None = None) -> _Check:
    def check(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise WireError(f"{where}: expected an integer, got {_describe(value)}")
        result = int(value)
        if minimum is not None and result < minimum:
            raise WireError(f"{where}: expected an integer >= {minimum}, got {result}")
        return result

    return check


def _number(*, low: float | None = None, high: float | None = None) -> _Check:
    def check(value: Any, where: str) -> float:
        if isinstance(value, str) and value in _NONFINITE:
            result = _NONFINITE[value]
        elif isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise WireError(f"{where}: expected a number, got {_describe(value)}")
        else:
            result = float(value)
        if (low is not None or high is not None) and not (
            (low is None or result >= low) and (high is None or result <= high)
        ):
            raise WireError(f"{where}: expected a number in [{low}, {high}], got {result}")
        return result

    return check


def _optional(inner: _Check) -> _Check:
    def check(value: Any, where: str) -> Any:
        return None if value is None else inner(value, where)

    return check


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise WireError(f"{where}: expected a string, got {_describe(value)}")
    return value


def _exit_reason(value: Any, where: str) -> str:
    if value not in EXIT_REASONS:
        raise WireError(
            f"{where}: expected one of {', '.join(sorted(EXIT_REASONS))}, got {_describe(value)}"
        )
    return str(value)


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise WireError(f"{where}: expected an object, got {_describe(value)}")
    return {str(k): restore_floats(v) for k, v in value.items()}


def _number_map(value: Any, where: str) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise WireError(f"{where}: expected an object of name -> number, got {_describe(value)}")
    result: dict[str, float] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise WireError(f"{where}: metric names must be strings, got {_describe(key)}")
        result[key] = _number()(item, f"{where}.{key}")
    return result


@dataclass(frozen=True)
class _Field:
    name: str
    check: _Check
    #: A declared string: "NaN" stays a string here.
    text: bool = False


_STEP = _integer(minimum=0)
_SCHEMA: dict[str, tuple[_Field, ...]] = {
    "metrics": (
        _Field("step", _STEP),
        _Field("loss", _optional(_number())),
        _Field("step_time_s", _number()),
        _Field("data_wait_fraction", _optional(_number(low=0.0, high=1.0))),
        _Field("metrics", _number_map),
    ),
    "system": (
        _Field("gpu_util", _optional(_number(low=0.0, high=100.0))),
        _Field("gpu_count", _integer(minimum=0)),
        _Field("disk_used", _integer(minimum=0)),
        _Field("disk_total", _integer(minimum=0)),
        _Field("disk_path", _string, text=True),
    ),
    "checkpoint_committed": (
        _Field("step", _STEP),
        _Field("bytes", _integer(minimum=0)),
        _Field("write_s", _number()),
        _Field("uri", _string, text=True),
    ),
    "checkpoint_failed": (_Field("step", _integer()), _Field("error", _string, text=True)),
    "restored": (
        _Field("step", _STEP),
        _Field("fallback_from", _optional(_integer(minimum=0))),
        _Field("restore_s", _number()),
    ),
    "preemption_notice": (
        _Field("source", _string, text=True),
        _Field("time_left_s", _optional(_number())),
    ),
    "exit": (_Field("code", _integer()), _Field("reason", _exit_reason, text=True)),
    "heartbeat": (_Field("step", _optional(_STEP)),),
    "log": (_Field("level", _string, text=True), _Field("message", _string, text=True)),
    "dry_run": (_Field("report", _object),),
    "started": (_Field("pid", _integer(minimum=0)), _Field("host", _string, text=True)),
}
assert set(_SCHEMA) == EVENT_TYPES


def restore_floats(value: Any) -> Any:
    """Turn the wire's "NaN"/"Infinity"/"-Infinity" strings back into floats, recursively."""
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, Mapping):
        return {k: restore_floats(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [restore_floats(v) for v in value]
    return value


def json_safe(value: Any) -> Any:
    """The inverse of restore_floats, for json.dumps(allow_nan=False)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _check_type(value: Any, where: str) -> str:
    if value not in EVENT_TYPES:
        raise WireError(
            f"{where}: unknown event type {_describe(value)}; expected one of "
            f"{', '.join(sorted(EVENT_TYPES))}"
        )
    return str(value)


def validate_payload(type: str, data: Any, *, where: str = "data") -> dict[str, Any]:
    """Check ``data`` against its type's fields; return a normalised copy.

    Numbers become ``int``/``float`` (numpy scalars included), the wire's non-finite
    strings become floats, and extra fields pass through. Raises WireError naming the
    field, so a bad event is refused where it is made, not by the control plane later.
    """
    fields = _SCHEMA[_check_type(type, "type")]
    if not isinstance(data, Mapping):
        raise WireError(f"{where}: expected an object, got {_describe(data)}")
    declared = {f.name for f in fields}
    result: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise WireError(f"{where}: field names must be strings, got {_describe(key)}")
        if key not in declared:
            result[key] = restore_floats(value)
    for spec in fields:
        if spec.name not in data:
            names = ", ".join(f.name for f in fields)
            raise WireError(f"{where}.{spec.name}: missing ({type} events need {names})")
        result[spec.name] = spec.check(data[spec.name], f"{where}.{spec.name}")
    return result


def _check_time(value: Any, where: str) -> float:
    result = _number()(value, where)
    if not math.isfinite(result) or result < 0:
        raise WireError(f"{where}: expected unix seconds, got {_describe(value)}")
    return result


def event_to_wire(event: Event, *, where: str = "event") -> dict[str, Any]:
    """The JSON-safe form of one event inside a batch (attempt and run are per batch)."""
    seq = _integer(minimum=0)(event.seq, f"{where}.seq")
    type = _check_type(event.type, f"{where}.type")
    data = validate_payload(type, event.data, where=f"{where}.data")
    return {
        "seq": seq,
        "type": type,
        "time": _check_time(event.time, f"{where}.time"),
        "data": json_safe(data),
    }


def event_from_wire(obj: Any, *, attempt: str, run: str, where: str = "event") -> Event:
    """Check one decoded event object and build the Event."""
    if not isinstance(obj, Mapping):
        raise WireError(f"{where}: expected an object, got {_describe(obj)}")
    for key in ("seq", "type", "time", "data"):
        if key not in obj:
            raise WireError(f"{where}.{key}: missing (every event needs seq, type, time, data)")
    for key, expected in (("attempt", attempt), ("run", run)):
        if key in obj and obj[key] != expected:
            raise WireError(
                f"{where}.{key}: {_describe(obj[key])} differs from the batch's "
                f"{expected!r}; send one batch per attempt"
            )
    type = _check_type(obj["type"], f"{where}.type")
    return Event(
        attempt=attempt,
        seq=_integer(minimum=0)(obj["seq"], f"{where}.seq"),
        type=type,
        time=_check_time(obj["time"], f"{where}.time"),
        run=run,
        data=validate_payload(type, obj["data"], where=f"{where}.data"),
    )


def _identifier(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise WireError(f"{where}: expected a non-empty string, got {_describe(value)}")
    return value


def encode_batch(events: Sequence[Event]) -> bytes:
    """The body of one POST to the ingest API. All events must share attempt and run."""
    if not events:
        raise WireError("events: the batch is empty; send at least one event")
    first = events[0]
    attempt = _identifier(first.attempt, "events[0].attempt")
    run = _identifier(first.run, "events[0].run")
    wire_events = []
    for index, event in enumerate(events):
        where = f"events[{index}]"
        if event.attempt != attempt:
            raise WireError(
                f"{where}.attempt: {event.attempt!r} differs from events[0]'s {attempt!r}; "
                "send one batch per attempt"
            )
        if event.run != run:
            raise WireError(
                f"{where}.run: {event.run!r} differs from events[0]'s {run!r}; "
                "send one batch per run"
            )
        wire_events.append(event_to_wire(event, where=where))
    body = {"v": WIRE_VERSION, "attempt": attempt, "run": run, "events": wire_events}
    try:
        text = json.dumps(body, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise WireError(
            f"events: a payload is not JSON-able ({exc}); send only JSON types"
        ) from exc
    return text.encode("utf-8")


def _reject_constant(name: str) -> Any:
    raise WireError(
        f"body: {name} is not standard JSON; send non-finite floats as the string {name!r}"
    )


def decode_batch(body: bytes, *, max_events: int = 10_000) -> list[Event]:
    """Parse and check one batch; WireError names the first bad field and its index."""
    try:
        obj = json.loads(body, parse_constant=_reject_constant)
    except ValueError as exc:
        raise WireError(f"body: not valid JSON ({exc}); send a batch from encode_batch") from exc
    if not isinstance(obj, dict):
        raise WireError(f"body: expected a JSON object, got {type(obj).__name__}")
    if "v" not in obj:
        raise WireError(f"v: missing; this side speaks wire version {WIRE_VERSION}")
    if isinstance(obj["v"], bool) or obj["v"] != WIRE_VERSION:
        raise WireError(
            f"v: unsupported wire version {_describe(obj['v'])}; this side speaks "
            f"{WIRE_VERSION}: install matching runner and control plane versions"
        )
    for key in ("attempt", "run", "events"):
        if key not in obj:
            raise WireError(f"{key}: missing (a batch needs v, attempt, run, events)")
    attempt = _identifier(obj["attempt"], "attempt")
    run = _identifier(obj["run"], "run")
    events = obj["events"]
    if not isinstance(events, list):
        raise WireError(f"events: expected a list, got {type(events).__name__}")
    if not events:
        raise WireError("events: the batch is empty; send at least one event")
    if len(events) > max_events:
        raise WireError(
            f"events: {len(events)} events in one batch, more than {max_events}; "
            "send smaller batches"
        )
    return [
        event_from_wire(item, attempt=attempt, run=run, where=f"events[{index}]")
        for index, item in enumerate(events)
    ]
