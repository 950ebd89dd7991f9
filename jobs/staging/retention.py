"""Staged copies after they are made: the retention rule the scheduled cleanup applies.

A copy is kept while a run that reads it (its stored spec's ``data_uri`` names the copy)
is not over, and for ``TRAINBOT_STAGING_KEEP_DAYS`` after the last of them ended (or
after the copy finished, if none used it); then its objects are deleted and the row is
marked ``DELETED`` (kept: the digest still counts the days it was kept). What keeping
them costs is :mod:`jobs.staging.figures`.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlmodel import Session, col, select

from jobs.database.db import session_scope
from jobs.database.models import Run
from jobs.process.deps import Deps
from jobs.staging.copier import split_uri
from jobs.staging.models import Staging, StagingState
from jobs.staging.work import copier_for

__all__ = ["expire_staged", "last_use"]

log = logging.getLogger(__name__)


def _users(session: Session, row: Staging) -> list[Run]:
    """The runs whose spec reads the copy (created after it was asked for)."""
    runs = session.exec(select(Run).where(col(Run.created_at) >= row.created_at)).all()
    return [run for run in runs if (run.spec or {}).get("data_uri") == row.target]


def last_use(session: Session, row: Staging, *, now: datetime) -> datetime | None:
    """When the last run that read the copy ended (``now`` while one is not over), or
    when the copy finished if none read it."""
    ends: list[datetime] = [row.finished_at] if row.finished_at is not None else []
    for run in _users(session, row):
        if not run.state.is_terminal():
            return now
        ends.append(run.ended_at or run.updated_at)
    return max(ends) if ends else None


def expire_staged(deps: Deps, *, now: datetime) -> list[str]:
    """Delete the copies past the retention rule; their ids. A copy whose objects cannot
    be deleted now stays, and is tried again at the next cleanup."""
    keep = timedelta(days=deps.settings.staging_keep_days)
    with session_scope(deps.engine) as session:
        rows = session.exec(select(Staging).where(Staging.state == StagingState.DONE)).all()
        due: list[Staging] = []
        for row in rows:
            used = last_use(session, row, now=now)
            if used is not None and used != row.last_used_at:
                row.last_used_at = used
                session.add(row)
            if used is not None and now - used >= keep:
                due.append(row)
        for row in due:
            session.expunge(row)
    deleted: list[str] = []
    for row in due:
        target = split_uri(row.target)
        try:
            count = copier_for(deps.settings, target.scheme, region=row.region).delete_prefix(
                target
            )
        except Exception as exc:  # the store's own errors, whatever they are
            log.warning("could not delete the staged copy %s (%s): %s", row.id, row.target, exc)
            continue
        with session_scope(deps.engine) as session:
            stored = session.get(Staging, row.id)
            if stored is not None:
                stored.state = StagingState.DELETED
                stored.deleted_at = now
                session.add(stored)
        deps.journal.record("staging_deleted", row.run_id, staging=row.id, objects=count)
        log.info("deleted the staged copy %s (%s): %d objects", row.id, row.target, count)
        deleted.append(row.id)
    return deleted
