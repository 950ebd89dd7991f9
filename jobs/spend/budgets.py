"""Run and team budgets: thresholds reported once, hard caps, and resubmits under a budget."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import or_
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from jobs.database.models import Budget, Run
from jobs.domain import format as fmt
from jobs.domain.errors import ConflictError
from jobs.domain.lifecycle import RunState
from jobs.spec import BudgetPolicy, stored_section
from jobs.spend.accrual import run_spent, team_spent

# Ended runs are still checked for a while: their last accrual may cross a threshold.
_ENDED_RUN_GRACE = timedelta(days=1)


@dataclass(frozen=True)
class BudgetStatus:
    """One budget, measured now."""

    #: ``"run"`` or ``"team"``.
    scope: str
    #: The run id, or the team's channel.
    name: str
    #: The budget in USD.
    usd: float
    #: Spent against it: the run's lifetime, or the team's calendar month (UTC) to date.
    spent: float
    #: ``100 × spent / usd``.
    pct: float
    #: Thresholds (percent) crossed since the last check and not reported before; the
    #: caller alerts on them (rule ``"budget"``). Each is reported once.
    crossed: tuple[int, ...]
    #: The run's hard cap is reached and the run still spends: the caller stops it.
    #: Always False for team budgets.
    hard_cap_hit: bool


def check_budgets(session: Session, *, now: datetime) -> list[BudgetStatus]:
    """Measure every active budget and mark newly crossed thresholds as reported.

    Returns a status for every budget checked, crossed or not; it sends nothing. Run
    budgets cover runs still able to spend and runs that ended within the last day;
    their thresholds and hard cap come from the stored spec (``budget.thresholds``,
    ``budget.hard_cap``). A hard cap applies only to a budget written in the spec, not
    to one taken from preflight's estimate, and always includes 100 %.
    """
    statuses = [_check_run(session, run, now=now) for run in _budgeted_runs(session, now=now)]
    month_start = datetime(now.year, now.month, 1, tzinfo=timezone.utc)
    teams = session.exec(
        select(Budget).where(Budget.scope == "team").order_by(col(Budget.name)).with_for_update()
    ).all()
    for budget in teams:
        if budget.updated_at < month_start:
            # Reported in an earlier month: every threshold is armed again.
            budget.alerted = []
            budget.updated_at = now
        spent = team_spent(session, channel=budget.name, since=month_start, until=now)
        crossed = _mark(budget, spent=spent, thresholds=budget.thresholds, now=now)
        statuses.append(_status(budget, spent=spent, crossed=crossed, hard_cap_hit=False))
    session.flush()
    return statuses


def _budgeted_runs(session: Session, *, now: datetime) -> list[Run]:
    terminal = [state for state in RunState if state.is_terminal()]
    query = (
        select(Run)
        .where(
            col(Run.budget_usd).is_not(None),
            col(Run.budget_usd) > 0,
            or_(
                col(Run.state).not_in(terminal),
                col(Run.ended_at) >= now - _ENDED_RUN_GRACE,
            ),
        )
        .order_by(col(Run.id))
    )
    return list(session.exec(query).all())


def _check_run(session: Session, run: Run, *, now: datetime) -> BudgetStatus:
    assert run.budget_usd is not None
    policy = stored_section(run.spec, BudgetPolicy, run_id=run.id)
    thresholds = policy.alert_percentages
    budget = _run_budget_row(session, run, thresholds=thresholds, now=now)
    spent = run_spent(session, run.id)
    crossed = _mark(budget, spent=spent, thresholds=thresholds, now=now)
    hit = policy.caps_spend and spent >= run.budget_usd and not run.state.is_terminal()
    return _status(budget, spent=spent, crossed=crossed, hard_cap_hit=hit)


def _run_budget_row(session: Session, run: Run, *, thresholds: list[int], now: datetime) -> Budget:
    """The run's row in ``budgets``, created on first check, kept in step with the run."""
    query = (
        select(Budget)
        .where(Budget.scope == "run", Budget.name == run.id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    budget = session.exec(query).first()
    if budget is None:
        budget = Budget(
            scope="run",
            name=run.id,
            usd=float(run.budget_usd or 0.0),
            period="run",
            thresholds=thresholds,
            alerted=[],
            created_at=now,
            updated_at=now,
        )
        try:
            with session.begin_nested():
                session.add(budget)
        except IntegrityError:
            # Another checker created it first; use theirs.
            budget = session.exec(query).one()
    if budget.usd != run.budget_usd or budget.thresholds != thresholds:
        budget.usd = float(run.budget_usd or 0.0)
        budget.thresholds = thresholds
        budget.updated_at = now
    return budget


def _mark(budget: Budget, *, spent: float, thresholds: Iterable[int], now: datetime) -> list[int]:
    """Record which thresholds are crossed; return those not reported before."""
    pct = 100.0 * spent / budget.usd if budget.usd > 0 else 0.0
    crossed_now = sorted(t for t in thresholds if pct >= t)
    new = [t for t in crossed_now if t not in budget.alerted]
    # Keep only thresholds still crossed, so one that spend drops back below re-arms.
    kept = sorted(set(crossed_now))
    if kept != sorted(budget.alerted):
        budget.alerted = kept  # a new list: in-place edits of JSON columns are not saved
        budget.updated_at = now
    return new


def _status(
    budget: Budget, *, spent: float, crossed: list[int], hard_cap_hit: bool
) -> BudgetStatus:
    pct = 100.0 * spent / budget.usd if budget.usd > 0 else 0.0
    return BudgetStatus(
        scope=budget.scope,
        name=budget.name,
        usd=budget.usd,
        spent=spent,
        pct=pct,
        crossed=tuple(crossed),
        hard_cap_hit=hard_cap_hit,
    )


def resubmit_budget(
    session: Session, old: Run, *, raised_usd: float | None
) -> tuple[float, float | None]:
    """The spend a resubmit of ``old`` carries and the budget it runs under.

    The budget is ``raised_usd`` when given (any amount: a person chose it), else the old
    run's. A hard cap that the carried spend has already reached refuses the resubmit:
    the new run would only be stopped again, or, before this rule, start from zero.
    """
    carried = run_spent(session, old.id)
    budget = raised_usd if raised_usd is not None else old.budget_usd
    policy = stored_section(old.spec, BudgetPolicy, run_id=old.id)
    if raised_usd is not None:
        # A raised budget is the new run's spec's (jobs.usecases.resubmits.raise_budget): capped
        # as one written there is, by the one definition, BudgetPolicy.caps_spend.
        policy = policy.model_copy(update={"usd": raised_usd})
    if policy.caps_spend and budget is not None and carried >= budget:
        suggestion = max(2 * budget, carried * 1.5)
        raise ConflictError(
            f"{old.id} has spent {fmt.usd(carried)} of its {fmt.usd(budget)} budget, which has a "
            f"hard cap, so a resubmit would stop at once. Raise the budget above what is "
            f"spent to continue: `/train resubmit {old.id} budget.usd={suggestion:.0f}`"
        )
    return carried, budget
