"""The runner events API: authenticate a batch, store it once, apply it, evaluate the alerts.

A runner (:class:`runner.telemetry.Reporter`) posts batches of up to 500 events encoded by
:mod:`runner.wire`, with its attempt's token as ``Authorization: Bearer …``. One batch is
one database transaction:

- the attempt row is read (and on PostgreSQL locked ``FOR UPDATE``) by id, and its
  ``token_hash`` compared with the caller's: a token revoked a moment ago (the attempt
  ended, ``token_hash`` is NULL) is refused even when the short-lived lookup cache still
  knew it, so revocation takes effect at once;
- the new ``metrics`` events (nearly all of them) go into one ``metric_blocks`` row for
  the batch (:class:`jobs.models.MetricBlock`: their seqs, times and payloads as JSON
  arrays; :mod:`jobs.metrics` reads them back), and every other event into a row of
  ``events`` with ``INSERT … ON CONFLICT (attempt_id, seq) DO NOTHING``: a few multi-row
  statements on SQLite, one ``INSERT … SELECT FROM unnest(…)`` on PostgreSQL (see
  :meth:`IngestService._insert`). ``(attempt, seq)`` is the event's identity, so a
  retried batch stores nothing twice and is acknowledged with ``duplicates = n``. Which
  events are new is known *before* inserting: ``attempts.last_seq`` is the highest
  stored seq, so a batch above it needs no look-up, and only a batch that reaches back
  under it costs two indexed range queries (rows, and blocks whose seq range meets the
  batch's). The attempt lock makes that exact; ``ON CONFLICT`` stays as the rows'
  backstop. The batch is decoded into columns
  (:func:`runner.wire.decode_batch_columns`), with each event's ``data`` as JSON text
  ready for its column, so no object is made per stored event;
- the new events' side effects (heartbeat, steps, checkpoints, ``started`` → ``RUNNING``,
  the preemption notice, the restored step) are applied in the same transaction, so the
  facts derived from events never disagree with the events stored.

After the commit, lifecycle events go to ``on_attempt_event`` (the service layer ends the
attempt on ``exit`` and resubmits) and the run's alert rules are evaluated once over an
in-memory window of recent observations; signals go to ``on_signals`` within the same
request, so a NaN loss is an alert before the runner's POST returns. Callback failures are
logged and never reach the runner: its events are stored, and a 5xx would only make it
send them again.

Malformed input never raises out of :meth:`IngestService.handle` and never changes state:
every check that can refuse a batch runs before the transaction starts.

Spend is not known here: :class:`~jobs.rules.RunContext` gets ``spent_usd=0.0``, so the
budget rule stays quiet on this path and the spend job, which knows the money, drives it.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import statistics
import threading
import time as _time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from itertools import chain
from operator import itemgetter
from typing import Any

import orjson
from sqlalchemy import (
    Connection,
    Engine,
    and_,
    bindparam,
    case,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlmodel import Session

from jobs.errors import IllegalTransition
from jobs.lifecycle import AttemptState, transition
from jobs.metrics import run_metrics
from jobs.models import Attempt, Checkpoint, MetricBlock, Run, hash_token, table_of, utcnow
from jobs.models import Event as EventRow
from jobs.rules import (
    AlertConfig,
    Obs,
    Rule,
    RunContext,
    Signal,
    TypedWindow,
    default_rules,
    evaluate_all,
)
from jobs.spec import AlertThresholds
from runner.errors import WireError
from runner.wire import Batch, Event, decode_batch_columns, json_safe, restore_floats

__all__ = [
    "LIFECYCLE_EVENTS",
    "WINDOW_MAX_OBS",
    "WINDOW_SPAN_S",
    "IngestResult",
    "IngestService",
]

log = logging.getLogger(__name__)

#: Event types the service layer reacts to; passed to ``on_attempt_event`` once each.
LIFECYCLE_EVENTS = frozenset(
    {"started", "checkpoint_committed", "preemption_notice", "exit", "restored", "dry_run"}
)
#: Event types the alert rules look at.
WINDOW_EVENTS = frozenset(
    {"metrics", "system", "preemption_notice", "exit", "checkpoint_committed"}
)
#: The rules' window per run (see :class:`_Series`): the last hour; per event type, the
#: newest RECENT_OBS observations in full and older ones thinned to one per BUCKET_S,
#: so at most 5 × (200 + 240) = 2,200 observations in all.
WINDOW_SPAN_S = 3600.0
RECENT_OBS = 200
BUCKET_S = 15.0
WINDOW_MAX_OBS = len(WINDOW_EVENTS) * (RECENT_OBS + int(WINDOW_SPAN_S // BUCKET_S))
#: After a restart a window is rebuilt from the newest this-many events of each type
#: (within the hour) in the events table.
REBUILD_OBS = 1000
#: Runs whose window is kept in memory; the least recently reporting one is dropped first
#: (and rebuilt from the events table if it reports again).
MAX_WINDOWS = 256
#: How long a token → attempt look-up is trusted before the database is asked again.
#: Revocation does not wait for it: the transaction re-checks the hash on the locked row.
TOKEN_CACHE_S = 1.0
_TOKEN_CACHE_MAX = 4096

# The widest integer the tables hold: seq, steps and bytes are 64-bit (migration 0003).
_INT8_MAX = 2**63 - 1
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_NAIVE_EPOCH = datetime(1970, 1, 1)
#: 9999-12-31 23:59:59 UTC, the last second a datetime holds.
_MAX_UNIX_TIME = 253_402_300_799.0
#: The events insert's columns, in the order of the row tuples.
_EVENT_COLUMNS = ("attempt_id", "run_id", "seq", "type", "time", "data", "received_at")
#: The PostgreSQL events insert: the batch's columns as arrays (see IngestService._insert).
_PG_INSERT_EVENTS = (
    "INSERT INTO events (attempt_id, run_id, seq, type, time, data, received_at) "
    "SELECT %(attempt_id)s, %(run_id)s, u.seq, u.type, u.time::timestamptz, u.data::json, "
    "%(received_at)s::timestamptz "
    "FROM unnest(%(seqs)s::bigint[], %(types)s::text[], %(times)s::text[], %(texts)s::text[]) "
    "AS u(seq, type, time, data) "
    "ON CONFLICT (attempt_id, seq) DO NOTHING"
)
#: SQLite: rows per multi-row events INSERT, largest first. Powers of two, so a batch of
#: any size takes a few statements of only eight kinds (each prepared once, then cached
#: by the driver), and 128 rows stay under the 999 parameters of old SQLite.
_SQLITE_CHUNKS = (128, 64, 32, 16, 8, 4, 2, 1)


def _sqlite_insert_sql(rows: int) -> str:
    """``INSERT … VALUES`` of ``rows`` rows. The attempt, the run and the arrival time are
    the same for every row: parameters 1 to 3, bound once; each row then takes four
    (seq, type, time, data)."""
    values = ", ".join(
        f"(?1, ?2, ?{4 + 4 * i}, ?{5 + 4 * i}, ?{6 + 4 * i}, ?{7 + 4 * i}, ?3)" for i in range(rows)
    )
    return (
        f"INSERT INTO events ({', '.join(_EVENT_COLUMNS)}) VALUES {values} "
        "ON CONFLICT (attempt_id, seq) DO NOTHING"
    )


_SQLITE_INSERT_EVENTS = {rows: _sqlite_insert_sql(rows) for rows in _SQLITE_CHUNKS}
#: The columns of a metrics block (see jobs.models.MetricBlock), in parameter order.
_BLOCK_COLUMNS = (
    "attempt_id",
    "run_id",
    "first_seq",
    "last_seq",
    "count",
    "first_time",
    "last_time",
    "seqs",
    "times",
    "data",
    "received_at",
)
_SQLITE_INSERT_BLOCK = (
    f"INSERT INTO metric_blocks ({', '.join(_BLOCK_COLUMNS)}) "
    f"VALUES ({', '.join('?' * len(_BLOCK_COLUMNS))})"
)
_PG_INSERT_BLOCK = (
    f"INSERT INTO metric_blocks ({', '.join(_BLOCK_COLUMNS)}) VALUES ("
    "%(attempt_id)s, %(run_id)s, %(first_seq)s, %(last_seq)s, %(count)s, "
    "%(first_time)s::timestamptz, %(last_time)s::timestamptz, %(seqs)s::json, "
    "%(times)s::json, %(data)s::json, %(received_at)s::timestamptz)"
)
_STEP_EVENTS = frozenset({"metrics", "heartbeat", "checkpoint_committed", "restored"})


_ATTEMPTS = table_of(Attempt)
_RUNS = table_of(Run)
_EVENTS = table_of(EventRow)
_BLOCKS = table_of(MetricBlock)
_CHECKPOINTS = table_of(Checkpoint)

SignalSink = Callable[[str, list[Signal], datetime], None]
AttemptEventSink = Callable[[str, str, dict[str, Any]], None]
#: One observation before it becomes an Obs: (unix time, event data).
_Point = tuple[float, Mapping[str, Any]]


@dataclass(frozen=True)
class IngestResult:
    """What the HTTP layer sends back: a status and a JSON body."""

    #: 200 stored (or already stored); 400 malformed; 401 unknown or revoked token;
    #: 403 token of another attempt; 413 too large; 503 database unavailable; 500 a bug.
    status: int
    #: ``{"accepted": n, "duplicates": m}`` or ``{"error": "..."}``.
    body: dict[str, Any]


def _error(status: int, message: str) -> IngestResult:
    return IngestResult(status, {"error": message})


def _unavailable(exc: SQLAlchemyError) -> IngestResult:
    # The driver's message names the table or the connection problem, never parameters.
    reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    log.warning("ingest: the database failed, batch not stored: %s", reason[0] if reason else exc)
    return _error(503, "the database is unavailable; the batch was not stored: retry later")


@dataclass(frozen=True)
class _Principal:
    """Who a token belongs to."""

    token_hash: str
    attempt_id: str
    run_id: str


@dataclass
class _Applied:
    """What one committed batch changed, for the callbacks and the rules."""

    accepted: int
    duplicates: int
    run_id: str
    attempt_number: int
    #: New events of LIFECYCLE_EVENTS types, in seq order.
    lifecycle: list[Event] = field(default_factory=list)
    #: New observations for the rules, per event type: (time, data), in seq order.
    observations: dict[str, list[_Point]] = field(default_factory=dict)
    last_step: int | None = None
    last_committed_step: int | None = None
    budget_usd: float | None = None
    preemption_times: tuple[float, ...] = ()
    max_time: float = 0.0


class _Series:
    """One event type's observations: every recent one, then a thinned hour behind them.

    Runners report metrics many times a second, and the rules re-read the whole window
    on every batch, so a window of every event would cost the rules time per event that
    grows with the window, and a flood of metrics would push the few system samples
    (the GPU-utilisation rule needs five minutes of them) out of a shared bound. So each
    type keeps its newest ``RECENT_OBS`` observations in full (spikes and trends need
    consecutive points), and older ones thinned to one per ``BUCKET_S`` seconds
    (baselines, means and time coverage survive thinning). A non-finite loss always
    wins its bucket, so a NaN is never thinned away.

    Points arrive as ``(time, data)``; an :class:`Obs` is made only for the points the
    window keeps, since a batch of 500 metrics keeps 200 in full and thins the rest.
    """

    __slots__ = ("history", "kind", "last_bucket", "recent")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.recent: deque[Obs] = deque()
        self.history: deque[Obs] = deque()
        self.last_bucket = -1.0

    def extend(self, points: Sequence[_Point]) -> None:
        """Add points, oldest first; those pushed out of the recent part are thinned."""
        recent = self.recent
        overflow = len(recent) + len(points) - RECENT_OBS
        if overflow > 0:
            from_recent = min(overflow, len(recent))
            if from_recent == len(recent):  # a big batch pushes all of them out
                leaving = list(recent)
                recent.clear()
            else:
                leaving = [recent.popleft() for _ in range(from_recent)]
            self._retire(leaving, made=True)
            retired = overflow - from_recent
            if retired > 0:
                self._retire(points[:retired], made=False)
                points = points[retired:]
        kind = self.kind
        recent.extend([Obs(time, kind, data) for time, data in points])

    def _retire(self, items: Sequence[Obs] | Sequence[_Point], *, made: bool) -> None:
        """Move observations (``made``) or points, oldest first, into the thinned
        history: one per bucket, the first of each unless a later one has a non-finite
        loss and the first has not. This runs for nearly every event, so it makes an Obs
        only for a point it keeps, and keeps an observation as it is.
        """
        # An Obs is (time, type, data) and a point (time, data): time first, data last.
        history = self.history
        last_bucket = self.last_bucket
        isfinite = math.isfinite
        kind = self.kind
        for item in items:
            time, data = item[0], item[-1]
            bucket = time // BUCKET_S
            if history and bucket == last_bucket:
                loss = data.get("loss")
                if (
                    isinstance(loss, float)
                    and not isfinite(loss)
                    and not _non_finite_loss(history[-1].data)
                ):
                    history[-1] = item if made else Obs(time, kind, data)  # type: ignore[assignment]
                continue
            history.append(item if made else Obs(time, kind, data))  # type: ignore[arg-type]
            last_bucket = bucket
        self.last_bucket = last_bucket

    def trim(self, horizon: float) -> None:
        for part in (self.history, self.recent):
            while part and part[0].time < horizon:
                part.popleft()

    def __len__(self) -> int:
        return len(self.history) + len(self.recent)


def _non_finite_loss(data: Mapping[str, Any]) -> bool:
    loss = data.get("loss")
    return isinstance(loss, float) and not math.isfinite(loss)


class _Window:
    """One run's rules and recent observations, per event type; used under its lock."""

    def __init__(self, rules: Sequence[Rule], *, thresholds: tuple[float, ...], hard_cap: bool):
        self.lock = threading.Lock()
        self.rules = list(rules)
        self.thresholds = thresholds
        self.hard_cap = hard_cap
        self.series: dict[str, _Series] = {kind: _Series(kind) for kind in sorted(WINDOW_EVENTS)}
        self.newest = 0.0

    def extend(self, observations: Mapping[str, Sequence[_Point]]) -> None:
        """Add each type's new points (oldest first), then drop what is over an hour old."""
        series = self.series
        added = False
        for kind, points in observations.items():
            if points:
                series[kind].extend(points)
                self.newest = max(self.newest, max(map(itemgetter(0), points)))
                added = True
        if added:
            horizon = self.newest - WINDOW_SPAN_S
            for part in series.values():
                part.trim(horizon)

    def observations(self) -> TypedWindow:
        """What the rules see: every series, already grouped by type."""
        return TypedWindow.from_groups(
            {kind: chain(part.history, part.recent) for kind, part in self.series.items()}
        )


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _event_datetime(seconds: float) -> datetime:
    return _EPOCH + timedelta(seconds=seconds)


