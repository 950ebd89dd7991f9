"""Issue 27, point 2: a spot run waits for capacity, on moto behind the EC2 gate.

The gate answers ``RunInstances`` with EC2's ``InsufficientInstanceCapacity`` for as
many launches as a test says; everything else is moto's. The next try of a waiting run
is deferred work that only the scheduler's leader runs: the test plays the leader
(:func:`lead`), taking the lease and running what is due, as its ``DeferredRunner``
does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlmodel import col, select

from jobs.background.deferred import claim_due, run_claimed
from jobs.background.scheduler import take_lease
from jobs.database.db import session_scope
from jobs.database.replica_tables import DeferredWork
from jobs.domain.lifecycle import RunState
from jobs.outbound.notify import Message, TextMessage
from jobs.process.bootstrap import ControlPlane
from jobs.usecases import service
from tests.jobs import test_aws_control_plane as base
from tests.jobs import test_aws_failover as failover
from tests.jobs.test_aws_control_plane import (
    ADA,
    RANKED,
    Recorder,
    Refusal,
    attempt_launched,
    attempts_of,
    control_plane,
    run_row,
    wait_until,
)
from tests.jobs.test_aws_failover import NO_ROOM, Gated, _confirmed

# The control-plane tests' fixtures, under their own names.
gate, gated = base.gate, failover.gated


def _refuse_spot(times: int, refused: list[str]) -> Any:
    """EC2 has no spot capacity for the first ``times`` launches, in any zone."""

    def refuse(form: Mapping[str, str]) -> Refusal | None:
        spot = form.get("InstanceMarketOptions.MarketType") == "spot"
        if spot and form.get("DryRun") != "true" and len(refused) < times:
            refused.append(form.get("Placement.AvailabilityZone", ""))
            return (400, "InsufficientInstanceCapacity", NO_ROOM)
        return None

    return refuse


def lead(cp: ControlPlane) -> int:
    """One look of the scheduler's leader for due deferred work, run here; how many."""
    deps = cp.deps
    token = take_lease(deps)
    assert token is not None
    claimed = claim_due(
        deps.engine, token=token, holder=deps.replica, now=deps.clock(), hold_s=60, grace_s=0
    )
    for work in claimed:
        run_claimed(deps, work)
    return len(claimed)


def _waits(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["type"] == "capacity_wait"]


def _wait_message(notes: Recorder, run_id: str) -> tuple[str, list[str]]:
    """The wait's one message: its ts, and its text as posted then as each edit left it."""
    posted = [
        (f"{i + 1}.000100", m)
        for i, m in enumerate(notes.posted)
        if isinstance(m, TextMessage) and m.run_id == run_id and "waiting for" in m.text
    ]
    assert len(posted) == 1, [m.text for _, m in posted]
    [(ts, first)] = posted
    edits: list[Message] = [m for ref, m in notes.updated if ref.ts == ts]
    return ts, [first.text] + [m.text for m in edits if isinstance(m, TextMessage)]


def _capacity_rows(cp: ControlPlane, run_id: str) -> list[DeferredWork]:
    with session_scope(cp.deps.engine) as s:
        rows = s.exec(
            select(DeferredWork).where(col(DeferredWork.key).startswith(f"capacity:{run_id}:"))
        ).all()
        for row in rows:
            s.expunge(row)
        return list(rows)


