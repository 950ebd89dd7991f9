"""Attempts end to end in the control plane's own code: lost work, and racing launches."""

from __future__ import annotations

import io
import threading
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlmodel import select

from bot.console import ConsoleNotifier
from jobs.background.tasks import run_summary
from jobs.database.db import session_scope
from jobs.database.models import Alert, Attempt, EventRow, Run
from jobs.domain.errors import SpecError
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.process.deps import Deps
from jobs.providers.base import ZoneCapacity
from jobs.runs import (
    end_attempt,
    launch_attempt,
    measured_interval,
    on_attempt_event,
    reconcile,
)
from jobs.runs.placement import NO_CAPACITY, NoPlacement, Placement, decide
from jobs.spec import JobSpec, parse_spec
from tests.jobs.local_plane import Clock
from tests.jobs.rows import add_run, sleeping_spec, tiny_run

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def _run_row(run_id: str, state: RunState, **fields: Any) -> Run:
    """Run ``run_id`` of the sleeping spec, requested by ada, in ``state``."""
    return tiny_run(run_id, spec=sleeping_spec(), requester="ada", state=state, **fields)


def _running(deps: Deps, run_id: str, *, committed: int, **attempt: Any) -> None:
    """A running run whose newest commit (and step) is ``committed``, with one attempt
    running since T0 (``attempt`` gives its id, number and any other fields)."""
    with session_scope(deps.engine) as session:
        run = _run_row(run_id, RunState.RUNNING)
        run.last_committed_step = committed
        run.last_step = committed
        session.add(run)
        session.flush()
        session.add(
            Attempt(
                run_id=run_id,
                provider="local",
                state=AttemptState.RUNNING,
                started_at=T0,
                **attempt,
            )
        )


def test_lost_time_counts_both_the_restore_and_the_steps_since_the_last_commit(
    deps: Deps,
) -> None:
    """A resumed attempt loses its start-up and restore, then the steps done after its
    last commit when it is preempted: run_summary's goodput counts both."""
    clock = Clock(T0)
    deps.clock = clock
    _running(deps, "r-lost", committed=100, id="a-lost", number=2, resumed_from_step=100)
    clock.now = T0 + timedelta(seconds=5)
    on_attempt_event(deps, "a-lost", "restored", {"step": 100})
    with session_scope(deps.engine) as session:
        a = session.get(Attempt, "a-lost")
        assert a is not None and a.lost_seconds == pytest.approx(5.0)
        # What the ingest API records from the runner's metrics: step 120 at 1 s a step.
        a.last_step = 120
        a.step_time_s = 1.0
        session.add(a)
    clock.now = T0 + timedelta(seconds=40)
    end_attempt(deps, "a-lost", state=AttemptState.PREEMPTED, exit_code=75, reason="preempted")
    with session_scope(deps.engine) as session:
        a = session.get(Attempt, "a-lost")
        assert a is not None and a.state == AttemptState.PREEMPTED
        assert a.lost_steps == 20
        assert a.lost_seconds == pytest.approx(5.0 + 20.0)
    with session_scope(deps.engine) as session:
        (alert,) = session.exec(select(Alert).where(Alert.rule == "preemption")).all()
        assert "code 75" in alert.detail and "None" not in alert.detail
    summary = run_summary(deps, "r-lost")
    assert summary["paid_s"] == pytest.approx(40.0)
    assert summary["lost_s"] == pytest.approx(25.0)
    assert summary["goodput"] == pytest.approx(1 - 25 / 40, abs=1e-4)


def test_the_sigterm_of_a_stop_is_not_reported_as_a_preemption(deps: Deps) -> None:
    out = io.StringIO()
    deps.notifier = ConsoleNotifier(out)
    _running(deps, "r-stop", committed=10, id="a-stop", number=1)
    notice = {"source": "signal", "time_left_s": 30.0}
    on_attempt_event(deps, "a-stop", "preemption_notice", notice)
    with session_scope(deps.engine) as session:
        run = session.get(Run, "r-stop")
        assert run is not None
        run.state = RunState.STOPPED  # what /train stop does before it terminates
        session.add(run)
    on_attempt_event(deps, "a-stop", "preemption_notice", notice)
    notices = [r for r in deps.records if r["type"] == "preemption_notice"]  # type: ignore[attr-defined]
    assert len(notices) == 1, "only the running run's notice is a preemption"
    text = out.getvalue()
    assert text.count("Preemption notice") == 1
    assert "Attempt 1 is stopping: its runner flushes a checkpoint first." in text


