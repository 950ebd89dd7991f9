"""The rows of the events a batch stores, and SQLite's writer of them.

A batch's metrics become one ``metric_blocks`` row and its other events rows of
``events``, with the times and payloads already in the text the columns take
(:func:`event_writes`). SQLite inserts them in as few statements as it allows
(:class:`SqliteWriter`); PostgreSQL sends them in the one statement that writes the
whole batch (:mod:`jobs.ingest.postgres`). See ``docs/architecture.md``, "Ingest".
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from itertools import chain
from typing import Any, NamedTuple

import orjson
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from runner.wire import Batch

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_NAIVE_EPOCH = datetime(1970, 1, 1)
#: The events insert's columns, in the order of the row tuples.
_EVENT_COLUMNS = ("attempt_id", "run_id", "seq", "type", "time", "data", "received_at")
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
#: The columns of a metrics block (see jobs.database.models.MetricBlock), in parameter order.
BLOCK_COLUMNS = (
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
    f"INSERT INTO metric_blocks ({', '.join(BLOCK_COLUMNS)}) "
    f"VALUES ({', '.join('?' * len(BLOCK_COLUMNS))})"
)


def time_texts(times: Sequence[float], *, suffix: str = "") -> list[str]:
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


@dataclass
class Kinds:
    """Where each kind of event is in a batch's columns."""

    #: Positions of the metrics events: nearly all of them.
    metrics: list[int]
    #: Positions of every other event.
    others: list[int]

    @classmethod
    def of(cls, types: Sequence[str]) -> Kinds:
        metrics = [i for i, kind in enumerate(types) if kind == "metrics"]
        if len(metrics) == len(types):
            return cls(metrics, [])
        return cls(metrics, [i for i, kind in enumerate(types) if kind != "metrics"])


def event_datetime(seconds: float) -> datetime:
    """Unix seconds as an aware UTC datetime."""
    return _EPOCH + timedelta(seconds=seconds)


class EventRows(NamedTuple):
    """A batch's events bound for rows of ``events`` (all but its metrics)."""

    attempt_id: str
    run_id: str
    #: The batch's arrival time, as the column's text.
    received: str
    new: Batch
    #: The events' times, as the column's texts (see :func:`time_texts`).
    times: list[str]


class EventWrites(NamedTuple):
    """What a batch stores of its events, in the columns' text."""

    #: The batch's arrival time, as the column's text.
    received: str
    #: The events other than metrics, bound for ``events``; None when there are none.
    rows: EventRows | None
    #: The metrics as one ``metric_blocks`` row, in :data:`BLOCK_COLUMNS` order; None
    #: when there are none.
    block: tuple[Any, ...] | None


def event_writes(
    *, attempt_id: str, run_id: str, new: Batch, kinds: Kinds, now: datetime, suffix: str
) -> EventWrites:
    """The new events as rows: the metrics as one block, the others as rows of ``events``.

    The times go in as the database's text (see :func:`time_texts`: ``suffix`` is ``""``
    for SQLite's naive DATETIME, ``"+00:00"`` for PostgreSQL's timestamptz) and the data as
    the wire's JSON text, so the driver converts nothing.
    """
    received = time_texts([now.timestamp()], suffix=suffix)[0]
    rows = None
    if kinds.others:
        others = new.select(kinds.others) if kinds.metrics else new
        times = time_texts(others.times, suffix=suffix)
        rows = EventRows(attempt_id, run_id, received, others, times)
    block = None
    if kinds.metrics:
        block = _block_values(attempt_id, run_id, new, kinds.metrics, received, suffix)
    return EventWrites(received, rows, block)


class SqliteWriter:
    """Multi-row ``INSERT … VALUES`` of up to 128 rows, straight on the driver's cursor.

    An ``executemany`` pays the driver's and SQLite's per-statement work for every row,
    which cost as much as SQLite's insert itself. SQLite's foreign-key checks stay on:
    switching them off for the transaction would save two look-ups a row, but SQLite then
    prepares these statements again for every batch, which costs four times as much.
    """

    def insert(self, connection: Connection, writes: EventWrites) -> None:
        """Insert a batch's events, inside the batch's transaction."""
        rows = writes.rows
        if rows is not None:
            new = rows.new
            values = list(
                chain.from_iterable(zip(new.seqs, new.types, rows.times, new.texts, strict=True))
            )
            shared = [rows.attempt_id, rows.run_id, rows.received]
            _sqlite_insert_events(connection, shared, values)
        if writes.block is not None:
            with _sqlite_cursor(connection) as execute:
                execute(_SQLITE_INSERT_BLOCK, writes.block)


def _block_values(
    attempt_id: str, run_id: str, new: Batch, positions: list[int], received: str, suffix: str
) -> tuple[Any, ...]:
    """The batch's metrics as one :class:`~jobs.database.models.MetricBlock` row, in seq order.

    The payloads go in as the wire's JSON texts joined into an array, and the seqs and
    times as arrays encoded once: nothing is formatted per event. A seq already stored
    never reaches here (the service keeps only new events), so the block's first seq is
    new and the insert has no conflict to resolve.
    """
    seqs = [new.seqs[i] for i in positions]
    if seqs != sorted(seqs):  # the runner sends in seq order
        positions = sorted(positions, key=new.seqs.__getitem__)
        seqs = [new.seqs[i] for i in positions]
    times = [new.times[i] for i in positions]
    first_time, last_time = time_texts([min(times), max(times)], suffix=suffix)
    return (
        attempt_id,
        run_id,
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