def test_a_run_with_no_capacity_for_three_tries_launches_on_the_fourth_using_no_attempt(
    tmp_path: Any, gated: Gated
) -> None:
    aws, gate = gated.aws, gated.gate
    gated.scores(40)
    refused: list[str] = []
    gate.refuse = _refuse_spot(3 * len(RANKED), refused)
    with control_plane(tmp_path, aws, gated.bucket) as (cp, records, notes):
        # One attempt is all it may use: the tries for capacity are not attempts.
        run = _confirmed(cp, "resubmit.backoff_s=0.1", "resubmit.max_attempts=1")
        for tries in (1, 2, 3):
            wait_until(lambda n=tries: len(_waits(records)) == n, what=f"wait {tries}")  # type: ignore[misc]
            waiting = run_row(cp, run.id)
            assert waiting.state == RunState.RECOVERING
            assert (waiting.reason or "").startswith("waiting for spot capacity; next try at")
            assert attempts_of(cp, run.id) == [], "a refused pass leaves no attempt"
            # No replica's timer runs the next try: only the leader does.
            [pending] = [r for r in _capacity_rows(cp, run.id) if r.done_at is None]
            assert pending.args["tries"] == tries
            wait_until(lambda: lead(cp) == 1, what=f"the leader's try {tries + 1}")
        wait_until(lambda: attempt_launched(cp, run.id, 1), what="attempt 1")
        [one] = attempts_of(cp, run.id)
        assert (one.number, one.zone, one.spot) == (1, RANKED[0], True)
        assert refused == list(RANKED) * 3
        assert [f.get("Placement.AvailabilityZone") for f in gate.launches()] == [
            *RANKED * 3,
            RANKED[0],
        ]
        assert [w["tries"] for w in _waits(records)] == [1, 2, 3]
        assert [w["tried"] for w in _waits(records)] == [list(RANKED)] * 3
        launched = [(r["attempt"], r["zone"]) for r in records if r["type"] == "launched"]
        assert launched == [(1, RANKED[0])]

        # One thread message told the wait, edited at each try, and says how it ended.
        _, texts = _wait_message(notes, run.id)
        assert [t.split(". ")[1].split(" at ")[0] for t in texts[:3]] == [
            "Try 1",
            "Try 2",
            "Try 3",
        ]
        assert f"{RANKED[1]}: EC2 has no spot capacity" in texts[0]
        assert "Next try at " in texts[0] and "resubmit.wait_for_capacity=6.0 h" in texts[0]
        assert f"/train stop {run.id} ends it" in texts[0]
        assert texts[-1].startswith(f"{run.id} waited ")
        assert f"try 4 found it, and attempt 1 launched in {RANKED[0]}." in texts[-1]
        thread = [m.text for m in notes.posted if isinstance(m, TextMessage) and m.run_id == run.id]
        assert not any("could not launch" in t for t in thread), thread
        assert run_row(cp, run.id).reason is None or "waiting" not in (
            run_row(cp, run.id).reason or ""
        )
        assert all(r.done_at is not None for r in _capacity_rows(cp, run.id))
        service.stop(cp.deps, run.id, ADA)


def test_stop_ends_the_wait_for_capacity(tmp_path: Any, gated: Gated) -> None:
    aws, gate = gated.aws, gated.gate
    gated.scores(20)
    refused: list[str] = []
    gate.refuse = _refuse_spot(1000, refused)
    with control_plane(tmp_path, aws, gated.bucket) as (cp, records, notes):
        # The first wait is a minute: the stop comes during it.
        run = _confirmed(cp, "resubmit.backoff_s=60", "resubmit.zone_failover=false")
        wait_until(lambda: len(_waits(records)) == 1, what="the wait")
        service.stop(cp.deps, run.id, ADA)
        stopped = run_row(cp, run.id)
        assert stopped.state == RunState.STOPPED
        _, texts = _wait_message(notes, run.id)
        assert texts[-1] == f"{run.id} stopped waiting for capacity after 1 tries: stopped by ada."
        # Its next try is dropped: the leader finds nothing due, and nothing launches.
        assert all(r.done_at is not None for r in _capacity_rows(cp, run.id))
        assert lead(cp) == 0
        assert len(gate.launches()) == len(refused) == 1
        assert attempts_of(cp, run.id) == []


def test_the_wait_outlives_the_control_plane(tmp_path: Any, gated: Gated) -> None:
    """The next try is a row: a control plane started after the one that deferred it
    makes the try as the leader, and edits the same thread message."""
    aws, gate = gated.aws, gated.gate
    gated.scores(20)
    refused: list[str] = []
    gate.refuse = _refuse_spot(2, refused)
    overrides = ("resubmit.backoff_s=0.1", "resubmit.zone_failover=false")
    with control_plane(tmp_path, aws, gated.bucket) as (cp, records, notes):
        run = _confirmed(cp, *overrides)
        wait_until(lambda: len(_waits(records)) == 1, what="the wait")
        ts, _ = _wait_message(notes, run.id)
    with control_plane(tmp_path, aws, gated.bucket) as (cp, records, notes):

        def launched() -> bool:
            lead(cp)
            return attempt_launched(cp, run.id, 1) is not None

        wait_until(launched, what="attempt 1, after the restart")
        assert refused == [RANKED[0]] * 2
        assert [w["tries"] for w in _waits(records)] == [2]
        edits = [m.text for ref, m in notes.updated if ref.ts == ts and isinstance(m, TextMessage)]
        assert [t.split(". ")[1].split(" at ")[0] for t in edits[:1]] == ["Try 2"]
        assert "try 3 found it, and attempt 1 launched" in edits[-1]
        service.stop(cp.deps, run.id, ADA)
