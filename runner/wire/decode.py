"""Decoding batches: the ingest API's hot path.

A batch the schema takes as it is (the common case) is decoded in one pass into its
structs; any other goes through :mod:`runner.wire.checks`, which keeps extra payload
fields and names the first bad field.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter
from typing import Any

import msgspec
import orjson

from runner.errors import WireError
from runner.wire.checks import ENVELOPE, Invalid, describe, event_fields, expected
from runner.wire.schema import (
    EVENT_STRUCTS,
    FIELDS,
    WIRE_VERSION,
    AnyEvent,
    Body,
    Event,
    Info,
    json_safe,
    restore_declared,
)


def _text(data: Any) -> str:
    """Standard JSON of plain values without NaN (see json_safe): orjson, the fastest,
    unless an integer is beyond its 64 bits (an extra field may hold one)."""
    try:
        return orjson.dumps(data).decode()
    except orjson.JSONEncodeError:
        return msgspec.json.encode(data).decode()


@dataclass(frozen=True)
class Batch:
    """A decoded, checked batch, one list per field: what the ingest API stores.

    ``data[i]`` is event i's payload, normalised as in :class:`Event`; ``texts[i]`` the
    same payload as standard JSON text (non-finite floats as the wire's strings), which
    decodes to equal values. ``given_texts`` None: made from ``data`` when asked for.
    """

    attempt: str
    run: str
    seqs: list[int]
    types: list[str]
    times: list[float]
    data: list[dict[str, Any]]
    given_texts: list[str] | None
    #: The node of a multi-node attempt that sent it (:attr:`runner.wire.schema.Body.node`).
    node: int = 0

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def texts(self) -> list[str]:
        """Each event's payload as standard JSON text."""
        if self.given_texts is None:
            texts = list(map(_text, self.data))
            object.__setattr__(self, "given_texts", texts)
            return texts
        return self.given_texts

    def json_array(self, positions: Sequence[int]) -> str:
        """The payloads at ``positions`` as one JSON array: their texts, joined."""
        if self.given_texts is None:
            return _text([self.data[i] for i in positions])
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
            self.node,
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


_TYPED = msgspec.json.Decoder(Body[AnyEvent])  # type: ignore[valid-type]
_SEQ = attrgetter("seq")
_KIND = attrgetter("kind")
_TIME_OF = attrgetter("time")
_DATA = attrgetter("data")


def _nonfinite(body: bytes) -> bool:
    """Whether a float may travel as a string in ``body``. An uppercase N or I is looked
    for first (memchr, a hundred times faster than the strings' search): the common
    batch has neither, and restoring is only a wasted walk when one is in a string."""
    return (b"N" in body or b"I" in body) and (b'"NaN"' in body or b'Infinity"' in body)


_AT_BYTE = re.compile(r"\(byte (\d+)\)")
_AT_PATH = re.compile(r" - at `\$(.*)`$")


def _size(events: list[Any], max_events: int) -> None:
    if not events:
        raise WireError("events: the batch is empty; send at least one event")
    if len(events) > max_events:
        raise WireError(
            f"events: {len(events)} events in one batch, more than {max_events}; "
            "send smaller batches"
        )


def _decode_typed(body: bytes, max_events: int) -> Batch | None:
    """The batch, decoded in one pass into the schema's structs; None when the schema
    refuses it (an extra field, any error), for :func:`_decode_general` to say why."""
    try:
        decoded = _TYPED.decode(body)
    except msgspec.MsgspecError:
        return None
    events = decoded.events
    _size(events, max_events)
    types = list(map(_KIND, events))
    data = list(map(msgspec.structs.asdict, map(_DATA, events)))
    texts = None
    if _nonfinite(body):
        data = list(map(restore_declared, types, data))
        texts = [_text(json_safe(d)) for d in data]
    return Batch(
        decoded.attempt,
        decoded.run,
        list(map(_SEQ, events)),
        types,
        list(map(_TIME_OF, events)),
        data,
        texts,
        decoded.node,
    )


def _parse(body: bytes) -> Any:
    """The body as plain JSON values; WireError says what is wrong with it."""
    if body[:3] == b"\xef\xbb\xbf":  # a UTF-8 byte-order mark, as json.loads allows
        body = body[3:]
    try:
        return msgspec.json.decode(body)
    except msgspec.ValidationError:  # a number beyond a double, or a huge integer
        where = _where_number(body)
        raise WireError(
            f"body: not valid JSON for the wire: the number{where} is out of range; send "
            "non-finite floats as the strings 'NaN', 'Infinity', '-Infinity'"
        ) from None
    except msgspec.DecodeError as exc:
        found = _AT_BYTE.search(str(exc))
        if found:
            rest = body[int(found.group(1)) :]
            for name in ("NaN", "Infinity", "-Infinity"):
                if rest.startswith(name.encode()):
                    raise WireError(
                        f"body: {name} is not standard JSON; send non-finite floats as "
                        f"the string {name!r}"
                    ) from None
        raise WireError(f"body: not valid JSON ({exc}); send a batch from encode_batch") from None


_Envelope = msgspec.defstruct("_Envelope", [(name, Any) for name in ENVELOPE])


def _where_number(body: bytes) -> str:
    """Where the number is that a plain parse found out of range (" at events[3].time"),
    or "" when the body's layout does not say."""
    try:
        msgspec.json.decode(body, type=Body[_Envelope])  # type: ignore[valid-type]
    except msgspec.ValidationError as exc:
        found = _AT_PATH.search(str(exc))
        if found:
            return f" at {found.group(1).lstrip('.')}"
    except msgspec.DecodeError:
        pass
    return ""


_HEAD = {f.name: f.type for f in msgspec.structs.fields(Body[Any])}
_OPTIONAL = {f.name for f in msgspec.structs.fields(Body[Any]) if not f.required}
_REQUIRED = ", ".join(name for name in _HEAD if name not in _OPTIONAL)


def _head(obj: Any) -> tuple[str, str, list[Any], int]:
    """attempt, run, the events list and the node of a parsed body; WireError if any is
    wrong."""
    if not isinstance(obj, dict):
        raise WireError(f"body: expected a JSON object, got {type(obj).__name__}")
    if "v" not in obj:
        raise WireError(f"v: missing; this side speaks wire version {WIRE_VERSION}")
    version = obj["v"]
    if isinstance(version, bool) or version != WIRE_VERSION:
        raise WireError(
            f"v: unsupported wire version {describe(version)}; this side speaks "
            f"{WIRE_VERSION}: install matching runner and control plane versions"
        )
    for name, field_type in _HEAD.items():
        if name not in obj and name in _OPTIONAL:
            continue
        if name not in obj:
            raise WireError(f"{name}: missing (a batch needs {_REQUIRED})")
        if name != "v":
            try:
                msgspec.convert(obj[name], field_type)
            except msgspec.ValidationError:
                info = msgspec.inspect.type_info(field_type)
                raise WireError(f"{name}: {expected(info, obj[name])}") from None
    return obj["attempt"], obj["run"], obj["events"], obj.get("node", 0)


def _holds_float(info: Info) -> bool:
    if isinstance(info, msgspec.inspect.Metadata):
        return _holds_float(info.type)
    if isinstance(info, msgspec.inspect.UnionType):
        return any(map(_holds_float, info.types))
    return isinstance(info, msgspec.inspect.FloatType)


#: Per type, its fields that take a float, and whether in an object's values (metrics).
_FLOAT_FIELDS = {
    kind: tuple(
        (f.name, isinstance(f.info, msgspec.inspect.DictType))
        for f in fields
        if _holds_float(f.info)
        or (isinstance(f.info, msgspec.inspect.DictType) and _holds_float(f.info.value_type))
    )
    for kind, fields in FIELDS.items()
}


def _as_stored(kind: str, sent: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """The payload as sent ("NaN" strings, extra fields kept), with what checking it
    changed: the defaults of fields added later, and an integer in a float field as the
    float it became. 2**63 - 1 sent as a loss is stored as 2.0**63, which the text must
    decode to, as the fast path's text (encoded from the values) does."""
    stored = sent
    if len(data) > len(sent):
        stored = {**sent, **{k: json_safe(v) for k, v in data.items() if k not in sent}}
    for name, in_map in _FLOAT_FIELDS[kind]:
        value = sent.get(name)
        if type(value) is int or (
            in_map and type(value) is dict and int in map(type, value.values())
        ):
            if stored is sent:
                stored = dict(sent)
            stored[name] = json_safe(data[name])
    return stored


def _decode_general(body: bytes, max_events: int) -> Batch:
    """Any batch: parsed into plain values, then each event checked against the schema,
    field by field where it does not convert at once; extra payload fields pass through,
    and a WireError names the first bad field and its index."""
    attempt, run, items, node = _head(_parse(body))
    _size(items, max_events)
    seqs: list[int] = []
    types: list[str] = []
    times: list[float] = []
    datas: list[dict[str, Any]] = []
    texts: list[str] = []
    for index, item in enumerate(items):
        kind = item.get("type") if type(item) is dict else None
        struct = EVENT_STRUCTS.get(kind) if type(kind) is str else None
        event: Any = None
        try:
            event = msgspec.convert(item, struct) if struct is not None else None
        except msgspec.ValidationError:
            event = None
        if event is not None:
            kind = item["type"]
            seq, time = event.seq, event.time
            data = restore_declared(kind, msgspec.structs.asdict(event.data))
        else:
            try:
                seq, kind, time, data = event_fields(item, attempt, run)
            except Invalid as exc:
                raise exc.at(f"events[{index}]") from None
        seqs.append(seq)
        types.append(kind)
        times.append(time)
        datas.append(data)
        texts.append(_text(_as_stored(kind, item["data"], data)))
    return Batch(attempt, run, seqs, types, times, datas, texts, node)


def decode_batch_columns(body: bytes, *, max_events: int = 10_000) -> Batch:
    """Parse and check one batch into a :class:`Batch`; WireError names the first bad
    field and its index."""
    typed = _decode_typed(body, max_events)
    return typed if typed is not None else _decode_general(body, max_events)


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
