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
from functools import partial
from itertools import repeat
from operator import attrgetter
from typing import Annotated, Any, Literal, Union, get_args

import msgspec
import orjson

from runner.errors import WireError

__all__ = [
    "EVENT_TYPES",
    "EXIT_REASONS",
    "WIRE_VERSION",
    "Batch",
    "Event",
    "decode_batch",
    "decode_batch_columns",
    "decode_batch_with_json",
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
#
# Decoding is the ingest API's hot path (every event of every runner passes here), so a
# check takes only the value and returns it normalised; when something is wrong it
# raises _Invalid with what is wrong and the path below the value (".acc"), and the
# caller that knows the location ("events[12].data.metrics") turns it into a WireError.
# A good batch never formats a location. Each check tries the exact types json.loads
# produces first (``type(x) is float``); the general ABC checks (numpy scalars,
# Fraction) run only when those fail.

_Check = Callable[[Any], Any]
_INF = math.inf
_MISSING: Any = object()


class _Invalid(Exception):
    """A check's complaint without its location; see above."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.message = message
        #: Where below the checked value, e.g. ".data.step"; "" for the value itself.
        self.path = path

    def below(self, step: str) -> _Invalid:
        """The same complaint, one level further out (``step`` is ".name")."""
        return _Invalid(self.message, step + self.path)

    def at(self, where: str) -> WireError:
        return WireError(f"{where}{self.path}: {self.message}")


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _integer(*, minimum: int | None = None, optional: bool = False) -> _Check:
    def check(value: Any) -> int | None:
        if type(value) is int:
            result = value
        elif value is None and optional:
            return None
        elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise _Invalid(f"expected an integer, got {_describe(value)}")
        else:
            result = int(value)
        if minimum is not None and result < minimum:
            raise _Invalid(f"expected an integer >= {minimum}, got {result}")
        return result

    return check


def _to_float(value: Any) -> float:
    """Any number the wire accepts (the non-finite strings included) as a float."""
    if type(value) is float:
        return value
    if isinstance(value, str):
        if value in _NONFINITE:
            return _NONFINITE[value]
    elif not isinstance(value, bool) and isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:
            raise _Invalid(
                f"expected a number in a float's range, got {_describe(value)}"
            ) from None
    raise _Invalid(f"expected a number, got {_describe(value)}")


def _number(
    *, low: float | None = None, high: float | None = None, optional: bool = False
) -> _Check:
    if low is None and high is None:

        def check(value: Any) -> float | None:
            if type(value) is float:
                return value
            if value is None and optional:
                return None
            return _to_float(value)

        return check

    def ranged(value: Any) -> float | None:
        if type(value) is float:
            result = value
        elif value is None and optional:
            return None
        else:
            result = _to_float(value)
        if (low is None or result >= low) and (high is None or result <= high):
            return result
        raise _Invalid(f"expected a number in [{low}, {high}], got {result}")

    return ranged


def _string(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise _Invalid(f"expected a string, got {_describe(value)}")


def _exit_reason(value: Any) -> str:
    if isinstance(value, str) and value in EXIT_REASONS:
        return str(value)
    raise _Invalid(f"expected one of {', '.join(sorted(EXIT_REASONS))}, got {_describe(value)}")


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise _Invalid(f"expected an object, got {_describe(value)}")
    return {str(k): restore_floats(v) for k, v in value.items()}


def _number_map(value: Any) -> dict[str, float]:
    if type(value) is not dict and not isinstance(value, Mapping):
        raise _Invalid(f"expected an object of name -> number, got {_describe(value)}")
    result: dict[str, float] = {}
    for key, item in value.items():
        if type(key) is not str and not isinstance(key, str):
            raise _Invalid(f"metric names must be strings, got {_describe(key)}")
        if type(item) is float:
            result[key] = item
            continue
        try:
            result[key] = _to_float(item)
        except _Invalid as exc:
            raise exc.below(f".{key}") from None
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
        _Field("loss", _number(optional=True)),
        _Field("step_time_s", _number()),
        _Field("data_wait_fraction", _number(low=0.0, high=1.0, optional=True)),
        _Field("metrics", _number_map),
    ),
    "system": (
        _Field("gpu_util", _number(low=0.0, high=100.0, optional=True)),
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
        _Field("fallback_from", _integer(minimum=0, optional=True)),
        _Field("restore_s", _number()),
    ),
    "preemption_notice": (
        _Field("source", _string, text=True),
        _Field("time_left_s", _number(optional=True)),
    ),
    "exit": (_Field("code", _integer()), _Field("reason", _exit_reason, text=True)),
    "heartbeat": (_Field("step", _integer(minimum=0, optional=True)),),
    "log": (_Field("level", _string, text=True), _Field("message", _string, text=True)),
    "dry_run": (_Field("report", _object),),
    "started": (_Field("pid", _integer(minimum=0)), _Field("host", _string, text=True)),
}
assert set(_SCHEMA) == EVENT_TYPES


@dataclass(frozen=True)
class _Payload:
    """One event type's fields, arranged for checking."""

    type: str
    #: (name, check) in schema order.
    fields: tuple[tuple[str, _Check], ...]
    declared: frozenset[str]
    #: "step, loss, …" for the "missing" message.
    names: str


_PAYLOADS: dict[str, _Payload] = {
    kind: _Payload(
        type=kind,
        fields=tuple((f.name, f.check) for f in fields),
        declared=frozenset(f.name for f in fields),
        names=", ".join(f.name for f in fields),
    )
    for kind, fields in _SCHEMA.items()
}


def restore_floats(value: Any) -> Any:
    """Turn the wire's "NaN"/"Infinity"/"-Infinity" strings back into floats, recursively."""
    kind = type(value)
    if kind is str:
        return _NONFINITE.get(value, value)
    if kind is float or kind is int or value is None:
        return value
    if kind is dict:
        return {k: restore_floats(v) for k, v in value.items()}
    if kind is list:
        return [restore_floats(v) for v in value]
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, Mapping):
        return {k: restore_floats(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [restore_floats(v) for v in value]
    return value


def json_safe(value: Any) -> Any:
    """The inverse of restore_floats, for json.dumps(allow_nan=False)."""
    kind = type(value)
    if kind is float:
        if value - value == 0.0:  # finite; inf - inf and nan - nan are nan
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if kind is str or kind is int or value is None:
        return value
    if kind is dict:
        return {k: json_safe(v) for k, v in value.items()}
    if kind is list:
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _event_type(value: Any) -> str:
    if isinstance(value, str) and value in EVENT_TYPES:
        return str(value)
    raise _Invalid(
        f"unknown event type {_describe(value)}; expected one of {', '.join(sorted(EVENT_TYPES))}"
    )


def _payload(type: Any) -> _Payload:
    spec = _PAYLOADS.get(type) if type.__class__ is str else None
    return spec if spec is not None else _PAYLOADS[_event_type(type)]


def _extra_fields(spec: _Payload, data: Mapping[Any, Any], result: dict[str, Any]) -> None:
    """Copy the fields the type does not declare into ``result``: they pass through."""
    for key, value in data.items():
        if not isinstance(key, str):
            raise _Invalid(f"field names must be strings, got {_describe(key)}")
        if key not in spec.declared:
            result[key] = restore_floats(value)


def _check_payload(spec: _Payload, data: Any) -> dict[str, Any]:
    if type(data) is not dict and not isinstance(data, Mapping):
        raise _Invalid(f"expected an object, got {_describe(data)}")
    result: dict[str, Any] = {}
    exact = len(data) == len(spec.fields)  # no extra fields, unless one is missing
    if not exact:
        _extra_fields(spec, data, result)
    for name, check in spec.fields:
        value = data.get(name, _MISSING)
        if value is _MISSING:
            if exact:  # a field name that is not a string is reported first, as before
                _extra_fields(spec, data, {})
            raise _Invalid(f"missing ({spec.type} events need {spec.names})", f".{name}")
        try:
            result[name] = check(value)
        except _Invalid as exc:
            if exact:
                _extra_fields(spec, data, {})
            raise exc.below(f".{name}") from None
    return result


def validate_payload(type: str, data: Any, *, where: str = "data") -> dict[str, Any]:
    """Check ``data`` against its type's fields; return a normalised copy.

    Numbers become ``int``/``float`` (numpy scalars included), the wire's non-finite
    strings become floats, and extra fields pass through. Raises WireError naming the
    field, so a bad event is refused where it is made, not by the control plane later.
    """
    try:
        spec = _payload(type)
    except _Invalid as exc:
        raise exc.at("type") from None
    try:
        return _check_payload(spec, data)
    except _Invalid as exc:
        raise exc.at(where) from None


def _unix_time(value: Any) -> float:
    result = _to_float(value)
    if not 0.0 <= result < _INF:  # NaN fails every comparison
        raise _Invalid(f"expected unix seconds, got {_describe(value)}")
    return result


def _checked(check: _Check, value: Any, path: str) -> Any:
    try:
        return check(value)
    except _Invalid as exc:
        raise exc.below(path) from None


def _event_to_wire(event: Event) -> dict[str, Any]:
    seq = _checked(_STEP, event.seq, ".seq")
    spec = _checked(_payload, event.type, ".type")
    data = _checked(partial(_check_payload, spec), event.data, ".data")
    return {
        "seq": seq,
        "type": spec.type,
        "time": _checked(_unix_time, event.time, ".time"),
        "data": json_safe(data),
    }


def event_to_wire(event: Event, *, where: str = "event") -> dict[str, Any]:
    """The JSON-safe form of one event inside a batch (attempt and run are per batch)."""
    try:
        return _event_to_wire(event)
    except _Invalid as exc:
        raise exc.at(where) from None


_EVENT_KEYS = ("seq", "type", "time", "data")
#: One checked event without its attempt and run: (seq, type, time, data).
_Fields = tuple[int, str, float, dict[str, Any]]


def _event_fields(obj: Any, attempt: str, run: str) -> _Fields:
    """One decoded event object, checked; _Invalid's path is relative to the event."""
    if type(obj) is not dict and not isinstance(obj, Mapping):
        raise _Invalid(f"expected an object, got {_describe(obj)}")
    try:
        seq, kind, time, data = obj["seq"], obj["type"], obj["time"], obj["data"]
    except KeyError:
        for key in _EVENT_KEYS:
            if key not in obj:
                raise _Invalid(
                    "missing (every event needs seq, type, time, data)", f".{key}"
                ) from None
        raise
    if len(obj) != len(_EVENT_KEYS):
        for key, expected in (("attempt", attempt), ("run", run)):
            if key in obj and obj[key] != expected:
                raise _Invalid(
                    f"{_describe(obj[key])} differs from the batch's {expected!r}; "
                    "send one batch per attempt",
                    f".{key}",
                )
    return _event_parts(seq, kind, time, data)


def _event_parts(seq: Any, kind: Any, time: Any, data: Any) -> _Fields:
    """The checks of one event's fields, in the order their errors are reported."""
    spec = _PAYLOADS.get(kind) if type(kind) is str else None
    if spec is None:
        spec = _checked(_payload, kind, ".type")
    if type(seq) is not int or seq < 0:
        seq = _checked(_STEP, seq, ".seq")
    if type(time) is not float or not 0.0 <= time < _INF:
        time = _checked(_unix_time, time, ".time")
    try:
        data = _check_payload(spec, data)
    except _Invalid as exc:
        raise exc.below(".data") from None
    return seq, spec.type, time, data


def event_from_wire(obj: Any, *, attempt: str, run: str, where: str = "event") -> Event:
    """Check one decoded event object and build the Event."""
    try:
        seq, kind, time, data = _event_fields(obj, attempt, run)
    except _Invalid as exc:
        raise exc.at(where) from None
    return Event(attempt, seq, kind, time, run, data)


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
        if event.attempt != attempt:
            raise WireError(
                f"events[{index}].attempt: {event.attempt!r} differs from events[0]'s "
                f"{attempt!r}; send one batch per attempt"
            )
        if event.run != run:
            raise WireError(
                f"events[{index}].run: {event.run!r} differs from events[0]'s {run!r}; "
                "send one batch per run"
            )
        try:
            wire_events.append(_event_to_wire(event))
        except _Invalid as exc:
            raise exc.at(f"events[{index}]") from None
    body = {"v": WIRE_VERSION, "attempt": attempt, "run": run, "events": wire_events}
    try:
        text = json.dumps(body, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise WireError(
            f"events: a payload is not JSON-able ({exc}); send only JSON types"
        ) from exc
    return text.encode("utf-8")


# --- decoding -------------------------------------------------------------------------------
#
# Decoding is the ingest API's hot path: every event of every runner passes here. The
# body is parsed by orjson, several times faster than the json module. An event as
# encode_batch writes it (the four keys, a plain metrics or system payload: exactly its
# fields, each already of the type it decodes to) is accepted by one test per field
# and keeps the parsed dict as its data; every other event goes through the general
# checks above, which build a normalised copy and name the first bad field.
#
# orjson and the json module disagree on a few inputs, and the json module's answers
# are the contract (decode_batch always used it). orjson refuses what standard JSON
# lacks but json.loads accepts (numbers beyond a double such as 1e999, lone surrogates
# in strings, a byte-order mark, UTF-16 and UTF-32 bodies), and turns integers beyond
# 64 bits into floats. So a body with a run of 19 digits or more (the only way to write
# such an integer; Python never writes a float with one) goes to the json module, and
# so does every body orjson refuses: the json module then accepts what it always
# accepted, or fails with the message it always gave.

#: Digits stay, everything else becomes a space: a long number is a run of "0"s after.
_DIGITS_ONLY = bytes(48 if 48 <= byte <= 57 else 32 for byte in range(256))
_LONG_NUMBER = b"0" * 19


def _reject_constant(name: str) -> Any:
    raise WireError(
        f"body: {name} is not standard JSON; send non-finite floats as the string {name!r}"
    )


def _parse(body: bytes) -> tuple[Any, bool]:
    """The parsed body, and whether orjson parsed it (then it holds no NaN or infinity,
    and every integer fits in 64 bits)."""
    if _LONG_NUMBER not in body.translate(_DIGITS_ONLY):
        try:
            return orjson.loads(body), True
        except orjson.JSONDecodeError:
            pass  # the json module says what is wrong, or accepts what it always has
    try:
        return json.loads(body, parse_constant=_reject_constant), False
    except ValueError as exc:
        raise WireError(f"body: not valid JSON ({exc}); send a batch from encode_batch") from exc


def _batch_head(obj: Any, max_events: int) -> tuple[str, str, list[Any]]:
    """attempt, run and the events list of a parsed body; WireError if any is wrong."""
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
    return attempt, run, events


def _plain_metrics(data: dict[str, Any]) -> bool:
    """A metrics payload with exactly its fields, each of the type it decodes to, so the
    general checks would return an equal dict."""
    if len(data) != 5:
        return False
    try:
        step, loss = data["step"], data["loss"]
        step_time, wait, metrics = data["step_time_s"], data["data_wait_fraction"], data["metrics"]
    except KeyError:
        return False
    if type(step) is not int or step < 0 or type(step_time) is not float:
        return False
    if (loss is not None and type(loss) is not float) or type(metrics) is not dict:
        return False
    if wait is not None and (type(wait) is not float or not 0.0 <= wait <= 1.0):
        return False
    for value in metrics.values():  # noqa: SIM110 (a loop is faster than all() here)
        if type(value) is not float:
            return False
    return True


def _plain_system(data: dict[str, Any]) -> bool:
    """:func:`_plain_metrics` for a system payload."""
    if len(data) != 5:
        return False
    try:
        gpu, count = data["gpu_util"], data["gpu_count"]
        used, total, path = data["disk_used"], data["disk_total"], data["disk_path"]
    except KeyError:
        return False
    return (
        (gpu is None or (type(gpu) is float and 0.0 <= gpu <= 100.0))
        and type(count) is int
        and count >= 0
        and type(used) is int
        and used >= 0
        and type(total) is int
        and total >= 0
        and type(path) is str
    )


_PLAIN: dict[str, Callable[[dict[str, Any]], bool]] = {
    "metrics": _plain_metrics,
    "system": _plain_system,
}


def _json_text(data: Any) -> str:
    """Standard JSON for any decoded data: the wire's strings for non-finite floats
    (json.loads makes inf of 1e999), integers of any size."""
    return json.dumps(json_safe(data), allow_nan=False, separators=(",", ":"))


@dataclass(frozen=True)
class Batch:
    """A decoded, checked batch, one list per field: what the ingest API stores.

    ``data[i]`` is event i's payload, normalised as in :class:`Event`; ``texts[i]`` the
    same payload as standard JSON text (non-finite floats as the wire's strings), which
    decodes to equal values: the normalised payload, or as the runner sent it when the
    general path decoded it (a number field sent as ``1`` then stays ``1``).

    The fast path leaves the texts to be made when asked for (``given_texts`` None):
    its payloads are plain JSON values, so orjson encodes them as they are, and a
    block of them (:meth:`json_array`) is encoded in one call.
    """

    attempt: str
    run: str
    seqs: list[int]
    types: list[str]
    times: list[float]
    data: list[dict[str, Any]]
    given_texts: list[str] | None

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def texts(self) -> list[str]:
        """Each event's payload as standard JSON text."""
        if self.given_texts is None:
            texts = list(map(bytes.decode, map(orjson.dumps, self.data)))
            object.__setattr__(self, "given_texts", texts)
            return texts
        return self.given_texts

    def json_array(self, positions: Sequence[int]) -> str:
        """The payloads at ``positions`` as one JSON array: their texts, joined."""
        if self.given_texts is None:
            return orjson.dumps([self.data[i] for i in positions]).decode()
        texts = self.given_texts
        return "[" + ",".join([texts[i] for i in positions]) + "]"

    def event(self, index: int) -> Event:
        """Event ``index`` as an :class:`Event`."""
        return Event(
            self.attempt,
            self.seqs[index],
            self.types[index],
            self.times[index],
            self.run,
            self.data[index],
        )

    def select(self, positions: Sequence[int]) -> Batch:
        """The events at ``positions``, in that order."""
        return Batch(
            self.attempt,
            self.run,
            [self.seqs[i] for i in positions],
            [self.types[i] for i in positions],
            [self.times[i] for i in positions],
            [self.data[i] for i in positions],
            None if self.given_texts is None else [self.given_texts[i] for i in positions],
        )

    def events(self) -> list[Event]:
        """Every event as an :class:`Event`, in batch order."""
        return list(
            map(
                Event,
                repeat(self.attempt),
                self.seqs,
                self.types,
                self.times,
                repeat(self.run),
                self.data,
            )
        )


# --- the typed fast path --------------------------------------------------------------------
#
# Most batches hold only the common event types, each payload exactly as encode_batch
# writes it. msgspec decodes such a body straight into typed structs, with every check
# the schema above makes (types, ranges, required fields, no extra field) done in C while
# parsing, which is several times faster than parsing into dicts and checking in Python.
# Whatever it refuses (another event type, an extra field, a "NaN" string, a number out of
# range, any malformed input) goes to the general path below, which accepts or refuses as
# decode_batch always has and names the first bad field. So the fast path only ever
# accepts what the general path accepts, with equal results: test_wire checks that.
# The structs live only while a batch is decoded and hold no cycles, so they stay out of
# the garbage collector (gc=False): a batch makes a thousand of them.

_I64 = 2**63 - 1
#: Integers the fast path takes: 64-bit, so that they encode anywhere; larger ones (and
#: the columns' range errors) are the general path's.
_Int = Annotated[int, msgspec.Meta(ge=-_I64 - 1, le=_I64)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=_I64)]
#: A JSON number as a float (ints become floats): what _number does.
_Unix = Annotated[float, msgspec.Meta(ge=0.0)]


class _MetricsData(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    step: _Count
    loss: float | None
    step_time_s: float
    data_wait_fraction: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None
    metrics: dict[str, float]


class _SystemData(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    gpu_util: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] | None
    gpu_count: _Count
    disk_used: _Count
    disk_total: _Count
    disk_path: str


class _CheckpointCommittedData(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    step: _Count
    bytes: _Count
    write_s: float
    uri: str


class _CheckpointFailedData(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    step: _Int
    error: str


class _RestoredData(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    step: _Count
    fallback_from: _Count | None
    restore_s: float


class _PreemptionNoticeData(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    source: str
    time_left_s: float | None


_ExitReason = Literal["succeeded", "preempted", "failed", "stopped"]
assert set(get_args(_ExitReason)) == EXIT_REASONS


class _ExitData(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    code: _Int
    reason: _ExitReason


class _HeartbeatData(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    step: _Count | None


class _LogData(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    level: str
    message: str


class _StartedData(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    pid: _Count
    host: str


# One event struct per type, tagged by "type". dry_run is left out: its report is any
# object, whose "NaN" strings become floats, which only the general path does.
def _event_struct(kind: str, data: type[msgspec.Struct]) -> type[msgspec.Struct]:
    return msgspec.defstruct(
        f"_{kind}_event",
        [("seq", _Count), ("time", _Unix), ("data", data)],
        tag_field="type",
        tag=kind,
        forbid_unknown_fields=True,
        gc=False,
        namespace={"kind": kind},
    )


_TYPED_DATA: dict[str, type[msgspec.Struct]] = {
    "metrics": _MetricsData,
    "system": _SystemData,
    "checkpoint_committed": _CheckpointCommittedData,
    "checkpoint_failed": _CheckpointFailedData,
    "restored": _RestoredData,
    "preemption_notice": _PreemptionNoticeData,
    "exit": _ExitData,
    "heartbeat": _HeartbeatData,
    "log": _LogData,
    "started": _StartedData,
}
assert set(_TYPED_DATA) == EVENT_TYPES - {"dry_run"}
_TYPED_EVENTS = tuple(_event_struct(kind, data) for kind, data in _TYPED_DATA.items())


class _TypedBatch(msgspec.Struct, gc=False):
    """A body; other top-level fields are ignored, as decode_batch ignores them."""

    v: Literal[1]
    attempt: Annotated[str, msgspec.Meta(min_length=1)]
    run: Annotated[str, msgspec.Meta(min_length=1)]
    events: list[Union[_TYPED_EVENTS]]  # type: ignore[valid-type]  # noqa: UP007


_TYPED_DECODER = msgspec.json.Decoder(_TypedBatch)
_SEQ = attrgetter("seq")
_KIND = attrgetter("kind")
_TIME_OF = attrgetter("time")
_DATA = attrgetter("data")


def _decode_typed(body: bytes, max_events: int) -> Batch | None:
    """The batch, when the fast path takes it; None sends it to the general path."""
    try:
        decoded = _TYPED_DECODER.decode(body)
    except msgspec.MsgspecError:
        return None
    events = decoded.events
    if not events or len(events) > max_events:
        return None  # the general path says what is wrong
    data = list(map(msgspec.structs.asdict, map(_DATA, events)))
    return Batch(
        decoded.attempt,
        decoded.run,
        list(map(_SEQ, events)),
        list(map(_KIND, events)),
        list(map(_TIME_OF, events)),
        data,
        None,  # made when asked for: see Batch
    )


def decode_batch_columns(body: bytes, *, max_events: int = 10_000) -> Batch:
    """Parse and check one batch into a :class:`Batch`; WireError names the first bad
    field and its index, as :func:`decode_batch` does."""
    typed = _decode_typed(body, max_events)
    return typed if typed is not None else _decode_general(body, max_events)


def _decode_general(body: bytes, max_events: int) -> Batch:
    """Any batch, the checks above field by field (see the comments of both paths)."""
    obj, exact = _parse(body)
    attempt, run, items = _batch_head(obj, max_events)
    seqs: list[int] = []
    types: list[str] = []
    times: list[float] = []
    datas: list[dict[str, Any]] = []
    texts: list[str] = []
    dumps = orjson.dumps
    # A body the json module parsed may hold infinities and huge integers: the general
    # path and _json_text handle those.
    plain = _PLAIN if exact else {}
    for item in items:
        if type(item) is dict and len(item) == 4:
            # A missing key gets None, which fails its test below.
            seq, kind, time, data = (
                item.get("seq"),
                item.get("type"),
                item.get("time"),
                item.get("data"),
            )
            if (
                type(seq) is int
                and seq >= 0
                and type(time) is float
                and 0.0 <= time < _INF
                and type(data) is dict
                and type(kind) is str
            ):
                check = plain.get(kind)
                if check is not None and check(data):
                    seqs.append(seq)
                    types.append(kind)
                    times.append(time)
                    datas.append(data)
                    texts.append(dumps(data).decode())
                    continue
        try:
            seq, kind, time, checked = _event_fields(item, attempt, run)
        except _Invalid as exc:
            raise exc.at(f"events[{len(seqs)}]") from None
        seqs.append(seq)
        types.append(kind)
        times.append(time)
        datas.append(checked)
        texts.append(_json_text(item["data"]))
    return Batch(attempt, run, seqs, types, times, datas, texts)


def decode_batch(body: bytes, *, max_events: int = 10_000) -> list[Event]:
    """Parse and check one batch; WireError names the first bad field and its index."""
    return decode_batch_columns(body, max_events=max_events).events()


def decode_batch_with_json(
    body: bytes, *, max_events: int = 10_000
) -> tuple[list[Event], list[str]]:
    """:func:`decode_batch`, plus each event's data as standard JSON text (see
    :attr:`Batch.texts`). Same checks and the same WireError as decode_batch."""
    batch = decode_batch_columns(body, max_events=max_events)
    return batch.events(), batch.texts
