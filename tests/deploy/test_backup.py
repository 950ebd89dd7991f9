"""The backup job and the restore drill (issue 28, point 4), against a real PostgreSQL.

deploy/kubernetes/backup/backup.sh (what the CronJob and compose's backup service run)
dumps a database the current code migrated and filled; restore.sh restores the dump into
a fresh database; every table's row count, the schema revision and a run's figures read
back the same, and the control plane starts on the restored database.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from sqlalchemy import Engine, inspect, text
from sqlalchemy.engine import make_url
from sqlmodel import Session

from jobs.database.db import current_revision, head_revision, make_engine, migrate
from jobs.database.models import EventRow, SpendRecord
from jobs.spend.accrual import run_spent
from tests.jobs.rows import add_running_attempt
from tests.paths import ROOT

BACKUP = ROOT / "deploy" / "kubernetes" / "backup"
TOOLS = ("pg_dump", "pg_restore", "psql")


@pytest.fixture
def server_url() -> str:
    url = os.environ.get("TRAINBOT_TEST_POSTGRES_URL")
    if not url:
        pytest.skip(
            "TRAINBOT_TEST_POSTGRES_URL is not set: set it to a PostgreSQL URL such as "
            "postgresql://postgres@127.0.0.1:5432/test to run the backup and restore drill"
        )
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (apt-get install postgresql-client)")
    return url


@pytest.fixture
def databases(server_url: str) -> Iterator[tuple[str, str]]:
    """Two empty databases on the test server: the source and the restore target.

    Made once per xdist worker and emptied (their schema dropped and made again) before
    and after each test, not dropped: DROP DATABASE waits for a checkpoint, seconds on a
    busy server."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    names = [f"trainbot_backup_{worker}_{role}" for role in ("src", "dst")]
    admin = make_engine(server_url).execution_options(isolation_level="AUTOCOMMIT")
    base = make_url(server_url)
    urls = [base.set(database=n).render_as_string(False) for n in names]
    with admin.connect() as connection:
        for name in names:
            there = connection.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}
            ).first()
            if there is None:
                connection.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    _empty(urls)
    try:
        yield urls[0], urls[1]
    finally:
        _empty(urls)


def _empty(urls: list[str]) -> None:
    for url in urls:
        engine = make_engine(url)
        with engine.begin() as connection:
            connection.execute(text("DROP SCHEMA public CASCADE"))
            connection.execute(text("CREATE SCHEMA public"))
        engine.dispose()


def _fill(engine: Engine) -> None:
    add_running_attempt(engine, provider="local", token="tok", checkpoint_uri=None)
    start = datetime(2026, 12, 5, 9, 0, 20, tzinfo=UTC)
    with Session(engine) as session:
        for minute in range(120):
            session.add(
                SpendRecord(
                    attempt_id="a-1",
                    run_id="r-1",
                    period_start=start + timedelta(minutes=minute),
                    period_end=start + timedelta(minutes=minute + 1),
                    usd=0.05,
                    price_per_hour=3.0,
                )
            )
        for seq in range(30):
            session.add(
                EventRow(
                    attempt_id="a-1",
                    run_id="r-1",
                    seq=seq,
                    type="log",
                    time=start + timedelta(seconds=seq),
                    data={"line": f"line {seq} ✓", "level": "info"},
                )
            )
        session.commit()


def _counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as connection:
        return {
            table: int(connection.execute(text(f'SELECT count(*) FROM "{table}"')).scalar_one())
            for table in inspect(connection).get_table_names()
        }


def _script(name: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(BACKUP / name), *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_backup_restores_into_a_fresh_database_with_every_row(
    databases: tuple[str, str], tmp_path: Path
) -> None:
    source_url, target_url = databases
    source = make_engine(source_url)
    migrate(source)
    _fill(source)
    before = _counts(source)
    assert before["spend_records"] == 120 and before["events"] == 30 and before["runs"] == 1

    # An older dump beside it, and BACKUP_KEEP=2: the oldest goes, the newest two stay.
    backups = tmp_path / "backups"
    backups.mkdir()
    for stamp in ("20200101T000000Z", "20200102T000000Z"):
        (backups / f"trainbot-{stamp}.dump").write_bytes(b"old")
    # The CronJob hands the control plane's own URL over, driver suffix and all.
    as_configured = source_url.replace("postgresql://", "postgresql+psycopg2://", 1)
    done = _script(
        "backup.sh", BACKUP_DIR=str(backups), BACKUP_KEEP="2", DATABASE_URL=as_configured
    )
    assert done.returncode == 0, done.stderr
    dumps = sorted(p.name for p in backups.iterdir())
    assert len(dumps) == 2 and dumps[0] == "trainbot-20200102T000000Z.dump", dumps
    newest = backups / dumps[1]
    assert f"backup: {newest}" in done.stdout

    restored = _script("restore.sh", str(newest), target_url)
    assert restored.returncode == 0, restored.stderr
    target = make_engine(target_url)
    assert _counts(target) == before
    assert current_revision(target) == head_revision()
    with Session(source) as s, Session(target) as t:
        assert run_spent(t, "r-1") == pytest.approx(run_spent(s, "r-1")) == pytest.approx(6.0)
    with source.connect() as s_conn, target.connect() as t_conn:
        query = text("SELECT id, seq, data FROM events ORDER BY id")
        assert t_conn.execute(query).all() == s_conn.execute(query).all()
    migrate(target)  # the control plane starts on it: nothing to do
    assert current_revision(target) == head_revision()

    # A second restore into the now-filled database is refused, and changes nothing.
    again = _script("restore.sh", str(newest), target_url)
    assert again.returncode == 3 and "restore into a fresh one" in again.stderr
    assert _counts(target) == before
    source.dispose()
    target.dispose()


def test_the_backup_says_what_is_wrong_without_a_place_or_a_database(
    server_url: str, tmp_path: Path
) -> None:
    done = _script("backup.sh", BACKUP_DIR="")
    assert done.returncode != 0 and "set BACKUP_DIR" in done.stderr
    done = _script("backup.sh", BACKUP_DIR=str(tmp_path), BACKUP_KEEP="none")
    assert done.returncode == 2 and "BACKUP_KEEP must be a whole number" in done.stderr
    unreachable = "postgresql://postgres@127.0.0.1:1/none"
    done = _script("backup.sh", BACKUP_DIR=str(tmp_path), DATABASE_URL=unreachable)
    assert done.returncode != 0
    assert list(tmp_path.iterdir()) == [], "no partial dump is left behind"


def test_compose_backs_up_the_replicas_database_with_the_same_script() -> None:
    compose = yaml.safe_load((BACKUP.parents[1] / "compose.yaml").read_text())
    services = compose["services"]
    backup = services["backup"]
    mounts = dict(reversed(v.removesuffix(":ro").rsplit(":", 1)) for v in backup["volumes"])
    assert mounts["/opt/trainbot-backup"] == "./kubernetes/backup"
    assert "sh /opt/trainbot-backup/backup.sh" in backup["command"][0]
    env = backup["environment"]
    assert env["DATABASE_URL"] == services["trainbot-1"]["environment"]["TRAINBOT_DATABASE_URL"]
    assert env["PGPASSWORD_FILE"].startswith("/run/secrets/trainbot/")
    assert "/run/secrets/trainbot" in mounts and env["BACKUP_DIR"] in mounts
    assert backup["depends_on"]["postgres"]["condition"] == "service_healthy"
