"""PostgreSQL: a batch's transaction in one round trip, two at most.

On SQLite a statement is a function call; on PostgreSQL each one is a round trip to the
server, and on a loaded machine each waits for the server's turn on a CPU. The driver
adds two of its own: psycopg2 sends ``BEGIN`` alone before a transaction's first
statement, and ``COMMIT`` alone at its end. So a batch's transaction is driven here by
hand, on a connection in autocommit mode (:class:`BatchTransaction`), in messages of
several statements that the server runs in order, stopping at the first error:

- the batch message: ``BEGIN`` and the transaction's settings (unless the read below
  sent them), the batch's writes as data-modifying CTEs of one statement (its events,
  its metrics block, the attempt's and the run's updates, its checkpoints), ``COMMIT``,
  then what the rules need of the run (its steps, its budget, when its preempted
  attempts ended) and the attempt's row. The answer comes back once the commit is
  durable; an error leaves the transaction to be rolled back.
- the read, only where needed: ``BEGIN``, the settings and the attempt's row, locked.

Every write of the statement hangs on the attempt's UPDATE, whose WHERE asks that the
row still be what the batch was worked out from (its token, seq, step, state …: the
columns :data:`ATTEMPT_COLUMNS`). So a batch can be worked out from the attempt's row
as this process last saw it (:class:`AttemptCache`) and sent at once: one round trip.
Where the row changed meanwhile (another batch, a revoked token, the service layer),
nothing is written; the batch is then read, locked and written again (two round trips),
as is a batch that reaches back under the attempt's last seq (a retry: its repeats are
looked up first) and a batch of a node after the first. See ``docs/architecture.md``,
"PostgreSQL: round trips and the commit".

The CTEs run on one snapshot, and each row is changed once at most (one attempt, one
run, one upsert per step), so the attempt's profile mark is a column of its one UPDATE.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from types import TracebackType
from typing import Any, NamedTuple

import orjson
from sqlalchemy import Connection, Dialect
from sqlalchemy.exc import SQLAlchemyError

from jobs.database.models import Attempt, table_of
from jobs.domain.lifecycle import AttemptState
from jobs.ingest.effects import Changes, Outcome
from jobs.ingest.writers import BLOCK_COLUMNS, EventWrites

#: The attempt's columns a batch is worked out from, and their SQL types for the guard.
ATTEMPT_COLUMNS = {
    "token_hash": "text",
    "number": "integer",
    "state": "text",
    "last_step": "bigint",
    "last_seq": "bigint",
    "started_at": "timestamptz",
    "preemption_notice_at": "timestamptz",
    "profile_until_step": "bigint",
    "profile_until_s": "float8",
    "profiled_at": "timestamptz",
}
_NAMES = ", ".join(ATTEMPT_COLUMNS)
#: The session setting that carries "the batch was written" past the COMMIT.
_WRITTEN = "trainbot.ingest_written"
#: How many attempts' rows a process remembers.
_CACHED_ATTEMPTS = 1024


class AttemptView(NamedTuple):
    """The attempt's row as a batch is worked out from it (:data:`ATTEMPT_COLUMNS`)."""

    token_hash: str | None
    number: int
    state: AttemptState
    last_step: int | None
    last_seq: int | None
    started_at: Any
    preemption_notice_at: Any
    profile_until_step: int | None
    profile_until_s: float | None
    profiled_at: Any


class AttemptCache:
    """The attempts' rows as this process's last batches left them; thread-safe."""

    def __init__(self) -> None:
        self._rows: OrderedDict[str, AttemptView] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, attempt_id: str) -> AttemptView | None:
        with self._lock:
            return self._rows.get(attempt_id)

    def put(self, attempt_id: str, row: AttemptView | None) -> None:
        with self._lock:
            if row is None or row.token_hash is None:  # gone, or ended: no batch will come
                self._rows.pop(attempt_id, None)
                return
            self._rows[attempt_id] = row
            self._rows.move_to_end(attempt_id)
            while len(self._rows) > _CACHED_ATTEMPTS:
                self._rows.popitem(last=False)


