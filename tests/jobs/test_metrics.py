"""Reading a run's metrics back from the blocks the ingest API stores them in.

Batches go in through the real :class:`jobs.ingest.IngestService` (SQLite and, when
``TRAINBOT_TEST_POSTGRES_URL`` is set, PostgreSQL), so the blocks are the ones a runner's
batches make.
"""

from __future__ import annotations

import math

from sqlalchemy import Engine
from sqlmodel import Session, select

from jobs.database.metrics import MetricPoint, run_metrics
from jobs.database.models import MetricBlock
from jobs.domain.lifecycle import AttemptState
from jobs.ingest import IngestService
from tests.jobs.test_ingest import AUTH, T0, Clock, add_run, body, metrics, system


def points(engine: Engine, run_id: str = "r-1", **kwargs: object) -> list[MetricPoint]:
    with engine.connect() as connection:
        return run_metrics(connection, run_id, **kwargs)  # type: ignore[arg-type]


def feed(engine: Engine) -> IngestService:
    """Two attempts of r-1: steps 0-299 (three batches), then 300-349 after a resubmit."""
    add_run(engine)
    add_run(engine, attempt_id="a-2", token="tok-2", number=2, state=AttemptState.RUNNING)
    svc = IngestService(engine, now=Clock())
    for first in (0, 100, 200):
        items = [system() if i == 50 else metrics(first + i, loss=1.0 / (1 + first + i))
                 for i in range(100)]  # fmt: skip
        assert svc.handle(AUTH, body(items, first_seq=first)).status == 200
    second = body([metrics(300 + i) for i in range(50)], attempt="a-2", first_seq=0,
                  times=[T0 + 300 + i for i in range(50)])  # fmt: skip
    assert svc.handle("Bearer tok-2", second).status == 200
    return svc


def test_every_point_comes_back_in_time_order_with_its_attempt(db_engine: Engine) -> None:
    feed(db_engine)

    got = points(db_engine)

    assert [p.data["step"] for p in got] == [s for s in range(350) if s not in (50, 150, 250)]
    assert [p.time for p in got] == sorted(p.time for p in got)
    assert {(p.attempt_id, p.attempt_number) for p in got[:297]} == {("a-1", 1)}
    assert {(p.attempt_id, p.attempt_number) for p in got[297:]} == {("a-2", 2)}
    assert got[0] == MetricPoint("a-1", 1, 0, T0, got[0].data)
    with Session(db_engine) as session:
        assert len(session.exec(select(MetricBlock)).all()) == 4  # one per batch


def test_limit_keeps_the_newest_and_reads_back_only_what_it_needs(db_engine: Engine) -> None:
    feed(db_engine)

    newest = points(db_engine, limit=60)
    one = points(db_engine, limit=1)

    assert [p.data["step"] for p in newest] == list(range(290, 350))[-60:]
    assert [p.data["step"] for p in one] == [349]
    assert points(db_engine, limit=0) == []


def test_since_and_attempt_filter(db_engine: Engine) -> None:
    feed(db_engine)

    late = points(db_engine, since=T0 + 280)
    first_attempt = points(db_engine, attempt_id="a-1", limit=5)

    assert [p.data["step"] for p in late] == list(range(280, 350))
    assert [p.data["step"] for p in first_attempt] == [295, 296, 297, 298, 299]
    assert points(db_engine, "r-unknown") == []


def test_a_late_block_that_overlaps_newer_ones_is_merged_in_order(db_engine: Engine) -> None:
    add_run(db_engine)
    svc = IngestService(db_engine, now=Clock())
    # seqs 10-19 arrive first, then a retry that also carries the missing 0-9 (older times).
    later = body([metrics(i) for i in range(10, 20)], first_seq=10)
    both = body([metrics(i) for i in range(20)], first_seq=0)
    assert svc.handle(AUTH, later).body == {"accepted": 10, "duplicates": 0}
    assert svc.handle(AUTH, both).body == {"accepted": 10, "duplicates": 10}

    assert [p.seq for p in points(db_engine)] == list(range(20))
    assert [p.seq for p in points(db_engine, limit=12)] == list(range(8, 20))


def test_non_finite_losses_come_back_as_floats(db_engine: Engine) -> None:
    add_run(db_engine)
    svc = IngestService(db_engine, now=Clock())
    svc.handle(AUTH, body([metrics(0, math.nan), metrics(1, math.inf), metrics(2, 0.5)]))

    losses = [p.data["loss"] for p in points(db_engine)]

    assert math.isnan(losses[0]) and losses[1] == math.inf and losses[2] == 0.5
