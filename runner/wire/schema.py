"""The wire's one schema: each event type's payload as a msgspec struct, and the batch.

The structs are the format: fields, types and ranges; extra payload fields pass through
(see :mod:`runner.wire.checks`). A field added later has a default, so a batch from an
older runner, which lacks it, is still read (the field takes its default). Floats travel
as JSON numbers or, when not finite, as the strings ``"NaN"``, ``"Infinity"``,
``"-Infinity"``; integers are 64-bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Literal, TypeVar, Union, get_args

import msgspec

WIRE_VERSION = 1

_I64_MAX = 2**63 - 1
#: 9999-12-31 23:59:59 UTC, the last second a datetime holds: the control plane stores
#: event times as timestamps.
MAX_UNIX_TIME = 253_402_300_799.0
#: How non-finite floats travel; standard JSON has no literal for them.
NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

#: A float: a JSON number, or the string a non-finite float travels as (decoded to it).
Float = Union[float, Literal["NaN", "Infinity", "-Infinity"]]  # noqa: UP007
#: Integers are 64-bit, as the control plane's columns are.
Int = Annotated[int, msgspec.Meta(ge=-_I64_MAX - 1, le=_I64_MAX)]
Count = Annotated[int, msgspec.Meta(ge=0, le=_I64_MAX)]
UnixTime = Annotated[float, msgspec.Meta(ge=0.0, lt=MAX_UNIX_TIME, description="unix seconds")]
#: ``setup_failed``: the spec's setup (or fetching its code) failed before the command ran;
#: the first line of its ``log_tail`` says which command, and how.
#: ``secret_unavailable``: a secret of the spec could not be read on the instance (the
#: ``log_tail`` names it and the store's answer, never a value); the command never ran.
#: ``image_unavailable``: the spec's container image cannot run on the instance (no
#: runtime, an image it cannot pull, no usable Python); the ``log_tail`` says what to do.
ExitReason = Literal[
    "succeeded",
    "preempted",
    "failed",
    "stopped",
    "setup_failed",
    "secret_unavailable",
    "image_unavailable",
]


class Payload(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """An event's ``data``. Decoded structs live only while a batch is decoded and hold
    no cycles, so they stay out of the garbage collector (a batch makes a thousand)."""


class MetricsData(Payload):
    step: Count
    loss: Float | None
    step_time_s: Float
    #: Time blocked on the next batch divided by step time.
    data_wait_fraction: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None
    #: User metrics: name -> number.
    metrics: dict[str, Float]


class SystemData(Payload):
    #: None: no GPU.
    gpu_util: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] | None
    gpu_count: Count
    #: Bytes of the scratch volume ``disk_path``.
    disk_used: Count
    disk_total: Count
    disk_path: str
    #: The node of a multi-node attempt it was sampled on (0: the first, or the only one).
    node: Count = 0
    #: From a node after the first: the mean data-wait fraction its first rank reported
    #: since the last sample (that node's own metrics are not sent); None: none reported.
    data_wait_fraction: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None


class CheckpointCommittedData(Payload):
    step: Count
    bytes: Count
    write_s: Float
    uri: str
    #: Seconds the training loop was blocked by the save (snapshotting the state; the
    #: write runs beside the next steps). None: not measured (an older runner, or a
    #: script that writes its own checkpoint files).
    stall_s: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    #: The periodic interval in effect from this save on, when it is ``"auto"`` and
    #: follows the save cost the session measures (seconds); None otherwise.
    interval_s: Annotated[float, msgspec.Meta(gt=0.0)] | None = None


class CheckpointFailedData(Payload):
    #: -1 when the failure is not tied to a step.
    step: Int
    error: str


class RestoredData(Payload):
    #: 0: a fresh start.
    step: Count
    #: The step whose checkpoint was corrupt.
    fallback_from: Count | None
    restore_s: Float


class PreemptionNoticeData(Payload):
    #: ``sigterm``, ``aws``, ``gcp`` …
    source: str
    time_left_s: Float | None


class ExitData(Payload):
    #: Negative: killed by that signal.
    code: Int
    reason: ExitReason
    #: A preempted exit after a notice: what its flushes did (the session's
    #: :meth:`~runner.session.notice.NoticeWindow.report`): ``notice_step``, ``window_s``
    #: (seconds to the deadline when the loop saw it), ``used_s``, ``flushes`` (each
    #: ``step``, ``started_s`` after the notice, ``landed``, ``write_s``),
    #: ``committed_step``, ``trained_on_steps``, ``given_up_steps`` (trained and not
    #: committed) and ``summary`` (one sentence for the run's thread); ``restore_given_up``
    #: when the notice came while the attempt still restored and it ended at once (nothing
    #: trained, nothing lost), ``late`` when the session's exit guard sent it because the
    #: training script had not handed control back by the deadline. None: no notice seen
    #: (an older runner, a kill without one).
    flush: dict[str, Any] | None = None

    #: The command's last lines of output (at most a few kilobytes), for the run's
    #: thread; the whole output is in the run's store (:mod:`runner.logship`). None: not
    #: captured (an older runner, a success).
    log_tail: str | None = None


class HeartbeatData(Payload):
    #: None: not training yet.
    step: Count | None


class LogData(Payload):
    level: str
    message: str


class DryRunData(Payload):
    #: The preflight dry-run figures; the non-finite strings anywhere in it are floats.
    report: dict[str, Any]


class StartedData(Payload):
    pid: Count
    host: str


#: Bounds of a script's alert (``session.alert``; the session clips to them) and of a
#: stacks dump (the supervisor clips it): they are shown in a chat message.
ALERT_TITLE_MAX = 200
ALERT_TEXT_MAX = 4000
STACKS_TEXT_MAX = 12_000
#: How loudly a script's alert asks (the control plane's severities).
AlertSeverity = Literal["info", "warning", "critical"]


class AlertData(Payload):
    """An alert the training script raised itself (``session.alert``, as ``wandb.alert``)."""

    #: One line; a repeat of the same title updates one alert instead of posting again.
    title: Annotated[str, msgspec.Meta(min_length=1, max_length=ALERT_TITLE_MAX)]
    text: Annotated[str, msgspec.Meta(max_length=ALERT_TEXT_MAX)]
    severity: AlertSeverity
    #: The step the script was at; None: before training.
    step: Count | None = None


class StacksData(Payload):
    """The training processes' Python stacks, dumped when the step stood still
    (:mod:`runner.stacks`)."""

    #: The step that stopped moving; None: before any.
    step: Count | None
    #: Seconds it had stood still.
    stalled_s: Annotated[float, msgspec.Meta(ge=0.0)]
    #: Processes that answered with their stacks.
    processes: Count
    #: Their stacks, one section per process (clipped in the middle).
    text: Annotated[str, msgspec.Meta(max_length=STACKS_TEXT_MAX)]


#: Each event type's payload.
PAYLOADS: dict[str, type[Payload]] = {
    "metrics": MetricsData,
    "system": SystemData,
    "checkpoint_committed": CheckpointCommittedData,
    "checkpoint_failed": CheckpointFailedData,
    "restored": RestoredData,
    "preemption_notice": PreemptionNoticeData,
    "exit": ExitData,
    "heartbeat": HeartbeatData,
    "log": LogData,
    "dry_run": DryRunData,
    "started": StartedData,
    "alert": AlertData,
    "stacks": StacksData,
}
EVENT_TYPES = frozenset(PAYLOADS)
EXIT_REASONS = frozenset(get_args(ExitReason))


def _event_struct(kind: str, payload: type[Payload]) -> type[msgspec.Struct]:
    """One event of a type, tagged by ``type``."""
    return msgspec.defstruct(
        f"{payload.__name__.removesuffix('Data')}Event",
        [("seq", Count), ("time", UnixTime), ("data", payload)],
        tag_field="type",
        tag=kind,
        forbid_unknown_fields=True,
        gc=False,
        namespace={"kind": kind},
    )


EVENT_STRUCTS = {kind: _event_struct(kind, payload) for kind, payload in PAYLOADS.items()}
AnyEvent = Union[tuple(EVENT_STRUCTS.values())]  # type: ignore[valid-type]  # noqa: UP007
_E = TypeVar("_E")


class Body(msgspec.Struct, Generic[_E], gc=False):
    """A batch; other top-level fields are ignored."""

    v: Literal[1]
    attempt: Annotated[str, msgspec.Meta(min_length=1)]
    run: Annotated[str, msgspec.Meta(min_length=1)]
    events: list[_E]
    #: The node of a multi-node attempt that sent it (0 for a one-node attempt, and from
    #: a runner older than multi-node runs). Its events' seqs start at node × NODE_SEQ_SPAN.
    node: Annotated[int, msgspec.Meta(ge=0, le=1023)] = 0


#: Each node of a gang numbers its events from node × NODE_SEQ_SPAN: the nodes share their
#: attempt (and its token), and the ingest API keeps one event per (attempt, seq).
NODE_SEQ_SPAN = 2**40


# --- what the schema says, for the error messages and the non-finite strings ---------------

Info = msgspec.inspect.Type


def floats_in(info: Info) -> bool:
    """Whether a field of this type may hold the non-finite strings."""
    if isinstance(info, msgspec.inspect.UnionType):
        return any(floats_in(t) for t in info.types)
    return isinstance(info, msgspec.inspect.LiteralType) and "NaN" in info.values


@dataclass(frozen=True)
class Field:
    """One payload field, as the checks and the decoders need it."""

    name: str
    #: The annotated type, for msgspec.convert.
    type: Any
    info: Info
    #: "float": non-finite strings decode to floats; "map": in its values; "any": anywhere.
    floats: str | None
    #: Whether a payload must carry it; one added later is optional and has a default.
    required: bool = True
    default: Any = None


def _payload_fields(payload: type[Payload]) -> tuple[Field, ...]:
    result = []
    for field in msgspec.structs.fields(payload):
        info = msgspec.inspect.type_info(field.type)
        floats = None
        if floats_in(info):
            floats = "float"
        elif isinstance(info, msgspec.inspect.DictType):
            floats = "map" if floats_in(info.value_type) else "any"
        default = None if field.required else field.default
        result.append(Field(field.name, field.type, info, floats, field.required, default))
    return tuple(result)


FIELDS = {kind: _payload_fields(payload) for kind, payload in PAYLOADS.items()}
FIELD_NAMES = {kind: frozenset(f.name for f in fields) for kind, fields in FIELDS.items()}
#: Per type, the fields where non-finite strings become floats: (name, floats).
_RESTORE = {
    kind: tuple((f.name, f.floats) for f in fields if f.floats) for kind, fields in FIELDS.items()
}


def restore_declared(kind: str, data: dict[str, Any]) -> dict[str, Any]:
    """The non-finite strings of a payload's float fields, and anywhere in a free-form
    field, as floats (in place). Declared strings stay strings."""
    for name, floats in _RESTORE[kind]:
        value = data[name]
        if floats == "float":
            if value.__class__ is str:
                data[name] = NONFINITE[value]
        elif floats == "map":
            if str in map(type, value.values()):
                data[name] = {
                    k: NONFINITE.get(v, v) if v.__class__ is str else v for k, v in value.items()
                }
        else:
            data[name] = restore_floats(value)
    return data


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
    #: JSON-able payload; its fields per type are PAYLOADS.
    data: dict[str, Any]


def restore_floats(value: Any) -> Any:
    """Turn the wire's "NaN"/"Infinity"/"-Infinity" strings back into floats, recursively."""
    kind = type(value)
    if kind is str:
        return NONFINITE.get(value, value)
    if kind is float or kind is int or value is None:
        return value
    if isinstance(value, str):
        return NONFINITE.get(value, value)
    return _map_items(value, restore_floats)


def json_safe(value: Any) -> Any:
    """The inverse of restore_floats, for json.dumps(allow_nan=False)."""
    kind = type(value)
    if kind is float:
        if value - value == 0.0:  # finite; inf - inf and nan - nan are nan
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if kind is str or kind is int or value is None:
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return _map_items(value, json_safe)


def _map_items(value: Any, convert: Callable[[Any], Any]) -> Any:
    """A dict (any Mapping) or list (or tuple) with ``convert`` applied to each item, as a
    dict or list; any other value as it is. Plain dicts and lists are checked first: fast."""
    kind = type(value)
    if kind is dict:
        return {k: convert(v) for k, v in value.items()}
    if kind is list:
        return [convert(v) for v in value]
    if isinstance(value, Mapping):
        return {k: convert(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [convert(v) for v in value]
    return value