def _time_texts(times: Sequence[float], *, suffix: str = "") -> list[str]:
    """Unix seconds as the text the events table is given for its DATETIME column.

    Each equals ``(epoch + timedelta(seconds=t)).isoformat(" ", "microseconds")``, the
    microseconds rounded half-even as timedelta rounds them, which is the text
    SQLAlchemy's SQLite DATETIME writes (naive UTC); ``suffix="+00:00"`` makes it a
    timestamptz literal for PostgreSQL. Building and formatting a datetime per event
    cost a third of SQLite's insert of the row; the events of a batch share a few
    seconds, so the date and time of day are formatted once per second and only the
    microseconds per event.
    """
    prefixes: dict[int, str] = {}
    texts: list[str] = []
    append = texts.append
    for seconds in times:
        whole = int(seconds)
        micro = round((seconds - whole) * 1e6)
        if micro == 1_000_000:
            whole += 1
            micro = 0
        prefix = prefixes.get(whole)
        if prefix is None:
            moment = _NAIVE_EPOCH + timedelta(seconds=whole)
            prefix = prefixes[whole] = moment.isoformat(" ") + "."
        append(f"{prefix}{micro:06d}{suffix}")
    return texts


#: Event types with integers that land in 64-bit columns (steps, checkpoint bytes).
_INT_COLUMN_FIELDS = {
    "metrics": ("step",),
    "heartbeat": ("step",),
    "restored": ("step",),
    "checkpoint_committed": ("step", "bytes"),
}


