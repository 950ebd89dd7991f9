"""What a run's preflight asks of staging: a finished copy of its dataset in its region
(the run then reads the copy), and otherwise what a copy would cost and take.

A run whose ``data_uri`` has a finished copy in one of its regions gets the copy as its
``data_uri`` before its checks run (:func:`use_staged_copy`): its dry run reads the copy
and its attempts are given it. Its stored spec then names the copy, and the copy's row
names the original (the card shows both). The runs that use a copy are those whose spec
names it; the retention rule counts from the last of them to finish.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from sqlalchemy import Engine
from sqlmodel import Session, col, select

from jobs.database.db import session_scope
from jobs.database.models import Run
from jobs.domain import format as fmt
from jobs.preflight.regions import region_requests
from jobs.preflight.report import PreflightContext
from jobs.process.deps import Deps
from jobs.process.settings import Settings
from jobs.runs.cards import say
from jobs.spec import JobSpec
from jobs.staging.copier import StagingError, split_uri
from jobs.staging.models import Staging, StagingState
from jobs.staging.work import offer, staged_copy

__all__ = ["StagingView", "for_preflight", "normal", "staged_from", "use_staged_copy"]

log = logging.getLogger(__name__)


def normal(uri: str) -> str | None:
    """``uri`` as staging stores it (a folder: ``s3://b/data/``); None if it is not a
    bucket URI staging can copy."""
    try:
        src = split_uri(uri)
    except StagingError:
        return None
    return src.uri(src.prefix)


class StagingView:
    """Preflight's view of staging (``PreflightContext.staging``)."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings

    def copy_of(self, source: str, region: str) -> str | None:
        """The finished copy of ``source`` in ``region``'s staging bucket."""
        wanted = normal(source)
        if wanted is None:
            return None
        with session_scope(self.engine) as session:
            row = staged_copy(session, wanted, region)
            return row.target if row is not None else None

    def offer(self, source: str, region: str) -> str | None:
        """What copying ``source`` into ``region`` would mean, to offer it; None when
        there is no staging bucket there or the copy cannot be sized."""
        if normal(source) is None or region not in _regions(self.settings):
            return None
        try:
            found = offer(self.settings, source, region)
        except StagingError as exc:
            log.info("no staging offer for %s in %s: %s", source, region, exc)
            return None
        e = found.estimate
        return (
            f"`/train stage {source} {region}` copies {found.objects} objects, "
            f"{fmt.size(e.n_bytes)}, to {found.target} for about {fmt.usd(e.usd)} of "
            f"transfer ({fmt.usd(e.usd_per_gb)}/GB, {e.source}) in about "
            f"{fmt.duration(e.seconds)}; the run then reads the copy"
        )


def _regions(settings: Settings) -> set[str]:
    return {pair.partition("=")[0].strip() for pair in settings.staging_buckets}


def use_staged_copy(
    session: Session, run: Run, spec: JobSpec, *, regions: list[str]
) -> tuple[JobSpec, Staging | None]:
    """``spec`` with ``data_uri`` the finished copy of its dataset in one of ``regions``
    (the run's row updated), and the copy; the spec unchanged and None when there is none."""
    wanted = normal(spec.data_uri) if spec.data_uri else None
    if wanted is None:
        return spec, None
    for region in regions:
        row = staged_copy(session, wanted, region)
        if row is not None:
            run.spec = {**run.spec, "data_uri": row.target}
            session.add(run)
            return spec.model_copy(update={"data_uri": row.target}), row
    return spec, None


def staged_from(session: Session, data_uri: str | None) -> Staging | None:
    """The copy a run's ``data_uri`` names, if it names one (for its card)."""
    if not data_uri:
        return None
    return session.exec(
        select(Staging)
        .where(Staging.target == data_uri, col(Staging.state) != StagingState.FAILED)
        .order_by(col(Staging.created_at).desc())
    ).first()


def for_preflight(deps: Deps, ctx: PreflightContext) -> PreflightContext:
    """The run's preflight context with staging: its view (when staging buckets are
    set), and its spec reading the finished copy of its dataset in one of its regions,
    if there is one (said in the thread)."""
    if not deps.settings.staging_buckets:
        return ctx
    regions = [req.region for req in region_requests(ctx) if req.region]
    with session_scope(deps.engine) as session:
        run = session.get(Run, ctx.run_id)
        if run is None:
            return ctx
        spec, row = use_staged_copy(session, run, ctx.spec, regions=regions)
        if row is not None:
            say(
                deps,
                run,
                "info",
                f"{run.id} reads its dataset from the staged copy {row.target} "
                f"({row.region}, {fmt.size(row.bytes_done)}, staging {row.id}) instead of "
                f"{row.source}.",
            )
            deps.journal.record("staging_used", run.id, staging=row.id, data_uri=row.target)
    return replace(ctx, spec=spec, staging=StagingView(deps.engine, deps.settings))
