"""Waiting for capacity: a run that no allowed zone takes now tries again later.

A pass over the zones (and regions) the spec allows ends in :class:`NoPlacement` when
every one refused the launch for lack of capacity. Rather than fail, the run waits, as
long as ``resubmit.wait_for_capacity`` allows from the first refusal: the next pass is
a row of deferred work (:data:`Later.CAPACITY`, run by
:func:`jobs.runs.relaunch.try_again`), due after a backoff that starts at
``resubmit.backoff_s``, doubles, is capped at :data:`MAX_BACKOFF_S` and jittered, and
only the scheduler's leader runs it (no replica's timer), so it survives a restart.

Waiting costs nothing and uses no attempt: the launches a pass made that were refused
(attempt rows that never had an instance) are forgotten when the run starts to wait,
so attempt numbers, ``/train logs`` and spend see only attempts that ran. One message
in the run's thread says what was tried and when the next try is, edited in place at
each try; it says how the wait ended (capacity found, the run stopped, the wait over).

The wait's state is its rows: their keys name the run and the *episode* (the last
attempt that had an instance, or ``start``), so a run that waits again after a later
preemption starts a new wait with its own time allowance.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlmodel import Session, col, select

from jobs.background.deferred import Later, current_fence, defer
from jobs.database.models import Attempt, Run
from jobs.database.replica_tables import DeferredWork
from jobs.domain import format as fmt
from jobs.domain.lifecycle import AttemptState
from jobs.outbound.notify import MessageRef, TextMessage
from jobs.process.deps import Deps
from jobs.runs.cards import refresh_card
from jobs.runs.placement import NO_CAPACITY, NoPlacement
from jobs.runs.rows import channel_of
from jobs.spec import JobSpec

__all__ = [
    "MAX_BACKOFF_S",
    "Retry",
    "Wait",
    "current",
    "defer_retry",
    "end_wait",
    "found_capacity",
    "not_due",
    "wait",
]

log = logging.getLogger(__name__)

#: The longest wait between two tries.
MAX_BACKOFF_S = 600.0
#: Each wait is jittered by up to this fraction either way, so runs that started
#: waiting together do not all try at once.
JITTER = 0.2


@dataclass(frozen=True)
class Wait:
    """Where a run's wait for capacity stands."""

    #: The last attempt that had an instance ("start": none yet); a new one starts a
    #: new wait.
    episode: str
    #: Passes refused so far in this wait.
    tries: int = 0
    #: When the first pass of this wait was refused; None: not waiting.
    since: datetime | None = None
    #: The thread message that tells the wait, edited at each try.
    ts: str | None = None
    #: When the next try is due, while one is pending.
    next_at: datetime | None = None
    #: The pending try's key.
    pending: str | None = None


@dataclass(frozen=True)
class Retry:
    """The next try, deferred once the caller's transaction has committed."""

    key: str
    args: dict[str, Any]
    due_at: datetime


def _prefix(run_id: str, episode: str) -> str:
    return f"capacity:{run_id}:{episode}:"


def _episode(session: Session, run_id: str) -> str:
    last = session.exec(
        select(Attempt.id)
        .where(Attempt.run_id == run_id, col(Attempt.instance_id).is_not(None))
        .order_by(col(Attempt.number).desc())
    ).first()
    return last or "start"


def current(session: Session, run_id: str) -> Wait:
    """The run's wait for capacity in its current episode (tries 0: not waiting)."""
    episode = _episode(session, run_id)
    rows = session.exec(
        select(DeferredWork).where(col(DeferredWork.key).startswith(_prefix(run_id, episode)))
    ).all()
    if not rows:
        return Wait(episode=episode)
    first = min(rows, key=lambda r: int(r.args.get("tries", 0)))
    pending = [r for r in rows if r.done_at is None]
    since = first.args.get("since")
    return Wait(
        episode=episode,
        tries=max(int(r.args.get("tries", 0)) for r in rows),
        since=datetime.fromisoformat(since) if since else None,
        ts=first.args.get("ts"),
        next_at=min(r.due_at for r in pending) if pending else None,
        pending=pending[0].key if pending else None,
    )


def not_due(session: Session, run_id: str, *, now: datetime) -> bool:
    """True while the run waits for capacity and its next try is not due: a launch
    asked for before then (reconcile's backstop, a stray timer) waits for it."""
    pending = session.exec(
        select(DeferredWork.due_at).where(
            col(DeferredWork.key).startswith(f"capacity:{run_id}:"),
            col(DeferredWork.done_at).is_(None),
        )
    ).all()
    return any(_aware(due) > now for due in pending)


def _aware(at: datetime) -> datetime:
    return at if at.tzinfo is not None else at.replace(tzinfo=timezone.utc)


def _forget_refusals(session: Session, run_id: str) -> list[str]:
    """Delete the pass's refused launches (attempt rows that never had an instance):
    the wait uses no attempt. Returns where each was refused, for the thread."""
    attempts = session.exec(
        select(Attempt).where(Attempt.run_id == run_id).order_by(col(Attempt.number).desc())
    ).all()
    tried: list[str] = []
    for attempt in attempts:
        reason = attempt.end_reason or ""
        if (
            attempt.state != AttemptState.FAILED
            or attempt.instance_id is not None
            or not reason.startswith(NO_CAPACITY)
        ):
            break
        tried.append(attempt.zone or attempt.region or "a zone the provider chose")
        session.delete(attempt)
    session.flush()
    return list(reversed(tried))