@pytest.mark.parametrize("noticed", [True, False], ids=["after-a-notice", "no-notice"])
def test_a_failed_exit_after_a_preemption_notice_is_a_preemption(deps: Deps, noticed: bool) -> None:
    """A runner that reports a failure (143: the SIGTERM reached the script before its
    handler) after a preemption notice was preempted, and its run is resubmitted; the
    same exit without a notice fails the run."""
    _running(
        deps,
        "r-143",
        committed=0,
        id="a-143",
        number=1,
        preemption_notice_at=T0 if noticed else None,
    )
    on_attempt_event(deps, "a-143", "exit", {"code": 143, "reason": "failed"})
    with session_scope(deps.engine) as session:
        attempt = session.get(Attempt, "a-143")
        run = session.get(Run, "r-143")
        assert attempt is not None and run is not None
        assert attempt.exit_code == 143
        if noticed:
            assert attempt.state == AttemptState.PREEMPTED
            assert attempt.end_reason == (
                "runner exited 143 (failed); it had a preemption notice, so it resumes"
            )
            assert run.state == RunState.RECOVERING
        else:
            assert (attempt.state, run.state) == (AttemptState.FAILED, RunState.FAILED)


def _new_run(deps: Deps, run_id: str) -> None:
    with session_scope(deps.engine) as session:
        session.add(_run_row(run_id, RunState.LAUNCHING))


def test_reconcile_moves_a_run_whose_attempt_runs_to_running(deps: Deps) -> None:
    """The ingest API moves an attempt to RUNNING in the transaction that stores its
    ``started`` event and the run only after the commit: a control plane killed in between
    leaves the run LAUNCHING, and its runner, whose batch was stored, never sends that
    event again (the kill -9 sweep found a run stuck so). Reconcile finishes the move."""
    _new_run(deps, "r-started")
    attempt = launch_attempt(deps, "r-started")
    assert attempt is not None and attempt.instance_id
    try:
        with session_scope(deps.engine) as session:  # what that transaction commits
            row = session.get(Attempt, attempt.id)
            assert row is not None and row.state == AttemptState.PROVISIONING
            row.state = AttemptState.RUNNING
            row.last_heartbeat = deps.clock()
            session.add(row)
        assert reconcile(deps)["running"] == 1
        with session_scope(deps.engine) as session:
            run = session.get(Run, "r-started")
            assert run is not None and run.state == RunState.RUNNING
        assert [r["type"] for r in deps.records if r["type"] == "run_running"] == ["run_running"]  # type: ignore[attr-defined]
        assert reconcile(deps)["running"] == 0  # once
    finally:
        deps.provider.terminate(attempt.instance_id)


def test_reconcile_racing_a_launch_records_one_instance_once(deps: Deps) -> None:
    """Reconcile runs while launches are in progress (the instance exists, the database
    does not know it yet): it may adopt the attempt, but the launch and the adoption
    record it once, with no illegal transition and no second instance."""
    run_ids = [f"r-race-{i}" for i in range(8)]
    for run_id in run_ids:
        _new_run(deps, run_id)
    errors: list[BaseException] = []
    done = threading.Event()

    def reconcile_loop() -> None:
        while not done.is_set():
            try:
                reconcile(deps)
            except BaseException as exc:  # the assertion below reports it
                errors.append(exc)
                return

    def launch(run_id: str) -> None:
        try:
            launch_attempt(deps, run_id)
        except BaseException as exc:
            errors.append(exc)

    reconciler = threading.Thread(target=reconcile_loop)
    reconciler.start()
    try:
        launchers = [threading.Thread(target=launch, args=(r,)) for r in run_ids]
        for t in launchers:
            t.start()
        for t in launchers:
            t.join(timeout=60)
    finally:
        done.set()
        reconciler.join(timeout=60)
    assert errors == []
    with session_scope(deps.engine) as session:
        attempts = session.exec(select(Attempt)).all()
    assert sorted(a.run_id for a in attempts) == sorted(run_ids)
    assert all(a.state == AttemptState.PROVISIONING and a.instance_id for a in attempts)
    launched = [r["attempt_id"] for r in deps.records if r["type"] == "launched"]  # type: ignore[attr-defined]
    assert sorted(launched) == sorted(a.id for a in attempts)
    per_attempt: dict[str, int] = {}
    for inst in deps.provider.list_instances():
        per_attempt[inst.attempt_id] = per_attempt.get(inst.attempt_id, 0) + 1
    assert per_attempt == {a.id: 1 for a in attempts}


