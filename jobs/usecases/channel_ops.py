"""What a person does in their channels besides driving a run: seeing runs, logs, spend,
budgets and on-call; acknowledging and snoozing alerts, setting who is on call, cleaning
up checkpoints; and the command log that makes a retried command count once. Always
scoped to the person's channels (:mod:`jobs.domain.actor`). The use-cases that move a run
through its states live in :mod:`jobs.usecases.service`, which re-exports these for the front ends.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from zoneinfo import ZoneInfo

from sqlmodel import col, select

from jobs import alerts, spend
from jobs.database.db import detach, session_scope
from jobs.database.models import Alert, OnCall, Run, utcnow
from jobs.database.replica_tables import CommandLog
from jobs.domain.actor import Actor, may_see, may_see_alert, may_touch
from jobs.domain.errors import ConflictError
from jobs.domain.lifecycle import RunState
from jobs.outbound.notify import RunCard
from jobs.process.deps import Deps
from jobs.runs import (
    card,
    get_run,
)
from jobs.spec import list_specs
from jobs.usecases.run_logs import RunLog, run_log

log = logging.getLogger(__name__)


#: The most runs a list returns: the reply shows what fits and says how many more.
LIST_LIMIT = 1000


def status(deps: Deps, run_id: str | None, actor: Actor) -> list[RunCard]:
    with session_scope(deps.engine) as session:
        if run_id is not None:
            run = get_run(session, run_id)
            may_see(actor, run)
            return [card(session, run)]
        runs = session.exec(
            select(Run)
            .where(Run.channel == actor.channel)
            .order_by(col(Run.created_at).desc())
            .limit(10)
        ).all()
        return [card(session, r) for r in runs if not r.state.is_terminal()] or [
            card(session, r) for r in runs[:3]
        ]


def list_runs(deps: Deps, scope: str, actor: Actor) -> list[RunCard]:
    with session_scope(deps.engine) as session:
        q = select(Run).order_by(col(Run.created_at).desc()).limit(LIST_LIMIT)
        if not actor.is_admin:
            q = q.where(col(Run.channel).in_(sorted(actor.visible)))
        if scope == "mine":
            q = q.where(Run.requester == actor.user)
        runs = session.exec(q).all()
        if scope == "active":
            runs = [r for r in runs if not r.state.is_terminal()]
        return [card(session, r) for r in runs]


def logs(
    deps: Deps, run_id: str, actor: Actor, *, attempt: int | None = None, node: int = 0
) -> RunLog:
    """The end of what a run's command printed (:mod:`jobs.usecases.run_logs`): from the run's
    store on every provider, after the instance is gone."""
    return run_log(deps, run_id, actor, attempt=attempt, node=node)


def acknowledge(deps: Deps, alert_id: str, actor: Actor) -> Alert:
    with session_scope(deps.engine) as session:
        may_see_alert(session, actor, alert_id)
        alert = alerts.acknowledge(
            session, alert_id, user=actor.user, now=deps.clock(), notifier=deps.notifier,
            journal=deps.journal,
        )  # fmt: skip
        detach(session, alert)
        return alert


def snooze(deps: Deps, alert_id: str, seconds: int, actor: Actor) -> Alert:
    with session_scope(deps.engine) as session:
        may_see_alert(session, actor, alert_id)
        alert = alerts.snooze(
            session, alert_id, user=actor.user, seconds=seconds, now=deps.clock(),
            notifier=deps.notifier, journal=deps.journal,
        )  # fmt: skip
        detach(session, alert)
        return alert


def spend_report(deps: Deps, period: str, actor: Actor) -> dict[str, Any]:
    with session_scope(deps.engine) as session:
        spend.accrue(session, now=deps.clock())
        return spend.spend_report(
            session,
            channel=actor.channel,
            period=period,
            now=deps.clock(),
            tz=ZoneInfo(deps.settings.timezone),
        )


def budgets(deps: Deps, actor: Actor) -> list[dict[str, Any]]:
    """Each active run's budget and spend, for `/train budget`."""
    out = []
    with session_scope(deps.engine) as session:
        spend.accrue(session, now=deps.clock())
        runs = session.exec(select(Run).where(Run.channel == actor.channel)).all()
        for run in runs:
            if run.state.is_terminal() and run.state != RunState.BUDGET_EXCEEDED:
                continue
            spent = spend.run_spent(session, run.id)
            out.append(
                {
                    "run_id": run.id,
                    "budget_usd": run.budget_usd,
                    "spent_usd": round(spent, 2),
                    "pct": round(100 * spent / run.budget_usd, 1) if run.budget_usd else None,
                    "state": run.state.value,
                }
            )
    return out


def oncall(deps: Deps, user: str | None, actor: Actor) -> str | None:
    """Show (or set) who is on call for this channel."""
    with session_scope(deps.engine) as session:
        row = session.get(OnCall, actor.channel)
        if user is None:
            return row.user if row else None
        if row is None:
            row = OnCall(channel=actor.channel, user=user, set_by=actor.user, set_at=deps.clock())
        else:
            row.user, row.set_by, row.set_at = user, actor.user, deps.clock()
        session.add(row)
        return user


def cleanup(deps: Deps, run_id: str, actor: Actor, *, dry_run: bool = False) -> dict[str, Any]:
    """Prune one run's checkpoints by its retention policy now."""
    from jobs.background.tasks import prune_run

    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        may_see(actor, run)
        if not dry_run:
            may_touch(actor, run)
    return prune_run(deps, run_id, dry_run=dry_run)


def specs(deps: Deps) -> list[str]:
    return list_specs(deps.settings.specs_dir)


def remember_command(deps: Deps, key: str, kind: str) -> bool:
    """Record a command key; False when it was seen before (a replayed request)."""
    with session_scope(deps.engine) as session:
        if session.get(CommandLog, key) is not None:
            return False
        session.add(CommandLog(key=key, kind=kind, created_at=utcnow()))
        try:
            session.flush()
        except ConflictError:
            return False
    return True


def wait_for(deps: Deps, run_id: str, states: set[RunState], *, timeout_s: float) -> RunState:
    """Block until a run reaches one of ``states`` (the demo and tests)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with session_scope(deps.engine) as session:
            state = get_run(session, run_id).state
        if state in states or time.monotonic() > deadline:
            return state
        time.sleep(0.2)
