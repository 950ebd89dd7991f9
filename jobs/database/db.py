"""Engine, sessions and migrations for SQLite (embedded) and PostgreSQL (production).

SQLite is tuned for a control plane with threads: WAL (readers never block the
writer) with ``synchronous=NORMAL``, foreign keys enforced, a busy timeout, and
``BEGIN IMMEDIATE`` for every transaction. The last one matters: with SQLite's default
deferred transactions two sessions that read and then write deadlock on the lock
upgrade, and SQLite fails one at once instead of waiting out the busy timeout. Taking
the write lock at ``BEGIN`` makes them queue. The price is that SQLite sessions run one
at a time, so keep them short: never hold a session open across a network call.

``synchronous=NORMAL`` in WAL mode syncs the WAL at each checkpoint, not at each
commit: a commit survives a crash of the process, and a power loss can take back the
last commits before the sync, never corrupt the database. That is the usual choice for
WAL; ``FULL`` would add a sync to every runner batch. The WAL is checkpointed every
``SQLITE_WAL_CHECKPOINT_PAGES`` pages (64 MiB) instead of SQLite's 4 MiB, so the two
syncs a checkpoint costs come sixteen times less often under the runners' event stream,
and ``journal_size_limit`` trims the WAL file back to that size afterwards.

Migrations are Alembic's, configured in code (no ``alembic.ini``); to draft a new
revision against a scratch database::

    from alembic import command
    from jobs.database.db import alembic_config, make_engine, migrate
    engine = make_engine("sqlite:////tmp/draft.db"); migrate(engine)
    with engine.begin() as conn:
        command.revision(alembic_config(conn), "add x", autogenerate=True, rev_id="0002")

then review the generated file; ``tests/jobs/test_db.py`` checks it matches the models.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import (
    Column,
    ColumnElement,
    Connection,
    Engine,
    Row,
    Select,
    Update,
    create_engine,
    delete,
    event,
    inspect,
    text,
)
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DisconnectionError,
    IntegrityError,
    NoSuchModuleError,
    OperationalError,
)
from sqlalchemy.pool import StaticPool
from sqlmodel import Field, Session, SQLModel

from jobs.domain.errors import ConflictError, DatabaseError, SettingsError

__all__ = [
    "COMPAT_TABLE",
    "MIGRATIONS_DIR",
    "SchemaCompat",
    "alembic_config",
    "claim_rows",
    "current_revision",
    "delete_before",
    "head_revision",
    "make_engine",
    "migrate",
    "serves_from",
    "session_scope",
]

#: The Alembic script directory shipped in the package.
MIGRATIONS_DIR = Path(__file__).resolve().parents[1] / "migrations"

#: Seconds a SQLite connection waits for another's write lock before giving up.
SQLITE_BUSY_TIMEOUT_S = 30.0
#: WAL pages (4 KiB) between automatic checkpoints (SQLite's default is 1000).
SQLITE_WAL_CHECKPOINT_PAGES = 16384
#: The WAL file is truncated back to this many bytes after a checkpoint.
SQLITE_WAL_LIMIT_BYTES = SQLITE_WAL_CHECKPOINT_PAGES * 4096
#: Seconds a pooled PostgreSQL connection may sit idle and be handed out unpinged.
POSTGRES_PING_IDLE_S = 1.0

# Arbitrary constant: the PostgreSQL advisory lock that makes concurrent replicas
# migrate one after the other instead of racing on CREATE TABLE.
_MIGRATION_LOCK_ID = 0x7472_6169_6E62  # "trainb"

#: The one-row table (migration 0020) that says which releases the schema serves.
COMPAT_TABLE = "schema_compat"

_URL_EXAMPLES = (
    "use sqlite:////absolute/path/trainbot.db or postgresql://user:password@host:5432/dbname"
)


def _parse_url(url: str) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise SettingsError(
            f"TRAINBOT_DATABASE_URL is not a database URL: {_URL_EXAMPLES}"
        ) from None
    if parsed.drivername in ("postgres", "postgresql"):
        # "postgres://" is what Heroku-style providers hand out; SQLAlchemy wants the full name.
        parsed = parsed.set(drivername="postgresql+psycopg2")
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise SettingsError(
            f"TRAINBOT_DATABASE_URL uses {backend!r}, which trainbot does not support: "
            f"{_URL_EXAMPLES}"
        )
    return parsed


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """An engine for a SQLite or PostgreSQL URL, configured for this control plane.

    Its errors leave out the statement's parameters: a run's row holds its spec, whose
    ``env`` may hold credentials, and errors are logged.

    Raises :class:`SettingsError` for a URL that is malformed, names another database,
    or needs a driver that is not installed. Connecting happens later, on first use.
    """
    parsed = _parse_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed, echo=echo)
    try:
        engine = create_engine(parsed, echo=echo, hide_parameters=True)
    except (ModuleNotFoundError, NoSuchModuleError):
        raise SettingsError(
            "TRAINBOT_DATABASE_URL names PostgreSQL but its driver is missing: "
            "pip install 'trainbot[postgres]' (psycopg2-binary)"
        ) from None
    _ping_when_idle(engine)
    return engine


def _ping_when_idle(engine: Engine) -> None:
    """Ping a pooled connection before handing it out when it sat idle
    ``POSTGRES_PING_IDLE_S`` or more: one that was dropped (a restarted server, a proxy's
    idle timeout) is replaced, not given to a caller. SQLAlchemy's ``pool_pre_ping`` pings
    at every checkout, a round trip of its own for every runner batch (the ingest API's
    hot path is one round trip without it); a connection in use a moment ago is no more
    likely dead than one pinged a moment ago."""

    @event.listens_for(engine, "connect")
    def _connected(_dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("idle_since")
        if since is not None and time.monotonic() - since < POSTGRES_PING_IDLE_S:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as exc:
            raise DisconnectionError(f"a pooled connection was dropped: {exc}") from exc


def _sqlite_engine(parsed: URL, *, echo: bool) -> Engine:
    database = parsed.database or ""
    connect_args: dict[str, Any] = {
        "check_same_thread": False,
        "timeout": SQLITE_BUSY_TIMEOUT_S,
    }
    if database in ("", ":memory:"):
        # One shared connection, or every thread would get its own empty database.
        engine = create_engine(
            parsed,
            echo=echo,
            connect_args=connect_args,
            poolclass=StaticPool,
            hide_parameters=True,
        )
    else:
        directory = Path(database).expanduser().absolute().parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SettingsError(
                f"cannot create {directory} for the SQLite database ({exc.strerror}): set "
                "TRAINBOT_STATE_DIR or TRAINBOT_DATABASE_URL to a writable place"
            ) from None
        engine = create_engine(parsed, echo=echo, connect_args=connect_args, hide_parameters=True)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy, not the sqlite3 module, decide where transactions begin.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
            if database not in ("", ":memory:"):
                cursor.execute("PRAGMA journal_mode=WAL")
                cursor.execute("PRAGMA synchronous=NORMAL")
                cursor.execute(f"PRAGMA wal_autocheckpoint={SQLITE_WAL_CHECKPOINT_PAGES}")
                cursor.execute(f"PRAGMA journal_size_limit={SQLITE_WAL_LIMIT_BYTES}")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def _first_line(exc: Exception) -> str:
    cause = getattr(exc, "orig", None) or exc
    return str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """A session that commits when the block ends and rolls back if it raises.

    Objects stay usable after the block (``expire_on_commit=False``), so a use-case
    can return what it wrote. A constraint violation becomes :class:`ConflictError`
    and an unreachable or locked database :class:`DatabaseError`; nothing is left
    half-written in either case.
    """
    session = Session(engine, expire_on_commit=False)
    try:
        yield session
        session.commit()
    except IntegrityError as exc:
        session.rollback()
        raise ConflictError(
            f"the database refused the change ({_first_line(exc)}): a record with the "
            "same key exists or a referenced one does not; if this repeats a command "
            "that already succeeded, there is nothing to do"
        ) from exc
    except OperationalError as exc:
        session.rollback()
        raise DatabaseError(
            f"the database failed ({_first_line(exc)}): check that it is running and "
            "that TRAINBOT_DATABASE_URL points at it, then retry"
        ) from exc
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def claim_rows(
    session: Session, query: Select[Any], key: ColumnElement[Any], change: Update
) -> Sequence[Row[Any]]:
    """Claim the rows ``query`` selects (their ``key`` column) with ``change``, an
    ``UPDATE … RETURNING``, in the caller's transaction. On PostgreSQL the selected rows
    are locked ``FOR UPDATE SKIP LOCKED`` first, so two replicas claiming at once take
    different rows; SQLite's single writer (``BEGIN IMMEDIATE``) serialises them already."""
    if session.get_bind().dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True)
    keys = list(session.execute(query).scalars())
    if not keys:
        return []
    return session.execute(change.where(key.in_(keys))).all()


