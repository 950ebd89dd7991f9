"""Issue 27, point 4, on the local provider: a hung run is found, shown and stopped.

A script trains 50 steps with the session and then blocks for good, as a collective
waiting for a dead rank does; its runner goes on reporting. The supervisor dumps the
script's Python stacks once the step has stood still (:mod:`runner.stacks`), into the
shipped logs and to the control plane; the reconcile pass's ``hung`` rule alerts with
the last step and those stacks, and, as the spec asks, trainbot stops the run when
nobody acknowledges it. The thresholds are seconds here (a floor of minutes by default).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from sqlmodel import col, select

from bot.dispatch import dispatch
from jobs import alerts
from jobs.background import tasks
from jobs.database.db import session_scope
from jobs.database.models import Alert, EventRow
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.outbound.notify import AlertMessage
from jobs.rules import AlertThresholds, Hung, Obs, RunContext
from jobs.runs import reconcile
from jobs.spec.sections import HungWatch
from tests.jobs import test_restarts
from tests.jobs.test_control_plane import ADA, attempts_of, run_state
from tests.jobs.test_restarts import Plane, _launch, _thread
from tests.waiting import wait_until

# The restart tests' control plane: the local provider, a notifier that keeps everything.
plane = test_restarts.plane

SCRIPT = Path(__file__).resolve().parent / "scripts" / "hang_after.py"


def _hung(cp_deps: object, run_id: str) -> Alert | None:
    with session_scope(cp_deps.engine) as session:  # type: ignore[attr-defined]
        for alert in alerts.open_alerts(session, run_id=run_id):
            if alert.rule == "hung":
                session.expunge(alert)
                return alert
    return None


def _stacks_stored(cp_deps: object, run_id: str, *, step: int) -> bool:
    """Whether the runner's dump of the stall at ``step`` is stored (a machine this busy
    may pause for seconds earlier on, and dump then too: that one is not the hang)."""
    with session_scope(cp_deps.engine) as session:  # type: ignore[attr-defined]
        rows = session.exec(
            select(EventRow.data).where(EventRow.run_id == run_id, col(EventRow.type) == "stacks")
        ).all()
    return any(isinstance(data, dict) and data.get("step") == step for data in rows)


@pytest.mark.slow
def test_a_script_hung_after_step_50_alerts_with_its_stack_and_is_stopped(plane: Plane) -> None:
    cp, _records, notes = plane
    run = _launch(
        cp,
        f"command=python {SCRIPT} 100000 50",
        "alerts.hung.floor=3s",
        "alerts.hung.factor=5",
        "alerts.hung.stop_after=1s",
    )
    wait_until(
        lambda: _stacks_stored(cp.deps, run, step=49), timeout=90, what="the runner's stacks dump"
    )
    # The step stands still past the floor, heartbeats go on: the next pass alerts.
    wait_until(
        lambda: reconcile(cp.deps) is not None and _hung(cp.deps, run) is not None,
        timeout=30,
        what="the hung alert",
    )
    hung = _hung(cp.deps, run)
    assert hung is not None and hung.severity == "CRITICAL"
    assert hung.title.startswith(f"Run {run} looks hung: step 49 has not moved for")
    assert "in wait_for_peers" in hung.detail and "hang_after.py" in hung.detail
    # The thread's alert message carries the stack, the loop's frame first.
    shown = [m for m in notes.posted if isinstance(m, AlertMessage) and m.rule == "hung"]
    assert shown and "in wait_for_peers" in shown[-1].detail
    current = shown[-1].detail.index("Current thread")
    assert current < shown[-1].detail.index("in wait_for_peers")
    assert run_state(cp, run) == RunState.RUNNING  # alerted, not yet stopped

    # Nobody acknowledges it: trainbot stops the run after alerts.hung.stop_after.
    later = cp.deps.clock() + timedelta(seconds=2)
    assert tasks.stop_diverged(cp.deps, now=later) == [run]
    assert run_state(cp, run) == RunState.STOPPED
    [attempt] = attempts_of(cp, run)
    assert attempt.state == AttemptState.TERMINATED
    said = [m.text for m in _thread(notes, run) if m.text.startswith(f"trainbot stopped {run}")]
    assert said and "its step stood still" in said[0]
    assert "the newest checkpoint from before the step stopped" in said[0]
    wait_until(
        lambda: cp.deps.provider.status(attempt.instance_id).state.is_terminal(),  # type: ignore[arg-type]
        timeout=30,
        what="the hung process ended",
    )
    # The dump is in the shipped logs, which outlive the instance.
    logs = dispatch(cp.deps, f"logs {run}", ADA, markup="plain").text
    assert "Python stacks of 1 process(es) follow" in logs
    assert "in wait_for_peers" in logs


def _ctx(attempt: int = 2) -> RunContext:
    return RunContext(
        run_id="r-h", last_heartbeat=NOW, preemption_times=(), attempt_number=attempt,
        last_committed_step=40, current_step=49,
    )  # fmt: skip


NOW = 1_800_000_000.0


def test_the_rule_alerts_past_the_runs_own_limit_and_clears_when_the_step_moves() -> None:
    rule = Hung(AlertThresholds(hung=HungWatch(factor=10, floor=60, stop_after=900)))
    # Attempt 2's steps take 12 s: its limit is 120 s, not the 60 s floor.
    window = [Obs(NOW - 300 + 12 * i, "metrics", {"step": i, "step_time_s": 12.0, "attempt": 2})
              for i in range(10)]  # fmt: skip
    last = window[-1].time
    stacks = {"text": "Current thread 0x1 (most recent call first):\n  File \"t.py\", line 3 in "
              "all_reduce\n```", "attempt": 2}  # fmt: skip
    window.append(Obs(last + 100, "stacks", stacks))
    assert rule.evaluate(window, now=last + 119, ctx=_ctx())[0].resolved
    [fired] = rule.evaluate(window, now=last + 121, ctx=_ctx())
    assert not fired.resolved and fired.stop_after_s == 900 and fired.began_step == 9
    assert fired.title == "Run r-h looks hung: step 9 has not moved for 2 min"
    assert "in all_reduce" in fired.detail and "ˋˋˋ" in fired.detail  # a fence cannot end the block
    # The previous attempt's steps say nothing about this one, which has not stepped.
    assert rule.evaluate(window, now=last + 121, ctx=_ctx(attempt=3)) == []
    # Without a dump, the alert says so.
    [bare] = rule.evaluate(window[:-1], now=last + 121, ctx=_ctx())
    assert "No stacks" in bare.detail


def test_steps_that_come_with_synced_saves_may_stand_still_between_saves() -> None:
    """A Trainer script under checkpoint.sync_dir: its steps are read at each save."""
    rule = Hung(AlertThresholds(hung=HungWatch(factor=20, floor=600)))
    start = NOW - 10_000
    window = [Obs(start + 5 * i, "metrics", {"step": i, "step_time_s": 5.0, "attempt": 2})
              for i in range(0, 720)]  # fmt: skip
    saves = [Obs(start + 1800 * k, "checkpoint_committed", {"step": 360 * k, "stall_s": None,
             "attempt": 2}) for k in (1, 2)]  # fmt: skip
    last = window[-1].time
    # Synced files every 30 min: 45 min without a step is hung, 40 is not.
    assert rule.evaluate([*window, *saves], now=last + 2400, ctx=_ctx())[0].resolved
    assert not rule.evaluate([*window, *saves], now=last + 2701, ctx=_ctx())[0].resolved
    # The session's own saves (a stall measured) leave its limit at the floor.
    own = [o._replace(data={**o.data, "stall_s": 0.2}) for o in saves]
    assert not rule.evaluate([*window, *own], now=last + 601, ctx=_ctx())[0].resolved