def _recovering_after(
    deps: Deps,
    run_id: str,
    *,
    preflight: dict[str, Any],
    last_step: int,
    saves: list[tuple[int, float]],
) -> None:
    """Run ``run_id`` RECOVERING at a 30 s interval after its attempt 1 was preempted at
    ``last_step``, having committed a checkpoint at each ``(step, stall_s)`` of ``saves``,
    a second apart from T0."""
    with session_scope(deps.engine) as session:
        run = _run_row(
            run_id,
            RunState.RECOVERING,
            preflight=preflight,
            checkpoint_interval_s=30.0,
        )
        attempt = Attempt(
            id=f"{run_id}-a1",
            run_id=run_id,
            number=1,
            provider="local",
            state=AttemptState.PREEMPTED,
            last_step=last_step,
        )
        add_run(session, run, attempt)
        for seq, (step, stall) in enumerate(saves):
            session.add(
                EventRow(
                    attempt_id=attempt.id,
                    run_id=run_id,
                    seq=seq,
                    type="checkpoint_committed",
                    time=T0 + timedelta(seconds=seq),
                    data={"step": step, "bytes": 1, "write_s": 2.0, "stall_s": stall, "uri": "x"},
                )
            )


def test_an_auto_interval_follows_the_stall_the_run_measured(deps: Deps) -> None:
    """Preflight's dry run ran on the control plane's CPU; once the run's own periodic
    saves are known, the next attempt checkpoints at the rule's interval for their cost
    (the final save, which copies nothing, does not count)."""
    from runner.preemption import daly_interval

    preflight = {
        "results": [{"name": "dry_run", "data": {"interval_mtbp_s": 6000.0, "interval_s": 30.0}}]
    }
    saves = [(20, 0.4), (40, 0.5), (60, 0.6), (80, 0.5), (100, 0.001)]
    _recovering_after(deps, "r-follow", preflight=preflight, last_step=100, saves=saves)
    with session_scope(deps.engine) as session:
        row = session.get(Run, "r-follow")
        assert row is not None
        assert measured_interval(session, row) == pytest.approx(daly_interval(0.5, 6000.0))
    second = launch_attempt(deps, "r-follow")
    assert second is not None and second.number == 2
    with session_scope(deps.engine) as session:
        row = session.get(Run, "r-follow")
        assert row is not None
        assert row.checkpoint_interval_s == pytest.approx(daly_interval(0.5, 6000.0))
    launched = next(r for r in deps.records if r["type"] == "launched")  # type: ignore[attr-defined]
    assert launched["checkpoint_interval_s"] == pytest.approx(daly_interval(0.5, 6000.0))
    assert any(r["type"] == "checkpoint_interval" for r in deps.records)  # type: ignore[attr-defined]


def test_too_few_saves_leave_the_interval_alone(deps: Deps) -> None:
    preflight = {"results": [{"name": "dry_run", "data": {"interval_mtbp_s": 6000.0}}]}
    _recovering_after(deps, "r-few", preflight=preflight, last_step=50, saves=[(20, 0.5)])
    with session_scope(deps.engine) as session:
        row = session.get(Run, "r-few")
        assert row is not None and measured_interval(session, row) is None


def test_reconcile_relaunching_after_a_preemption_reports_the_resubmit_once(
    deps: Deps,
) -> None:
    """The resubmit timer died with its process (the backoff here outlasts the test), so
    reconcile's backstop launches the next attempt: it is still a resubmit, with its
    record and the work lost, and a second reconcile launches nothing more."""
    clock = Clock(T0)
    deps.clock = clock
    _running(
        deps, "r-backstop", committed=50, id="a-backstop-1", number=1, last_step=58, step_time_s=2.0
    )
    clock.now = T0 + timedelta(seconds=120)
    end_attempt(
        deps, "a-backstop-1", state=AttemptState.PREEMPTED, exit_code=75, reason="preempted"
    )
    with session_scope(deps.engine) as session:
        run_now = session.get(Run, "r-backstop")
        assert run_now is not None and run_now.state == RunState.RECOVERING
    records: list[dict[str, Any]] = deps.records  # type: ignore[attr-defined]
    reconcile(deps)  # the backoff is not over: nothing yet
    assert not [r for r in records if r["type"] == "resubmitted"]
    clock.now = T0 + timedelta(seconds=120 + 3601)
    reconcile(deps)
    reconcile(deps)
    resubmits = [r for r in records if r["type"] == "resubmitted"]
    assert len(resubmits) == 1
    assert resubmits[0]["attempt"] == 2
    assert resubmits[0]["resume_from_step"] == 50
    assert resubmits[0]["lost_steps"] == 8
    assert resubmits[0]["lost_seconds"] == pytest.approx(16.0)
    with session_scope(deps.engine) as session:
        attempts = session.exec(select(Attempt).where(Attempt.run_id == "r-backstop")).all()
    assert sorted(a.number for a in attempts) == [1, 2]


