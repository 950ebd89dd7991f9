from __future__ import annotations

import json
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import StatementError
from sqlmodel import SQLModel, select

from jobs.database.db import (
    alembic_config,
    current_revision,
    head_revision,
    make_engine,
    migrate,
    session_scope,
)
from jobs.database.models import (
    Alert,
    AlertState,
    Attempt,
    Budget,
    Checkpoint,
    EventRow,
    MetricBlock,
    Run,
    SpendRecord,
    alert_dedupe_key,
    hash_token,
    table_of,
)
from jobs.database.replica_tables import CommandLog, SchedulerLease
from jobs.domain.errors import ConflictError, DatabaseError, SettingsError
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.process.settings import load_settings
from jobs.spec import JobSpec, load_spec

NOW = datetime(2024, 3, 1, 12, 0, tzinfo=timezone.utc)
TABLES = {
    "runs",
    "attempts",
    "events",
    "metric_blocks",
    "checkpoints",
    "alerts",
    "spend_records",
    "budgets",
    "scheduler_leases",
    "command_log",
    "oncall",
    "deferred_work",
    "slack_outbox",
    "slack_pace",
    "dry_runs",
    "api_tokens",
    "pagerduty_outbox",
    "staging",
    "kept_instances",
    "schema_compat",
}


def add_run_and_attempt(
    engine: Engine,
    run_id: str = "r-1",
    attempt_id: str = "a-1",
    *,
    spec: dict[str, Any] | None = None,
) -> None:
    """A run and its attempt, written with the columns the database has at its revision
    (an older one, in the migration tests)."""
    rows = [
        Run(id=run_id, spec_name="tiny", spec=spec or {}, requester="U1", created_at=NOW),
        Attempt(id=attempt_id, run_id=run_id, number=1, provider="local"),
    ]
    with engine.begin() as connection:
        for row in rows:
            table = table_of(type(row))
            present = {c["name"] for c in inspect(connection).get_columns(table.name)}
            values = {k: v for k, v in row.model_dump().items() if k in present}
            connection.execute(table.insert().values(**values))


def event(
    seq: int,
    data: dict[str, Any] | None = None,
    *,
    attempt_id: str = "a-1",
    run_id: str = "r-1",
    kind: str = "log",
    time: datetime = NOW,
) -> EventRow:
    return EventRow(
        attempt_id=attempt_id, run_id=run_id, seq=seq, type=kind, time=time, data=data or {}
    )


def schema_diff(engine: Engine) -> list[Any]:
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        return list(compare_metadata(context, SQLModel.metadata))


# --- migrations -----------------------------------------------------------------------


def test_migrate_creates_every_table_and_records_the_revision(empty_engine: Engine) -> None:
    assert current_revision(empty_engine) is None
    migrate(empty_engine)
    assert current_revision(empty_engine) == head_revision()
    assert set(inspect(empty_engine).get_table_names()) >= TABLES
    migrate(empty_engine)  # a second start is a no-op
    assert current_revision(empty_engine) == head_revision()


def test_migrated_schema_matches_the_models(db_engine: Engine) -> None:
    assert set(SQLModel.metadata.tables) == TABLES
    assert schema_diff(db_engine) == []


def test_schema_comparison_notices_drift(db_engine: Engine) -> None:
    with db_engine.begin() as connection:
        connection.execute(text("DROP INDEX ix_runs_requester"))
    diff = schema_diff(db_engine)
    assert [entry[0] for entry in diff] == ["add_index"]


def test_downgrade_removes_everything_and_upgrade_restores_it(db_engine: Engine) -> None:
    with db_engine.begin() as connection:
        command.downgrade(alembic_config(connection), "base")
    assert not TABLES & set(inspect(db_engine).get_table_names())
    assert current_revision(db_engine) is None
    migrate(db_engine)
    assert schema_diff(db_engine) == []


def test_a_database_from_a_newer_version_is_refused(db_engine: Engine) -> None:
    with db_engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999_future'"))
        connection.execute(text("UPDATE schema_compat SET serves_from = '9998_future'"))
    with pytest.raises(DatabaseError, match="run that version"):
        migrate(db_engine)


