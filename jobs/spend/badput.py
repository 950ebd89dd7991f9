"""Badput: the paid time that made no progress, split by its cause.

Each attempt's paid time, from launch (``started_at``) to its end, is cut at what its
runner reported:

- **start-up**: launch until the runner began restoring (the ``restored`` event's time
  less its ``restore_s``; without one, the ``started`` event; without either, all of it):
  provisioning, boot, install, and the process starting.
- **restore**: the ``restored`` event's ``restore_s``.
- **checkpoint stall**: the ``stall_s`` of each ``checkpoint_committed`` event, the time
  the loop was blocked by a save.
- **lost work**: of an attempt that was preempted or lost, the work done after its last
  committed checkpoint (``lost_steps`` × the step time; without a step time, from the last
  commit to the end), counted when the attempt ended.
- **data wait**: the rest of the training time × its data-wait fraction (the ``metrics``
  events' ``data_wait_fraction``, weighted by their step times).
- **on-demand premium**: of an on-demand attempt, what it paid above the spot price of
  the same request (``spot_price_per_hour``), for all of its paid time.

The first five are instance-seconds, disjoint within an attempt. Their dollars are at the
attempt's rate (its spend records' dollars per instance-second); an on-demand attempt's
are at its spot share of that rate, so that the premium, its own line, is not counted
twice and the categories add up in dollars. A window (a digest's day) gets the part of
each interval inside it, the stalls it holds, and the lost work of the attempts that
ended in it, as the digest counts lost work.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_
from sqlmodel import Session, col, select

from jobs.database.event_rollup import weight
from jobs.database.models import Attempt, EventRow, MetricBlock, Run, SpendRecord
from jobs.domain.lifecycle import AttemptState

__all__ = ["CATEGORIES", "LABELS", "AttemptFacts", "attempt_badput", "badput_figures"]

#: The categories, in the order the digest and the summary list them.
CATEGORIES = (
    "startup",
    "restore",
    "checkpoint_stall",
    "lost_work",
    "data_wait",
    "on_demand_premium",
)
#: Short names, for the chart's bars and the text's lines.
LABELS: Mapping[str, str] = {
    "startup": "provisioning and start-up",
    "restore": "restore",
    "checkpoint_stall": "checkpoint stall",
    "lost_work": "work lost to preemptions",
    "data_wait": "idle, waiting for data",
    "on_demand_premium": "on-demand premium",
}
_EVENT_TYPES = ("started", "restored", "checkpoint_committed")
_LOSING = (AttemptState.PREEMPTED, AttemptState.LOST)


@dataclass(frozen=True)
class AttemptFacts:
    """What the control plane recorded of one attempt that the split needs."""

    attempt: Attempt
    #: Its ``started``, ``restored`` and ``checkpoint_committed`` events: (type, time, data).
    events: Sequence[tuple[str, datetime, Mapping[str, Any]]]
    #: Its ``metrics`` points: (unix time, step_time_s, data_wait_fraction).
    points: Sequence[tuple[float, float, float]]
    #: Dollars per instance-second paid (its spend records'), or None: unpriced.
    rate: float | None


def _overlap(start: datetime, end: datetime, since: datetime, until: datetime) -> float:
    return max(0.0, (min(end, until) - max(start, since)).total_seconds())


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def attempt_badput(
    facts: AttemptFacts, *, since: datetime, until: datetime
) -> dict[str, tuple[float, float]]:
    """One attempt's badput in ``[since, until)``: category → (instance-seconds, USD)."""
    a = facts.attempt
    result = {name: (0.0, 0.0) for name in CATEGORIES}
    if a.started_at is None:
        return result
    paid_start = a.started_at
    paid_end = min(a.ended_at, until) if a.ended_at is not None else until
    if paid_end <= paid_start:
        return result
    events = sorted(facts.events, key=lambda e: e[1])
    restored = next((e for e in events if e[0] == "restored"), None)
    started = next((e for e in events if e[0] == "started"), None)
    restore_s = 0.0
    if restored is not None:
        train_start = restored[1]
        restore_s = max(0.0, _number(restored[2].get("restore_s")) or 0.0)
    elif started is not None:
        train_start = started[1]
    else:
        train_start = paid_end  # it never got going: all of it was start-up
    train_start = min(max(train_start, paid_start), paid_end)
    restore_start = max(paid_start, train_start - timedelta(seconds=restore_s))
    seconds = {name: 0.0 for name in CATEGORIES}
    seconds["startup"] = _overlap(paid_start, restore_start, since, until)
    seconds["restore"] = _overlap(restore_start, train_start, since, until)
    training = _overlap(train_start, paid_end, since, until)
    commits = [e for e in events if e[0] == "checkpoint_committed"]
    stall = sum(
        _number(e[2].get("stall_s")) or 0.0
        for e in commits
        if since <= e[1] < until and paid_start <= e[1] <= paid_end
    )
    seconds["checkpoint_stall"] = min(stall, training)
    if a.state in _LOSING and a.ended_at is not None and since <= a.ended_at < until:
        if a.step_time_s:
            lost = a.lost_steps * a.step_time_s
        else:
            last = max([train_start, *(e[1] for e in commits)])
            lost = max(0.0, (a.ended_at - last).total_seconds())
        seconds["lost_work"] = min(lost, training - seconds["checkpoint_stall"])
    since_s, until_s = since.timestamp(), until.timestamp()
    waited = [(t, w) for (at, t, w) in facts.points if since_s <= at < until_s and t > 0]
    stepped = sum(t for t, _ in waited)
    if stepped > 0:
        fraction = sum(t * w for t, w in waited) / stepped
        rest = training - seconds["checkpoint_stall"] - seconds["lost_work"]
        seconds["data_wait"] = max(0.0, rest) * fraction
    rate = facts.rate or 0.0
    spot_share = 1.0
    paid = _overlap(paid_start, paid_end, since, until)
    price, spot = a.price_per_hour, a.spot_price_per_hour
    if not a.spot and price and spot is not None and price > spot:
        spot_share = spot / price
        seconds["on_demand_premium"] = paid * (1.0 - spot_share)
    for name, value in seconds.items():
        instance_s = value * a.instances
        share = 1.0 if name == "on_demand_premium" else spot_share
        result[name] = (instance_s, instance_s * rate * share)
    return result


