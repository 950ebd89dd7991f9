"""``/train stage``: a person's copy of a dataset into a region's staging bucket, outside
a run, and the list of copies. The caller (the bot's verb) has checked that the person
may start compute (``TRAINBOT_LAUNCHERS``)."""

from __future__ import annotations

from sqlmodel import col, select

from jobs.database.db import session_scope
from jobs.database.models import Run
from jobs.domain import format as fmt
from jobs.domain.actor import Actor, may_touch
from jobs.process.deps import Deps
from jobs.staging.copier import StagingError
from jobs.staging.models import Staging, StagingState
from jobs.staging.work import offer, start

__all__ = ["stage", "stage_run", "stage_status"]

#: The most copies ``/train stage status`` lists.
LISTED = 20


def stage(deps: Deps, source: str, region: str, actor: Actor) -> str:
    """Start copying ``source`` into ``region``'s staging bucket (or say the copy done or
    under way); the reply's text. Raises :class:`jobs.staging.StagingError` saying why
    not. The progress goes to the person's channel."""
    found = offer(deps.settings, source, region)
    row, new = start(
        deps.engine,
        found,
        requested_by=actor.user,
        channel=actor.channel or None,
        now=deps.clock(),
    )
    if not new:
        if row.state is StagingState.DONE:
            return (
                f"{found.source} is staged in {region} already: {row.target} (staging "
                f"{row.id}). Runs in {region} with data_uri={found.source} read the copy."
            )
        return f"{found.source} is being staged into {region} already (staging {row.id})."
    deps.journal.record("staging_started", None, staging=row.id, source=row.source)
    return (
        f"Staging {row.id}: {found.text()}. It runs on the control plane's leader and "
        "survives a restart; its progress is posted here. Runs in "
        f"{region} with data_uri={found.source} then read the copy."
    )


def stage_run(deps: Deps, run_id: str, actor: Actor) -> str:
    """Copy the dataset of ``run_id`` (its preflight found it in another region) into
    the run's region; the progress goes to the run's thread. Only its requester or an
    admin may."""
    with session_scope(deps.engine) as session:
        run = session.get(Run, run_id)
        if run is None or not actor.sees(run.channel):
            raise StagingError(f"no run {run_id} in this channel")
        may_touch(actor, run)
        source = (run.spec or {}).get("data_uri")
        region = _data_region(run)
        channel, thread_ts, spec_name = run.channel, run.thread_ts, run.spec_name
    if not source:
        raise StagingError(f"{run_id} declares no dataset (its spec has no data_uri)")
    if region is None:
        raise StagingError(f"cannot tell {run_id}'s region: write /train stage {source} REGION")
    found = offer(deps.settings, source, region)
    row, new = start(
        deps.engine,
        found,
        requested_by=actor.user,
        channel=channel,
        thread_ts=thread_ts,
        run_id=run_id,
        now=deps.clock(),
    )
    if not new:
        return f"{found.source} is staged (or being staged) into {region} already: {row.id}."
    deps.journal.record("staging_started", run_id, staging=row.id, source=row.source)
    return (
        f"Staging {row.id} for {run_id}: {found.text()}. Its progress is in the run's "
        f"thread; once it is done, /train launch {spec_name} reads the copy."
    )


def _data_region(run: Run) -> str | None:
    """The region preflight's data check judged the dataset against."""
    for result in (run.preflight or {}).get("results", []):
        if result.get("name") == "data":
            region = (result.get("data") or {}).get("region")
            if region:
                return str(region)
    regions = ((run.spec or {}).get("resources") or {}).get("regions") or []
    return str(regions[0]) if regions else None


def stage_status(deps: Deps) -> str:
    """The copies, newest first: what each is, how far it got."""
    with session_scope(deps.engine) as session:
        rows = session.exec(
            select(Staging)
            .where(Staging.state != StagingState.DELETED)
            .order_by(col(Staging.created_at).desc())
            .limit(LISTED)
        ).all()
        lines = [_line(row) for row in rows]
    if not lines:
        return "No staged datasets. /train stage s3://BUCKET/PREFIX REGION copies one."
    return "Staged datasets, newest first:\n" + "\n".join(lines)


def _line(row: Staging) -> str:
    done = row.bytes_done + sum(int(p.get("size", 0)) for p in row.parts)
    share = fmt.percent(done / row.total_bytes) if row.total_bytes else "n/a"
    what = {
        StagingState.QUEUED: "queued",
        StagingState.COPYING: f"copying, {share} of {fmt.size(row.total_bytes)}",
        StagingState.DONE: f"done, {fmt.size(row.bytes_done)}",
        StagingState.FAILED: f"failed: {row.error}",
        StagingState.DELETED: "deleted",
    }[row.state]
    return f"  {row.id} {row.source} → {row.target} ({row.region}): {what}"