def test_upgrading_a_database_with_rows_widens_steps_seqs_and_bytes(
    empty_engine: Engine,
) -> None:
    with empty_engine.begin() as connection:
        command.upgrade(alembic_config(connection), "0002")
    add_run_and_attempt(empty_engine)
    with session_scope(empty_engine) as session:
        session.add(event(7, {"loss": 1.0}))

    migrate(empty_engine)  # 0003, with a run, an attempt and an event in the tables

    three_gib, big_step = 3 * 2**30, 5_000_000_000
    with session_scope(empty_engine) as session:
        session.add(event(2**40))
        session.add(
            Checkpoint(run_id="r-1", step=big_step, uri="u", bytes=three_gib, committed_at=NOW)
        )
        attempt = session.get(Attempt, "a-1")
        assert attempt is not None
        attempt.last_seq, attempt.last_step = 2**40, big_step
    with session_scope(empty_engine) as session:
        assert sorted(e.seq for e in session.exec(select(EventRow)).all()) == [7, 2**40]
        checkpoint = session.exec(select(Checkpoint)).one()
        assert (checkpoint.step, checkpoint.bytes) == (big_step, three_gib)
        attempt = session.get(Attempt, "a-1")
        assert attempt is not None and (attempt.last_seq, attempt.last_step) == (2**40, big_step)
    assert schema_diff(empty_engine) == []


def test_upgrading_moves_a_resumed_runs_prefix_out_of_its_spec(empty_engine: Engine) -> None:
    """0005: the prefix a resubmit wrote into the spec's env becomes the column trainbot
    alone writes; a value that is not a run id (set by a chat override) is dropped."""
    with empty_engine.begin() as connection:
        command.upgrade(alembic_config(connection), "0004")
    add_run_and_attempt(empty_engine, spec={"env": {"TRAINBOT_CHECKPOINT_PREFIX": "r-old"}})
    add_run_and_attempt(
        empty_engine, "r-2", "a-2", spec={"env": {"TRAINBOT_CHECKPOINT_PREFIX": "../r-x", "A": "1"}}
    )
    migrate(empty_engine)
    with session_scope(empty_engine) as session:
        first, second = session.get(Run, "r-1"), session.get(Run, "r-2")
        assert first is not None and second is not None
        assert (first.checkpoint_prefix, first.spec["env"]) == ("r-old", {})
        assert (second.checkpoint_prefix, second.spec["env"]) == (None, {"A": "1"})
    assert schema_diff(empty_engine) == []
    with empty_engine.begin() as connection:
        command.downgrade(alembic_config(connection), "0004")
        spec = connection.execute(text("SELECT spec FROM runs WHERE id = 'r-1'")).scalar_one()
    env = (spec if isinstance(spec, dict) else json.loads(spec))["env"]
    assert env == {"TRAINBOT_CHECKPOINT_PREFIX": "r-old"}


def test_upgrading_moves_metrics_rows_into_blocks_and_downgrading_moves_them_back(
    empty_engine: Engine,
) -> None:
    with empty_engine.begin() as connection:
        command.upgrade(alembic_config(connection), "0003")
    add_run_and_attempt(empty_engine)
    add_run_and_attempt(empty_engine, run_id="r-2", attempt_id="a-2")
    metrics = [
        (attempt, seq, NOW + timedelta(seconds=seq / 4, microseconds=7))
        for attempt in ("a-1", "a-2")
        for seq in range(0, 1400 if attempt == "a-1" else 3)
    ]
    with session_scope(empty_engine) as session:
        for attempt, seq, at in reversed(metrics):  # not in seq order
            run = "r-1" if attempt == "a-1" else "r-2"
            session.add(
                event(seq, {"step": seq, "loss": "NaN" if seq == 5 else 1.0 / (seq + 1)},
                      attempt_id=attempt, run_id=run, kind="metrics", time=at)
            )  # fmt: skip
        session.add(event(5000, {"message": "kept"}))

    migrate(empty_engine)  # 0004

    with session_scope(empty_engine) as session:
        blocks = session.exec(select(MetricBlock).order_by(MetricBlock.attempt_id, MetricBlock.first_seq)).all()  # fmt: skip
        assert [(b.attempt_id, b.first_seq, b.last_seq, b.count) for b in blocks] == [
            ("a-1", 0, 499, 500), ("a-1", 500, 999, 500), ("a-1", 1000, 1399, 400),
            ("a-2", 0, 2, 3),
        ]  # fmt: skip
        points = [
            (b.attempt_id, seq, time, data)
            for b in blocks
            for seq, time, data in zip(b.seqs, b.times, b.data, strict=True)
        ]
        assert [(a, s, t) for a, s, t, _ in points] == [
            (a, s, at.timestamp()) for a, s, at in metrics
        ]
        assert points[5][3] == {"step": 5, "loss": "NaN"}
        assert blocks[1].first_time == NOW + timedelta(seconds=125, microseconds=7)
        assert blocks[1].last_time == NOW + timedelta(seconds=249.75, microseconds=7)
        assert [(e.seq, e.type) for e in session.exec(select(EventRow)).all()] == [(5000, "log")]

    with empty_engine.begin() as connection:
        command.downgrade(alembic_config(connection), "0003")

    assert "metric_blocks" not in inspect(empty_engine).get_table_names()
    with empty_engine.connect() as connection:
        rows = connection.execute(
            text("SELECT attempt_id, seq, type FROM events ORDER BY attempt_id, seq")
        ).all()
    assert [tuple(r) for r in rows] == sorted(
        [(a, s, "metrics") for a, s, _ in metrics] + [("a-1", 5000, "log")]
    )
    migrate(empty_engine)
    assert schema_diff(empty_engine) == []


