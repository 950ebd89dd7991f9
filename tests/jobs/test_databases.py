"""The migrated test databases handed from test to test (``tests.jobs.databases``): the
next test gets exactly the migrated state, whatever the last one did to its database."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import Engine, inspect
from sqlmodel import select

from jobs.database.db import current_revision, head_revision, make_engine, migrate, session_scope
from jobs.database.models import Checkpoint, Run
from tests.jobs.databases import PostgresSchemas, SqliteTemplate, fresh_schema, postgres_or_skip
from tests.jobs.rows import tiny_run

NOW = datetime(2026, 12, 6, 12, tzinfo=UTC)


@pytest.fixture(scope="module")
def schemas() -> Iterator[PostgresSchemas]:
    made = PostgresSchemas(postgres_or_skip("to test the reused PostgreSQL schema"))
    yield made
    made.close()


@pytest.fixture(scope="module")
def migrated_catalog() -> dict[str, object]:
    """The catalog of a schema migrated the ordinary way, to compare with."""
    with fresh_schema(postgres_or_skip("to compare with a migration"), "trainbot_ref") as url:
        engine = make_engine(url)
        try:
            migrate(engine)
            return catalog(engine)
        finally:
            engine.dispose()


def catalog(engine: Engine) -> dict[str, object]:
    """What a migrated database holds besides rows: tables, columns, indexes, keys."""
    inspector = inspect(engine)
    return {
        table: (
            sorted(
                (c["name"], str(c["type"]), c["nullable"]) for c in inspector.get_columns(table)
            ),
            sorted(str(sorted(i.items())) for i in inspector.get_indexes(table)),
            sorted(str(sorted(f.items())) for f in inspector.get_foreign_keys(table)),
        )
        for table in inspector.get_table_names()
    }


def write_a_run_and_a_checkpoint(engine: Engine) -> int:
    """A run and a checkpoint of it; the checkpoint's id (from its sequence)."""
    with session_scope(engine) as session:
        session.add(tiny_run("r-1"))
        session.flush()
        checkpoint = Checkpoint(run_id="r-1", step=5, uri="u", bytes=1, committed_at=NOW)
        session.add(checkpoint)
        session.flush()
        assert checkpoint.id is not None
        return checkpoint.id


def rows_and_next_id(engine: Engine) -> tuple[int, int, int]:
    """Runs and checkpoints stored, and the id the next checkpoint gets."""
    with session_scope(engine) as session:
        runs = len(session.exec(select(Run)).all())
        checkpoints = len(session.exec(select(Checkpoint)).all())
    next_id = write_a_run_and_a_checkpoint(engine)
    return runs, checkpoints, next_id


@pytest.mark.postgres
def test_the_next_test_gets_the_migrated_schema_without_the_last_ones_rows(
    schemas: PostgresSchemas, migrated_catalog: dict[str, object]
) -> None:
    first = make_engine(schemas.acquire())
    migrations = schemas.fresh_count
    assert catalog(first) == migrated_catalog
    assert rows_and_next_id(first) == (0, 0, 1)  # and a run and checkpoint 1 written
    first.dispose()

    second = make_engine(schemas.acquire())
    assert rows_and_next_id(second) == (0, 0, 1)  # emptied, the sequence started again
    assert catalog(second) == migrated_catalog
    assert current_revision(second) == head_revision()
    assert schemas.fresh_count == migrations  # emptied, not migrated again
    second.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize(
    "change",
    [
        "DROP INDEX ix_runs_requester",
        "CREATE INDEX ix_probe ON runs (spec_name)",
        "ALTER TABLE runs ADD COLUMN probe integer",
        "ALTER TABLE runs ALTER COLUMN requester DROP NOT NULL",
        "CREATE TABLE probe (id serial PRIMARY KEY)",
        "CREATE FUNCTION probe() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RETURN NEW; END $$; "
        "CREATE TRIGGER probe BEFORE INSERT ON runs FOR EACH ROW EXECUTE FUNCTION probe()",
        "UPDATE alembic_version SET version_num = '9999_future'",
        "UPDATE schema_compat SET serves_from = '9998_future'",
    ],
)
def test_a_schema_a_test_changed_is_set_aside_for_a_new_migrated_one(
    schemas: PostgresSchemas, migrated_catalog: dict[str, object], change: str
) -> None:
    first = make_engine(schemas.acquire())
    migrations = schemas.fresh_count
    with first.begin() as connection:
        connection.exec_driver_sql(change)
    first.dispose()

    second = make_engine(schemas.acquire())
    assert schemas.fresh_count == migrations + 1
    assert catalog(second) == migrated_catalog
    assert current_revision(second) == head_revision()
    second.dispose()


@pytest.mark.postgres
def test_a_schema_a_test_left_locked_is_set_aside(schemas: PostgresSchemas) -> None:
    first = make_engine(schemas.acquire())
    migrations = schemas.fresh_count
    held = first.connect()
    transaction = held.begin()
    held.exec_driver_sql("LOCK TABLE runs IN ACCESS EXCLUSIVE MODE")
    try:
        second = make_engine(schemas.acquire())  # waits 1 s for the lock, then moves on
        assert schemas.fresh_count == migrations + 1
        assert current_revision(second) == head_revision()
        second.dispose()
    finally:
        transaction.rollback()
        held.close()
        first.dispose()


def test_each_sqlite_copy_is_the_migrated_file_alone(tmp_path: Path) -> None:
    template = SqliteTemplate(tmp_path / "template")
    (tmp_path / "template").mkdir()
    engines = []
    for name in ("a.db", "b.db"):
        template.copy_to(tmp_path / name)
        engines.append(make_engine(f"sqlite:///{tmp_path / name}"))
    write_a_run_and_a_checkpoint(engines[0])
    assert rows_and_next_id(engines[1]) == (0, 0, 1)
    assert current_revision(engines[1]) == head_revision()
    with pytest.raises(FileExistsError, match="a migrated copy would replace it"):
        template.copy_to(tmp_path / "a.db")
    for engine in engines:
        engine.dispose()
