"""Checking events field by field against the schema, with messages that name the field.

The runner checks each event where it is made (:func:`validate_payload`) and when it
encodes a batch; the control plane uses the same checks to say what is wrong with a
batch the schema refused in one pass, and for batches with extra payload fields.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, get_args

import msgspec

from runner.errors import WireError
from runner.wire.schema import (
    EVENT_TYPES,
    FIELD_NAMES,
    FIELDS,
    NONFINITE,
    PAYLOADS,
    WIRE_VERSION,
    Count,
    Event,
    Field,
    Info,
    UnixTime,
    floats_in,
    json_safe,
    restore_declared,
    restore_floats,
)

#: An event's seq and time, as the event structs declare them.
_SEQ = Field("seq", Count, msgspec.inspect.type_info(Count), None)
_TIME = Field("time", UnixTime, msgspec.inspect.type_info(UnixTime), None)


class Invalid(Exception):
    """A complaint without its location; ``path`` is where below the checked value
    (".data.step"). The caller that knows the location turns it into a WireError."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.path = path

    def below(self, step: str) -> Invalid:
        return Invalid(self.message, step + self.path)

    def at(self, where: str) -> WireError:
        return WireError(f"{where}{self.path}: {self.message}")


def describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def expected(info: Info, value: Any) -> str:
    """What a field of type ``info`` takes, said about ``value``, which it refused."""
    got = describe(value)
    if isinstance(info, msgspec.inspect.Metadata):
        about = (info.extra_json_schema or {}).get("description")
        number = NONFINITE.get(value, value) if isinstance(value, str) else value
        if about and isinstance(number, numbers.Real) and not isinstance(number, bool):
            return f"expected {about}, got {got}"
        info = info.type
    options = [t for t in getattr(info, "types", (info,)) if t != msgspec.inspect.NoneType()]
    first = options[0]
    if isinstance(first, msgspec.inspect.IntType) and len(options) == 1:
        if isinstance(value, int) and not isinstance(value, bool):
            if first.le is not None and value > first.le:
                return f"{value} is above {first.le}"
            if first.ge is not None and value < first.ge:
                return f"expected an integer >= {first.ge}, got {value}"
        return f"expected an integer, got {got}"
    if isinstance(first, msgspec.inspect.FloatType):
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            try:
                float(value)
            except OverflowError:
                return f"expected a number in a float's range, got {got}"
            if first.ge is not None or first.le is not None:
                return f"expected a number in [{first.ge}, {first.le}], got {float(value)}"
        return f"expected a number, got {got}"
    if isinstance(first, msgspec.inspect.LiteralType):
        return f"expected one of {', '.join(sorted(map(str, first.values)))}, got {got}"
    if isinstance(first, msgspec.inspect.StrType):
        if (
            isinstance(value, str)
            and first.max_length is not None
            and len(value) > first.max_length
        ):
            return f"expected at most {first.max_length} characters, got {len(value)}"
        return f"expected a {'non-empty ' if first.min_length else ''}string, got {got}"
    if isinstance(first, msgspec.inspect.DictType):
        if floats_in(first.value_type):
            return f"expected an object of name -> number, got {got}"
        return f"expected an object, got {got}"
    if isinstance(first, msgspec.inspect.ListType):
        return f"expected a list, got {type(value).__name__}"
    return f"expected an object, got {got}"


def _plain(value: Any) -> Any:
    """A number of another kind (numpy scalars, Fraction) as an int or a float, so the
    schema's types take it, also as an object's values; everything else as it is."""
    kind = type(value)
    if kind is int or kind is float or kind is str or value is None or kind is bool:
        return value
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:
            raise Invalid(f"expected a number in a float's range, got {describe(value)}") from None
    return value


def _convert(value: Any, field: Field) -> Any:
    """``value`` as the field's type; Invalid names the first thing wrong with it."""
    try:
        return msgspec.convert(_plain(value), field.type)
    except msgspec.ValidationError:
        pass
    if field.floats == "map" and isinstance(value, Mapping):
        value_type = get_args(field.type)[1]
        value_info = msgspec.inspect.type_info(value_type)
        for key, item in value.items():
            if not isinstance(key, str):
                raise Invalid(f"metric names must be strings, got {describe(key)}")
            try:
                msgspec.convert(_plain(item), value_type)
            except msgspec.ValidationError:
                raise Invalid(expected(value_info, item), f".{key}") from None
    raise Invalid(expected(field.info, value))


