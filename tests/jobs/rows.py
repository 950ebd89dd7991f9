"""Rows the credential brokers' and the ingest tests start from: a migrated SQLite database and a run
with one running attempt whose token the broker checks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Engine
from sqlmodel import Session

from jobs.database.db import make_engine, migrate
from jobs.database.models import Attempt, Run, hash_token
from jobs.domain.lifecycle import AttemptState, RunState


def migrated_sqlite(tmp_path: Path) -> Iterator[Engine]:
    """A migrated SQLite database in the test's directory (a fixture body)."""
    made = make_engine(f"sqlite:///{tmp_path / 'plane.db'}")
    migrate(made)
    yield made
    made.dispose()


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
        session.add(
            Run(
                id=run_id,
                spec_name="tiny",
                spec={"name": "tiny", "command": ["true"]},
                requester="U1",
                checkpoint_uri=checkpoint_uri,
                checkpoint_prefix=checkpoint_prefix,
                **({} if run_state is None else {"state": run_state}),
            )
        )
        session.flush()
        session.add(
            Attempt(
                id=attempt_id,
                run_id=run_id,
                number=1,
                state=AttemptState.RUNNING,
                provider=provider,
                instances=instances,
                token_hash=hash_token(token) if token else None,
            )
        )
        session.commit()
