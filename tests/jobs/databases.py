"""The tests' databases: ``db_engine``, a migrated database, once on SQLite (a file in
the test's temporary directory) and once on PostgreSQL when ``TRAINBOT_TEST_POSTGRES_URL``
is set, so nothing works on one database by accident; ``empty_engine``, a database
before migration (a fresh PostgreSQL schema, dropped afterwards). ``tests/conftest.py``
loads this module as a plugin, so every test package has these fixtures.

A migrated database without a migration per test.

Migrating costs 0.2 s on SQLite and 0.7-1 s on PostgreSQL (about 120 DDL statements,
then ``DROP SCHEMA … CASCADE``), and some 500 tests take a migrated database. Each test
still gets a database in exactly the migrated state:

- **SQLite:** each worker migrates one file once; a test gets a byte copy of it.
- **PostgreSQL:** each worker migrates one schema once and hands it to one test at a
  time. Before the next test it checks that the schema is still the migrated one (a
  fingerprint of its catalog: tables, columns, defaults, constraints, indexes,
  sequences, triggers, functions and types) and that the two tables migrate writes
  (``alembic_version``, ``schema_compat``) hold what migrate wrote. If so it deletes
  every row and restarts the sequences; if anything differs (a test dropped an index,
  added a trigger, downgraded) or a lock is still held a second later, the schema is
  set aside (dropped, or at the worker's end where still locked) and a new one migrated. A test's leftovers therefore never reach the next test.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import Connection, Engine, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from jobs.database.db import make_engine, migrate

# The tables migrate itself fills; the others are empty after migrating.
MIGRATE_WRITES = ("alembic_version", "schema_compat")

# The catalog of one schema, as one text: changes with any DDL a test may run there.
_FINGERPRINT = text(
    """
    WITH ns AS (SELECT oid FROM pg_namespace WHERE nspname = :schema)
    SELECT md5(coalesce(string_agg(part, '|' ORDER BY part), '')) FROM (
      SELECT 'rel:' || c.relname || ':' || c.relkind::text
        FROM pg_class c WHERE c.relnamespace = (SELECT oid FROM ns)
      UNION ALL
      SELECT 'col:' || c.relname || '.' || a.attname || ':'
             || format_type(a.atttypid, a.atttypmod) || ':' || a.attnotnull::text || ':'
             || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
       WHERE c.relnamespace = (SELECT oid FROM ns) AND a.attnum > 0 AND NOT a.attisdropped
      UNION ALL
      SELECT 'con:' || conname || ':' || pg_get_constraintdef(oid)
        FROM pg_constraint WHERE connamespace = (SELECT oid FROM ns)
      UNION ALL
      SELECT 'idx:' || pg_get_indexdef(i.indexrelid)
        FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
       WHERE c.relnamespace = (SELECT oid FROM ns)
      UNION ALL
      SELECT 'trg:' || t.tgname || ':' || c.relname
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
       WHERE c.relnamespace = (SELECT oid FROM ns) AND NOT t.tgisinternal
      UNION ALL
      SELECT 'fn:' || p.proname FROM pg_proc p WHERE p.pronamespace = (SELECT oid FROM ns)
      UNION ALL
      SELECT 'type:' || t.typname FROM pg_type t WHERE t.typnamespace = (SELECT oid FROM ns)
      UNION ALL
      SELECT 'enum:' || t.typname || ':' || e.enumlabel || ':' || e.enumsortorder::text
        FROM pg_enum e JOIN pg_type t ON t.oid = e.enumtypid
       WHERE t.typnamespace = (SELECT oid FROM ns)
    ) AS parts(part)
    """
)


def with_search_path(url: str, schema: str) -> str:
    """The URL with libpq's ``options`` set so every connection uses ``schema``."""
    parsed = make_url(url)
    options = parsed.query.get("options", "")
    if isinstance(options, tuple):
        options = " ".join(options)
    options = f"{options} -csearch_path={schema}".strip()
    return parsed.update_query_dict({"options": options}).render_as_string(hide_password=False)


