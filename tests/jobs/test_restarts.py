"""Issue 27, point 3, on the local provider: preemptions and errors counted apart.

An attempt exiting with a code listed in ``resubmit.recover_on_exit_codes`` restarts
from its newest checkpoint, saying why; one exiting with another code fails the run
with its log tail; preemptions do not use up a run (``max_attempts`` is ignored, and
``max_preemptions`` is the optional ceiling). The control plane is
:mod:`tests.jobs.test_control_plane`'s, with a notifier that keeps every message.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobs.database.db import session_scope
from jobs.database.models import Attempt, Run
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.outbound.notify import CallbackJournal, TextMessage
from jobs.process.bootstrap import ControlPlane
from jobs.process.deps import Deps
from jobs.runs import end_attempt, reconcile
from jobs.usecases import service
from tests.jobs.rows import sleeping_spec
from tests.jobs.test_aws_control_plane import Recorder
from tests.jobs.test_control_plane import (
    ADA,
    FAST,
    _started,
    attempts_of,
    run_state,
    settings_for,
)
from tests.waiting import wait_until

SCRIPT = Path(__file__).resolve().parent / "scripts" / "crash_once.py"

Plane = tuple[ControlPlane, list[dict[str, Any]], Recorder]


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    records: list[dict[str, Any]] = []
    journal = CallbackJournal(lambda t, run, data: records.append({"type": t, "run": run, **data}))
    notes = Recorder()
    cp = ControlPlane(
        settings_for(tmp_path / "state"),  # type: ignore[arg-type]
        notifier=notes,
        journal=journal,
        scheduler=False,
    )
    with cp:
        yield cp, records, notes
    for inst in cp.deps.provider.list_instances():
        if not inst.state.is_terminal():
            cp.deps.provider.terminate(inst.instance_id)
    cp.deps.provider.close()  # type: ignore[attr-defined]


def _launch(cp: ControlPlane, *overrides: str) -> str:
    run = service.submit(cp.deps, spec_name="tiny", overrides=[*FAST, *overrides], actor=ADA)
    wait_until(lambda: run_state(cp, run.id) == RunState.AWAITING_CONFIRMATION, what="preflight")
    service.confirm(cp.deps, run.id, ADA)
    return run.id


def _thread(notes: Recorder, run_id: str) -> list[TextMessage]:
    return [m for m in notes.posted if isinstance(m, TextMessage) and m.run_id == run_id]


@pytest.mark.slow
def test_an_attempt_exiting_with_a_listed_code_restarts_from_its_checkpoint(plane: Plane) -> None:
    cp, records, notes = plane
    run = _launch(
        cp,
        f"command=python {SCRIPT} 16 12 134",
        "resubmit.recover_on_exit_codes=[134]",
        "resubmit.max_restarts_on_errors=2",
    )
    wait_until(lambda: run_state(cp, run).is_terminal(), timeout=120, what="the end")
    assert run_state(cp, run) == RunState.SUCCEEDED
    first, second = attempts_of(cp, run)
    assert (first.state, first.exit_code) == (AttemptState.FAILED, 134), first.end_reason
    assert second.state == AttemptState.SUCCEEDED
    assert second.resumed_from_step == 10
    [restart] = [r for r in records if r["type"] == "restart_on_error"]
    assert (restart["exit_code"], restart["restart"], restart["of"]) == (134, 1, 2)
    said = [m for m in _thread(notes, run) if "recover_on_exit_codes" in m.text]
    assert [m.text for m in said] == [
        f"Attempt 1 of {run} exited 134: exit 134 is listed in "
        "resubmit.recover_on_exit_codes: restart 1 of 2 from step 10."
    ]
    assert "NCCL watchdog: collective timed out at step 12" in (said[0].log_tail or "")
    assert second.instance_id is not None
    log = cp.deps.provider.log_path(second.instance_id).read_text()  # type: ignore[attr-defined]
    result = json.loads([line for line in log.splitlines() if line.startswith("{")][-1])
    assert result == {"step": 16, "resumed_from": 10}


@pytest.mark.slow
def test_an_attempt_exiting_with_another_code_fails_the_run_with_its_log_tail(
    plane: Plane,
) -> None:
    cp, records, notes = plane
    run = _launch(cp, f"command=python {SCRIPT} 16 7 3", "resubmit.recover_on_exit_codes=[134]")
    wait_until(lambda: run_state(cp, run).is_terminal(), timeout=120, what="the end")
    assert run_state(cp, run) == RunState.FAILED
    [only] = attempts_of(cp, run)
    assert (only.state, only.exit_code) == (AttemptState.FAILED, 3)
    assert not [r for r in records if r["type"] == "restart_on_error"]
    [failed] = [m for m in _thread(notes, run) if m.text.startswith(f"Run {run} failed:")]
    assert failed.log_tail is not None
    assert "NCCL watchdog: collective timed out at step 7" in failed.log_tail


@pytest.mark.slow
def test_preemptions_beyond_the_old_max_attempts_do_not_fail_the_run(plane: Plane) -> None:
    cp, records, _ = plane
    # The deprecated max_attempts=2 would have failed the run at its third attempt.
    run = _launch(cp, "command=sleep 60", "resubmit.max_attempts=2")
    for number in (1, 2):
        wait_until(lambda n=number: _started(cp, run, n) is not None, what=f"attempt {number}")  # type: ignore[misc]
        attempt = _started(cp, run, number)
        assert attempt is not None and attempt.instance_id is not None
        cp.deps.provider.preempt(attempt.instance_id)  # type: ignore[attr-defined]

    def third() -> bool:
        reconcile(cp.deps)
        return _started(cp, run, 3) is not None

    wait_until(third, timeout=90, what="attempt 3")
    assert run_state(cp, run) in (RunState.RECOVERING, RunState.RUNNING)
    assert [a.state for a in attempts_of(cp, run)][:2] == [AttemptState.PREEMPTED] * 2
    assert [r["attempt"] for r in records if r["type"] == "preempted"] == [1, 2]
    assert not [r for r in records if r["type"] == "run_finished"]
    service.stop(cp.deps, run, ADA)


def _run_with(deps: Deps, resubmit: dict[str, Any], *, preemptions: int, failed: int) -> str:
    """A running run with ``resubmit`` in its spec, ``preemptions`` and ``failed`` earlier
    attempts (those exited 134), and attempt "a-now" running."""
    spec = sleeping_spec(resubmit={"backoff_s": 3600, **resubmit})
    with session_scope(deps.engine) as session:
        run = Run(id="r-count", spec_name="tiny", spec=spec, requester="ada")
        run.state, run.preemptions, run.last_committed_step = RunState.RUNNING, preemptions, 40
        session.add(run)
        session.flush()
        earlier = [AttemptState.PREEMPTED] * preemptions + [AttemptState.FAILED] * failed
        for number, state in enumerate(earlier, start=1):
            code = 134 if state == AttemptState.FAILED else 75
            session.add(
                Attempt(run_id=run.id, number=number, provider="local", state=state, exit_code=code)
            )
        session.add(
            Attempt(
                id="a-now",
                run_id=run.id,
                number=len(earlier) + 1,
                provider="local",
                state=AttemptState.RUNNING,
            )
        )
    return "r-count"


def _reason(deps: Deps, run_id: str) -> tuple[RunState, str]:
    with session_scope(deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None
        return run.state, run.reason or ""


def test_the_preemption_past_max_preemptions_fails_the_run(deps: Deps) -> None:
    run = _run_with(deps, {"max_preemptions": 2}, preemptions=2, failed=0)
    end_attempt(deps, "a-now", state=AttemptState.PREEMPTED, exit_code=75, reason="preempted")
    state, reason = _reason(deps, run)
    assert state == RunState.FAILED
    assert reason.startswith("preempted 3 times, more than resubmit.max_preemptions=2; ")


def test_a_listed_exit_past_max_restarts_on_errors_fails_the_run(deps: Deps) -> None:
    policy = {"recover_on_exit_codes": [134], "max_restarts_on_errors": 1}
    run = _run_with(deps, policy, preemptions=3, failed=1)  # preemptions are not counted
    end_attempt(deps, "a-now", state=AttemptState.FAILED, exit_code=134, reason="exited 134")
    state, reason = _reason(deps, run)
    assert state == RunState.FAILED
    assert reason == (
        "exited 134; exit 134 is listed in resubmit.recover_on_exit_codes, but the 1 "
        "restart(s) resubmit.max_restarts_on_errors allows are used"
    )
