"""Copying a dataset into the staging bucket of a run's region, and what happens after.

:func:`offer` says what a copy would cost and take; :func:`start` records it (a
:class:`~jobs.staging.models.Staging` row) and defers the copy (:data:`Later.STAGING`),
which only the scheduler's leader runs, so it survives the replica that asked for it.
:func:`copy_staging` goes on from where the row says: after the last object finished,
and within the object in progress from its stored upload and parts (S3) or rewrite
token (GCS), saved after every step. One message in the thread says the progress,
edited in place at most every :data:`PROGRESS_EVERY_S` seconds.

The same source copied to the same region again is the same copy: :func:`start` gives
back the one done or under way, and a run's preflight finds a finished one
(:func:`staged_copy`) and uses it.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol, runtime_checkable

from sqlalchemy import Engine
from sqlmodel import Session, col, select

from jobs.background.deferred import Later, current_fence, defer, deferrable, pending
from jobs.database.db import session_scope
from jobs.domain import format as fmt
from jobs.outbound.notify import MessageRef, TextMessage
from jobs.process.deps import Deps
from jobs.process.settings import Settings
from jobs.runs.fence import check_fence
from jobs.staging.copier import (
    Copier,
    ObjectRef,
    Progress,
    SaveProgress,
    StagingError,
    split_uri,
)
from jobs.staging.models import Staging, StagingState
from jobs.staging.prices import TransferEstimate, estimate

__all__ = [
    "PROGRESS_EVERY_S",
    "Offer",
    "StagingInterrupted",
    "copier_for",
    "copy_staging",
    "offer",
    "staged_copy",
    "staging_root",
    "start",
    "target_for",
]

log = logging.getLogger(__name__)

#: The progress message is edited at most this often (Slack allows about one call a
#: second per channel, and other messages share it).
PROGRESS_EVERY_S = 3.0


#: How long the first post may take to get its message id.
RESOLVE_S = 10.0


@runtime_checkable
class _Resolves(Protocol):
    """A notifier that queues posts and can say a queued post's real id (Slack's)."""

    def resolve(self, ref: MessageRef, *, timeout: float = 0.0) -> MessageRef | None: ...


class StagingInterrupted(StagingError):
    """The control plane is shutting down: the copy stops and the leader resumes it."""


def staging_roots(settings: Settings) -> dict[str, str]:
    """The admin's staging bucket per region (``TRAINBOT_STAGING_BUCKETS``)."""
    roots: dict[str, str] = {}
    for pair in settings.staging_buckets:
        region, _, uri = pair.partition("=")
        roots[region.strip()] = uri.strip().rstrip("/")
    return roots


def staging_root(settings: Settings, region: str) -> str | None:
    return staging_roots(settings).get(region)


def target_for(root: str, source: str) -> str:
    """Where ``source`` is copied under a region's staging root: its bucket and prefix,
    so the same dataset always lands in the same place."""
    src = split_uri(source)
    return f"{root.rstrip('/')}/{src.bucket}/{src.prefix}"


def copier_for(settings: Settings, scheme: str, *, region: str) -> Copier:
    """The copier for a store, talking to ``region`` (the target's)."""
    if scheme == "s3":
        from jobs.staging.s3 import S3Copier

        return S3Copier(
            region=region,
            endpoint_url=settings.aws_endpoint_url,
            part_size=settings.staging_part_bytes,
        )
    if scheme == "gs":
        from jobs.staging.gcs import GCSCopier

        return GCSCopier(project=settings.gcp_project)
    raise StagingError(f"staging copies s3:// and gs:// data, not {scheme}://")


@dataclass(frozen=True)
class Offer:
    """What copying ``source`` into ``region``'s staging bucket would mean."""

    source: str
    target: str
    region: str
    source_region: str
    objects: int
    estimate: TransferEstimate

    def text(self) -> str:
        e = self.estimate
        return (
            f"copy {self.source} ({self.source_region}) to {self.target} ({self.region}): "
            f"{self.objects} objects, {fmt.size(e.n_bytes)}, about {fmt.usd(e.usd)} of "
            f"transfer at {fmt.usd(e.usd_per_gb)}/GB ({e.source}), about "
            f"{fmt.duration(e.seconds)}"
        )


def offer(settings: Settings, source: str, region: str, *, copier: Copier | None = None) -> Offer:
    """Size up a copy of ``source`` into ``region``'s staging bucket. Raises
    :class:`StagingError` saying why there can be none (no bucket for the region, a
    scheme the region's bucket is not on, nothing under the prefix)."""
    src = split_uri(source)
    root = staging_root(settings, region)
    if root is None:
        raise StagingError(
            f"no staging bucket is set for {region}: an admin adds "
            f"{region}=s3://BUCKET (or gs://) to TRAINBOT_STAGING_BUCKETS"
        )
    if split_uri(root).scheme != src.scheme:
        raise StagingError(
            f"{source} is on {src.scheme}:// but {region}'s staging bucket is {root}: "
            "staging copies within one cloud"
        )
    copier = copier or copier_for(settings, src.scheme, region=region)
    where = copier.region(src.bucket) or "an unknown region"
    if where == region:
        raise StagingError(f"{source} is in {region} already: runs there read it without a copy")
    count = total = 0
    for obj in copier.list_after(src, None):
        count, total = count + 1, total + obj.size
    if count == 0:
        raise StagingError(f"nothing to copy: {source} holds no objects")
    return Offer(
        source=src.uri(src.prefix),
        target=target_for(root, source),
        region=region,
        source_region=where,
        objects=count,
        estimate=estimate(source, n_bytes=total, source_region=where, target_region=region),
    )


