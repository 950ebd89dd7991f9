"""What runs cost: accrual, totals, budgets, and the figures of the daily digest.

Money is recorded as :class:`~jobs.models.SpendRecord` rows, one per attempt per
accrual interval: the attempt's current price per instance-hour (spot price at launch,
refreshed by whoever updates ``Attempt.price_per_hour``) × hours × instances. Records
tile each attempt's paid time without gaps or overlaps: each starts where the last
ended, and ``UNIQUE(attempt_id, period_start)`` means a second, concurrent accrual of
the same interval fails instead of counting twice.

Sums over a time window (a day, a month) prorate each record by the share of it
inside the window, so a record that straddles local midnight is split between the two
days, whatever the accrual interval.

Budgets alert once per threshold: the thresholds already reported are kept in the
``budgets`` table (``alerted``), for team budgets (scope ``"team"``) and for runs
(scope ``"run"``, one row per run, created on its first check). A threshold that spend
falls back below (a raised budget) is armed again, and so is every team threshold at
the start of a new month (``updated_at`` tells which month ``alerted`` belongs to).
"""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone, tzinfo
from typing import Any

from sqlalchemy import func, or_
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from jobs.errors import TrainbotError
from jobs.lifecycle import AttemptState, RunState
from jobs.models import Attempt, Budget, Run, SpendRecord
from jobs.spec import BudgetPolicy, Resources, stored_section

__all__ = [
    "PERIODS",
    "BudgetStatus",
    "accrue",
    "check_budgets",
    "digest_figures",
    "run_spent",
    "spend_chart_png",
    "spend_report",
    "team_spent",
]

#: Periods ``/train spend`` understands: calendar periods to date, in the channel's time.
PERIODS = ("day", "week", "month")

# Ended runs are still checked for a while: their last accrual may cross a threshold.
_ENDED_RUN_GRACE = timedelta(days=1)


# --- accrual --------------------------------------------------------------------------


def accrue(session: Session, *, now: datetime) -> list[SpendRecord]:
    """Add the spend of every priced attempt since its last record, up to ``now``.

    An attempt is paid from ``started_at`` until ``ended_at`` (or ``now`` while it
    runs). Calling again at the same ``now`` adds nothing; an ended attempt is closed
    out exactly at ``ended_at`` and never accrues again.
    """
    last_end = (
        select(SpendRecord.attempt_id, func.max(SpendRecord.period_end).label("last_end"))
        .group_by(col(SpendRecord.attempt_id))
        .subquery()
    )
    rows = session.exec(
        select(Attempt, last_end.c.last_end)
        .outerjoin(last_end, last_end.c.attempt_id == Attempt.id)
        .where(
            col(Attempt.price_per_hour).is_not(None),
            col(Attempt.started_at).is_not(None),
            or_(
                col(Attempt.ended_at).is_(None),
                last_end.c.last_end.is_(None),
                last_end.c.last_end < Attempt.ended_at,
            ),
        )
        .order_by(col(Attempt.id))
    ).all()
    added: list[SpendRecord] = []
    for attempt, accrued_until in rows:
        assert attempt.started_at is not None and attempt.price_per_hour is not None
        start = _utc(accrued_until) if accrued_until is not None else attempt.started_at
        end = min(now, attempt.ended_at) if attempt.ended_at is not None else now
        if end <= start:
            continue
        hours = (end - start).total_seconds() / 3600.0
        record = SpendRecord(
            attempt_id=attempt.id,
            run_id=attempt.run_id,
            period_start=start,
            period_end=end,
            usd=attempt.price_per_hour * hours * attempt.instances,
            instances=attempt.instances,
            price_per_hour=attempt.price_per_hour,
        )
        session.add(record)
        added.append(record)
    session.flush()
    return added


def _utc(value: datetime) -> datetime:
    # An aggregate bypasses the column type: SQLite hands back naive UTC (or text).
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


# --- totals ---------------------------------------------------------------------------


def run_spent(session: Session, run_id: str) -> float:
    """Everything the run has accrued, all attempts, in USD."""
    total = session.exec(
        select(func.coalesce(func.sum(SpendRecord.usd), 0.0)).where(SpendRecord.run_id == run_id)
    ).one()
    return float(total)


def team_spent(session: Session, *, channel: str | None, since: datetime, until: datetime) -> float:
    """What the channel's runs (every run when ``channel`` is None) cost in ``[since, until)``."""
    return sum(piece.usd for piece in _pieces(session, channel=channel, since=since, until=until))


@dataclass(frozen=True)
class _Piece:
    """The part of one spend record inside a window."""

    run_id: str
    usd: float
    #: Paid instance-seconds.
    seconds: float
    start: datetime
    end: datetime