_GUARD = (
    f"({_NAMES}) IS NOT DISTINCT FROM ("
    + ", ".join(f"%(g_{name})s::{kind}" for name, kind in ATTEMPT_COLUMNS.items())
    + ")"
)
# As Effects._update_attempt: a NULL parameter leaves its column as it is. The profile
# mark too (Effects.finish): the row is as it was read, with profiled_at NULL.
_ATTEMPT = (
    "att AS (UPDATE attempts SET last_heartbeat = %(p_now)s, last_seq = %(p_last_seq)s, "
    "last_step = coalesce(%(p_last_step)s, last_step), "
    "step_time_s = coalesce(%(p_step_time_s)s, step_time_s), "
    "resumed_from_step = coalesce(%(p_resumed_from_step)s, resumed_from_step), "
    "started_at = coalesce(%(p_started_at)s, started_at), "
    "preemption_notice_at = coalesce(%(p_notice_at)s, preemption_notice_at), "
    "state = coalesce(%(p_state)s, state), "
    "profiled_at = coalesce(profiled_at, %(p_profiled_at)s) "
    f"WHERE id = %(attempt_id)s AND {_GUARD} RETURNING 1)"
)
_EVENTS = (
    "ev AS (INSERT INTO events (attempt_id, run_id, seq, type, time, data, received_at) "
    "SELECT %(attempt_id)s, %(run_id)s, u.seq, u.type, u.time::timestamptz, u.data::json, "
    "%(received_at)s::timestamptz FROM att, unnest(%(ev_seqs)s::bigint[], "
    "%(ev_types)s::text[], %(ev_times)s::text[], %(ev_texts)s::text[]) "
    "AS u(seq, type, time, data) ON CONFLICT (attempt_id, seq) DO NOTHING)"
)
_BLOCK = (
    f"blk AS (INSERT INTO metric_blocks ({', '.join(BLOCK_COLUMNS)}) SELECT "
    "%(attempt_id)s, %(run_id)s, %(b_first_seq)s, %(b_last_seq)s, %(b_count)s, "
    "%(b_first_time)s::timestamptz, %(b_last_time)s::timestamptz, %(b_seqs)s::json, "
    "%(b_times)s::json, %(b_data)s::json, %(received_at)s::timestamptz FROM att)"
)
# As Effects._upsert_checkpoint; one row per step (Effects.changes keeps the last).
_CHECKPOINTS = (
    "ck AS (INSERT INTO checkpoints "
    "(run_id, attempt_id, step, uri, bytes, committed_at, metrics, deleted_at) "
    "SELECT %(run_id)s, %(attempt_id)s, c.step, c.uri, c.bytes, c.at, c.metrics::json, NULL "
    "FROM att, unnest(%(ck_steps)s::bigint[], %(ck_uris)s::text[], %(ck_bytes)s::bigint[], "
    "%(ck_at)s::timestamptz[], %(ck_metrics)s::text[]) AS c(step, uri, bytes, at, metrics) "
    "ON CONFLICT (run_id, step) DO UPDATE SET attempt_id = excluded.attempt_id, "
    "uri = excluded.uri, bytes = excluded.bytes, committed_at = excluded.committed_at, "
    "metrics = excluded.metrics, deleted_at = NULL)"
)


def _forward(column: str, name: str) -> str:
    """As Effects._update_run: the column moves forward only; NULL leaves it."""
    value = f"%({name})s::bigint"
    return (
        f"{column} = CASE WHEN {value} IS NULL THEN {column} WHEN {column} IS NULL THEN {value} "
        f"WHEN {column} < {value} THEN {value} ELSE {column} END"
    )


_RUN = (
    f"rn AS (UPDATE runs SET {_forward('last_step', 'p_step')}, "
    f"{_forward('last_committed_step', 'p_committed')} "
    "WHERE id = %(run_id)s AND EXISTS (SELECT 1 FROM att))"
)
_PREEMPTED = ", ".join(f"'{s.value}'" for s in (AttemptState.PREEMPTED, AttemptState.LOST))
# After the COMMIT: whether the batch was written, the run as the batch left it (or as a
# later commit did; a batch never ends an attempt, so the preempted attempts are the ones
# before it), and the attempt's row for the next batch.
_RESULT = (
    f"SELECT current_setting('{_WRITTEN}'), r.last_step, r.last_committed_step, "
    "r.budget_usd, ARRAY(SELECT extract(epoch FROM p.ended_at)::float8 FROM attempts p "
    f"WHERE p.run_id = %(run_id)s AND p.state IN ({_PREEMPTED}) AND p.ended_at IS NOT NULL), "
    + ", ".join(f"a.{name}" for name in ATTEMPT_COLUMNS)
    + " FROM (SELECT 1) AS one LEFT JOIN runs r ON r.id = %(run_id)s "
    "LEFT JOIN attempts a ON a.id = %(attempt_id)s"
)
_LZ4 = "SET LOCAL default_toast_compression = lz4; "


def _statement(*, events: bool, block: bool, checkpoints: bool, run: bool) -> str:
    ctes = [_ATTEMPT]
    if events:
        ctes.append(_EVENTS)
    if block:
        ctes.append(_BLOCK)
    if checkpoints:
        ctes.append(_CHECKPOINTS)
    if run:
        ctes.append(_RUN)
    # Every CTE runs to completion whether or not the query reads it; the setting is
    # the session's, so it outlives the COMMIT for the result to read.
    written = f"SELECT set_config('{_WRITTEN}', (SELECT count(*) FROM att)::text, false)"
    return f"WITH {', '.join(ctes)} {written}; COMMIT; {_RESULT}"


#: Each shape of batch's message, built once: (events, block, checkpoints, run update).
_STATEMENTS = {
    (e, b, c, r): _statement(events=e, block=b, checkpoints=c, run=r)
    for e in (False, True)
    for b in (False, True)
    for c in (False, True)
    for r in (False, True)
}
_READ = f"SELECT {_NAMES} FROM attempts WHERE id = %(attempt_id)s FOR UPDATE"