def staged_copy(session: Session, source: str, region: str) -> Staging | None:
    """The finished copy of ``source`` in ``region``, if there is one."""
    return session.exec(
        select(Staging)
        .where(
            Staging.source == source,
            Staging.region == region,
            Staging.state == StagingState.DONE,
        )
        .order_by(col(Staging.finished_at).desc())
    ).first()


def _under_way(session: Session, source: str, region: str) -> Staging | None:
    return session.exec(
        select(Staging).where(
            Staging.source == source,
            Staging.region == region,
            col(Staging.state).in_([StagingState.QUEUED, StagingState.COPYING, StagingState.DONE]),
        )
    ).first()


def start(
    engine: Engine,
    found: Offer,
    *,
    requested_by: str,
    channel: str | None,
    thread_ts: str | None = None,
    run_id: str | None = None,
    now: datetime,
) -> tuple[Staging, bool]:
    """Record the copy and defer it to the leader; the copy of the same source to the
    same region already done or under way instead, with False."""
    with session_scope(engine) as session:
        existing = _under_way(session, found.source, found.region)
        if existing is not None:
            session.expunge(existing)
    if existing is not None:
        if existing.state is not StagingState.DONE and not _scheduled(engine, existing.id):
            # Its work gave up (a store that kept failing): asking again resumes it.
            _defer(engine, existing.id, key=f"staging:{existing.id}:{now.timestamp():.0f}", now=now)
        return existing, False
    with session_scope(engine) as session:
        row = Staging(
            id=f"st-{secrets.token_hex(4)}",
            source=found.source,
            target=found.target,
            region=found.region,
            requested_by=requested_by,
            run_id=run_id,
            channel=channel,
            thread_ts=thread_ts,
            total_objects=found.objects,
            total_bytes=found.estimate.n_bytes,
            usd=found.estimate.usd,
            created_at=now,
            updated_at=now,
        )
        session.add(row)
        session.flush()
        session.expunge(row)
    _defer(engine, row.id, key=f"staging:{row.id}", now=now)
    return row, True


def _defer(engine: Engine, staging_id: str, *, key: str, now: datetime) -> None:
    """The copy as deferred work: a row only, which the scheduler's leader runs."""
    defer(
        engine,
        kind=Later.STAGING,
        key=key,
        args={"staging_id": staging_id},
        due_at=now,
        fence=current_fence(),
        now=now,
    )


def _scheduled(engine: Engine, staging_id: str) -> bool:
    """Whether the copy has deferred work not done (it runs, or will)."""
    return any(
        w.key == f"staging:{staging_id}" or w.key.startswith(f"staging:{staging_id}:")
        for w in pending(engine)
    )