class SqliteTemplate:
    """One migrated SQLite file per worker, copied for each test."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._template: Path | None = None

    def copy_to(self, path: Path) -> None:
        """Put a migrated database at ``path`` (which must not exist yet)."""
        if self._template is None:
            template = self._directory / "migrated.db"
            engine = make_engine(f"sqlite:///{template}")
            try:
                migrate(engine)
            finally:
                engine.dispose()
            # Everything in the main file, so the copy needs no -wal beside it (closing
            # the last connection checkpoints, and removes the -wal file).
            sqlite3.connect(template).close()
            leftover = [p.name for p in self._directory.iterdir() if p != template]
            if leftover:
                raise RuntimeError(f"the migrated SQLite file left {leftover} beside it")
            self._template = template
        if path.exists():
            raise FileExistsError(f"{path} exists: a migrated copy would replace it")
        shutil.copyfile(self._template, path)


class PostgresSchemas:
    """One migrated PostgreSQL schema per worker, emptied between tests (see the module)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._admin = make_engine(url)
        self._schema: str | None = None
        self._fingerprint = ""
        self._written: dict[str, str] = {}
        self._delete_order: list[str] = []
        self._left: list[str] = []  # set aside while still locked: dropped at the end
        self.fresh_count = 0  # schemas migrated: one, unless tests changed theirs

    def acquire(self) -> str:
        """The URL of a schema in the migrated state, with no rows a test wrote."""
        if self._schema is not None and not self._emptied(self._schema):
            self._set_aside(self._schema)
            self._schema = None
        if self._schema is None:
            self._schema = self._migrated()
        return with_search_path(self._url, self._schema)

    def close(self) -> None:
        if self._schema is not None:
            self._set_aside(self._schema)
            self._schema = None
        for schema in self._left:
            self._drop(schema, lock_timeout_s=10)
        self._admin.dispose()

    def _migrated(self) -> str:
        schema = f"trainbot_test_{uuid.uuid4().hex[:12]}"
        with self._admin.begin() as connection:
            connection.execute(text(f'CREATE SCHEMA "{schema}"'))
        engine = make_engine(with_search_path(self._url, schema))
        try:
            migrate(engine)
            with engine.connect() as connection:
                self._fingerprint = self._fingerprint_of(connection, schema)
                self._written = {
                    table: self._rows_of(connection, table) for table in MIGRATE_WRITES
                }
            sorted_tables = inspect(engine).get_sorted_table_and_fkc_names()
        except BaseException:
            engine.dispose()
            self._drop(schema, lock_timeout_s=5)  # no schema left behind by a failure
            raise
        engine.dispose()
        names = [name for name, _ in sorted_tables if name is not None]
        # Children before their parents, so no foreign key refuses a delete.
        self._delete_order = [name for name in reversed(names) if name not in MIGRATE_WRITES]
        self.fresh_count += 1
        return schema

    def _emptied(self, schema: str) -> bool:
        """Delete every row a test wrote; False where the schema is no longer the
        migrated one, or cannot be emptied at once (a lock a test left behind)."""
        try:
            with self._admin.begin() as connection:
                connection.execute(text("SET LOCAL lock_timeout = '1s'"))
                connection.execute(text(f'SET LOCAL search_path = "{schema}"'))
                if self._fingerprint_of(connection, schema) != self._fingerprint:
                    return False
                for table, rows in self._written.items():
                    if self._rows_of(connection, table) != rows:
                        return False
                for table in self._delete_order:
                    connection.execute(text(f'DELETE FROM "{table}"'))
                connection.execute(
                    text(
                        "SELECT setval(s.seqrelid, s.seqstart, false) FROM pg_sequence s "
                        "JOIN pg_class c ON c.oid = s.seqrelid "
                        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = :schema"
                    ),
                    {"schema": schema},
                )
        except SQLAlchemyError:
            return False
        return True

    def _set_aside(self, schema: str) -> None:
        """Drop a schema no test uses any more; one still locked is dropped at the end."""
        if not self._drop(schema, lock_timeout_s=1):
            self._left.append(schema)

    def _drop(self, schema: str, *, lock_timeout_s: int) -> bool:
        try:
            with self._admin.begin() as connection:
                connection.execute(text(f"SET LOCAL lock_timeout = '{lock_timeout_s}s'"))
                connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        except SQLAlchemyError:
            return False
        return True

    @staticmethod
    def _fingerprint_of(connection: Connection, schema: str) -> str:
        return str(connection.execute(_FINGERPRINT, {"schema": schema}).scalar_one())

    @staticmethod
    def _rows_of(connection: Connection, table: str) -> str:
        every_row = (
            f"SELECT coalesce(string_agg(t::text, ',' ORDER BY t::text), '') FROM \"{table}\" t"
        )
        return str(connection.execute(text(every_row)).scalar_one())


