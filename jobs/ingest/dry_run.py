"""A cloud dry run's reports: ``POST /v1/dry-run``, with the dry run's own token.

A dry run's instance is no attempt (nothing bills, resubmits or alerts on it), so it
sends no event batches; its token is kept hashed on its ``dry_runs`` row as an
attempt's is on ``attempts``, scoped to that dry run, and revoked (set to NULL) when the
dry run ends. The preflight check waiting on the row (:mod:`jobs.preflight.cloud_dry_run`)
reads the phase and the report that land here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy import Engine, select, update
from sqlalchemy.exc import SQLAlchemyError

from jobs.database.models import DryRunInstance, hash_token, table_of
from jobs.ingest.auth import bearer
from jobs.ingest.service import IngestResult
from runner.errors import WireError
from runner.wire import decode_dry_run_post

__all__ = ["DryRunIngest", "DryRunPrincipal"]

log = logging.getLogger(__name__)

_DRY_RUNS = table_of(DryRunInstance)
_REVOKED = (
    "unknown or revoked dry-run token: the dry run has ended or the token is wrong; stop sending"
)


@dataclass(frozen=True)
class DryRunPrincipal:
    """Whose dry-run token this is."""

    dry_run_id: str
    run_id: str


class DryRunIngest:
    """The dry-run report route, independent of HTTP. Thread-safe (no state of its own)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def principal(self, authorization: str | None) -> DryRunPrincipal | None:
        """The live dry run whose token is the bearer, else None (asks the database every
        time: these are a few calls per dry run). Raises SQLAlchemyError."""
        token = bearer(authorization)
        return None if token is None else self._lookup(hash_token(token))

    def _lookup(self, token_hash: str) -> DryRunPrincipal | None:
        rows = _DRY_RUNS.c
        with self._engine.connect() as connection:
            row = connection.execute(
                select(rows.id, rows.run_id).where(rows.token_hash == token_hash)
            ).first()
        return None if row is None else DryRunPrincipal(row.id, row.run_id)

    def handle(self, authorization: str | None, body: bytes) -> IngestResult:
        """Authenticate, decode and store one report; never raises."""
        try:
            return self._handle(authorization, body)
        except SQLAlchemyError as exc:
            log.warning("dry-run report not stored, the database failed: %s", type(exc).__name__)
            return IngestResult(503, {"error": "the database is unavailable: retry later"})
        except Exception:  # a bug must not take the server down; the runner retries
            log.exception("a dry-run report failed unexpectedly")
            return IngestResult(500, {"error": "internal error while storing the report"})

    def _handle(self, authorization: str | None, body: bytes) -> IngestResult:
        token = bearer(authorization)
        if token is None:
            return IngestResult(401, {"error": "missing 'Authorization: Bearer <token>' header"})
        token_hash = hash_token(token)
        who = self._lookup(token_hash)
        if who is None:
            return IngestResult(401, {"error": _REVOKED})
        try:
            post = decode_dry_run_post(body)
        except WireError as exc:
            return IngestResult(400, {"error": str(exc)})
        if post.dry_run != who.dry_run_id:
            return IngestResult(
                403,
                {
                    "error": f"this token belongs to dry run {who.dry_run_id}, not "
                    f"{post.dry_run}: a token is scoped to its dry run"
                },
            )
        rows = _DRY_RUNS.c
        values: dict[str, object] = {"phase": post.phase}
        if post.report is not None:
            values["report"] = post.report
        with self._engine.begin() as connection:
            # The token is compared again in the write: one revoked meanwhile stores nothing.
            done = connection.execute(
                update(_DRY_RUNS)
                .where(rows.id == who.dry_run_id, rows.token_hash == token_hash)
                .values(**values)
            )
        if done.rowcount == 0:
            return IngestResult(401, {"error": _REVOKED})
        log.info("dry run %s of run %s: %s", who.dry_run_id, who.run_id, post.phase)
        return IngestResult(200, {"stored": post.phase})