def _pieces(
    session: Session, *, channel: str | None, since: datetime, until: datetime
) -> list[_Piece]:
    query = (
        select(SpendRecord)
        .where(col(SpendRecord.period_end) > since, col(SpendRecord.period_start) < until)
        .order_by(col(SpendRecord.period_start), col(SpendRecord.id))
    )
    if channel is not None:
        query = query.join(Run, col(Run.id) == SpendRecord.run_id).where(Run.channel == channel)
    pieces = []
    for record in session.exec(query).all():
        start = max(record.period_start, since)
        end = min(record.period_end, until)
        length = (record.period_end - record.period_start).total_seconds()
        inside = (end - start).total_seconds()
        if inside <= 0 or length <= 0:
            continue
        pieces.append(
            _Piece(
                run_id=record.run_id,
                usd=record.usd * inside / length,
                seconds=inside * record.instances,
                start=start,
                end=end,
            )
        )
    return pieces


# --- budgets --------------------------------------------------------------------------


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


# --- digest and reports ---------------------------------------------------------------


def _midnight(day: date, tz: tzinfo) -> datetime:
    return datetime.combine(day, time.min, tzinfo=tz).astimezone(timezone.utc)


def _cents(usd: float) -> float:
    return round(usd, 2)


def _accelerators(run: Run) -> int:
    """GPUs (or other accelerators) per instance from the stored spec; 0 for CPU runs."""
    accelerator = stored_section(run.spec, Resources, run_id=run.id).accelerator
    return accelerator.count if accelerator is not None else 0


def _goodput(paid_s: float, lost_s: float) -> float | None:
    if paid_s <= 0:
        return None
    return round(min(1.0, max(0.0, 1.0 - lost_s / paid_s)), 4)


def _window_figures(
    session: Session, *, channel: str | None, since: datetime, until: datetime
) -> dict[str, Any]:
    """Spend, preemptions, goodput and lost hours of the channel's runs in ``[since, until)``.

    Lost work counts in the window its attempt ended in (that is when it is known);
    paid time is the prorated spend records. Both are instance-seconds, so goodput is
    the share of paid instance time whose work was kept.
    """
    pieces = _pieces(session, channel=channel, since=since, until=until)
    ended_query = select(Attempt, Run).join(Run, col(Run.id) == Attempt.run_id)
    ended_query = ended_query.where(
        col(Attempt.ended_at) >= since, col(Attempt.ended_at) < until
    ).order_by(col(Attempt.ended_at), col(Attempt.id))
    if channel is not None:
        ended_query = ended_query.where(Run.channel == channel)
    ended = session.exec(ended_query).all()

    usd: dict[str, float] = defaultdict(float)
    paid: dict[str, float] = defaultdict(float)
    for piece in pieces:
        usd[piece.run_id] += piece.usd
        paid[piece.run_id] += piece.seconds
    lost: dict[str, float] = defaultdict(float)
    preempted: dict[str, int] = defaultdict(int)
    runs: dict[str, Run] = {}
    for attempt, run in ended:
        runs[run.id] = run
        lost[run.id] += attempt.lost_seconds * attempt.instances
        if attempt.state is AttemptState.PREEMPTED:
            preempted[run.id] += 1
    missing = sorted(set(usd) - set(runs))
    if missing:
        for run in session.exec(select(Run).where(col(Run.id).in_(missing))).all():
            runs[run.id] = run

    per_run = []
    per_user: dict[str, float] = defaultdict(float)
    gpu_hours_lost = 0.0
    for run_id in sorted(runs, key=lambda r: (-usd.get(r, 0.0), r)):
        run = runs[run_id]
        per_user[run.requester] += usd.get(run_id, 0.0)
        gpu_hours_lost += lost[run_id] * _accelerators(run) / 3600.0
        per_run.append(
            {
                "run_id": run_id,
                "spec": run.spec_name,
                "requester": run.requester,
                "state": run.state.value,
                "usd": _cents(usd.get(run_id, 0.0)),
                "preemptions": preempted.get(run_id, 0),
                "goodput": _goodput(paid.get(run_id, 0.0), lost.get(run_id, 0.0)),
            }
        )
    total_paid = sum(paid.values())
    total_lost = sum(lost.values())
    return {
        "usd": _cents(sum(usd.values())),
        "per_run": per_run,
        "per_user": [
            {"user": user, "usd": _cents(amount)}
            for user, amount in sorted(per_user.items(), key=lambda item: (-item[1], item[0]))
        ],
        "preemptions": sum(preempted.values()),
        "goodput": _goodput(total_paid, total_lost),
        "paid_instance_hours": round(total_paid / 3600.0, 3),
        "instance_hours_lost": round(total_lost / 3600.0, 3),
        "gpu_hours_lost": round(gpu_hours_lost, 3),
    }


