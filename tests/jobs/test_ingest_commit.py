"""How a batch commits on PostgreSQL: durably, whatever it holds, in one round trip when
the attempt's row is as the last batch left it (:mod:`jobs.ingest.postgres`).

The settings a transaction commits with are read at its commit, inside it, by a deferred
constraint trigger on ``attempts`` (every batch updates its attempt's row once): what the
server really did, not what the code meant to.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, event, text
from sqlmodel import Session, col, select

from jobs.database.models import Checkpoint, Run
from tests.jobs.test_ingest import (
    AUTH,
    add_run,
    attempt_row,
    body,
    count_events,
    metrics,
    service,
    stored_events,
    system,
)

_NOTE_COMMITS = (
    "CREATE TABLE commit_notes (id serial PRIMARY KEY, sync text, toast text)",
    "CREATE FUNCTION note_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
    "INSERT INTO commit_notes (sync, toast) VALUES (current_setting('synchronous_commit'), "
    "current_setting('default_toast_compression')); RETURN NULL; END $$",
    "CREATE CONSTRAINT TRIGGER note_commit AFTER UPDATE ON attempts "
    "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION note_commit()",
)


@pytest.fixture
def postgres(db_engine: Engine) -> Engine:
    if db_engine.dialect.name != "postgresql":
        pytest.skip("the round trips, synchronous_commit and TOAST compression are PostgreSQL's")
    add_run(db_engine)
    return db_engine


def commits(engine: Engine) -> list[dict[str, str]]:
    """The ``synchronous_commit`` and ``default_toast_compression`` of every commit that
    updated an attempt since :func:`note_commits`, in order."""
    with engine.connect() as connection:
        rows = connection.execute(text("SELECT sync, toast FROM commit_notes ORDER BY id"))
        return [{"synchronous_commit": sync, "toast": toast} for sync, toast in rows]


def note_commits(engine: Engine) -> None:
    with engine.begin() as connection:
        for statement in _NOTE_COMMITS:
            connection.execute(text(statement))


@pytest.fixture
def statements(postgres: Engine) -> Iterator[list[str]]:
    """Every statement sent on the engine's connections (the pool's ping aside)."""
    sent: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement)

    event.listen(postgres, "before_cursor_execute", before)
    yield sent
    event.remove(postgres, "before_cursor_execute", before)


def test_every_batch_commits_durably_whatever_it_holds(postgres: Engine) -> None:
    """An acknowledged batch survives a crash of the server: telemetry too (a runner
    deletes what was acknowledged, so a batch lost after its 200 is lost for good)."""
    note_commits(postgres)
    svc = service(postgres)
    checkpoint = {"step": 3, "bytes": 10, "write_s": 1.0, "uri": "file:///c/3"}
    batches: list[list[tuple[str, dict[str, Any]]]] = [
        [metrics(1), system(), ("heartbeat", {"step": 1})],
        [metrics(2), ("checkpoint_committed", checkpoint)],
        [("log", {"level": "info", "message": "hello"})],
        [metrics(4)],
        [metrics(5), system()],
        [("exit", {"code": 0, "reason": "succeeded"})],
    ]
    seq = 0
    for items in batches:
        assert svc.handle(AUTH, body(items, first_seq=seq)).status == 200
        seq += len(items)

    assert [c["synchronous_commit"] for c in commits(postgres)] == ["on"] * len(batches)
    with postgres.connect() as connection:
        assert connection.exec_driver_sql("SHOW synchronous_commit").scalar() == "on"


def test_a_batch_after_the_first_is_one_round_trip(postgres: Engine, statements: list[str]) -> None:
    """Every column the batch is worked out from set (a started, noticed, profiled
    attempt), and each one compared as it comes back from the database."""
    with postgres.begin() as connection:
        connection.execute(
            text("UPDATE attempts SET profile_until_step = 5, profile_until_s = 30.5")
        )
    due: list[str] = []
    svc = service(postgres, on_profile_due=due.append)
    first_items = [
        ("started", {"pid": 7, "host": "h"}),
        ("preemption_notice", {"source": "aws", "time_left_s": 120.0}),
        *[metrics(step) for step in range(2, 10)],
    ]
    assert svc.handle(AUTH, body(first_items)).status == 200
    first = list(statements)
    statements.clear()

    for batch in range(1, 6):
        items = [metrics(batch * 10 + i) for i in range(10)]
        assert svc.handle(AUTH, body(items, first_seq=batch * 10)).status == 200

    # The first batch reads the attempt's row, locked, then writes and commits; the next
    # ones are worked out from the row as it left it, each one message that begins,
    # writes and commits.
    ours = [s for s in first if "FOR UPDATE" in s or "; COMMIT; " in s]
    assert len(ours) == 2
    assert ours[0].startswith("BEGIN; ") and "FOR UPDATE" in ours[0]
    assert ours[1].startswith("WITH att AS (UPDATE attempts")
    ours = [s for s in statements if "token_hash = " not in s]  # a token look-up is not
    assert len(ours) == 5
    assert all(s.startswith("BEGIN; ") and "; COMMIT; " in s for s in ours)
    assert not any("FOR UPDATE" in s for s in ours)
    assert count_events(postgres) == 60
    attempt = attempt_row(postgres)
    assert (attempt.last_seq, attempt.last_step, attempt.state.value) == (59, 59, "RUNNING")
    assert None not in (attempt.started_at, attempt.preemption_notice_at, attempt.profiled_at)
    assert due == ["a-1"]


def test_a_row_changed_by_another_replica_is_read_again_and_nothing_is_lost(
    postgres: Engine, statements: list[str]
) -> None:
    """Two replicas take turns with one runner's batches: each one's remembered row is
    stale every time, so each batch writes nothing at first, then is read, locked and
    written once."""
    one, two = service(postgres), service(postgres)
    seq = 0
    for turn in range(6):
        items = [metrics(seq + i) for i in range(5)] + [("heartbeat", {"step": seq + 4})]
        result = (one if turn % 2 == 0 else two).handle(AUTH, body(items, first_seq=seq))
        assert result.status == 200
        assert result.body == {"accepted": 6, "duplicates": 0}
        seq += len(items)

    assert [e.seq for e in stored_events(postgres)] == list(range(seq))
    attempt = attempt_row(postgres)
    assert (attempt.last_seq, attempt.last_step) == (seq - 1, seq - 2)
    # Turns 3 to 6 each tried the one message first, found the row changed, then read it.
    tried = [s for s in statements if "; COMMIT; " in s]
    assert len(tried) == 6 + 4


def test_a_batch_that_fails_on_the_one_message_path_leaves_nothing_open(
    postgres: Engine,
) -> None:
    svc = service(postgres)
    assert svc.handle(AUTH, body([metrics(0)])).status == 200
    with postgres.begin() as connection:
        connection.execute(
            text(
                "CREATE FUNCTION no_room() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'no room for events'; END $$"
            )
        )
        connection.execute(
            text(
                "CREATE TRIGGER no_room BEFORE INSERT ON metric_blocks "
                "FOR EACH ROW EXECUTE FUNCTION no_room()"
            )
        )
    items = [metrics(i) for i in range(1, 50)]

    refused = svc.handle(AUTH, body(items, first_seq=1))

    assert refused.status == 503
    assert count_events(postgres) == 1
    assert attempt_row(postgres).last_seq == 0
    with postgres.connect() as connection:  # the pool's connection is out of its transaction
        dbapi: Any = connection.connection.dbapi_connection
        assert dbapi.info.transaction_status == 0  # idle
        assert dbapi.autocommit is False
        connection.execute(text("DROP TRIGGER no_room ON metric_blocks"))
        connection.commit()
    again = svc.handle(AUTH, body(items, first_seq=1))
    assert again.body == {"accepted": 49, "duplicates": 0}
    assert count_events(postgres) == 50


def test_metrics_blocks_are_compressed_with_lz4_where_the_server_has_it(
    postgres: Engine,
) -> None:
    with postgres.connect() as connection:
        has_lz4 = connection.exec_driver_sql(
            "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"
        ).scalar()
    note_commits(postgres)
    svc = service(postgres)
    for first in (0, 400):  # the first batch reads the row, the second does not
        items = [metrics(step, loss=1.0 + step / 1000) for step in range(first, first + 400)]
        assert svc.handle(AUTH, body(items, first_seq=first)).status == 200
    assert [c["toast"] for c in commits(postgres)] == ["lz4" if has_lz4 else "pglz"] * 2
    if has_lz4:
        with postgres.connect() as connection:
            methods = connection.exec_driver_sql(
                "SELECT pg_column_compression(data) FROM metric_blocks"
            ).scalars()
            assert list(methods) == ["lz4", "lz4"]


def test_the_last_report_of_a_checkpoint_step_in_one_batch_wins(db_engine: Engine) -> None:
    """Two reports of one step in a batch: one row, the later report's (on PostgreSQL,
    one upsert may not change a row twice)."""
    add_run(db_engine)
    first = {"step": 5, "bytes": 1, "write_s": 1.0, "uri": "file:///c/5-first"}
    again = {"step": 5, "bytes": 2, "write_s": 1.0, "uri": "file:///c/5-again"}
    other = {"step": 7, "bytes": 3, "write_s": 1.0, "uri": "file:///c/7"}
    items = [
        metrics(5),
        ("checkpoint_committed", first),
        ("checkpoint_committed", again),
        metrics(7),
        ("checkpoint_committed", other),
    ]
    assert service(db_engine).handle(AUTH, body(items)).status == 200
    with Session(db_engine) as session:
        rows = session.exec(
            select(Checkpoint.step, Checkpoint.uri, Checkpoint.bytes).order_by(col(Checkpoint.step))
        ).all()
        run = session.get(Run, "r-1")
        assert run is not None
        assert (run.last_step, run.last_committed_step) == (7, 7)
    assert [tuple(r) for r in rows] == [(5, "file:///c/5-again", 2), (7, "file:///c/7", 3)]
