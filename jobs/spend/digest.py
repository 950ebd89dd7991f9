"""The figures of the daily digest and of ``/train spend``, and the digest's chart.

Compute (the spend records) and storage (:mod:`~jobs.spend.storage`) are separate lines;
the badput split (:mod:`~jobs.spend.badput`) goes with both.
"""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Mapping
from datetime import date, datetime, time, timedelta, timezone, tzinfo
from typing import Any

from sqlmodel import Session, col, select

from jobs.database.models import Attempt, Run
from jobs.domain.errors import TrainbotError
from jobs.domain.format import usd as usd_text
from jobs.domain.lifecycle import AttemptState
from jobs.spec import Resources, stored_section
from jobs.spend.accrual import team_spent, window_pieces
from jobs.spend.badput import badput_figures
from jobs.spend.storage import storage_figures

#: Periods ``/train spend`` understands: calendar periods to date, in the channel's time.
PERIODS = ("day", "week", "month")


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
    pieces = window_pieces(session, channel=channel, since=since, until=until)
    ended_query = select(Attempt, Run).join(Run, col(Run.id) == Attempt.run_id)
    ended_query = ended_query.where(
        col(Attempt.ended_at) >= since, col(Attempt.ended_at) < until
    ).order_by(col(Attempt.ended_at), col(Attempt.id))
    if channel is not None:
        ended_query = ended_query.where(Run.channel == channel)
    ended = session.exec(ended_query).all()

    usd: dict[str, float] = defaultdict(float)
    paid: dict[str, float] = defaultdict(float)
    dry_runs: dict[str, float] = defaultdict(float)
    kept: dict[str, float] = defaultdict(float)
    for piece in pieces:
        usd[piece.run_id] += piece.usd
        if piece.dry_run:  # spend, but no training time for goodput to judge
            dry_runs[piece.run_id] += piece.usd
        elif piece.kept:  # a failed attempt's instance kept to look at: no training either
            kept[piece.run_id] += piece.usd
        else:
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
        if dry_runs.get(run_id):  # of its usd, what its preflight dry runs cost
            per_run[-1]["dry_run_usd"] = _cents(dry_runs[run_id])
        if kept.get(run_id):  # of its usd, what its kept failed instances cost
            per_run[-1]["kept_usd"] = _cents(kept[run_id])
    total_paid = sum(paid.values())
    total_lost = sum(lost.values())
    return {
        "usd": _cents(sum(usd.values())),
        # Of which preflight dry runs' instances (also in each run's usd).
        "dry_run_usd": _cents(sum(dry_runs.values())),
        # Of which failed attempts' instances kept to look at (debug.keep_failed_instance).
        "kept_usd": _cents(sum(kept.values())),
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
    pieces = window_pieces(session, channel=channel, since=bounds[0], until=until)
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
    storage = storage_figures(session, channel=channel, since=since, until=until)
    month_storage = storage_figures(session, channel=channel, since=month_start, until=now)
    storage["month_to_date_usd"] = month_storage["usd"]
    # Imported here: jobs.staging reads the storage prices from this package.
    from jobs.staging.figures import staged_figures

    storage["staged"] = staged_figures(session, channel=channel, since=since, until=until)
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
        "storage": storage,
        "badput": badput_figures(session, channel=channel, since=since, until=until),
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
        "storage": storage_figures(session, channel=channel, since=since, until=now),
        "badput": badput_figures(session, channel=channel, since=since, until=now),
        "per_day": _per_day(session, channel=channel, first=first, last=today, tz=tz, until=now),
    }


def spend_chart_png(figures: Mapping[str, Any]) -> bytes:
    """A bar chart of spend per run, per day when the figures have days, and the badput
    split by cause when they have one, as PNG bytes.

    matplotlib is imported here, with the Agg backend, so the control plane starts
    without it and never needs a display.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [row for row in figures.get("per_run", []) if row.get("usd", 0) > 0]
    days = list(figures.get("per_day", []))
    badput = figures.get("badput")
    panels = 1 + bool(days) + bool(badput)
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
        if badput:
            _badput_panel(axes[0][panels - 1], badput)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        return buffer.getvalue()
    finally:
        plt.close(fig)


def _badput_panel(ax: Any, badput: Mapping[str, Any]) -> None:
    """Horizontal bars: the dollars each cause of badput cost, the first cause on top."""
    rows = list(badput.get("categories", []))
    ax.set_title(f"Badput by cause, {usd_text(badput.get('usd'))} in all", fontsize=9)
    if not any(row.get("usd", 0) > 0 for row in rows):
        ax.text(0.5, 0.5, "no badput", ha="center", va="center", transform=ax.transAxes)
        return
    labels = [str(row["label"]) for row in rows][::-1]
    values = [float(row["usd"]) for row in rows][::-1]
    ax.barh(labels, values, color="#c44e52")
    ax.set_xlabel("USD")
    ax.tick_params(axis="y", labelsize=7)