def _check_payload(kind: str, data: Any) -> dict[str, Any]:
    """A payload checked field by field in schema order, normalised; extras pass through."""
    if not isinstance(data, Mapping):
        raise Invalid(f"expected an object, got {describe(data)}")
    fields = FIELDS[kind]
    result: dict[str, Any] = {}
    for field in fields:
        if field.name not in data:
            if not field.required:
                result[field.name] = field.default
                continue
            names = ", ".join(f.name for f in fields if f.required)
            raise Invalid(f"missing ({kind} events need {names})", f".{field.name}")
        try:
            result[field.name] = _convert(data[field.name], field)
        except Invalid as exc:
            raise exc.below(f".{field.name}") from None
    declared = FIELD_NAMES[kind]
    for key, value in data.items():
        if key not in declared:
            if not isinstance(key, str):
                raise Invalid(f"field names must be strings, got {describe(key)}")
            result[key] = restore_floats(value)
    return restore_declared(kind, result)


def _event_type(value: Any) -> str:
    if isinstance(value, str) and value in PAYLOADS:
        return str(value)
    raise Invalid(
        f"unknown event type {describe(value)}; expected one of {', '.join(sorted(EVENT_TYPES))}"
    )


def _envelope(value: Any, field: Field) -> Any:
    """An event's seq or time, checked."""
    try:
        return _convert(value, field)
    except Invalid as exc:
        raise exc.below(f".{field.name}") from None


def validate_payload(type: str, data: Any, *, where: str = "data") -> dict[str, Any]:
    """Check ``data`` against its type's fields; return a normalised copy.

    Numbers become ``int``/``float`` (numpy scalars included), the wire's non-finite
    strings become floats, and extra fields pass through. Raises WireError naming the
    field, so a bad event is refused where it is made, not by the control plane later.
    """
    try:
        kind = _event_type(type)
    except Invalid as exc:
        raise exc.at("type") from None
    try:
        return _check_payload(kind, data)
    except Invalid as exc:
        raise exc.at(where) from None


ENVELOPE = ("seq", "type", "time", "data")


def event_fields(obj: Any, attempt: str, run: str) -> tuple[int, str, float, dict[str, Any]]:
    """One decoded event object, checked in the order its errors are reported (type,
    seq, time, data); Invalid's path is relative to the event."""
    if not isinstance(obj, Mapping):
        raise Invalid(f"expected an object, got {describe(obj)}")
    for key in ENVELOPE:
        if key not in obj:
            raise Invalid("missing (every event needs seq, type, time, data)", f".{key}")
    if len(obj) != len(ENVELOPE):
        for key, expected in (("attempt", attempt), ("run", run)):
            if key in obj and obj[key] != expected:
                raise Invalid(
                    f"{describe(obj[key])} differs from the batch's {expected!r}; "
                    "send one batch per attempt",
                    f".{key}",
                )
    try:
        kind = _event_type(obj["type"])
    except Invalid as exc:
        raise exc.below(".type") from None
    seq = _envelope(obj["seq"], _SEQ)
    time = _envelope(obj["time"], _TIME)
    try:
        data = _check_payload(kind, obj["data"])
    except Invalid as exc:
        raise exc.below(".data") from None
    return seq, kind, time, data


def event_from_wire(obj: Any, *, attempt: str, run: str, where: str = "event") -> Event:
    """Check one decoded event object and build the Event."""
    try:
        seq, kind, time, data = event_fields(obj, attempt, run)
    except Invalid as exc:
        raise exc.at(where) from None
    return Event(attempt, seq, kind, time, run, data)


def _event_to_wire(event: Event) -> dict[str, Any]:
    try:
        kind = _event_type(event.type)
    except Invalid as exc:
        raise exc.below(".type") from None
    seq = _envelope(event.seq, _SEQ)
    time = _envelope(event.time, _TIME)
    try:
        data = _check_payload(kind, event.data)
    except Invalid as exc:
        raise exc.below(".data") from None
    return {"seq": seq, "type": kind, "time": time, "data": json_safe(data)}


def event_to_wire(event: Event, *, where: str = "event") -> dict[str, Any]:
    """The JSON-safe form of one event inside a batch (attempt and run are per batch)."""
    try:
        return _event_to_wire(event)
    except Invalid as exc:
        raise exc.at(where) from None


def _identifier(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise WireError(f"{where}: expected a non-empty string, got {describe(value)}")
    return value


def encode_batch(events: Sequence[Event], *, node: int = 0) -> bytes:
    """The body of one POST to the ingest API. All events must share attempt and run;
    ``node``: the node of a multi-node attempt that sends them."""
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
        except Invalid as exc:
            raise exc.at(f"events[{index}]") from None
    body: dict[str, Any] = {"v": WIRE_VERSION, "attempt": attempt, "run": run}
    body["events"] = wire_events
    if node:
        body["node"] = node
    try:
        text = json.dumps(body, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise WireError(
            f"events: a payload is not JSON-able ({exc}); send only JSON types"
        ) from exc
    return text.encode("utf-8")
