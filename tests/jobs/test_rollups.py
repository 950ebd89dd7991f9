"""Roll-ups bound the database's growth and change no figure (issue 28, point 4).

One channel, two runs of two instances priced per minute as accrual writes them: one
ended 37 days ago after three days (its records roll up per day, its event stream is
pruned), one running for three days up to now (rolled up per hour past a day, its last
day left by the minute). The digest, the run summaries and the Prometheus figures are
read before and after :func:`jobs.background.tasks.rollup_job`.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, func, insert
from sqlmodel import Session, col, select

from jobs.background import tasks
from jobs.database.event_rollup import KEPT_TYPES, POINTS_PER_ATTEMPT
from jobs.database.metrics import run_metrics
from jobs.database.models import EventRow, MetricBlock, SpendRecord
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.process.deps import Deps
from jobs.process.settings import Settings
from jobs.spend.digest import digest_figures
from jobs.spend.rollup import ROWS_PER_BUCKET
from jobs.web.prometheus import ControlPlaneMetrics
from tests.jobs.local_plane import Clock, local_deps
from tests.jobs.rows import add_run, running_attempt, tiny_run

NOW = datetime(2026, 12, 6, 9, 0, tzinfo=UTC)
PRICE = 2.0
INSTANCES = 2
#: Accrual's records start where the attempt started: 20 s past the minute, so every
#: hour has one record that straddles its end.
OFFSET = timedelta(seconds=20)
OLD_START = NOW - timedelta(days=40) + OFFSET
OLD_END = OLD_START + timedelta(days=3)
LIVE_START = NOW - timedelta(days=3) + OFFSET
#: Metric points of the ended run: one every 30 s for its three days.
POINT_EVERY_S = 30


@pytest.fixture
def deps(settings: Settings, db_engine: Engine, tmp_path: Path) -> Iterator[Deps]:
    with local_deps(settings, db_engine, tmp_path, clock=Clock(NOW)) as made:
        yield made


def _run(session: Session, run_id: str, start: datetime, end: datetime | None) -> None:
    add_run(
        session,
        tiny_run(
            run_id,
            channel="C1",
            budget_usd=5000.0,
            state=RunState.SUCCEEDED if end else RunState.RUNNING,
            created_at=start - timedelta(minutes=5),
            ended_at=end,
        ),
        running_attempt(
            f"{run_id}-a1",
            run_id,
            state=AttemptState.SUCCEEDED if end else AttemptState.RUNNING,
            provider="local",
            instances=INSTANCES,
            price_per_hour=PRICE,
            started_at=start,
            ended_at=end,
        ),
    )
    minutes = int(((end or NOW) - start).total_seconds() // 60)
    session.execute(
        insert(SpendRecord),
        [
            {
                "attempt_id": f"{run_id}-a1",
                "run_id": run_id,
                "period_start": start + timedelta(minutes=m),
                "period_end": start + timedelta(minutes=m + 1),
                "usd": PRICE * INSTANCES / 60,
                "instances": INSTANCES,
                "price_per_hour": PRICE,
            }
            for m in range(minutes)
        ],
    )


def _stream(session: Session, run_id: str, start: datetime, end: datetime) -> None:
    """The ended run's events: lifecycle ones, system and log ones, and metric blocks of
    100 points each with varying step times and data-wait fractions."""
    attempt = f"{run_id}-a1"
    seq = 0
    rows: list[dict[str, Any]] = []
    for kind, at in (("started", start), ("checkpoint_committed", start + timedelta(hours=30))):
        rows.append({"type": kind, "time": at, "data": {"step": 10}})
    for i in range(0, int((end - start).total_seconds()), 600):
        rows.append({"type": "system", "time": start + timedelta(seconds=i), "data": {"gpu": 9}})
        rows.append({"type": "log", "time": start + timedelta(seconds=i), "data": {"line": "x"}})
    for row in rows:
        session.add(EventRow(attempt_id=attempt, run_id=run_id, seq=seq, **row))
        seq += 1
    points = int((end - start).total_seconds() // POINT_EVERY_S)
    for first in range(0, points, 100):
        idx = range(first, min(first + 100, points))
        times = [start.timestamp() + i * POINT_EVERY_S for i in idx]
        session.add(
            MetricBlock(
                attempt_id=attempt,
                run_id=run_id,
                first_seq=seq + first,
                last_seq=seq + idx[-1],
                count=len(idx),
                first_time=datetime.fromtimestamp(times[0], UTC),
                last_time=datetime.fromtimestamp(times[-1], UTC),
                seqs=[seq + i for i in idx],
                times=times,
                data=[
                    {
                        "step": i,
                        "loss": 3.0 / (1 + i),
                        "step_time_s": 0.5 + (i % 7) / 10,
                        "data_wait_fraction": (i % 11) / 20,
                        "metrics": {},
                    }
                    for i in idx
                ],
            )
        )


def _scenario(deps: Deps) -> None:
    with Session(deps.engine) as session:
        _run(session, "old", OLD_START, OLD_END)
        _stream(session, "old", OLD_START, OLD_END)
        _run(session, "live", LIVE_START, None)
        session.commit()


def _prometheus(deps: Deps) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(ControlPlaneMetrics(deps.engine, clock=deps.clock).registry)
    return {
        (s.name, tuple(sorted(s.labels.items()))): round(s.value, 6)
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if "spend" in s.name or "paid" in s.name or "budget" in s.name or "goodput" in s.name
    }


def _figures(deps: Deps) -> dict[str, Any]:
    with Session(deps.engine) as session:
        digests = {
            str(day): digest_figures(session, channel="C1", now=NOW, tz=UTC, day=day)
            for day in (
                NOW.date() - timedelta(days=1),
                NOW.date(),
                OLD_START.date(),
                (OLD_START + timedelta(days=1)).date(),
            )
        }
    return {
        "digests": digests,
        "summaries": {r: tasks.run_summary(deps, r) for r in ("old", "live")},
        "prometheus": _prometheus(deps),
    }


def _same(before: Any, after: Any, where: str = "") -> None:
    """Equal, floats to 1e-9 relative (a sum of many minutes in another order)."""
    if isinstance(before, dict):
        assert before.keys() == after.keys(), where
        for key in before:
            _same(before[key], after[key], f"{where}.{key}")
    elif isinstance(before, list):
        assert len(before) == len(after), where
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            _same(b, a, f"{where}[{i}]")
    elif isinstance(before, float):
        assert after == pytest.approx(before, rel=1e-9, abs=1e-9), where
    else:
        assert before == after, where


def _count(deps: Deps, model: Any, *where: Any) -> int:
    with Session(deps.engine) as session:
        return int(session.exec(select(func.count()).select_from(model).where(*where)).one())


def test_a_rollup_changes_no_figure_and_bounds_the_rows(deps: Deps) -> None:
    _scenario(deps)
    assert _count(deps, SpendRecord) == 2 * 3 * 1440 - 1  # a minute a record, both runs
    before = _figures(deps)
    assert before["summaries"]["old"]["spent_usd"] == pytest.approx(3 * 24 * PRICE * INSTANCES)
    assert before["summaries"]["old"]["badput"]["categories"], "data wait is in the figures"

    done = tasks.rollup_job(deps)
    assert done["spend_merged"] > 7000 and done["points_thinned"] > 7000

    _same(before, _figures(deps))

    # The bound: past a month, at most ROWS_PER_BUCKET records per attempt and UTC day;
    # past a day, per hour; the last day by the minute, as accrual wrote it.
    old_rows = _count(deps, SpendRecord, SpendRecord.run_id == "old")
    assert old_rows <= ROWS_PER_BUCKET * 4  # three days and a bit: four UTC days
    rolled = _count(
        deps,
        SpendRecord,
        SpendRecord.run_id == "live",
        col(SpendRecord.period_end) <= NOW - timedelta(days=1),
    )
    hours = 2 * 24 + 1
    assert rolled <= ROWS_PER_BUCKET * hours
    recent = _count(
        deps,
        SpendRecord,
        SpendRecord.run_id == "live",
        SpendRecord.period_end > NOW - timedelta(days=1),
    )
    assert recent == 1440
    # Per run-hour of history older than a day: at most 2 rows, from 60.
    assert (old_rows + rolled) / (72 + 48) <= ROWS_PER_BUCKET

    # The ended run's stream: its lifecycle events stay, the rest is gone; its chart
    # keeps at most POINTS_PER_ATTEMPT points (plus one per UTC day), in one block.
    assert _count(deps, MetricBlock, MetricBlock.run_id == "old") == 1
    with Session(deps.engine) as session:
        kinds = set(session.exec(select(EventRow.type).where(EventRow.run_id == "old")).all())
        assert kinds == {"started", "checkpoint_committed"} and kinds <= KEPT_TYPES
        points = run_metrics(session.connection(), "old")
        assert len(points) <= POINTS_PER_ATTEMPT + 4
        assert points[-1].data["step"] == 3 * 86400 // POINT_EVERY_S - 1

    # A second pass at the same moment changes nothing.
    assert tasks.rollup_job(deps) == {
        "spend_merged": 0,
        "spend_written": 0,
        "events_deleted": 0,
        "points_thinned": 0,
    }
    # Accrual goes on from the live run's last record, as before.
    deps.clock.now = NOW + timedelta(minutes=5)  # type: ignore[attr-defined]
    tasks.spend_job(deps)
    assert (
        _count(deps, SpendRecord, SpendRecord.run_id == "live", SpendRecord.period_end > NOW) >= 1
    )
    assert tasks.run_summary(deps, "live")["spent_usd"] == pytest.approx(
        (NOW + timedelta(minutes=5) - LIVE_START).total_seconds() / 3600 * PRICE * INSTANCES,
        rel=1e-6,
    )
