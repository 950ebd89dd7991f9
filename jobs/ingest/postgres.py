"""PostgreSQL: everything a batch writes, in one statement.

On SQLite a statement is a function call; on PostgreSQL each one is a round trip to the
server, and on a loaded machine each waits for the server's turn on a CPU. So after the
attempt's row is read and locked, the batch's events, its metrics block, the attempt's
and the run's updates and its checkpoints go as data-modifying CTEs of one statement,
whose result is what the rules need of the run (its steps, its budget, when its
preempted attempts ended). A batch is then five round trips where it was ten: the pool's
pre-ping, BEGIN, the read, this statement, COMMIT (see ``docs/architecture.md``,
"PostgreSQL: round trips and the commit").

The CTEs run on one snapshot: the final SELECT sees the attempts as they were before
the statement, which is what the preemption times need (a batch never ends an attempt),
and each row is changed once at most (one attempt, one run, one upsert per step).
"""

from __future__ import annotations

from typing import Any

import orjson
from sqlalchemy import Connection

from jobs.domain.lifecycle import AttemptState
from jobs.ingest.effects import Changes, Outcome
from jobs.ingest.writers import BLOCK_COLUMNS, EventWrites

_EVENTS = (
    "ev AS (INSERT INTO events (attempt_id, run_id, seq, type, time, data, received_at) "
    "SELECT %(attempt_id)s, %(run_id)s, u.seq, u.type, u.time::timestamptz, u.data::json, "
    "%(received_at)s::timestamptz FROM unnest(%(ev_seqs)s::bigint[], %(ev_types)s::text[], "
    "%(ev_times)s::text[], %(ev_texts)s::text[]) AS u(seq, type, time, data) "
    "ON CONFLICT (attempt_id, seq) DO NOTHING)"
)
_BLOCK = (
    f"blk AS (INSERT INTO metric_blocks ({', '.join(BLOCK_COLUMNS)}) VALUES ("
    "%(attempt_id)s, %(run_id)s, %(b_first_seq)s, %(b_last_seq)s, %(b_count)s, "
    "%(b_first_time)s::timestamptz, %(b_last_time)s::timestamptz, %(b_seqs)s::json, "
    "%(b_times)s::json, %(b_data)s::json, %(received_at)s::timestamptz))"
)
# As Effects._update_attempt: a NULL parameter leaves its column as it is.
_ATTEMPT = (
    "att AS (UPDATE attempts SET last_heartbeat = %(p_now)s, last_seq = %(p_last_seq)s, "
    "last_step = coalesce(%(p_last_step)s, last_step), "
    "step_time_s = coalesce(%(p_step_time_s)s, step_time_s), "
    "resumed_from_step = coalesce(%(p_resumed_from_step)s, resumed_from_step), "
    "started_at = coalesce(%(p_started_at)s, started_at), "
    "preemption_notice_at = coalesce(%(p_notice_at)s, preemption_notice_at), "
    "state = coalesce(%(p_state)s, state) WHERE id = %(attempt_id)s)"
)
# As Effects._upsert_checkpoint; one row per step (Effects.changes keeps the last).
_CHECKPOINTS = (
    "ck AS (INSERT INTO checkpoints "
    "(run_id, attempt_id, step, uri, bytes, committed_at, metrics, deleted_at) "
    "SELECT %(run_id)s, %(attempt_id)s, c.step, c.uri, c.bytes, c.at, c.metrics::json, NULL "
    "FROM unnest(%(ck_steps)s::bigint[], %(ck_uris)s::text[], %(ck_bytes)s::bigint[], "
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
    f"{_forward('last_committed_step', 'p_committed')} WHERE id = %(run_id)s "
    "RETURNING last_step, last_committed_step, budget_usd)"
)
_PREEMPTED = ", ".join(f"'{s.value}'" for s in (AttemptState.PREEMPTED, AttemptState.LOST))
_RESULT = (
    "SELECT r.last_step, r.last_committed_step, r.budget_usd, "
    "ARRAY(SELECT extract(epoch FROM a.ended_at)::float8 FROM attempts a "
    f"WHERE a.run_id = %(run_id)s AND a.state IN ({_PREEMPTED}) AND a.ended_at IS NOT NULL) "
    "FROM (SELECT 1) AS one "
)


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
        source = "LEFT JOIN rn r ON true"
    else:
        source = "LEFT JOIN runs r ON r.id = %(run_id)s"
    return f"WITH {', '.join(ctes)} {_RESULT}{source}"


#: Each shape of batch's statement, built once: (events, block, checkpoints, run update).
_STATEMENTS = {
    (e, b, c, r): _statement(events=e, block=b, checkpoints=c, run=r)
    for e in (False, True)
    for b in (False, True)
    for c in (False, True)
    for r in (False, True)
}


def write_batch(
    connection: Connection, events: EventWrites, changes: Changes, *, run_id: str
) -> Outcome:
    """Write a batch's events and ``changes`` in one statement, in the batch's transaction."""
    params: dict[str, Any] = dict(changes.attempt)
    params["run_id"] = run_id
    params["received_at"] = events.received
    if params["p_state"] is not None:
        params["p_state"] = AttemptState(params["p_state"]).value
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
    row = connection.exec_driver_sql(statement, params).one()
    return Outcome(row[0], row[1], row[2], tuple(row[3]))
