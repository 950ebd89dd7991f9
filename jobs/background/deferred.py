"""Deferred work: what is due later lives in a row, not in one process's timer.

A resubmit after its backoff, a launch retry after no capacity, a day's digest: each is
a row of ``deferred_work``
(:class:`jobs.database.replica_tables.DeferredWork`) holding a :class:`Later` kind,
its keyword arguments as JSON, its due time and who has claimed it. The kinds are
named here and each is bound to one function by :func:`deferrable`; a row names its
kind, never a pickled callable, so a row written by one version of trainbot is run by
the function of that name in the next, or refused with a log line.

Two things run rows, and a claim (one UPDATE, on PostgreSQL over rows locked ``FOR
UPDATE SKIP LOCKED``; SQLite has a single writer) decides which one does:

- **The replica that deferred it**, on a timer (:meth:`jobs.process.deps.Deps.later`): on time,
  as before the rows existed, so the embedded control plane waits no longer than it did.
  Its claim lasts ``hold_s``; a replica that dies holding it frees it then.
- **The leader** (:class:`DeferredRunner`, started with the scheduler): every
  ``poll_s`` it claims what is overdue by more than ``grace_s`` (the deferring replica
  died, or shut down, before its timer fired) and what an earlier leader claimed and did
  not finish (its fencing token is lower: taken back at once). It runs them under its
  own fencing token, so a deposed leader's late launch is refused as for its other
  scheduled work, and the row is released for the current leader.

Every kind must be safe to run twice (a claim expires while its work is still running,
a replica dies after the work but before marking it done): a resubmit finds the next
attempt launched, a launch finds the attempt number taken, a digest's posts carry keys
that the Slack outbox posts once. Done rows stay a week (:data:`KEEP_DONE`), so the
same key is not deferred again meanwhile (a digest re-made by a new leader).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Engine, and_, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlmodel import col

from jobs.database.db import claim_rows, delete_before, session_scope
from jobs.database.models import table_of
from jobs.database.replica_tables import DeferredWork
from jobs.domain.errors import DatabaseError, FencedOut

if TYPE_CHECKING:
    from jobs.process.deps import Deps

log = logging.getLogger(__name__)

_WORK = table_of(DeferredWork)

#: Seconds between the leader's looks for overdue work.
POLL_S = 1.0
#: How overdue a row must be before the leader takes it from the replica that deferred
#: it (whose timer should have fired by then).
GRACE_S = 2.0
#: A failing row is tried again after 2, 4, 8 … seconds, at most this many times.
MAX_ATTEMPTS = 8
MAX_RETRY_S = 300.0
#: How long done rows are kept (their keys stop the same work being deferred again).
KEEP_DONE = timedelta(days=7)


class Later(str, Enum):
    """The kinds of work that may be deferred, each bound to one function."""

    #: ``jobs.runs.resubmit_if_due(previous_attempt_id=…)``: the next attempt after a
    #: preemption, once its backoff is over.
    RESUBMIT = "resubmit"
    #: ``jobs.runs.launch_attempt(run_id=…)``: a launch retried after no capacity.
    LAUNCH = "launch"
    #: ``jobs.runs.relaunch.try_again(run_id=…, episode=…, tries=…, since=…, ts=…)``:
    #: the next try of a run waiting for capacity; run by the leader only.
    CAPACITY = "capacity"
    #: ``jobs.staging.work.copy_staging(staging_id=…)``: a dataset's copy into another
    #: region's staging bucket, resumed where its row says; run by the leader only.
    STAGING = "staging"
    #: ``jobs.background.scheduler.digest_day(posted=…, day=…)``: a day's digest, one
    #: ``DIGEST_CHANNEL`` per channel.
    DIGEST = "digest"
    #: ``jobs.background.scheduler.digest_channel(channel=…, posted=…, day=…)``: one channel's.
    DIGEST_CHANNEL = "digest_channel"


_REGISTRY: dict[Later, Callable[..., Any]] = {}
_Fn = TypeVar("_Fn", bound=Callable[..., Any])

#: The scheduler lease's fencing token that the scheduled work on this thread started
#: under; None for work a person started (chat), which any replica may do.
_FENCE: ContextVar[int | None] = ContextVar("trainbot_fence", default=None)


@contextmanager
def fenced(token: int | None) -> Iterator[None]:
    """Run the block as scheduled work of the leader holding ``token``."""
    reset = _FENCE.set(token)
    try:
        yield
    finally:
        _FENCE.reset(reset)


def current_fence() -> int | None:
    """The fencing token the work on this thread runs under (None: not scheduled work)."""
    return _FENCE.get()


def deferrable(kind: Later) -> Callable[[_Fn], _Fn]:
    """Bind ``kind`` to the decorated function ``fn(deps, **args)``."""

    def bind(fn: _Fn) -> _Fn:
        bound = _REGISTRY.setdefault(kind, fn)
        if bound is not fn:
            raise RuntimeError(f"{kind.value} is bound to {bound.__qualname__} already")
        return fn

    return bind


def registry() -> Mapping[Later, Callable[..., Any]]:
    """Each kind's function (those whose modules are imported)."""
    return dict(_REGISTRY)