def delete_before(engine: Engine, column: Column[Any], before: datetime) -> int:
    """Delete the rows of ``column``'s table whose ``column`` is earlier than ``before``
    (NULL: kept); how many went."""
    with session_scope(engine) as session:
        gone = session.execute(delete(column.table).where(column < before).returning(column))
        return len(gone.all())


def alembic_config(connection: Connection | None = None, *, url: str | None = None) -> Config:
    """Alembic's configuration for ``jobs/migrations``, built in code.

    ``connection`` is what the migrations run on; ``url`` is only for offline
    (``--sql``) rendering.
    """
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("path_separator", "os")
    config.set_main_option("file_template", "%%(rev)s_%%(slug)s")
    if url is not None:
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """The newest schema revision this version of trainbot knows."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise DatabaseError("jobs/migrations has no revisions: the package is incomplete")
    return head


def current_revision(engine: Engine) -> str | None:
    """The schema revision the database is at; ``None`` before the first migration."""
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    except OperationalError as exc:
        raise DatabaseError(
            f"cannot read the schema revision ({_first_line(exc)}): check that the database "
            "is running and that TRAINBOT_DATABASE_URL points at it"
        ) from exc


class SchemaCompat(SQLModel, table=True):
    """Which releases the schema serves (one row, id 1; migration 0020).

    Written by :func:`migrate` after each upgrade and read, with plain SQL, by an older
    release that finds a revision it does not know (a rollback).
    """

    __tablename__ = COMPAT_TABLE

    id: int | None = Field(default=None, primary_key=True)
    #: The newest revision, as the code that migrated the schema knows it.
    head: str
    #: The oldest revision whose release still runs on this schema.
    serves_from: str


def serves_from(script: ScriptDirectory | None = None) -> str:
    """The oldest revision whose code still runs on the schema at this code's head.

    Walking down from the head, every migration that declares ``expand_only = True``
    (new tables, nullable columns, new indexes: nothing an older release reads or writes
    changes) leaves the release before it able to run; the first one that does not
    declare it (a drop, a rename, a type change, or simply undeclared) stops the walk.
    """
    script = script or ScriptDirectory.from_config(alembic_config())
    revision = script.get_revision(head_revision())
    while revision is not None and getattr(revision.module, "expand_only", False) is True:
        down = revision.down_revision
        if not isinstance(down, str):
            break
        revision = script.get_revision(down)
    if revision is None:
        raise DatabaseError("jobs/migrations has no revisions: the package is incomplete")
    return revision.revision


def _compat_row(connection: Connection) -> tuple[str, str] | None:
    """The schema's (head, serves_from) as the newest code that migrated it wrote them;
    ``None`` where no release has written them (the table arrived in 0020)."""
    if COMPAT_TABLE not in inspect(connection).get_table_names():
        return None
    row = connection.execute(
        text(f"SELECT head, serves_from FROM {COMPAT_TABLE} WHERE id = 1")
    ).first()
    return None if row is None else (str(row[0]), str(row[1]))


def _runs_on_newer_schema(connection: Connection, script: ScriptDirectory) -> bool:
    """Whether the schema is newer than this code but still serves it (an expand-only
    step ahead: a rollback to this release); raises where it does not serve it."""
    current = MigrationContext.configure(connection).get_current_revision()
    if current is None or _known(script, current):
        return False
    compat = _compat_row(connection)
    ours = head_revision()
    if compat is None or not _known(script, compat[1]):
        oldest = "a release it does not name" if compat is None else f"revision {compat[1]}"
        raise DatabaseError(
            f"the database's schema is at revision {current}, written by a newer trainbot, "
            f"and serves {oldest} onward; this trainbot knows revisions up to {ours}. "
            "If a newer trainbot has migrated it, run that version (or newer) instead"
        )
    return True


def _known(script: ScriptDirectory, revision: str) -> bool:
    try:
        return script.get_revision(revision) is not None
    except CommandError:
        return False


def _record_compat(connection: Connection, script: ScriptDirectory) -> None:
    if COMPAT_TABLE not in inspect(connection).get_table_names():
        return
    head, oldest = head_revision(), serves_from(script)
    if _compat_row(connection) == (head, oldest):
        return
    connection.execute(text(f"DELETE FROM {COMPAT_TABLE}"))
    connection.execute(
        text(f"INSERT INTO {COMPAT_TABLE} (id, head, serves_from) VALUES (1, :head, :oldest)"),
        {"head": head, "oldest": oldest},
    )


def migrate(engine: Engine) -> None:
    """Bring the schema up to the newest revision (``alembic upgrade head``).

    Safe to call at every start and from several replicas at once: it does nothing
    when the schema is current, and on PostgreSQL an advisory lock serialises
    concurrent callers. The whole upgrade is one transaction where the database
    allows (both do), so a failure leaves the previous schema intact.

    Expand, then contract: the schema records which oldest revision it still serves
    (:func:`serves_from`, in ``schema_compat``), so a release rolled back onto a schema
    one expand-only step ahead of it runs on it unchanged; one further behind is
    refused with the revisions named.
    """
    try:
        with engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(
                    text("SELECT pg_advisory_xact_lock(:lock_id)"), {"lock_id": _MIGRATION_LOCK_ID}
                )
            script = ScriptDirectory.from_config(alembic_config())
            if _runs_on_newer_schema(connection, script):
                return
            command.upgrade(alembic_config(connection), "head")
            _record_compat(connection, script)
    except CommandError as exc:
        raise DatabaseError(
            f"cannot migrate the database: {exc}. If a newer trainbot has migrated it, "
            "run that version (or newer) instead"
        ) from exc
    except OperationalError as exc:
        raise DatabaseError(
            f"cannot migrate the database ({_first_line(exc)}): check that it is running and "
            "that TRAINBOT_DATABASE_URL points at it"
        ) from exc


def detach(session: Session, obj: object) -> None:
    """Write an object's pending changes, then detach it so it can outlive the session.

    Expunging without the flush silently drops whatever was changed since the last one.
    """
    session.flush()
    session.expunge(obj)
