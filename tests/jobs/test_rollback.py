"""Expand, then contract: release N-1 runs on schema N (issue 28, point 4).

The rollback test checks out the release before the newest migration with
``git worktree add`` and runs its own code (migrate, ingest, a run's read path) in a
subprocess against a database the current code migrated.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, text
from sqlmodel import Session

from jobs.database.db import COMPAT_TABLE, alembic_config, current_revision, head_revision, migrate
from jobs.database.db import serves_from as oldest_served
from jobs.database.metrics import run_metrics
from jobs.database.models import SpendRecord
from jobs.domain.errors import DatabaseError
from jobs.spend.accrual import run_spent
from tests.jobs.rows import add_running_attempt, migrated_sqlite
from tests.paths import ROOT

#: What the previous release does on the new schema, with its own code: a start
#: (migrate), a runner's batch through its ingest service, then the run's points, card
#: and spend read back. It is written against the API both releases share.
PREVIOUS_RELEASE = r"""
import json, os, sys, time
from sqlmodel import Session
from jobs.ingest import IngestService
if os.path.isdir("jobs/database"):  # the release's own tree is the working directory
    from jobs.database.db import current_revision, make_engine, migrate
    from jobs.database.metrics import run_metrics
    from jobs.database.models import Run
else:  # a release from before jobs/ was grouped into packages
    from jobs.db import current_revision, make_engine, migrate
    from jobs.metrics import run_metrics
    from jobs.models import Run
from jobs.runs.cards import card
from jobs.spend.accrual import run_spent
from runner.wire import Event, encode_batch

engine = make_engine(sys.argv[1])
migrate(engine)
now = time.time()
events = [
    Event("a-1", seq, "metrics", now - 60 + seq, "r-1", {
        "step": seq,
        "loss": 2.0 - seq / 10,
        "step_time_s": 0.5,
        "data_wait_fraction": 0.1,
        "metrics": {},
    })
    for seq in range(5)
]
result = IngestService(engine).handle("Bearer tok-old", encode_batch(events))
with engine.connect() as connection:
    points = run_metrics(connection, "r-1")
with Session(engine) as session:
    run = session.get(Run, "r-1")
    shown = card(session, run)
    spent = run_spent(session, "r-1")
print(json.dumps({
    "revision": current_revision(engine),
    "ingest": [result.status, result.body],
    "points": len(points),
    "card_step": shown.step,
    "spent": spent,
}))
"""


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    yield from migrated_sqlite(tmp_path)


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"git {' '.join(args[:2])} failed here ({done.stderr.strip()[:200]})")
    return done.stdout.strip()


def _previous_release() -> str:
    """The commit before the one that added the newest migration (HEAD itself while
    that migration is not committed yet)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("the rollback test needs the git history of the checkout: no git here")
    if _git("rev-parse", "--is-shallow-repository") == "true":
        pytest.skip(
            "the rollback test needs the commit before the newest migration, and this "
            "clone is shallow: git fetch --unshallow"
        )
    script = ScriptDirectory.from_config(alembic_config())
    newest = script.get_revision(head_revision())
    assert newest is not None
    path = Path(newest.path).resolve().relative_to(ROOT)
    added = _git("log", "-1", "--format=%H", "--diff-filter=A", "--", str(path))
    return f"{added}^" if added else "HEAD"


@pytest.fixture
def previous_release(tmp_path: Path) -> Iterator[Path]:
    commit = _previous_release()
    tree = tmp_path / "previous"
    _git("worktree", "add", "--detach", str(tree), commit)
    try:
        yield tree
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
            capture_output=True,
            timeout=60,
            check=False,
        )


def _record(engine: Engine) -> tuple[str, str]:
    with engine.connect() as connection:
        row = connection.execute(text(f"SELECT head, serves_from FROM {COMPAT_TABLE}")).one()
    return str(row[0]), str(row[1])


def test_migrate_records_the_oldest_release_the_schema_serves(engine: Engine) -> None:
    script = ScriptDirectory.from_config(alembic_config())
    oldest = oldest_served(script)
    assert _record(engine) == (head_revision(), oldest)
    # Every migration after the oldest served revision only expands; that one does not
    # declare it (or is the first).
    revision = script.get_revision(head_revision())
    while revision is not None and revision.revision != oldest:
        assert revision.module.expand_only is True, revision.revision
        revision = script.get_revision(revision.down_revision)  # type: ignore[arg-type]
    assert revision is not None
    assert getattr(revision.module, "expand_only", False) is not True or not revision.down_revision


def test_a_newer_schema_that_serves_this_release_is_used_as_it_is(engine: Engine) -> None:
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999_next'"))
        connection.execute(
            text(f"UPDATE {COMPAT_TABLE} SET serves_from = :ours"), {"ours": head_revision()}
        )
    migrate(engine)
    assert current_revision(engine) == "9999_next"


def test_a_newer_schema_past_this_release_is_refused_naming_the_revisions(engine: Engine) -> None:
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999_next'"))
        connection.execute(text(f"UPDATE {COMPAT_TABLE} SET serves_from = '9998_prev'"))
    with pytest.raises(DatabaseError) as refused:
        migrate(engine)
    message = str(refused.value)
    assert "9999_next" in message and "9998_prev" in message and head_revision() in message
    assert "run that version (or newer)" in message


def test_the_previous_release_runs_on_the_new_schema(
    engine: Engine, previous_release: Path
) -> None:
    add_running_attempt(engine, provider="local", token="tok-old", checkpoint_uri=None)
    with Session(engine) as session:
        start = datetime.now(timezone.utc) - timedelta(minutes=10)
        session.add(
            SpendRecord(
                attempt_id="a-1",
                run_id="r-1",
                period_start=start,
                period_end=start + timedelta(minutes=10),
                usd=0.25,
                price_per_hour=1.5,
            )
        )
        session.commit()
    url = str(engine.url)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", PREVIOUS_RELEASE, url],
        cwd=previous_release,
        env={**os.environ, "PYTHONPATH": str(previous_release)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    newest = ScriptDirectory.from_config(alembic_config()).get_revision(head_revision())
    assert newest is not None
    if getattr(newest.module, "expand_only", False) is not True:
        # A contracting migration is newest: the previous release must say so, not run.
        assert done.returncode != 0
        assert "run that version (or newer)" in done.stderr
        return
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["revision"] == head_revision()  # it ran on schema N, not downgraded
    assert seen["ingest"] == [200, {"accepted": 5, "duplicates": 0}]
    assert seen["points"] == 5 and seen["card_step"] == 4
    assert time.monotonic() - started < 60
    # And what the previous release wrote, the current one reads and keeps.
    migrate(engine)
    assert current_revision(engine) == head_revision()
    with engine.connect() as connection:
        assert [p.data["step"] for p in run_metrics(connection, "r-1")] == [0, 1, 2, 3, 4]
    with Session(engine) as session:
        assert run_spent(session, "r-1") == seen["spent"] == pytest.approx(0.25)