@dataclass(frozen=True)
class Claimed:
    """A row this replica has claimed and now runs."""

    key: str
    kind: str
    args: dict[str, Any]
    #: The fencing token it runs under.
    fence: int | None
    #: Claims so far, this one included.
    attempts: int


def defer(
    engine: Engine,
    *,
    kind: Later,
    key: str,
    args: Mapping[str, Any],
    due_at: datetime,
    fence: int | None,
    now: datetime,
) -> bool:
    """Record work due at ``due_at``; False when ``key`` was deferred already (the first
    stays, done or not)."""
    try:
        json.dumps(dict(args))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"deferred {kind.value} {key}: arguments must be JSON ({exc})") from None
    values = {
        "key": key,
        "kind": kind.value,
        "args": dict(args),
        "due_at": due_at,
        "created_at": now,
        "fence": fence,
        "attempts": 0,
    }
    with session_scope(engine) as session:
        dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
        inserted = session.execute(
            dialect.insert(_WORK)
            .values(**values)
            .on_conflict_do_nothing(index_elements=["key"])
            .returning(_WORK.c.key)
        ).first()
        return inserted is not None


def claim(engine: Engine, key: str, *, holder: str, now: datetime, hold_s: float) -> Claimed | None:
    """Take ``key`` to run it now, unless it is done or someone else holds it."""
    with session_scope(engine) as session:
        row = session.execute(
            update(_WORK)
            .where(
                _WORK.c.key == key,
                _WORK.c.done_at.is_(None),
                or_(_WORK.c.claimed_until.is_(None), _WORK.c.claimed_until < now),
            )
            .values(
                claimed_by=holder,
                claimed_until=now + timedelta(seconds=hold_s),
                # Leader's work (it has a token) is taken back by the next leader at once.
                claimed_fence=_WORK.c.fence,
                attempts=_WORK.c.attempts + 1,
            )
            .returning(_WORK.c.kind, _WORK.c.args, _WORK.c.fence, _WORK.c.attempts)
        ).first()
    if row is None:
        return None
    return Claimed(
        key=key, kind=row.kind, args=row.args or {}, fence=row.fence, attempts=row.attempts
    )


def claim_due(
    engine: Engine,
    *,
    token: int,
    holder: str,
    now: datetime,
    hold_s: float,
    grace_s: float = GRACE_S,
    limit: int = 50,
) -> list[Claimed]:
    """The leader's claim: rows overdue by ``grace_s`` that nobody holds, and rows an
    earlier leader (a lower token) claimed and did not finish. They run under ``token``."""
    with session_scope(engine) as session:
        due = (
            select(_WORK.c.key)
            .where(
                _WORK.c.done_at.is_(None),
                _WORK.c.due_at <= now - timedelta(seconds=grace_s),
                or_(
                    _WORK.c.claimed_until.is_(None),
                    _WORK.c.claimed_fence < token,
                    # An expired claim, unless it is this leader's own: still running
                    # here, however long it takes.
                    and_(
                        _WORK.c.claimed_until < now,
                        or_(_WORK.c.claimed_fence.is_(None), _WORK.c.claimed_fence != token),
                    ),
                ),
            )
            .order_by(_WORK.c.due_at)
            .limit(limit)
        )
        take = (
            update(_WORK)
            .values(
                claimed_by=holder,
                claimed_until=now + timedelta(seconds=hold_s),
                claimed_fence=token,
                attempts=_WORK.c.attempts + 1,
            )
            .returning(_WORK.c.key, _WORK.c.kind, _WORK.c.args, _WORK.c.attempts)
        )
        rows = claim_rows(session, due, _WORK.c.key, take)
    return [
        Claimed(key=r.key, kind=r.kind, args=r.args or {}, fence=token, attempts=r.attempts)
        for r in rows
    ]


def finish(engine: Engine, key: str, *, now: datetime, error: str | None = None) -> None:
    """Mark ``key`` done (with the error that made it give up, if any)."""
    with session_scope(engine) as session:
        session.execute(
            update(_WORK)
            .where(_WORK.c.key == key, _WORK.c.done_at.is_(None))
            .values(done_at=now, claimed_until=None, error=error)
        )