def test_unreachable_database_is_a_database_error() -> None:
    engine = make_engine("postgresql://nobody@127.0.0.1:1/none?connect_timeout=2")
    with pytest.raises(DatabaseError, match="TRAINBOT_DATABASE_URL"):
        migrate(engine)
    with pytest.raises(DatabaseError):
        current_revision(engine)


# --- constraints ----------------------------------------------------------------------


def test_attempt_and_seq_are_unique(db_engine: Engine) -> None:
    add_run_and_attempt(db_engine)
    with session_scope(db_engine) as session:
        session.add(event(1, {"loss": 1.0}))
    with pytest.raises(ConflictError, match="already succeeded, there is nothing to do"):
        with session_scope(db_engine) as session:
            session.add(event(2, {"loss": 0.9}))
            session.add(event(1, {"loss": 0.5}))
    # The failed batch left nothing behind, and the original event is untouched.
    with session_scope(db_engine) as session:
        stored = session.exec(select(EventRow)).all()
    assert [(e.seq, e.data) for e in stored] == [(1, {"loss": 1.0})]
    add_run_and_attempt(db_engine, run_id="r-2", attempt_id="a-2")
    with session_scope(db_engine) as session:
        session.add(event(1, attempt_id="a-2", run_id="r-2"))  # same seq, other attempt


def test_idempotency_key_is_unique(db_engine: Engine) -> None:
    with session_scope(db_engine) as session:
        session.add(Run(id="r-1", spec_name="tiny", requester="U1", idempotency_key="slack:1"))
        session.add(Run(id="r-2", spec_name="tiny", requester="U1"))
        session.add(Run(id="r-3", spec_name="tiny", requester="U1"))  # many NULL keys are fine
    with pytest.raises(ConflictError):
        with session_scope(db_engine) as session:
            session.add(Run(id="r-4", spec_name="tiny", requester="U2", idempotency_key="slack:1"))
    with session_scope(db_engine) as session:
        session.add(CommandLog(key="slack:cmd:1", kind="launch", result={"run_id": "r-1"}))
    with pytest.raises(ConflictError):
        with session_scope(db_engine) as session:
            session.add(CommandLog(key="slack:cmd:1", kind="launch"))


def test_one_unresolved_alert_per_run_rule_and_key(db_engine: Engine) -> None:
    add_run_and_attempt(db_engine)
    dedupe = alert_dedupe_key("r-1", "loss_spike", "loss")
    with session_scope(db_engine) as session:
        session.add(
            Alert(run_id="r-1", rule="loss_spike", key="loss", dedupe_key=dedupe, title="t")
        )
    with pytest.raises(ConflictError):
        with session_scope(db_engine) as session:
            session.add(
                Alert(run_id="r-1", rule="loss_spike", key="loss", dedupe_key=dedupe, title="t")
            )
    with session_scope(db_engine) as session:
        first = session.exec(select(Alert)).one()
        first.state, first.dedupe_key, first.resolved_at = AlertState.RESOLVED, None, NOW
    with session_scope(db_engine) as session:
        session.add(
            Alert(run_id="r-1", rule="loss_spike", key="loss", dedupe_key=dedupe, title="t")
        )
    with session_scope(db_engine) as session:
        states = sorted(a.state.value for a in session.exec(select(Alert)).all())
    assert states == ["OPEN", "RESOLVED"]


