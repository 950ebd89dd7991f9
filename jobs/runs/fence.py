"""Fencing: scheduled work a deposed leader started is refused before the provider call.

The scheduler's leader holds a lease whose token rises at each change of holder; work it
starts carries the token (:func:`jobs.process.deps.current_fence`), and the launch and the
termination of an instance check here that it is still the lease's. Its own module
because both the launch and the end of an attempt ask it.
"""

from __future__ import annotations

import logging

from sqlmodel import Session

from jobs.database.db import session_scope
from jobs.database.replica_tables import LEADER_LEASE, SchedulerLease
from jobs.domain.errors import FencedOut
from jobs.process.deps import Deps, current_fence

__all__ = ["check_fence"]

log = logging.getLogger(__name__)


def check_fence(deps: Deps, session: Session | None, *, action: str) -> None:
    """Refuse ``action`` (a provider call) when it is scheduled work whose fencing token
    is no longer the lease's: a deposed leader's late call. Checked in the caller's
    transaction (``session``; None: a transaction of its own), with the lease row
    share-locked on PostgreSQL, so a takeover commits either before the check (refused)
    or after the caller's transaction."""
    token = current_fence()
    if token is None:
        return
    if session is None:
        with session_scope(deps.engine) as own:
            check_fence(deps, own, action=action)
        return
    lease = session.get(SchedulerLease, LEADER_LEASE, with_for_update={"read": True})
    if lease is not None and lease.token == token and lease.expires_at > deps.clock():
        return
    current = "none" if lease is None else f"{lease.token} held by {lease.holder}"
    log.warning(
        "refused %s: this replica's scheduler lease (token %d) is no longer current "
        "(lease: %s); the leader redoes it",
        action,
        token,
        current,
    )
    raise FencedOut(
        f"refused {action}: this replica is no longer the scheduler's leader (fencing "
        f"token {token}, lease {current}); the current leader's reconcile takes it over"
    )
