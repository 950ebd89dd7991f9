"""How a batch commits: durably when it carries anything but telemetry, and the whole
batch's writes in one statement on PostgreSQL (:mod:`jobs.ingest.postgres`).

The settings a transaction commits with are read at its commit, on its own connection,
by a listener on the engine: what the server really did, not what the code meant to.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, event, select
from sqlmodel import Session

from jobs.database.models import Checkpoint, Run
from tests.jobs.test_ingest import AUTH, add_run, body, metrics, service, system


@pytest.fixture
def commits(db_engine: Engine) -> Iterator[list[dict[str, str]]]:
    """The ``synchronous_commit`` and ``default_toast_compression`` of every commit."""
    if db_engine.dialect.name != "postgresql":
        pytest.skip("synchronous_commit and TOAST compression are PostgreSQL's")
    seen: list[dict[str, str]] = []

    def on_commit(connection: Any) -> None:
        cursor = connection.connection.dbapi_connection.cursor()
        try:
            cursor.execute(
                "SELECT current_setting('synchronous_commit'), "
                "current_setting('default_toast_compression')"
            )
            sync, toast = cursor.fetchone()
        finally:
            cursor.close()
        seen.append({"synchronous_commit": sync, "toast": toast})

    event.listen(db_engine, "commit", on_commit)
    yield seen
    event.remove(db_engine, "commit", on_commit)


def test_telemetry_commits_without_waiting_for_the_disk_and_lifecycle_durably(
    db_engine: Engine, commits: list[dict[str, str]]
) -> None:
    add_run(db_engine)
    svc = service(db_engine)
    checkpoint = {"step": 3, "bytes": 10, "write_s": 1.0, "uri": "file:///c/3"}
    batches: list[tuple[str, list[tuple[str, dict[str, Any]]]]] = [
        ("telemetry", [metrics(1), system(), ("heartbeat", {"step": 1})]),
        ("lifecycle", [metrics(2), ("checkpoint_committed", checkpoint)]),
        ("lifecycle", [("log", {"level": "info", "message": "hello"})]),
        ("telemetry", [metrics(4)]),
        ("lifecycle", [("exit", {"code": 0, "reason": "succeeded"})]),
    ]
    seq = 0
    for _, items in batches:
        assert svc.handle(AUTH, body(items, first_seq=seq)).status == 200
        seq += len(items)
    ingest_commits = commits[-len(batches) :]
    assert [c["synchronous_commit"] for c in ingest_commits] == [
        "off" if kind == "telemetry" else "on" for kind, _ in batches
    ]
    # Set for the batch's transaction only: the pool's connection is back to durable.
    with db_engine.connect() as connection:
        assert connection.exec_driver_sql("SHOW synchronous_commit").scalar() == "on"


def test_metrics_blocks_are_compressed_with_lz4_where_the_server_has_it(
    db_engine: Engine, commits: list[dict[str, str]]
) -> None:
    with db_engine.connect() as connection:
        has_lz4 = connection.exec_driver_sql(
            "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"
        ).scalar()
    add_run(db_engine)
    items = [metrics(step, loss=1.0 + step / 1000) for step in range(400)]
    assert service(db_engine).handle(AUTH, body(items)).status == 200
    assert commits[-1]["toast"] == ("lz4" if has_lz4 else "pglz")
    if has_lz4:
        with db_engine.connect() as connection:
            method = connection.exec_driver_sql(
                "SELECT pg_column_compression(data) FROM metric_blocks"
            ).scalar()
        assert method == "lz4"


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
        rows = session.execute(
            select(Checkpoint.step, Checkpoint.uri, Checkpoint.bytes).order_by(Checkpoint.step)
        ).all()
        run = session.get(Run, "r-1")
        assert run is not None
        assert (run.last_step, run.last_committed_step) == (7, 7)
    assert [tuple(r) for r in rows] == [(5, "file:///c/5-again", 2), (7, "file:///c/7", 3)]