# -- the fixtures (a plugin of tests/conftest.py, so every test package has them) -------

POSTGRES_URL_ENV = "TRAINBOT_TEST_POSTGRES_URL"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_kind(request: pytest.FixtureRequest) -> str:
    """Which database a test's ``db_engine`` or ``empty_engine`` is: each test runs on both."""
    return str(request.param)


@pytest.fixture
def empty_engine(database_kind: str, tmp_path: Path) -> Iterator[Engine]:
    """An engine on an empty database: SQLite, or a fresh PostgreSQL schema."""
    if database_kind == "sqlite":
        engine = make_engine(f"sqlite:///{tmp_path / 'trainbot.db'}")
        yield engine
        engine.dispose()
        return
    url = postgres_or_skip("to run the PostgreSQL variant")
    with fresh_schema(url, "trainbot_test") as schema_url:
        engine = make_engine(schema_url)
        try:
            yield engine
        finally:
            engine.dispose()


def postgres_or_skip(why: str) -> str:
    """The test PostgreSQL's URL, or the test skipped saying how to set it and ``why``."""
    url = os.environ.get(POSTGRES_URL_ENV)
    if not url:
        pytest.skip(
            f"{POSTGRES_URL_ENV} is not set: set it to a PostgreSQL URL such as "
            f"postgresql://postgres@127.0.0.1:5432/test {why}"
        )
    return url


@contextmanager
def fresh_schema(url: str, prefix: str) -> Iterator[str]:
    """A URL whose connections use a new PostgreSQL schema (``prefix`` and a random
    suffix) of the database at ``url``; the schema is dropped at the end."""
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = make_engine(url)
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield with_search_path(url, schema)
    finally:
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> SqliteTemplate:
    """The worker's migrated SQLite file, copied for each test."""
    return SqliteTemplate(tmp_path_factory.mktemp("migrated"))


@pytest.fixture(scope="session")
def postgres_schemas() -> Iterator[PostgresSchemas]:
    """The worker's migrated PostgreSQL schema, emptied between tests."""
    schemas = PostgresSchemas(postgres_or_skip("to run the PostgreSQL variant"))
    yield schemas
    schemas.close()


@pytest.fixture
def db_engine(
    database_kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Engine]:
    """An engine on a database migrated to the newest revision, with no rows."""
    if "empty_engine" in request.fixturenames:
        # The same database as the test's empty_engine, as a test that takes both expects.
        engine = request.getfixturevalue("empty_engine")
        migrate(engine)
        yield engine
        return
    if database_kind == "sqlite":
        path = tmp_path / "trainbot.db"
        request.getfixturevalue("sqlite_template").copy_to(path)
        engine = make_engine(f"sqlite:///{path}")
    else:
        engine = make_engine(request.getfixturevalue("postgres_schemas").acquire())
    try:
        yield engine
    finally:
        engine.dispose()
