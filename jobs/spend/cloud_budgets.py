"""Removing an ended run's cloud budget (AWS Budgets), once, retried until it goes."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sqlmodel import col, select

from jobs.database.db import session_scope
from jobs.database.models import Run
from jobs.domain.lifecycle import RunState
from jobs.providers.base import ProviderError
from jobs.spec import Resources, stored_section

if TYPE_CHECKING:
    from jobs.process.deps import Deps


log = logging.getLogger(__name__)


def remove_cloud_budgets(
    deps: Deps, *, now: datetime, run_ids: Iterable[str] | None = None
) -> list[str]:
    """Delete the cloud budget of every ended run (of ``run_ids``, when given) that ended
    ``cloud_budget_keep_days`` ago or more; returns the runs whose budget went.

    Each run's budget is removed once (``Run.cloud_budget_removed_at``); a failure is
    logged and tried again by the next call (the cleanup job), so nothing stays behind.
    """
    if not any(p.capabilities.cloud_budgets for p in deps.providers.values()):
        return []
    keep = timedelta(days=deps.settings.cloud_budget_keep_days)
    terminal = [state for state in RunState if state.is_terminal()]
    query = select(Run.id, Run.spec).where(
        col(Run.state).in_(terminal),
        col(Run.budget_usd).is_not(None),
        col(Run.ended_at).is_not(None),
        col(Run.ended_at) <= now - keep,
        col(Run.cloud_budget_removed_at).is_(None),
    )
    if run_ids is not None:
        query = query.where(col(Run.id).in_(list(run_ids)))
    with session_scope(deps.engine) as session:
        due = list(session.exec(query.order_by(col(Run.id))).all())
    removed = []
    for run_id, spec in due:
        try:  # the budget is in the billing of the provider the run went on
            provider = deps.provider_for(stored_section(spec, Resources, run_id=run_id))
        except ProviderError:
            continue  # not configured here: nothing of it can be removed from here
        if not provider.capabilities.cloud_budgets:
            continue
        try:
            provider.delete_budget(run_id=run_id)
        except ProviderError as exc:
            log.warning("removing the cloud budget of %s failed (cleanup retries): %s", run_id, exc)
            continue
        with session_scope(deps.engine) as session:
            run = session.get(Run, run_id)
            if run is not None:
                run.cloud_budget_removed_at = now
                session.add(run)
        deps.journal.record("cloud_budget_removed", run_id)
        removed.append(run_id)
    return removed