@dataclass
class _Kinds:
    """Where each kind of event is in a batch's columns."""

    #: Positions of the metrics events: nearly all of them.
    metrics: list[int]
    #: Positions of every other event.
    others: list[int]

    @classmethod
    def of(cls, types: Sequence[str]) -> _Kinds:
        metrics = [i for i, kind in enumerate(types) if kind == "metrics"]
        if len(metrics) == len(types):
            return cls(metrics, [])
        return cls(metrics, [i for i, kind in enumerate(types) if kind != "metrics"])


def _check_ranges(batch: Batch, kinds: _Kinds) -> str | None:
    """What the wire allows but the tables cannot hold; checked before anything is written.

    A quick pass over whole columns; only a batch that fails it is walked event by
    event, to name the first offender as the message always has.
    """
    data = batch.data
    if (
        max(batch.seqs) <= _INT8_MAX
        and max(batch.times) < _MAX_UNIX_TIME
        and (not kinds.metrics or max([data[i]["step"] for i in kinds.metrics]) <= _INT8_MAX)
        and all(_fits(batch.types[i], data[i]) for i in kinds.others)
    ):
        return None
    for index in range(len(batch)):
        seq, time, kind = batch.seqs[index], batch.times[index], batch.types[index]
        if seq > _INT8_MAX:
            return f"events[{index}].seq: {seq} is above {_INT8_MAX}"
        if not time < _MAX_UNIX_TIME:
            return f"events[{index}].time: {time} is not a plausible unix time"
        for name in _INT_COLUMN_FIELDS.get(kind, ()):
            value = data[index].get(name)
            if isinstance(value, int) and value > _INT8_MAX:
                return f"events[{index}].data.{name}: {value} is above {_INT8_MAX}"
    return None