# -- where the next attempt goes: the placement policy, without a provider ---------------

EAST, WEST = "us-east-1", "us-west-2"
EAST_ZONES = ("us-east-1c", "us-east-1a", "us-east-1b")  # as the provider ranks them
WEST_ZONES = ("us-west-2a", "us-west-2b")
NO_ROOM = "EC2 has no spot capacity for g5.xlarge in {zone} now (InsufficientInstanceCapacity)"


def _aws_spec(**resources: Any) -> JobSpec:
    data = {"command": "python train.py", "resources": {"cloud": "aws", **resources}}
    return parse_spec({**data, "dry_run": {"enabled": False}}, name="gpu")


def _attempt(number: int, zone: str | None, state: AttemptState, *, spot: bool = True) -> Attempt:
    """A past attempt; a FAILED one was refused for lack of capacity in its zone."""
    refused = state == AttemptState.FAILED
    return Attempt(
        run_id="r-place",
        number=number,
        provider="aws",
        region=zone[:-1] if zone else EAST,
        zone=zone,
        spot=spot,
        state=state,
        end_reason=f"{NO_CAPACITY}: {NO_ROOM.format(zone=zone)}" if refused else None,
    )


class Cloud:
    """What the placement asks a provider, answered from tables; ``asked`` keeps the
    regions whose fit was checked."""

    def __init__(
        self,
        zones: dict[str, tuple[str, ...]] | None = None,
        misfits: dict[str, str] | None = None,
    ) -> None:
        self.zones = zones if zones is not None else {EAST: EAST_ZONES, WEST: WEST_ZONES}
        self.misfits = misfits or {}
        self.asked: list[tuple[str, bool]] = []

    def capacity(self, region: str, spot: bool) -> list[ZoneCapacity]:
        return [ZoneCapacity(z, True, None, "offered") for z in self.zones.get(region, ())]

    def fits(self, region: str, spot: bool) -> str | None:
        self.asked.append((region, spot))
        return self.misfits.get(region)


def _decide(
    spec: JobSpec, attempts: list[Attempt], cloud: Cloud, *, preemptions: int = 0
) -> Placement | NoPlacement:
    return decide(
        spec,
        attempts,
        preemptions=preemptions,
        default_region=EAST,
        capacity=cloud.capacity,
        fits=cloud.fits,
    )


def test_placement_starts_on_spot_in_the_best_zone_and_moves_on_after_a_preemption() -> None:
    spec, cloud = _aws_spec(region=EAST), Cloud()
    first = _decide(spec, [], cloud)
    assert first == Placement(EAST, "us-east-1c", True)
    preempted = [_attempt(1, "us-east-1c", AttemptState.PREEMPTED)]
    assert _decide(spec, preempted, cloud, preemptions=1) == Placement(EAST, "us-east-1a", True)
    lost_nothing = [_attempt(1, "us-east-1a", AttemptState.LOST)]
    assert _decide(spec, lost_nothing, cloud) == Placement(EAST, "us-east-1a", True)
    assert cloud.asked == [], "the first region was preflight's to check"


def test_no_spot_capacity_anywhere_fails_naming_each_zone_and_what_it_said() -> None:
    spec = _aws_spec(region=EAST)
    refused = [_attempt(n, z, AttemptState.FAILED) for n, z in enumerate(EAST_ZONES, 1)]
    placed = _decide(spec, refused, Cloud())
    assert isinstance(placed, NoPlacement)
    for zone in EAST_ZONES:
        assert f"{zone}: {NO_ROOM.format(zone=zone)}" in placed.reason
    assert "resources.on_demand_fallback=true" in placed.reason


def test_the_on_demand_fallback_runs_on_demand_then_tries_spot_again() -> None:
    spec = _aws_spec(region=EAST, on_demand_fallback=True)
    refused = [_attempt(n, z, AttemptState.FAILED) for n, z in enumerate(EAST_ZONES, 1)]
    placed = _decide(spec, refused, Cloud())
    assert isinstance(placed, Placement) and not placed.spot
    assert placed.region == EAST and placed.zone in EAST_ZONES
    assert placed.note.startswith(f"no spot capacity in {EAST}: us-east-1c: EC2 has no spot")
    # The on-demand attempt ran and ended: the next one is spot again, in the best zone.
    ran = [*refused, _attempt(4, placed.zone, AttemptState.LOST, spot=False)]
    assert _decide(spec, ran, Cloud()) == Placement(EAST, placed.zone, True)
    # On-demand refused too: the run fails, saying both.
    both = [*refused, _attempt(4, placed.zone, AttemptState.FAILED, spot=False)]
    both += [
        _attempt(5 + i, z, AttemptState.FAILED, spot=False)
        for i, z in enumerate(z for z in EAST_ZONES if z != placed.zone)
    ]
    failed = _decide(spec, both, Cloud())
    assert isinstance(failed, NoPlacement)
    assert "spot: us-east-1" in failed.reason and "on-demand: us-east-1" in failed.reason