def release(engine: Engine, key: str, *, now: datetime, delay_s: float, error: str) -> None:
    """Give ``key`` back, due again in ``delay_s``, for whoever claims it next."""
    with session_scope(engine) as session:
        session.execute(
            update(_WORK)
            .where(_WORK.c.key == key, _WORK.c.done_at.is_(None))
            .values(
                claimed_by=None,
                claimed_until=None,
                claimed_fence=None,
                due_at=now + timedelta(seconds=delay_s),
                error=error[:1000],
            )
        )


def prune(engine: Engine, *, before: datetime) -> int:
    """Forget work done before ``before``."""
    return delete_before(engine, _WORK.c.done_at, before)


def pending(engine: Engine) -> list[DeferredWork]:
    """Work not done yet, soonest first (for people and tests)."""
    with session_scope(engine) as session:
        rows = session.execute(
            select(DeferredWork)
            .where(col(DeferredWork.done_at).is_(None))
            .order_by(col(DeferredWork.due_at))
        ).scalars()
        return list(rows)


def run_claimed(deps: Deps, work: Claimed) -> None:
    """Run one claimed row under its fencing token, then mark it done or give it back."""
    try:
        fn = _REGISTRY[Later(work.kind)]
    except (ValueError, KeyError):
        log.error(
            "deferred work %s has kind %r, which this version of trainbot does not know; "
            "it is marked done without running",
            work.key,
            work.kind,
        )
        finish(deps.engine, work.key, now=deps.clock(), error=f"unknown kind {work.kind!r}")
        return
    try:
        with fenced(work.fence):
            fn(deps, **work.args)
    except FencedOut as exc:  # a deposed leader's: the current one takes it at once
        release(deps.engine, work.key, now=deps.clock(), delay_s=0.0, error=str(exc))
        return
    except Exception as exc:
        delay = min(2.0**work.attempts, MAX_RETRY_S)
        if isinstance(exc, DatabaseError):
            log.warning("deferred %s failed, retrying in %.0f s: %s", work.key, delay, exc)
        else:
            log.exception("deferred %s failed (attempt %d)", work.key, work.attempts)
        try:
            if work.attempts >= MAX_ATTEMPTS:
                log.error("deferred %s gave up after %d attempts", work.key, work.attempts)
                finish(deps.engine, work.key, now=deps.clock(), error=str(exc)[:1000])
            else:
                release(deps.engine, work.key, now=deps.clock(), delay_s=delay, error=str(exc))
        except DatabaseError as again:  # its claim expires, and the leader takes it then
            log.warning("could not give deferred %s back: %s", work.key, again)
        return
    try:
        finish(deps.engine, work.key, now=deps.clock())
    except DatabaseError as exc:  # done all the same; whoever runs it again finds so
        log.warning("could not mark deferred %s done: %s", work.key, exc)


def run_now(deps: Deps, key: str) -> bool:
    """Claim ``key`` and run it on this thread; False when it is done or held elsewhere."""
    work = claim(deps.engine, key, holder=deps.replica, now=deps.clock(), hold_s=deps.hold_s)
    if work is None:
        return False
    run_claimed(deps, work)
    return True


class DeferredRunner:
    """The leader's share: overdue work nobody else ran, on a thread, under ``token``."""

    def __init__(self, deps: Deps, *, token: int, poll_s: float = POLL_S) -> None:
        self.deps = deps
        self.token = token
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pruned: datetime | None = None

    def start(self) -> DeferredRunner:
        self._thread = threading.Thread(
            target=self._loop, name=f"trainbot-deferred-{self.token}", daemon=True
        )
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.run_due()
            except DatabaseError as exc:
                log.warning("cannot look for deferred work: %s", exc)
            except Exception:
                log.exception("looking for deferred work failed")

    def run_due(self) -> int:
        """Claim what is due and run it on the control plane's pool; how many rows."""
        now = self.deps.clock()
        claimed = claim_due(
            self.deps.engine,
            token=self.token,
            holder=self.deps.replica,
            now=now,
            hold_s=self.deps.hold_s,
        )
        for work in claimed:
            log.info("running deferred %s (leader, token %d)", work.key, self.token)
            self.deps.background(run_claimed, self.deps, work)
        if self._pruned is None or now - self._pruned > timedelta(hours=1):
            prune(self.deps.engine, before=now - KEEP_DONE)
            self._pruned = now
        return len(claimed)

    def stop(self) -> None:
        """Stop looking; work already handed to the pool finishes there."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