def _fits(kind: str, data: Mapping[str, Any]) -> bool:
    """Whether the integers of an event that land in 64-bit columns fit there."""
    for name in _INT_COLUMN_FIELDS.get(kind, ()):
        value = data.get(name)
        if isinstance(value, int) and value > _INT8_MAX:
            return False
    return True


def _sqlite_insert_events(connection: Connection, shared: list[Any], values: list[Any]) -> None:
    """Insert events in as few multi-row INSERTs as the chunks allow (see
    :func:`_sqlite_insert_sql`): ``shared`` holds attempt, run and arrival time, and
    ``values`` seq, type, time and data of every row, row after row (on the driver's
    cursor: see :func:`_sqlite_cursor`).
    """
    width = 4
    left = len(values) // width
    start = 0
    with _sqlite_cursor(connection) as execute:
        for rows in _SQLITE_CHUNKS:
            statement = _SQLITE_INSERT_EVENTS[rows]
            while left >= rows:
                end = start + rows * width
                execute(statement, shared + values[start:end])
                start, left = end, left - rows


@contextmanager
def _sqlite_cursor(connection: Connection) -> Iterator[Callable[[str, Sequence[Any]], None]]:
    """Execute statements on the driver's cursor of the transaction's connection, its
    errors raised as SQLAlchemy's, as every other statement's are."""
    cursor = connection.connection.cursor()

    def execute(statement: str, params: Sequence[Any]) -> None:
        try:
            cursor.execute(statement, params)
        except sqlite3.Error as exc:
            raise DBAPIError.instance(statement, None, exc, sqlite3.Error) from exc

    try:
        yield execute
    finally:
        cursor.close()


def _last_metrics_at(
    types: Sequence[str], data: Sequence[Mapping[str, Any]], step: int
) -> Mapping[str, Any] | None:
    """The data of the last metrics event at ``step``: a checkpoint's metrics by default."""
    for index in range(len(types) - 1, -1, -1):
        if types[index] == "metrics" and data[index]["step"] == step:
            return data[index]
    return None


def _spec_facts(run: Run) -> tuple[AlertConfig, tuple[float, ...], bool]:
    """Alert thresholds, budget thresholds and hard cap from the run's stored spec.

    A spec that does not parse (an old row, a hand-made test run) falls back to the
    defaults with a warning: a run must never go unwatched because of its spec.
    """
    spec: Mapping[str, Any] = run.spec if isinstance(run.spec, Mapping) else {}
    try:
        alerts = AlertThresholds.model_validate(spec.get("alerts") or {})
        cfg = AlertConfig(**alerts.model_dump())
    except (ValueError, TypeError) as exc:
        log.warning("run %s: alert thresholds unusable (%s); using the defaults", run.id, exc)
        cfg = AlertConfig()
    budget = spec.get("budget")
    if not isinstance(budget, Mapping):
        budget = {}
    raw = budget.get("thresholds", [50, 80, 100])
    thresholds = tuple(
        float(t)
        for t in (raw if isinstance(raw, list) else [])
        if isinstance(t, int | float) and not isinstance(t, bool)
    )
    return cfg, thresholds, bool(budget.get("hard_cap", True))