def _per_day(
    session: Session, *, channel: str | None, first: date, last: date, tz: tzinfo, until: datetime
) -> list[dict[str, Any]]:
    """Spend per local day from ``first`` to ``last`` inclusive (the last one up to ``until``)."""
    days = [first + timedelta(days=n) for n in range((last - first).days + 1)]
    bounds = [_midnight(day, tz) for day in days] + [until]
    pieces = _pieces(session, channel=channel, since=bounds[0], until=until)
    totals = [0.0] * len(days)
    for piece in pieces:
        length = (piece.end - piece.start).total_seconds()
        for index in range(len(days)):
            lo, hi = bounds[index], min(bounds[index + 1], until)
            inside = (min(piece.end, hi) - max(piece.start, lo)).total_seconds()
            if inside > 0 and length > 0:
                totals[index] += piece.usd * inside / length
    return [
        {"date": day.isoformat(), "usd": _cents(usd)} for day, usd in zip(days, totals, strict=True)
    ]


def digest_figures(
    session: Session,
    *,
    channel: str | None,
    now: datetime,
    tz: tzinfo,
    day: date | None = None,
) -> dict[str, Any]:
    """The daily digest for one channel (every channel when None), in its local time.

    It covers ``day``, a local calendar day: by default yesterday, the day the scheduled
    digest reports; today covers midnight to ``now`` ("today so far"). The month is the
    local calendar month up to ``now``. Every value is JSON-able; USD is rounded to cents.
    """
    today = now.astimezone(tz).date()
    if day is None:
        day = today - timedelta(days=1)
    if day > today:
        raise TrainbotError(f"the digest of {day} cannot be made before that day ({today})")
    month_first = today.replace(day=1)
    since = _midnight(day, tz)
    until = min(_midnight(day + timedelta(days=1), tz), now)
    figures = _window_figures(session, channel=channel, since=since, until=until)
    day_usd = figures.pop("usd")
    label = {today: "today so far", today - timedelta(days=1): "yesterday"}.get(
        day, day.isoformat()
    )
    month_start = _midnight(month_first, tz)
    month_usd = team_spent(session, channel=channel, since=month_start, until=now)
    return {
        "channel": channel,
        "timezone": str(tz),
        "date": day.isoformat(),
        "day_label": label,
        "month": f"{month_first:%Y-%m}",
        "since": since.isoformat(),
        "until": until.isoformat(),
        "day_usd": day_usd,
        "month_to_date_usd": _cents(month_usd),
        **figures,
        "per_day": _per_day(
            session, channel=channel, first=month_first, last=today, tz=tz, until=now
        ),
    }


def spend_report(
    session: Session, *, channel: str | None, period: str, now: datetime, tz: tzinfo
) -> dict[str, Any]:
    """``/train spend day|week|month``: this local day, week (from Monday) or month, to date."""
    today = now.astimezone(tz).date()
    if period == "day":
        first = today
    elif period == "week":
        first = today - timedelta(days=today.weekday())
    elif period == "month":
        first = today.replace(day=1)
    else:
        raise TrainbotError(
            f"{period!r} is not a spend period: use `/train spend day`, `week` or `month`"
        )
    since = _midnight(first, tz)
    figures = _window_figures(session, channel=channel, since=since, until=now)
    return {
        "channel": channel,
        "timezone": str(tz),
        "period": period,
        "since": since.isoformat(),
        "until": now.isoformat(),
        "first_date": first.isoformat(),
        "last_date": today.isoformat(),
        **figures,
        "per_day": _per_day(session, channel=channel, first=first, last=today, tz=tz, until=now),
    }


def spend_chart_png(figures: Mapping[str, Any]) -> bytes:
    """A bar chart of spend per run, and per day when the figures have days, as PNG bytes.

    matplotlib is imported here, with the Agg backend, so the control plane starts
    without it and never needs a display.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [row for row in figures.get("per_run", []) if row.get("usd", 0) > 0]
    days = list(figures.get("per_day", []))
    panels = 2 if days else 1
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3), dpi=100, squeeze=False)
    try:
        ax = axes[0][0]
        title = f"Spend per run, {figures['date']}" if "date" in figures else "Spend per run"
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("USD")
        if runs:
            ax.bar([row["run_id"] for row in runs], [row["usd"] for row in runs], color="#4c72b0")
            ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        else:
            ax.text(0.5, 0.5, "no spend", ha="center", va="center", transform=ax.transAxes)
        if days:
            ax = axes[0][1]
            ax.set_title("Spend per day", fontsize=9)
            ax.bar(
                [row["date"][-2:] for row in days], [row["usd"] for row in days], color="#55a868"
            )
            ax.tick_params(axis="x", labelsize=6)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        return buffer.getvalue()
    finally:
        plt.close(fig)