def wait(
    deps: Deps, session: Session, run: Run, spec: JobSpec, found: NoPlacement, *, now: datetime
) -> Retry | None:
    """Make ``run`` wait for capacity after a refused pass, or None when it may not (the
    refusal is not about capacity, the spec asks for no wait, or the wait is over): the
    caller fails it then. Tells the thread (one message, edited) and the card."""
    policy = spec.resubmit
    if not found.waitable or policy.wait_for_capacity <= 0:
        return None
    state = current(session, run.id)
    since = state.since or now
    allowed = timedelta(seconds=policy.wait_for_capacity)
    deadline = since + allowed
    if now >= deadline:
        return None
    tries = state.tries + 1
    backoff = min(MAX_BACKOFF_S, policy.backoff_s * 2 ** min(tries - 1, 30))
    backoff *= random.uniform(1 - JITTER, 1 + JITTER)
    next_at = min(now + timedelta(seconds=backoff), deadline)
    tried = _forget_refusals(session, run.id)
    market = "spot " if spec.resources.spot else ""
    text = (
        f"{run.id} is waiting for {market}capacity. Try {tries} at {_time(now)} found none "
        f"({found.reason}). Next try at {_time(next_at)} (in "
        f"{fmt.duration((next_at - now).total_seconds())}); it waits until {_time(deadline)} "
        f"(resubmit.wait_for_capacity={fmt.duration(allowed.total_seconds())}). Waiting costs "
        f"nothing and uses no attempt; /train stop {run.id} ends it."
    )
    ts = _tell(deps, run, text, ts=state.ts)
    run.reason = f"waiting for {market}capacity; next try at {_time(next_at)}"
    run.updated_at = now
    session.add(run)
    deps.journal.record(
        "capacity_wait",
        run.id,
        tries=tries,
        tried=tried,
        next_at=next_at.isoformat(),
        until=deadline.isoformat(),
    )
    refresh_card(deps, session, run)
    args = {
        "run_id": run.id,
        "episode": state.episode,
        "tries": tries,
        "since": since.isoformat(),
        "ts": ts,
    }
    return Retry(key=f"{_prefix(run.id, state.episode)}{tries}", args=args, due_at=next_at)


def gave_up(deps: Deps, session: Session, run: Run, spec: JobSpec) -> str:
    """The wait is over and the run fails: what its reason adds ("" when it did not
    wait), and the wait's message says so."""
    state = current(session, run.id)
    if not state.tries:
        return ""
    allowed = fmt.duration(spec.resubmit.wait_for_capacity)
    said = (
        f" (waited {allowed} for capacity over {state.tries + 1} tries, as "
        "resubmit.wait_for_capacity allows)"
    )
    if state.ts is not None:
        _tell(deps, run, f"{run.id} stopped waiting for capacity{said}.", ts=state.ts)
    return said


def defer_retry(deps: Deps, retry: Retry) -> None:
    """Record the next try as deferred work: a row only, which the scheduler's leader
    runs when it is due (and after a restart)."""
    defer(
        deps.engine,
        kind=Later.CAPACITY,
        key=retry.key,
        args=retry.args,
        due_at=retry.due_at,
        fence=current_fence(),
        now=deps.clock(),
    )


def end_wait(deps: Deps, session: Session, run: Run, *, why: str) -> None:
    """End ``run``'s wait for capacity, if it waits (a person stopped it): its pending
    try is dropped and its message says so."""
    state = current(session, run.id)
    if not state.tries:
        return
    if state.pending is not None:
        row = session.get(DeferredWork, state.pending)
        if row is not None and row.done_at is None:
            row.done_at = deps.clock()
            row.error = f"wait ended: {why}"
            session.add(row)
    if state.ts is not None:
        _tell(
            deps,
            run,
            f"{run.id} stopped waiting for capacity after {state.tries} tries: {why}.",
            ts=state.ts,
        )


def found_capacity(
    deps: Deps, session: Session, run: Run, attempt: Attempt, *, zone: str, now: datetime
) -> None:
    """The attempt launched after the run waited: the wait's message says where, and
    the card's "waiting" reason goes. Called before the attempt records its instance
    (which starts a new episode)."""
    state = current(session, run.id)
    if not state.tries:
        return
    waited = fmt.duration((now - _aware(state.since)).total_seconds()) if state.since else "a while"
    if state.ts is not None:
        _tell(
            deps,
            run,
            f"{run.id} waited {waited} for capacity: try {state.tries + 1} found it, and "
            f"attempt {attempt.number} launched in {zone or attempt.zone or attempt.region}.",
            ts=state.ts,
        )
    if (run.reason or "").startswith("waiting for"):
        run.reason = None
        session.add(run)


def _tell(deps: Deps, run: Run, text: str, *, ts: str | None) -> str | None:
    """Post the wait's message, or edit it in place once posted."""
    msg = TextMessage(
        channel=channel_of(run), thread_ts=run.thread_ts, kind="info", text=text, run_id=run.id
    )
    if ts is None:
        return deps.notifier.post(msg).ts
    deps.notifier.update(MessageRef(channel=channel_of(run), ts=ts), msg)
    return ts


def _time(at: datetime) -> str:
    return _aware(at).astimezone(timezone.utc).strftime("%H:%M:%S UTC")