def test_on_demand_after_n_preemptions_says_why() -> None:
    spec = parse_spec(
        {
            "command": "python train.py",
            "resources": {"cloud": "aws", "region": EAST},
            "resubmit": {"on_demand_after_preemptions": 2},
        },
        name="gpu",
    )
    preempted = [_attempt(n, "us-east-1c", AttemptState.PREEMPTED) for n in (1, 2)]
    placed = _decide(spec, preempted, Cloud(), preemptions=2)
    assert isinstance(placed, Placement) and not placed.spot
    assert placed.note == "after 2 preemptions (resubmit.on_demand_after_preemptions=2)"
    assert _decide(spec, preempted[:1], Cloud(), preemptions=1) == Placement(
        EAST, "us-east-1a", True
    )


def test_a_region_out_of_capacity_moves_the_run_to_the_next_after_checking_it() -> None:
    spec = _aws_spec(regions=[EAST, WEST], zones=["us-east-1a", "us-east-1c"])
    cloud = Cloud(zones={EAST: ("us-east-1c", "us-east-1a"), WEST: WEST_ZONES})
    refused = [_attempt(1, "us-east-1c", AttemptState.FAILED)]
    assert _decide(spec, refused, cloud) == Placement(EAST, "us-east-1a", True)
    refused.append(_attempt(2, "us-east-1a", AttemptState.FAILED))
    placed = _decide(spec, refused, cloud)
    assert isinstance(placed, Placement)
    assert (placed.region, placed.zone, placed.spot) == (WEST, "us-west-2a", True)
    assert placed.note.startswith(f"no spot capacity in {EAST}: us-east-1c: ")
    assert cloud.asked == [(WEST, True)]
    # Preempted there, the run stays in that region without checking it again.
    there = [*refused, _attempt(3, "us-west-2a", AttemptState.PREEMPTED)]
    assert _decide(spec, there, cloud, preemptions=1) == Placement(WEST, "us-west-2b", True)
    assert cloud.asked == [(WEST, True)]


def test_a_region_whose_data_is_elsewhere_is_skipped_with_the_reason() -> None:
    spec = _aws_spec(regions=[EAST, WEST])
    why = "the dataset s3://tokens/train is in us-east-1 (set resources.allow_cross_region_data=…)"
    cloud = Cloud(misfits={WEST: why})
    refused = [_attempt(n, z, AttemptState.FAILED) for n, z in enumerate(EAST_ZONES, 1)]
    placed = _decide(spec, refused, cloud)
    assert isinstance(placed, NoPlacement)
    assert f"{WEST} skipped: {why}" in placed.reason


def test_when_the_provider_ranks_no_zone_the_launch_decides() -> None:
    """A provider's "not now" may be advice (the local provider's busy cores): with no
    refused launch yet, the attempt goes ahead in the listed zones, or anywhere."""
    nothing = Cloud(zones={})
    assert _decide(_aws_spec(region=EAST), [], nothing) == Placement(EAST, None, True)
    listed = _aws_spec(region=EAST, zones=["us-east-1b"])
    assert _decide(listed, [], nothing) == Placement(EAST, "us-east-1b", True)
    refused = [_attempt(1, "us-east-1b", AttemptState.FAILED)]
    assert isinstance(_decide(listed, refused, nothing), NoPlacement)


def test_regions_and_its_one_region_shorthand() -> None:
    assert _aws_spec(region=EAST).resources.regions == [EAST]
    both = _aws_spec(regions=[EAST, WEST], zones=["us-west-2b"]).resources
    assert (both.region, both.zones_in(EAST), both.zones_in(WEST)) == (EAST, [], ["us-west-2b"])
    stored = _aws_spec(regions=[EAST, WEST]).model_dump(mode="json")
    assert JobSpec.model_validate(stored).resources.regions == [EAST, WEST]
    with pytest.raises(SpecError, match=r"region .* and resources.regions .* are both set"):
        _aws_spec(region=EAST, regions=[EAST, WEST])
    with pytest.raises(SpecError, match="not in any of the regions"):
        _aws_spec(regions=[EAST, WEST], zones=["eu-west-1a"])