def test_foreign_keys_are_enforced(db_engine: Engine) -> None:
    with pytest.raises(ConflictError):
        with session_scope(db_engine) as session:
            session.add(event(1, attempt_id="a-missing", run_id="r-missing"))


def test_session_scope_rolls_back_on_any_error(db_engine: Engine) -> None:
    with pytest.raises(RuntimeError):
        with session_scope(db_engine) as session:
            session.add(Run(id="r-9", spec_name="tiny", requester="U1"))
            session.flush()
            raise RuntimeError("boom")
    with session_scope(db_engine) as session:
        assert session.get(Run, "r-9") is None


# --- round trips ----------------------------------------------------------------------


def test_json_round_trip(db_engine: Engine) -> None:
    spec = load_spec("tiny", specs_dir=load_settings({}).specs_dir, overrides=["budget.usd=7"])
    payload = {"loss": 0.25, "nested": {"list": [1, 2.5, None, True]}, "text": "ünïcode ✓"}
    with session_scope(db_engine) as session:
        session.add(
            Run(id="r-1", spec_name="tiny", requester="U1", spec=spec.model_dump(mode="json"))
        )
        session.flush()
        session.add(Attempt(id="a-1", run_id="r-1", number=1, provider="local"))
        session.flush()
        session.add(event(1, payload))
        session.add(Budget(scope="team", name="C1", usd=1000.0, alerted=[50]))
        session.add(
            Checkpoint(run_id="r-1", step=10, uri="file:///c/r-1/step-10", committed_at=NOW)
        )
    with session_scope(db_engine) as session:
        run = session.get(Run, "r-1")
        stored = session.exec(select(EventRow)).one()
        budget = session.exec(select(Budget)).one()
        checkpoint = session.exec(select(Checkpoint)).one()
    assert run is not None
    assert JobSpec.model_validate(run.spec) == spec
    assert stored.data == payload
    assert (budget.thresholds, budget.alerted) == ([50, 80, 100], [50])
    assert checkpoint.metrics == {}


def test_datetimes_round_trip_as_aware_utc(db_engine: Engine) -> None:
    add_run_and_attempt(db_engine)
    berlin = timezone(timedelta(hours=2))
    local_time = datetime(2024, 3, 1, 14, 30, 15, 123456, tzinfo=berlin)
    with session_scope(db_engine) as session:
        attempt = session.get(Attempt, "a-1")
        assert attempt is not None
        attempt.last_heartbeat = local_time
        session.add(SchedulerLease(name="scheduler", holder="replica-1", expires_at=NOW))
    with session_scope(db_engine) as session:
        attempt = session.get(Attempt, "a-1")
        lease = session.get(SchedulerLease, "scheduler")
    assert attempt is not None and attempt.last_heartbeat is not None
    assert attempt.last_heartbeat == local_time
    assert attempt.last_heartbeat.utcoffset() == timedelta(0)
    assert attempt.last_heartbeat.hour == 12 and attempt.last_heartbeat.microsecond == 123456
    assert attempt.created_at.tzinfo is not None
    assert (
        lease is not None
        and lease.expires_at == NOW
        and lease.expires_at.utcoffset() == timedelta(0)
    )


def test_time_ranges_compare_instants_not_wall_clocks(db_engine: Engine) -> None:
    add_run_and_attempt(db_engine)
    tokyo = timezone(timedelta(hours=9))
    with session_scope(db_engine) as session:
        for seq, when in enumerate(
            [NOW - timedelta(minutes=10), (NOW + timedelta(minutes=5)).astimezone(tokyo)], 1
        ):
            session.add(
                SpendRecord(
                    attempt_id="a-1",
                    run_id="r-1",
                    period_start=when - timedelta(minutes=1),
                    period_end=when,
                    usd=0.1 * seq,
                    price_per_hour=1.0,
                )
            )
    with session_scope(db_engine) as session:
        later = session.exec(select(SpendRecord).where(SpendRecord.period_end > NOW)).all()
    assert [record.usd for record in later] == [pytest.approx(0.2)]


