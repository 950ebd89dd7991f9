"""Launching a waiting run again: the next try for capacity, a price that is now met.

A launch that finds no capacity, or no price under ``resubmit.max_price``, records a
wait (:mod:`jobs.runs.capacity`, :mod:`jobs.runs.price`) and returns; what ends the wait
is here, above both and above the launch, so the launch can ask them without their
asking it back.
"""

from __future__ import annotations

import logging

from sqlmodel import col, select

from jobs.background.deferred import Later, deferrable
from jobs.database.db import session_scope
from jobs.database.models import Run
from jobs.domain.lifecycle import RunState
from jobs.process.deps import Deps
from jobs.runs import capacity
from jobs.runs.launch import launch_attempt
from jobs.runs.rows import active_attempt

__all__ = ["try_again", "watch_prices"]

log = logging.getLogger(__name__)


@deferrable(Later.CAPACITY)
def try_again(
    deps: Deps, run_id: str, episode: str, tries: int, since: str, ts: str | None
) -> None:
    """The next pass of a waiting run (the leader's deferred work). A run stopped
    meanwhile is not launched; its message says the wait ended."""
    with session_scope(deps.engine) as session:
        run = session.get(Run, run_id)
        if run is None:
            return
        if run.state not in (RunState.LAUNCHING, RunState.RECOVERING):
            capacity.end_wait(deps, session, run, why=f"{run.id} is {run.state.value.lower()}")
            return
    log.info("capacity: try %d for %s (waiting since %s)", tries + 1, run_id, since)
    launch_attempt(deps, run_id)


def watch_prices(deps: Deps) -> list[str]:
    """The scheduled price job: launch each waiting run whose price is met now (the
    launch asks the price again). Returns the runs it launched."""
    with session_scope(deps.engine) as session:
        live = session.exec(
            select(Run)
            .where(col(Run.state).in_([RunState.LAUNCHING, RunState.RECOVERING]))
            .order_by(col(Run.id))
        ).all()
        # Filtered here: a JSON column set back to None may hold JSON null, not SQL NULL.
        waiting = [r.id for r in live if r.price_wait and active_attempt(session, r.id) is None]
    return [run_id for run_id in waiting if launch_attempt(deps, run_id) is not None]