@functools.cache
def _result_types(dialect: Dialect) -> list[Any]:
    """What turns each of :data:`ATTEMPT_COLUMNS` into its Python value (None: nothing)."""
    attempts = table_of(Attempt).c
    return [attempts[name].type.result_processor(dialect, None) for name in ATTEMPT_COLUMNS]


class Written(NamedTuple):
    """What the batch message found."""

    #: Whether the batch was written: False when the attempt's row was not the one it
    #: was worked out from (nothing was).
    written: bool
    outcome: Outcome
    #: The attempt's row after the commit; None if it is gone.
    attempt: AttemptView | None


class BatchTransaction:
    """One batch's transaction on a pooled connection, begun and committed by the
    messages of this module rather than by the driver (see the module's docstring).

    The connection is in autocommit mode while it is held, so the driver sends nothing of
    its own; leaving the block with the transaction open rolls it back, and a connection
    that cannot roll back is dropped from the pool rather than handed on in a transaction.
    ``lz4``: compress the metrics block's TOAST with lz4 (the server has it): pglz took
    1 to 2 ms a batch, lz4 a tenth of that.
    """

    def __init__(self, connection: Connection, *, lz4: bool) -> None:
        self._connection = connection
        self._begin = "BEGIN; " + (_LZ4 if lz4 else "")
        self._open = False
        self._types = _result_types(connection.dialect)

    def __enter__(self) -> BatchTransaction:
        self._dbapi().autocommit = True
        return self

    def read(self, attempt_id: str) -> AttemptView | None:
        """Begin, and read and lock the attempt's row (None: there is none)."""
        begin, self._begin, self._open = self._begin, "", True
        row = self._connection.exec_driver_sql(begin + _READ, {"attempt_id": attempt_id}).first()
        return None if row is None else self._attempt(tuple(row))

    def commit_batch(
        self,
        events: EventWrites,
        changes: Changes,
        *,
        attempt: AttemptView,
        run_id: str,
        profiled: bool,
    ) -> Written:
        """Write a batch's events and ``changes`` if the attempt's row is still ``attempt``,
        commit, and read back what the rules need: one round trip. ``profiled``: mark the
        attempt profiled."""
        params: dict[str, Any] = dict(changes.attempt)
        params["run_id"] = run_id
        params["received_at"] = events.received
        params["p_profiled_at"] = params["p_now"] if profiled else None
        if params["p_state"] is not None:
            params["p_state"] = AttemptState(params["p_state"]).value
        for name, value in zip(ATTEMPT_COLUMNS, attempt, strict=True):
            params[f"g_{name}"] = value
        params["g_state"] = attempt.state.value
        rows, block = events.rows, events.block
        if rows is not None:
            params["ev_seqs"] = rows.new.seqs
            params["ev_types"] = rows.new.types
            params["ev_times"] = rows.times
            params["ev_texts"] = rows.new.texts
        if block is not None:
            for column, value in zip(BLOCK_COLUMNS, block, strict=True):
                params[f"b_{column}"] = value
        checkpoints = changes.checkpoints
        if checkpoints:
            params["ck_steps"] = [c["step"] for c in checkpoints]
            params["ck_uris"] = [c["uri"] for c in checkpoints]
            params["ck_bytes"] = [c["bytes"] for c in checkpoints]
            params["ck_at"] = [c["committed_at"] for c in checkpoints]
            params["ck_metrics"] = [orjson.dumps(c["metrics"]).decode() for c in checkpoints]
        run = changes.top_step is not None or changes.top_committed is not None
        params["p_step"] = changes.top_step
        params["p_committed"] = changes.top_committed
        statement = _STATEMENTS[(rows is not None, block is not None, bool(checkpoints), run)]
        begin, self._begin, self._open = self._begin, "", True
        row = tuple(self._connection.exec_driver_sql(begin + statement, params).one())
        self._open = False
        view = None if row[5] is None else self._attempt(row[5:])
        return Written(row[0] == "1", Outcome(row[1], row[2], row[3], tuple(row[4])), view)

    def _attempt(self, values: tuple[Any, ...]) -> AttemptView:
        """The row's values as the columns' types give them back (aware UTC, enums)."""
        pairs = zip(self._types, values, strict=True)
        return AttemptView(*(value if to is None else to(value) for to, value in pairs))

    def _dbapi(self) -> Any:
        return self._connection.connection.dbapi_connection

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        connection = self._connection
        try:
            if self._open and not connection.invalidated:
                self._open = False
                try:
                    connection.exec_driver_sql("ROLLBACK")
                except SQLAlchemyError:
                    if exc is None:
                        raise
        finally:
            if not connection.invalidated:
                dbapi = self._dbapi()
                if dbapi is None or dbapi.info.transaction_status != 0:  # not idle
                    connection.invalidate()  # never back to the pool inside a transaction
                else:
                    dbapi.autocommit = False