class _Run:
    """One pass of a copy: the row's state in memory, saved after every step."""

    def __init__(self, deps: Deps, row: Staging, copier: Copier) -> None:
        self.deps = deps
        self.row = row
        self.copier = copier
        self.src = split_uri(row.source)
        self.dst = split_uri(row.target)
        self._told = 0.0
        self._started = time.monotonic()
        self._moved = 0  # bytes copied by this pass, for the rate

    # -- saving --------------------------------------------------------------------

    def _save(self, **values: object) -> None:
        with session_scope(self.deps.engine) as session:
            # A deposed leader stops here: the current one has taken the copy over.
            check_fence(self.deps, session, action=f"staging {self.row.id}")
            row = session.get(Staging, self.row.id)
            if row is None:
                raise StagingError(f"staging {self.row.id} was deleted while it copied")
            for name, value in {**values, "updated_at": self.deps.clock()}.items():
                setattr(row, name, value)
                setattr(self.row, name, value)
            session.add(row)

    def part_saved(self, obj: ObjectRef, progress: Progress) -> None:
        before = sum(int(p.get("size", 0)) for p in self.row.parts)
        self._moved += max(0, progress.bytes_done() - before)
        self._save(
            current_key=obj.key,
            upload_id=progress.token,
            parts=list(progress.parts),
            part_copies=self.row.part_copies + int(progress.copied),
        )
        self.tell()
        if self.deps.closing:
            raise StagingInterrupted(f"staging {self.row.id} paused: the control plane stops")

    def _saver(self, obj: ObjectRef) -> SaveProgress:
        def save(progress: Progress) -> None:
            self.part_saved(obj, progress)

        return save

    def object_done(self, obj: ObjectRef) -> None:
        self._save(
            after_key=obj.key,
            objects_done=self.row.objects_done + 1,
            bytes_done=self.row.bytes_done + obj.size,
            current_key=None,
            upload_id=None,
            parts=[],
        )
        self.tell()

    # -- telling -------------------------------------------------------------------

    def tell(self, *, final: str | None = None) -> None:
        """Edit the progress message (at most every PROGRESS_EVERY_S, the last always)."""
        now = time.monotonic()
        if final is None and now - self._told < PROGRESS_EVERY_S and self.row.message_ts:
            return
        self._told = now
        row = self.row
        if row.channel is None:
            return
        in_part = sum(int(p.get("size", 0)) for p in row.parts)
        done = row.bytes_done + in_part
        share = done / row.total_bytes if row.total_bytes else 1.0
        if final is not None:
            text = final
        else:
            spent = now - self._started
            rate = self._moved / spent if spent > 0 and self._moved else None
            left = (row.total_bytes - done) / rate if rate else None
            text = (
                f"Staging {row.id}: copying {row.source} to {row.target} ({row.region}): "
                f"{fmt.size(done)} of {fmt.size(row.total_bytes)} ({fmt.percent(share)}), "
                f"{row.objects_done} of {row.total_objects} objects"
                + (f", {fmt.size(rate)}/s, about {fmt.duration(left)} left" if rate else "")
                + "."
            )
        msg = TextMessage(
            channel=row.channel, thread_ts=row.thread_ts, kind="info", text=text, run_id=row.run_id
        )
        if row.message_ts is None:
            ref = self.deps.notifier.post(msg)
            if isinstance(self.deps.notifier, _Resolves):
                # The message's own id, not the notifier's handle for it: a control plane
                # started after this one edits it.
                ref = self.deps.notifier.resolve(ref, timeout=RESOLVE_S) or ref
            self._save(message_ts=ref.ts)
        else:
            self.deps.notifier.update(MessageRef(channel=row.channel, ts=row.message_ts), msg)

    # -- the copy ------------------------------------------------------------------

    def run(self) -> None:
        if self.row.state is StagingState.QUEUED:
            self._save(state=StagingState.COPYING)
        self.tell()
        resume = self.row.current_key
        for obj in self.copier.list_after(self.src, self.row.after_key):
            progress = Progress()
            if obj.key == resume:
                progress = Progress(token=self.row.upload_id, parts=list(self.row.parts))
            elif self.row.parts or self.row.upload_id:
                self._save(current_key=None, upload_id=None, parts=[])
            dst_key = self.dst.prefix + obj.key[len(self.src.prefix) :]
            self.copier.copy(
                obj,
                src=self.src,
                dst=self.dst,
                dst_key=dst_key,
                progress=progress,
                save=self._saver(obj),
            )
            self.object_done(obj)
        now = self.deps.clock()
        self._save(
            state=StagingState.DONE,
            finished_at=now,
            last_used_at=now,
            total_bytes=max(self.row.total_bytes, self.row.bytes_done),
            total_objects=max(self.row.total_objects, self.row.objects_done),
        )
        self.tell(
            final=(
                f"Staged {self.row.id}: {self.row.source} is copied to {self.row.target} "
                f"({self.row.region}): {fmt.size(self.row.bytes_done)} in "
                f"{self.row.objects_done} objects. Runs in {self.row.region} with this "
                f"data_uri use the copy; it is deleted {self.deps.settings.staging_keep_days:g} "
                "days after the last run that used it finished."
            )
        )
        self.deps.journal.record(
            "staging_done", self.row.run_id, staging=self.row.id, bytes=self.row.bytes_done
        )


@deferrable(Later.STAGING)
def copy_staging(deps: Deps, staging_id: str) -> None:
    """Copy (or go on copying) a staging row's dataset: the leader's deferred work."""
    with session_scope(deps.engine) as session:
        row = session.get(Staging, staging_id)
        if row is None or row.state.is_terminal():
            return
        session.expunge(row)
    log.info(
        "staging %s: %s to %s from %d objects done%s",
        row.id,
        row.source,
        row.target,
        row.objects_done,
        f", {len(row.parts)} parts of {row.current_key}" if row.current_key else "",
    )
    work = _Run(
        deps, row, copier_for(deps.settings, split_uri(row.source).scheme, region=row.region)
    )
    try:
        work.run()
    except StagingInterrupted:
        raise
    except StagingError as exc:
        work._save(state=StagingState.FAILED, error=str(exc)[:1000], finished_at=deps.clock())
        work.tell(final=f"Staging {row.id} failed: {exc}")


def keep_until(row: Staging, settings: Settings) -> datetime | None:
    """When the retention rule deletes a finished copy."""
    since = row.last_used_at or row.finished_at
    if since is None:
        return None
    return since + timedelta(days=settings.staging_keep_days)
