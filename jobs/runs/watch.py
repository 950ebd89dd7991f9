"""The reconcile pass's look at running attempts: the rules no event triggers.

A hung run sends heartbeats and nothing else, so nothing on the stream says that its
step stopped; the rules of :attr:`Trigger.PERIODIC` (the ``hung`` rule) are evaluated
here instead, once per reconcile pass, for every attempt that runs and is heard from (a
silent one is the lost heartbeat's), over its recent metrics and its newest stacks dump.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime

from sqlmodel import Session, col, select

from jobs.database.db import session_scope
from jobs.database.metrics import run_metrics
from jobs.database.models import Attempt, EventRow, Run
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.process.deps import Deps
from jobs.rules import Obs, Trigger, evaluate_all, rules_on
from jobs.runs.cards import raise_signals, run_context
from jobs.spec import AlertThresholds, stored_section
from runner.stacks import RECENT_STEPS
from runner.wire import restore_floats

log = logging.getLogger(__name__)

#: The saves a run's save interval is judged from.
RECENT_SAVES = 10

__all__ = ["watch_running"]


def watch_running(deps: Deps, *, now: datetime) -> int:
    """Evaluate the periodic rules of every running attempt heard from within its
    heartbeat deadline; the number of attempts looked at."""
    with session_scope(deps.engine) as session:
        rows = session.exec(
            select(Attempt.id)
            .join(Run, col(Run.id) == col(Attempt.run_id))
            .where(Attempt.state == AttemptState.RUNNING, Run.state == RunState.RUNNING)
        ).all()
    for attempt_id in rows:
        try:
            _watch(deps, attempt_id, now=now)
        except Exception:  # one run's bad rows must not stop the others' watch
            log.exception("the periodic rules of attempt %s failed", attempt_id)
    return len(rows)


def _watch(deps: Deps, attempt_id: str, *, now: datetime) -> None:
    with session_scope(deps.engine) as session:
        attempt = session.get(Attempt, attempt_id)
        run = session.get(Run, attempt.run_id) if attempt is not None else None
        if attempt is None or run is None or attempt.last_heartbeat is None:
            return
        thresholds = stored_section(run.spec, AlertThresholds, run_id=run.id)
        silent = (now - attempt.last_heartbeat).total_seconds()
        if silent > thresholds.heartbeat_deadline_s:
            return  # the lost heartbeat's to say
        rules = rules_on(Trigger.PERIODIC, thresholds)
        if not rules:
            return
        window = _window(session, attempt)
        ctx = run_context(session, run, attempt, now=now)
        signals = evaluate_all(rules, window, now=now.timestamp(), ctx=ctx)
        if signals:
            raise_signals(deps, session, run, signals, now=now)


def _window(session: Session, attempt: Attempt) -> list[Obs]:
    """The attempt's recent metrics and saves, and its newest stacks dump."""
    points = run_metrics(
        session.connection(), attempt.run_id, limit=RECENT_STEPS, attempt_id=attempt.id
    )
    window = [Obs(p.time, "metrics", {**p.data, "attempt": p.attempt_number}) for p in points]
    # The recent saves: a script whose steps come with them is judged by their interval.
    saves = session.exec(
        select(EventRow.time, EventRow.data)
        .where(
            EventRow.run_id == attempt.run_id,
            EventRow.type == "checkpoint_committed",
            EventRow.attempt_id == attempt.id,
        )
        .order_by(col(EventRow.time).desc(), col(EventRow.id).desc())
        .limit(RECENT_SAVES)
    ).all()
    for when, data in saves:
        payload = data if isinstance(data, Mapping) else {}
        window.append(
            Obs(when.timestamp(), "checkpoint_committed", {**payload, "attempt": attempt.number})
        )
    stacks = session.exec(
        select(EventRow.time, EventRow.data)
        .where(
            EventRow.run_id == attempt.run_id,  # the (run, type, time) index
            EventRow.type == "stacks",
            EventRow.attempt_id == attempt.id,
        )
        .order_by(col(EventRow.time).desc(), col(EventRow.id).desc())
        .limit(1)
    ).first()
    if stacks is not None:
        data = restore_floats(stacks[1]) if isinstance(stacks[1], Mapping) else {}
        window.append(Obs(stacks[0].timestamp(), "stacks", {**data, "attempt": attempt.number}))
    return window