def _facts(
    session: Session, attempts: Sequence[Attempt], *, since: datetime, until: datetime
) -> list[AttemptFacts]:
    ids = [a.id for a in attempts]
    events: dict[str, list[tuple[str, datetime, Mapping[str, Any]]]] = defaultdict(list)
    points: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    rates: dict[str, float] = {}
    if ids:
        for row in session.exec(
            select(EventRow)
            .where(col(EventRow.attempt_id).in_(ids), col(EventRow.type).in_(_EVENT_TYPES))
            .order_by(col(EventRow.attempt_id), col(EventRow.seq))
        ).all():
            events[row.attempt_id].append((row.type, row.time, row.data or {}))
        for block in session.exec(
            select(MetricBlock).where(
                col(MetricBlock.attempt_id).in_(ids),
                col(MetricBlock.last_time) >= since,
                col(MetricBlock.first_time) < until,
            )
        ).all():
            for at, data in zip(block.times, block.data, strict=False):
                step_s = _number(data.get("step_time_s"))
                wait = _number(data.get("data_wait_fraction"))
                if step_s is not None and wait is not None:
                    # A point thinned after the run's retention stands for several.
                    points[block.attempt_id].append((float(at), step_s * weight(data), wait))
        paid: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for record in session.exec(
            select(SpendRecord).where(col(SpendRecord.attempt_id).in_(ids))
        ).all():
            seconds = (record.period_end - record.period_start).total_seconds()
            paid[record.attempt_id][0] += record.usd
            paid[record.attempt_id][1] += seconds * record.instances
        rates = {k: usd / instance_s for k, (usd, instance_s) in paid.items() if instance_s > 0}
    facts = []
    for a in attempts:
        rate = rates.get(a.id)
        if rate is None and a.price_per_hour is not None:
            rate = a.price_per_hour / 3600.0
        facts.append(AttemptFacts(a, events[a.id], points[a.id], rate))
    return facts


def _attempts(
    session: Session,
    *,
    channel: str | None,
    run_ids: Iterable[str] | None,
    since: datetime,
    until: datetime,
) -> list[Attempt]:
    query = (
        select(Attempt)
        .join(Run, col(Run.id) == Attempt.run_id)
        .where(
            col(Attempt.started_at).is_not(None),
            col(Attempt.started_at) < until,
            or_(col(Attempt.ended_at).is_(None), col(Attempt.ended_at) >= since),
        )
        .order_by(col(Attempt.run_id), col(Attempt.number))
    )
    if channel is not None:
        query = query.where(Run.channel == channel)
    if run_ids is not None:
        query = query.where(col(Attempt.run_id).in_(list(run_ids)))
    return list(session.exec(query).all())


def badput_figures(
    session: Session,
    *,
    since: datetime,
    until: datetime,
    channel: str | None = None,
    run_ids: Iterable[str] | None = None,
) -> dict[str, Any]:
    """The badput split of the channel's runs (or of ``run_ids``) in ``[since, until)``.

    ``categories`` holds one entry per :data:`CATEGORIES` with its instance-seconds,
    instance-hours and dollars (the premium's time is the paid time it bought);
    ``instance_hours`` sums the five kinds of time (the premium is money, not time),
    ``usd`` all six; ``paid_usd`` is what the attempts paid in the window and
    ``share`` the part of it that was badput. ``premium_unknown`` counts the on-demand
    attempts with no recorded spot price, whose premium is left out.
    """
    attempts = _attempts(session, channel=channel, run_ids=run_ids, since=since, until=until)
    totals = {name: [0.0, 0.0] for name in CATEGORIES}
    paid_usd = 0.0
    unknown = 0
    for facts in _facts(session, attempts, since=since, until=until):
        a = facts.attempt
        for name, (instance_s, usd) in attempt_badput(facts, since=since, until=until).items():
            totals[name][0] += instance_s
            totals[name][1] += usd
        if a.started_at is not None:
            end = min(a.ended_at, until) if a.ended_at is not None else until
            paid_usd += _overlap(a.started_at, end, since, until) * a.instances * (facts.rate or 0)
        if not a.spot and a.spot_price_per_hour is None:
            unknown += 1
    time_s = sum(totals[n][0] for n in CATEGORIES if n != "on_demand_premium")
    usd = sum(v[1] for v in totals.values())
    return {
        "categories": [
            {
                "name": name,
                "label": LABELS[name],
                "instance_seconds": round(totals[name][0], 6),
                "instance_hours": round(totals[name][0] / 3600.0, 4),
                "usd": round(totals[name][1], 4),
            }
            for name in CATEGORIES
        ],
        "instance_hours": round(time_s / 3600.0, 4),
        "usd": round(usd, 4),
        "paid_usd": round(paid_usd, 4),
        "share": round(usd / paid_usd, 4) if paid_usd > 0 else None,
        "premium_unknown": unknown,
    }