def test_naive_datetimes_are_refused(db_engine: Engine) -> None:
    with pytest.raises(StatementError, match="naive datetime"):
        with session_scope(db_engine) as session:
            session.add(
                Run(id="r-1", spec_name="t", requester="U1", created_at=datetime(2024, 1, 1))
            )


def test_states_come_back_as_enum_members(db_engine: Engine) -> None:
    add_run_and_attempt(db_engine)
    with session_scope(db_engine) as session:
        run = session.get(Run, "r-1")
        assert run is not None
        run.state = RunState.RECOVERING
    with session_scope(db_engine) as session:
        run = session.get(Run, "r-1")
        attempt = session.get(Attempt, "a-1")
        recovering = session.exec(select(Run).where(Run.state == RunState.RECOVERING)).all()
    assert run is not None and run.state is RunState.RECOVERING
    assert attempt is not None and attempt.state is AttemptState.REQUESTED
    assert [r.id for r in recovering] == ["r-1"]


def test_tokens_are_stored_hashed(db_engine: Engine) -> None:
    add_run_and_attempt(db_engine)
    token = "runner-token-abc"
    with session_scope(db_engine) as session:
        attempt = session.get(Attempt, "a-1")
        assert attempt is not None
        attempt.token_hash = hash_token(token)
    with session_scope(db_engine) as session:
        found = session.exec(select(Attempt).where(Attempt.token_hash == hash_token(token))).one()
    assert found.id == "a-1"
    assert found.token_hash is not None and token not in found.token_hash
    assert len(found.token_hash) == 64


# --- engines --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("not a url", "TRAINBOT_DATABASE_URL is not a database URL"),
        ("mysql://u@h/db", "uses 'mysql', which trainbot does not support"),
    ],
)
def test_bad_database_urls(url: str, expected: str) -> None:
    with pytest.raises(SettingsError, match=expected) as caught:
        make_engine(url)
    assert "postgresql://" in str(caught.value)


def test_postgres_scheme_alias_and_hidden_password() -> None:
    engine = make_engine("postgres://user:hunter2@db.example.com/trainbot")
    assert engine.url.drivername == "postgresql+psycopg2"
    with pytest.raises(SettingsError) as caught:
        make_engine("mysql://user:hunter2@db/x")
    assert "hunter2" not in str(caught.value)


def test_sqlite_engine_is_tuned_for_threads(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'nested' / 'dir' / 'trainbot.db'}")
    with engine.connect() as connection:
        pragmas = {
            name: connection.exec_driver_sql(f"PRAGMA {name}").scalar()
            for name in (
                "journal_mode",
                "synchronous",
                "foreign_keys",
                "busy_timeout",
                "wal_autocheckpoint",
                "journal_size_limit",
            )
        }
    assert pragmas == {
        "journal_mode": "wal",
        "synchronous": 1,  # NORMAL
        "foreign_keys": 1,
        "busy_timeout": 30000,
        "wal_autocheckpoint": 16384,
        "journal_size_limit": 16384 * 4096,
    }
    engine.dispose()


def test_in_memory_sqlite_is_shared_between_threads() -> None:
    engine = make_engine("sqlite://")
    migrate(engine)
    with session_scope(engine) as session:
        session.add(Run(id="r-1", spec_name="tiny", requester="U1"))
    seen: list[Run | None] = []

    def read() -> None:
        with session_scope(engine) as session:
            seen.append(session.get(Run, "r-1"))

    thread = threading.Thread(target=read)
    thread.start()
    thread.join(timeout=10)
    assert seen and seen[0] is not None


def test_concurrent_read_then_write_on_sqlite_neither_fails_nor_loses_updates(
    tmp_path: Path,
) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'trainbot.db'}")
    migrate(engine)
    with session_scope(engine) as session:
        session.add(Run(id="r-1", spec_name="tiny", requester="U1"))
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def bump() -> None:
        try:
            start.wait(timeout=10)
            for _ in range(15):
                with session_scope(engine) as session:
                    run = session.get(Run, "r-1")
                    assert run is not None
                    run.preemptions += 1
        except BaseException as exc:  # collected and asserted on below
            errors.append(exc)

    threads = [threading.Thread(target=bump) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    with session_scope(engine) as session:
        run = session.get(Run, "r-1")
    assert run is not None and run.preemptions == 90
    engine.dispose()