class IngestService:
    """The runner events API, independent of HTTP: ``handle(authorization, body)``.

    Thread-safe; one instance serves every request thread of the process.
    ``rules_for(run)`` picks a run's alert rules (default: :func:`jobs.rules.default_rules`
    with the thresholds of the run's spec); it is called when the run's window is built,
    the first batch after start or after :meth:`forget_run`.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        rules_for: Callable[[Run], Sequence[Rule]] | None = None,
        on_signals: SignalSink | None = None,
        on_attempt_event: AttemptEventSink | None = None,
        now: Callable[[], datetime] = utcnow,
        max_body_bytes: int = 8 << 20,
    ) -> None:
        self._engine = engine
        self._rules_for = rules_for
        self._on_signals = on_signals
        self._on_attempt_event = on_attempt_event
        self._now = now
        self.max_body_bytes = max_body_bytes
        self._postgres = engine.dialect.name == "postgresql"
        self._tokens: OrderedDict[str, tuple[_Principal, float]] = OrderedDict()
        self._tokens_lock = threading.Lock()
        self._windows: OrderedDict[str, _Window] = OrderedDict()
        self._windows_lock = threading.Lock()
        self._build_statements()

    # --- the request ----------------------------------------------------------------

    def handle(self, authorization: str | None, body: bytes) -> IngestResult:
        """Authenticate, decode, store and apply one batch; never raises."""
        try:
            return self._handle(authorization, body)
        except Exception:  # a bug must not take the server down; the runner retries
            log.exception("ingest failed unexpectedly; the batch was not stored")
            return _error(500, "internal error while storing the batch; it will be retried")

    def forget_run(self, run_id: str) -> None:
        """Drop a run's window and rules (it ended, or its spec changed); rebuilt on demand."""
        with self._windows_lock:
            self._windows.pop(run_id, None)

    def _handle(self, authorization: str | None, body: bytes) -> IngestResult:
        if len(body) > self.max_body_bytes:
            return _error(
                413,
                f"batch of {len(body)} bytes is over the {self.max_body_bytes}-byte limit; "
                "send fewer events per batch",
            )
        token = _bearer(authorization)
        if token is None:
            return _error(401, "missing 'Authorization: Bearer <runner token>' header")
        try:
            principal = self._principal(hash_token(token))
        except SQLAlchemyError as exc:
            return _unavailable(exc)
        if principal is None:
            return _error(401, _REVOKED)
        try:
            batch = decode_batch_columns(body)
        except WireError as exc:
            return _error(400, str(exc))
        if batch.attempt != principal.attempt_id or batch.run != principal.run_id:
            return _error(
                403,
                f"this token belongs to attempt {principal.attempt_id} of run "
                f"{principal.run_id}, but the batch is for attempt {batch.attempt} of run "
                f"{batch.run}: a token is scoped to its attempt",
            )
        kinds = _Kinds.of(batch.types)
        problem = _check_ranges(batch, kinds)
        if problem is not None:
            return _error(400, problem)
        now = self._now()
        try:
            applied = self._store(principal, batch, kinds, now=now)
        except SQLAlchemyError as exc:
            return _unavailable(exc)
        if applied is None:
            self._drop_token(principal.token_hash)
            return _error(401, _REVOKED)
        if applied.accepted:
            self._after_commit(principal.attempt_id, applied, now=now)
        return IngestResult(200, {"accepted": applied.accepted, "duplicates": applied.duplicates})

    # --- tokens ---------------------------------------------------------------------

    def runner_of(self, authorization: str | None) -> tuple[str, str] | None:
        """``(run id, attempt id)`` of the live attempt whose token is the bearer, else None.

        Asks the database, not the look-up cache, so a token revoked a moment ago gets
        nothing (callers that hand out something, unlike a batch, cannot re-check later).
        Raises SQLAlchemyError when the database is unavailable.
        """
        token = _bearer(authorization)
        if token is None:
            return None
        principal = self._principal(hash_token(token), cached=False)
        return None if principal is None else (principal.run_id, principal.attempt_id)

    def _principal(self, token_hash: str, *, cached: bool = True) -> _Principal | None:
        clock = _time.monotonic()
        with self._tokens_lock:
            hit = self._tokens.get(token_hash)
            if cached and hit is not None and hit[1] > clock:
                return hit[0]
        attempts = _ATTEMPTS.c
        with self._engine.connect() as connection:
            row = connection.execute(
                select(attempts.id, attempts.run_id).where(attempts.token_hash == token_hash)
            ).first()
        if row is None:
            return None
        principal = _Principal(token_hash, row.id, row.run_id)
        with self._tokens_lock:
            self._tokens[token_hash] = (principal, clock + TOKEN_CACHE_S)
            self._tokens.move_to_end(token_hash)
            while len(self._tokens) > _TOKEN_CACHE_MAX:
                self._tokens.popitem(last=False)
        return principal

    def _drop_token(self, token_hash: str) -> None:
        with self._tokens_lock:
            self._tokens.pop(token_hash, None)

    # --- the transaction ------------------------------------------------------------

    def _build_statements(self) -> None:
        """Build the statements once; SQLAlchemy's cache then compiles each once."""
        attempts = _ATTEMPTS.c
        runs = _RUNS.c
        events = _EVENTS.c
        read_attempt = select(
            attempts.token_hash,
            attempts.number,
            attempts.state,
            attempts.last_step,
            attempts.last_seq,
            attempts.started_at,
            attempts.preemption_notice_at,
        ).where(attempts.id == bindparam("attempt_id"))
        self._read_attempt = read_attempt.with_for_update() if self._postgres else read_attempt
        self._read_run = select(runs.last_step, runs.last_committed_step, runs.budget_usd).where(
            runs.id == bindparam("run_id")
        )
        self._existing_seqs = select(events.seq).where(
            and_(
                events.attempt_id == bindparam("attempt_id"),
                events.seq.between(bindparam("low"), bindparam("high")),
            )
        )
        blocks = _BLOCKS.c
        self._existing_block_seqs = select(blocks.seqs).where(
            and_(
                blocks.attempt_id == bindparam("attempt_id"),
                blocks.first_seq <= bindparam("high"),
                blocks.last_seq >= bindparam("low"),
            )
        )
        self._preemptions = select(attempts.ended_at).where(
            attempts.run_id == bindparam("run_id"),
            # Not in_(): an expanding IN is re-rendered on every execution.
            or_(attempts.state == AttemptState.PREEMPTED, attempts.state == AttemptState.LOST),
            attempts.ended_at.is_not(None),
        )

        def keep(name: str, col: Any) -> Any:
            """SET col = COALESCE(:name, col): a NULL parameter leaves the column as it is."""
            return func.coalesce(bindparam(name, type_=col.type), col)

        # One statement for every batch, so SQLAlchemy compiles it once; building the
        # UPDATE from the changed columns cost a compilation-cache look-up of a new
        # statement per batch, five times the price of executing it.
        self._update_attempt = (
            update(_ATTEMPTS)
            .where(attempts.id == bindparam("attempt_id"))
            .values(
                last_heartbeat=bindparam("p_now", type_=attempts.last_heartbeat.type),
                last_seq=bindparam("p_last_seq", type_=attempts.last_seq.type),
                last_step=keep("p_last_step", attempts.last_step),
                step_time_s=keep("p_step_time_s", attempts.step_time_s),
                resumed_from_step=keep("p_resumed_from_step", attempts.resumed_from_step),
                started_at=keep("p_started_at", attempts.started_at),
                preemption_notice_at=keep("p_notice_at", attempts.preemption_notice_at),
                state=keep("p_state", attempts.state),
            )
        )
        # Untyped: the rows arrive already in the database's form (JSON text, and times
        # as the text of SQLite's DATETIME or a timestamptz literal; see _time_texts),
        # which keeps the per-row Python to the minimum; this is the hot path.
        dialect_insert = postgresql.insert if self._postgres else sqlite.insert
        ckpt_insert = dialect_insert(_CHECKPOINTS)
        self._upsert_checkpoint = ckpt_insert.on_conflict_do_update(
            index_elements=["run_id", "step"],
            set_={
                "attempt_id": ckpt_insert.excluded.attempt_id,
                "uri": ckpt_insert.excluded.uri,
                "bytes": ckpt_insert.excluded.bytes,
                "committed_at": ckpt_insert.excluded.committed_at,
                "metrics": ckpt_insert.excluded.metrics,
                "deleted_at": None,
            },
        )

        # Both run columns in one statement; a NULL parameter leaves its column as it is,
        # and neither ever moves back.
        def forward(name: str, col: Any) -> Any:
            value = bindparam(name, type_=col.type)
            return case(
                (value.is_(None), col),
                (col.is_(None), value),
                (col < value, value),
                else_=col,
            )

        self._update_run = (
            update(_RUNS)
            .where(runs.id == bindparam("run_id"))
            .values(
                last_step=forward("p_step", runs.last_step),
                last_committed_step=forward("p_committed", runs.last_committed_step),
            )
        )
        # What the rules need of the run comes back from the same statement where the
        # database can (PostgreSQL; SQLite 3.35 and newer): one statement less a batch.
        self._update_returns = bool(self._engine.dialect.update_returning)
        if self._update_returns:
            self._update_run = self._update_run.returning(
                runs.last_step, runs.last_committed_step, runs.budget_usd
            )

    def _insert(
        self,
        connection: Connection,
        principal: _Principal,
        new: Batch,
        kinds: _Kinds,
        now: datetime,
    ) -> None:
        """Store the new events: the metrics as one block, the others as rows."""
        suffix = "+00:00" if self._postgres else ""
        received = _time_texts([now.timestamp()], suffix=suffix)[0]
        if kinds.others:
            others = new.select(kinds.others) if kinds.metrics else new
            self._insert_rows(connection, principal, others, received, suffix)
        if kinds.metrics:
            self._insert_block(connection, principal, new, kinds.metrics, received, suffix)

    def _insert_block(
        self,
        connection: Connection,
        principal: _Principal,
        new: Batch,
        positions: list[int],
        received: str,
        suffix: str,
    ) -> None:
        """The batch's metrics as one :class:`~jobs.models.MetricBlock` row, in seq order.

        The payloads go in as the wire's JSON texts joined into an array, and the seqs
        and times as arrays encoded once: nothing is formatted per event. A seq already
        stored never reaches here (see :meth:`_new_events`), so the block's first seq is
        new and the insert has no conflict to resolve.
        """
        seqs = [new.seqs[i] for i in positions]
        if seqs != sorted(seqs):  # the runner sends in seq order
            positions = sorted(positions, key=new.seqs.__getitem__)
            seqs = [new.seqs[i] for i in positions]
        times = [new.times[i] for i in positions]
        first_time, last_time = _time_texts([min(times), max(times)], suffix=suffix)
        values = (
            principal.attempt_id,
            principal.run_id,
            seqs[0],
            seqs[-1],
            len(seqs),
            first_time,
            last_time,
            orjson.dumps(seqs).decode(),
            orjson.dumps(times).decode(),
            new.json_array(positions),
            received,
        )
        if self._postgres:
            params = dict(zip(_BLOCK_COLUMNS, values, strict=True))
            connection.exec_driver_sql(_PG_INSERT_BLOCK, params)
            return
        with _sqlite_cursor(connection) as execute:
            execute(_SQLITE_INSERT_BLOCK, values)

    def _insert_rows(
        self,
        connection: Connection,
        principal: _Principal,
        new: Batch,
        received: str,
        suffix: str,
    ) -> None:
        """Insert events as rows in a few statements, whatever the batch's size.

        The times go in as the database's text (see :func:`_time_texts`) and the data as
        the wire's JSON text, so the driver converts nothing. On PostgreSQL the columns go
        as four arrays into one ``INSERT … SELECT FROM unnest(…)``: one statement and one
        round trip for the whole batch. On SQLite a multi-row ``INSERT … VALUES`` of up to
        128 rows goes straight to the driver's cursor: an ``executemany`` pays the
        driver's and SQLite's per-statement work for every row, which cost as much as
        SQLite's insert itself. SQLite's foreign-key checks stay on: switching them off
        for the transaction would save two look-ups a row, but SQLite then prepares
        these statements again for every batch, which costs four times as much.
        """
        times = _time_texts(new.times, suffix=suffix)
        if self._postgres:
            connection.exec_driver_sql(
                _PG_INSERT_EVENTS,
                {
                    "attempt_id": principal.attempt_id,
                    "run_id": principal.run_id,
                    "received_at": received,
                    "seqs": new.seqs,
                    "types": new.types,
                    "times": times,
                    "texts": new.texts,
                },
            )
            return
        values = list(chain.from_iterable(zip(new.seqs, new.types, times, new.texts, strict=True)))
        _sqlite_insert_events(
            connection, [principal.attempt_id, principal.run_id, received], values
        )

    def _store(
        self, principal: _Principal, batch: Batch, kinds: _Kinds, *, now: datetime
    ) -> _Applied | None:
        """One transaction; ``None`` when the token was revoked meanwhile.

        Each event's ``data`` column gets the JSON text the wire decoded it from
        (:attr:`runner.wire.Batch.texts`), not an encoding of the normalised dict.
        """
        attempt_id = principal.attempt_id
        with self._engine.begin() as connection:
            attempt = connection.execute(self._read_attempt, {"attempt_id": attempt_id}).first()
            if attempt is None or attempt.token_hash != principal.token_hash:
                return None
            new = self._new_events(connection, attempt.last_seq, attempt_id, batch)
            applied = _Applied(
                accepted=len(new),
                duplicates=len(batch) - len(new),
                run_id=principal.run_id,
                attempt_number=attempt.number,
            )
            if not new:
                return applied
            # The hot path: whole columns, no object per event (see _insert).
            types, times = new.types, new.times
            if new is not batch:  # some were stored already
                kinds = _Kinds.of(types)
            data = new.data
            metrics = [data[i] for i in kinds.metrics]
            steps = [d["step"] for d in metrics]
            step_times = [s for s in (d["step_time_s"] for d in metrics) if s == s]  # not NaN
            applied.observations["metrics"] = list(
                zip([times[i] for i in kinds.metrics], metrics, strict=True)
            )
            system: list[_Point] = []
            for index in kinds.others:  # a few per batch
                if types[index] == "system":
                    system.append((times[index], data[index]))
                else:
                    self._rare(new.event(index), attempt.number, steps, applied)
            applied.observations["system"] = system
            applied.max_time = max(times)
            self._insert(connection, principal, new, kinds, now)
            self._apply(
                connection,
                attempt,
                new,
                steps=steps,
                step_times=step_times,
                applied=applied,
                now=now,
            )
        return applied

    @staticmethod
    def _rare(event: Event, attempt_number: int, steps: list[int], applied: _Applied) -> None:
        """Everything but metrics and system: a few per batch at most."""
        kind, data = event.type, event.data
        if kind in _STEP_EVENTS:
            step = _as_int(data.get("step"))
            if step is not None:
                steps.append(step)
        if kind in WINDOW_EVENTS:
            applied.observations.setdefault(kind, []).append(
                (event.time, {**data, "attempt": attempt_number})
            )
        if kind in LIFECYCLE_EVENTS:
            applied.lifecycle.append(event)

    def _new_events(
        self, connection: Connection, last_seq: int | None, attempt_id: str, batch: Batch
    ) -> Batch:
        """The events not stored yet (the first of each seq): usually the whole batch."""
        seqs = batch.seqs
        low = min(seqs)
        existing: set[int] = set()
        if last_seq is not None and low <= last_seq:
            bounds = {"attempt_id": attempt_id, "low": low, "high": max(seqs)}
            existing = set(connection.execute(self._existing_seqs, bounds).scalars())
            for stored in connection.execute(self._existing_block_seqs, bounds).scalars():
                existing.update(stored)
        if not existing and len(set(seqs)) == len(seqs):
            return batch
        keep: list[int] = []
        for index, seq in enumerate(seqs):
            if seq not in existing:
                existing.add(seq)
                keep.append(index)
        return batch.select(keep)

    def _apply(
        self,
        connection: Connection,
        attempt: Any,
        new: Batch,
        *,
        steps: list[int],
        step_times: list[float],
        applied: _Applied,
        now: datetime,
    ) -> None:
        """The side effects of the new events, inside the batch's transaction."""
        run_id, attempt_id = applied.run_id, new.attempt
        top_seq = max(new.seqs)
        top_step = max(steps) if steps else None
        # The attempt row is locked (FOR UPDATE / BEGIN IMMEDIATE): what was read is current.
        # None leaves a column as it is (see _update_attempt).
        values: dict[str, Any] = {
            "attempt_id": attempt_id,
            "p_now": now,
            "p_last_seq": top_seq if attempt.last_seq is None else max(attempt.last_seq, top_seq),
            "p_last_step": top_step
            if top_step is not None and (attempt.last_step is None or top_step > attempt.last_step)
            else None,
            "p_step_time_s": statistics.median(step_times) if step_times else None,
            "p_resumed_from_step": None,
            "p_started_at": None,
            "p_notice_at": None,
            "p_state": None,
        }
        state = attempt.state
        committed: list[Event] = []
        for event in applied.lifecycle:
            kind, data = event.type, event.data
            if kind == "started":
                state = self._started(state, attempt_id)
                if attempt.started_at is None and values["p_started_at"] is None:
                    values["p_started_at"] = _event_datetime(event.time)
            elif kind == "restored":
                values["p_resumed_from_step"] = data["step"]
            elif kind == "preemption_notice" and attempt.preemption_notice_at is None:
                if values["p_notice_at"] is None:
                    values["p_notice_at"] = _event_datetime(event.time)
            elif kind == "checkpoint_committed":
                committed.append(event)
        if state != attempt.state:
            values["p_state"] = state
        connection.execute(self._update_attempt, values)
        for event in committed:
            data = event.data
            step = data["step"]
            metrics = data.get("metrics")
            if not isinstance(metrics, Mapping):
                at_step = _last_metrics_at(new.types, new.data, step)
                metrics = {}
                if at_step is not None:
                    metrics = dict(at_step.get("metrics") or {})
                    if at_step.get("loss") is not None:
                        metrics["loss"] = at_step["loss"]
            connection.execute(
                self._upsert_checkpoint,
                {
                    "run_id": run_id,
                    "attempt_id": attempt_id,
                    "step": step,
                    "uri": data["uri"],
                    "bytes": data["bytes"],
                    "committed_at": _event_datetime(event.time),
                    "metrics": json_safe(dict(metrics)),
                    "deleted_at": None,
                },
            )
        top_committed = max(e.data["step"] for e in committed) if committed else None
        run = None
        if top_step is not None or top_committed is not None:
            updated = connection.execute(
                self._update_run,
                {"run_id": run_id, "p_step": top_step, "p_committed": top_committed},
            )
            if self._update_returns:
                run = updated.first()
        if run is None:
            run = connection.execute(self._read_run, {"run_id": run_id}).first()
        if run is not None:
            applied.last_step = run.last_step
            applied.last_committed_step = run.last_committed_step
            applied.budget_usd = run.budget_usd
        applied.preemption_times = tuple(
            t.timestamp()
            for t in connection.execute(self._preemptions, {"run_id": run_id}).scalars()
        )

    @staticmethod
    def _started(state: AttemptState, attempt_id: str) -> AttemptState:
        """``started`` moves a booting attempt to RUNNING; any other state stays as it is."""
        try:
            if state is AttemptState.REQUESTED:
                state = transition(state, AttemptState.PROVISIONING, subject_id=attempt_id)
            if state is AttemptState.PROVISIONING:
                state = transition(state, AttemptState.RUNNING, subject_id=attempt_id)
        except IllegalTransition as exc:  # cannot happen from the states above; be safe
            log.warning("ignored 'started' of attempt %s: %s", attempt_id, exc)
        if state.is_terminal():
            log.info("attempt %s reported 'started' after it ended (%s)", attempt_id, state)
        return state

    # --- after the commit -------------------------------------------------------------

    def _after_commit(self, attempt_id: str, applied: _Applied, *, now: datetime) -> None:
        if self._on_attempt_event is not None:
            for event in applied.lifecycle:
                try:
                    self._on_attempt_event(attempt_id, event.type, event.data)
                except Exception:
                    log.exception("on_attempt_event(%s, %s) failed", attempt_id, event.type)
        try:
            self._evaluate(applied, now=now)
        except Exception:
            log.exception("alert rules of run %s failed on a batch", applied.run_id)

    def _evaluate(self, applied: _Applied, *, now: datetime) -> None:
        run_id = applied.run_id
        window, fresh = self._window(run_id, applied)
        if window is None:
            return
        with window.lock:
            if not fresh:
                window.extend(applied.observations)
            ctx = RunContext(
                run_id=run_id,
                budget_usd=applied.budget_usd,
                spent_usd=0.0,  # the spend job drives the budget rule; see the module doc
                thresholds_pct=window.thresholds,
                hard_cap=window.hard_cap,
                last_heartbeat=now.timestamp(),
                preemption_times=applied.preemption_times,
                attempt_number=applied.attempt_number,
                last_committed_step=applied.last_committed_step,
                current_step=applied.last_step,
            )
            signals = evaluate_all(
                window.rules, window.observations(), now=now.timestamp(), ctx=ctx
            )
        if signals and self._on_signals is not None:
            try:
                self._on_signals(run_id, signals, now)
            except Exception:
                log.exception("on_signals for run %s failed", run_id)

    def _window(self, run_id: str, applied: _Applied) -> tuple[_Window | None, bool]:
        """The run's window, building it from the events table when it is not in memory.

        ``fresh`` is True when it was just read from the table, which already holds this
        batch's events (they were committed), so they must not be appended again.
        """
        with self._windows_lock:
            window = self._windows.get(run_id)
            if window is not None:
                self._windows.move_to_end(run_id)
                return window, False
        window = self._load_window(run_id, since=applied.max_time - WINDOW_SPAN_S)
        if window is None:
            return None, False
        with self._windows_lock:
            existing = self._windows.get(run_id)
            if existing is not None:  # another thread built it meanwhile
                return existing, False
            self._windows[run_id] = window
            while len(self._windows) > MAX_WINDOWS:
                self._windows.popitem(last=False)
        return window, True

    def _load_window(self, run_id: str, *, since: float) -> _Window | None:
        events = _EVENTS.c
        attempts = _ATTEMPTS.c
        with Session(self._engine) as session:
            run = session.get(Run, run_id)
            if run is None:
                return None
            if self._rules_for is not None:
                rules: Sequence[Rule] = self._rules_for(run)
                _, thresholds, hard_cap = _spec_facts(run)
            else:
                cfg, thresholds, hard_cap = _spec_facts(run)
                rules = default_rules(cfg)
            window = _Window(rules, thresholds=thresholds, hard_cap=hard_cap)
            connection = session.connection()
            since = max(since, 0.0)
            metrics = run_metrics(connection, run_id, limit=REBUILD_OBS, since=since)
            window.extend({"metrics": [(p.time, p.data) for p in metrics]})
            for kind in sorted(WINDOW_EVENTS - {"metrics"}):
                rows = connection.execute(
                    select(events.time, events.data, attempts.number)
                    .join_from(_EVENTS, _ATTEMPTS, attempts.id == events.attempt_id)
                    .where(
                        events.run_id == run_id,
                        events.type == kind,
                        events.time >= _event_datetime(since),
                    )
                    .order_by(events.time.desc(), events.id.desc())
                    .limit(REBUILD_OBS)
                ).all()
                points: list[_Point] = []
                for row in reversed(rows):
                    data = restore_floats(row.data) if isinstance(row.data, Mapping) else {}
                    if kind != "system":
                        data = {**data, "attempt": row.number}
                    points.append((row.time.timestamp(), data))
                window.extend({kind: points})
        return window


_REVOKED = (
    "unknown or revoked runner token: the attempt has ended or the token is wrong; "
    "stop sending for this attempt"
)
