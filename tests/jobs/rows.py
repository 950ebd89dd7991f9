"""Rows the control plane's tests start from: a migrated SQLite database, a run of the tiny
spec and its running attempt (whose token the brokers and the ingest API check)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlmodel import Session, SQLModel
from sqlmodel.sql.expression import SelectOfScalar

from jobs.database.db import make_engine, migrate
from jobs.database.models import Attempt, Run, hash_token
from jobs.domain.lifecycle import AttemptState, RunState

M = TypeVar("M", bound=SQLModel)


def migrated_sqlite(tmp_path: Path) -> Iterator[Engine]:
    """A migrated SQLite database in the test's directory (a fixture body)."""
    made = make_engine(f"sqlite:///{tmp_path / 'plane.db'}")
    migrate(made)
    yield made
    made.dispose()


def sleeping_spec(**extra: Any) -> dict[str, Any]:
    """A stored spec named tiny whose command sleeps a minute (a local run stays up through
    the test), with no dry run and no resubmit within the test; ``extra`` adds or replaces
    sections."""
    return {
        "name": "tiny",
        "command": [sys.executable, "-c", "import time; time.sleep(60)"],
        "dry_run": {"enabled": False},
        "resubmit": {"backoff_s": 3600},
        **extra,
    }


def tiny_run(run_id: str, **fields: Any) -> Run:
    """Run ``run_id`` of the tiny spec (``true``), requested by U1; ``fields`` set any other
    column or replace these."""
    values: dict[str, Any] = {
        "spec_name": "tiny",
        "spec": {"name": "tiny", "command": ["true"]},
        "requester": "U1",
        **fields,
    }
    return Run(id=run_id, **values)


def running_attempt(attempt_id: str, run_id: str, **fields: Any) -> Attempt:
    """Attempt 1 of ``run_id``, running; ``fields`` set any other column or replace these."""
    values: dict[str, Any] = {"number": 1, "state": AttemptState.RUNNING, **fields}
    return Attempt(id=attempt_id, run_id=run_id, **values)


def add_run(session: Session, run: Run, *attempts: Attempt) -> None:
    """``run`` and its ``attempts``, flushed (the run first: an attempt's row refers to it)."""
    session.add(run)
    session.flush()
    session.add_all(attempts)
    session.flush()


def add_running_attempt(
    engine: Engine,
    *,
    provider: str,
    token: str | None,
    checkpoint_uri: str | None,
    checkpoint_prefix: str | None = None,
    run_id: str = "r-1",
    attempt_id: str = "a-1",
    instances: int = 1,
    run_state: RunState | None = None,
) -> None:
    """Run ``run_id`` with attempt 1 running on ``provider`` (``instances`` nodes); the
    attempt's token is ``token`` (None: an attempt whose token was revoked); the run in
    ``run_state`` (None: as a new row is)."""
    with Session(engine) as session:
        add_run(
            session,
            tiny_run(
                run_id,
                checkpoint_uri=checkpoint_uri,
                checkpoint_prefix=checkpoint_prefix,
                **({} if run_state is None else {"state": run_state}),
            ),
            running_attempt(
                attempt_id,
                run_id,
                provider=provider,
                instances=instances,
                token_hash=hash_token(token) if token else None,
            ),
        )
        session.commit()


def detached(engine: Engine, model: type[M], key: str) -> M:
    """The ``model`` row whose primary key is ``key`` (which must exist), read in a session
    of its own and detached, so that its columns stay readable once the session is gone."""
    with Session(engine) as session:
        row = session.get(model, key)
        assert row is not None, f"no {model.__name__} {key!r}"
        session.expunge(row)
        return row


def all_detached(engine: Engine, query: SelectOfScalar[M]) -> list[M]:
    """The rows ``query`` selects, read in a session of their own and detached."""
    with Session(engine) as session:
        rows = list(session.exec(query).all())
        for row in rows:
            session.expunge(row)
        return rows
