"""Issue 29: a preempted attempt's exit, with its flush report, leaves before the kill.

The exit event is the report: under ``trainbot-runner exec`` the supervisor reads it
from the session's events file (every ``poll_s``) and sends it on, and the kill at the
deadline ends both processes. An exit written at the deadline, or after a write still in
flight (the session used to wait for the writer before saying it had ended), never
reaches the control plane: the attempt ends unreported. The session keeps
:data:`~runner.session.notice.REPORT_S` of the window for it, whatever its flushes do.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from runner import EXIT_PREEMPTED
from runner.preemption import Notice, PreemptionFlag
from runner.session import EverySteps, Session, SessionConfig
from runner.session.notice import REPORT_S
from runner.store import LocalStore
from runner.wire import Event
from tests.fakes.ingest import FakeIngest
from tests.runner.paced_store import PacedStore
from tests.runner.stand_ins import Recorder, Weights
from tests.runner.test_notice_slow_write import FLOATS
from tests.runner.tinyproc import TINY, tiny_env

#: 8 MiB at 32 MiB/s: a quarter of a second before the notice.
BPS = 32 << 20


class ExitSpeedsUp(Recorder):
    """Once the exit is out, the test has what it checks: the rest of a slow write goes
    at full speed, so the session's teardown does not wait seconds for it."""

    def __init__(self, store: PacedStore) -> None:
        super().__init__()
        self.store = store

    def emit(self, type: str, data: Mapping[str, Any], *, time: float | None = None) -> None:
        super().emit(type, data, time=time)
        if type == "exit":
            self.store.slowdown = 0.0


def _noticed(
    tmp_path: Path, *, window_s: float, slowdown: float, train_through: bool, bps: float = BPS
) -> tuple[Recorder, Session, float]:
    """A first attempt noticed during step 3, its store ``slowdown`` times slower from
    then on; returns its events, the session and the deadline."""
    store = PacedStore(LocalStore(tmp_path / "r"), bps)
    sink = ExitSpeedsUp(store)
    session = Session(
        SessionConfig(
            run_id="r",
            checkpoint_uri=str(tmp_path),
            window_s=window_s,
            train_through_notice=train_through,
        ),
        sink=sink,
        store=store,
        flag=PreemptionFlag(),
        decision=EverySteps(100_000),
        install_signals=False,
        prefetch=False,
    )
    deadline = 0.0
    weights = Weights(FLOATS)
    with session as s:
        s.track(weights=weights)
        for step in s.steps(100_000):
            weights.t[step] += 1.0
            time.sleep(0.005)
            if step == 3:
                store.slowdown = slowdown
                now = time.monotonic()
                deadline = now + window_s
                s.flag.set(Notice("signal", "test", received_at=now, deadline=deadline))
    return sink, session, deadline


@pytest.mark.parametrize("train_through", [True, False], ids=["train-through", "stop"])
def test_a_flush_that_cannot_land_in_the_window_does_not_hold_back_the_exit(
    tmp_path: Path, train_through: bool
) -> None:
    """The store goes 40x slower at the notice: the notice's flush (8 MiB, 10 s now)
    cannot land in a 2.5 s window. The exit still leaves before the deadline, with a
    report saying so (it used to wait for the write, 7.5 s past the kill)."""
    sink, session, deadline = _noticed(
        tmp_path, window_s=2.5, slowdown=40.0, train_through=train_through
    )
    assert session.exit_code == EXIT_PREEMPTED
    [(exit_data, exited_at)] = sink.timed("exit")
    assert exited_at <= deadline - REPORT_S / 2, exited_at - deadline
    report = exit_data["flush"]
    assert report["committed_step"] is None
    assert [f["landed"] for f in report["flushes"]] == [False]
    assert "still being written" in report["summary"], report["summary"]
    assert "nothing committed" in report["summary"], report["summary"]


def test_the_exit_leaves_its_report_time_before_the_deadline(tmp_path: Path) -> None:
    """The write keeps its speed (8 MiB at 256 MiB/s: 31 ms); training goes on and a
    second flush is planned. The plan leaves the report its time: the exit is written
    about ``REPORT_S`` before the deadline, not half a write (16 ms) before it, which is
    inside one 0.2 s poll of the supervisor."""
    sink, session, deadline = _noticed(
        tmp_path, window_s=1.5, slowdown=1.0, train_through=True, bps=256 << 20
    )
    assert session.exit_code == EXIT_PREEMPTED
    [(exit_data, exited_at)] = sink.timed("exit")
    report = exit_data["flush"]
    assert report["flushes"][0]["landed"], report["summary"]
    assert len(report["flushes"]) == 2 and report["committed_step"] >= 4, report["summary"]
    # Half of REPORT_S: slack for a loaded machine's late wake-up, and still ten times
    # what the plan left the report before.
    assert exited_at <= deadline - REPORT_S / 2, exited_at - deadline


EXEC = [sys.executable, "-m", "runner.cli", "exec", "--"]
#: The example's steps and its small state: a flush takes milliseconds, so the plan left
#: the report almost nothing of the window (half a write) before this change.
TINY_RUN = [sys.executable, "-m", "runner.examples.tiny", *TINY, "--step-delay", "0.01"]
E2E_WINDOW_S = 1.5
E2E_TRIALS = 3


def _preempted_under_exec(tmp_path: Path, n: int) -> list[Event]:
    """One attempt under ``trainbot-runner exec`` in a process group of its own, as on an
    instance: SIGTERM to the group once it trains, SIGKILL to the group when the window
    ends (the local provider's preemption). Returns what the control plane received."""
    token = f"tok-{n}"
    with FakeIngest(token=token).start() as ingest:
        env = tiny_env(tmp_path / f"t{n}", run_id=f"r-e2e-{n}")
        env.pop("TRAINBOT_EVENTS_FILE")
        env.update(
            TRAINBOT_INGEST_URL=ingest.url,
            TRAINBOT_TOKEN=token,
            TRAINBOT_ATTEMPT_ID=f"r-e2e-{n}-1",
            TRAINBOT_SPOOL_DIR=str(tmp_path / f"spool-{n}"),
            TRAINBOT_TERMINATION_WINDOW_S=str(E2E_WINDOW_S),
            TRAINBOT_TRAIN_THROUGH_NOTICE="1",
            TRAINBOT_CHECKPOINT_EVERY_STEPS="1000000",
        )
        proc = subprocess.Popen(
            [*EXEC, *TINY_RUN, "--steps", "1000000"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            trained = ingest.wait_for(
                lambda: sum(e.type == "metrics" for e in ingest.accepted) >= 5, timeout=120
            )
            assert trained, "the example did not start training"
            os.killpg(proc.pid, signal.SIGTERM)
            killer = threading.Timer(E2E_WINDOW_S, _kill_group, args=(proc.pid,))
            killer.start()
            proc.communicate(timeout=60)
            killer.join()
        finally:
            if proc.poll() is None:
                _kill_group(proc.pid)
                proc.communicate(timeout=30)
        # What had arrived by the kill is all there is: the supervisor died with it.
        return list(ingest.accepted)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


@pytest.mark.slow
def test_under_exec_the_report_reaches_the_control_plane_before_the_kill(
    tmp_path: Path,
) -> None:
    """The path the benchmark saw fail (issue 29: preempted attempts whose exit carried no
    report): session, events file, supervisor, HTTP, then SIGKILL to the whole group at
    the deadline. Every trial's exit arrives, with a report whose committed step is at
    or after the notice's. Before this change the exit was written half a write before
    the deadline, inside the supervisor's 0.2 s poll, and the kill took it along."""
    with ThreadPoolExecutor(max_workers=E2E_TRIALS) as pool:
        results = list(pool.map(lambda n: _preempted_under_exec(tmp_path, n), range(E2E_TRIALS)))
    for events in results:
        exits = [e for e in events if e.type == "exit"]
        assert len(exits) == 1, [e.type for e in events[-5:]]
        report = exits[0].data["flush"]
        assert report is not None, exits[0].data
        assert report["committed_step"] is not None, report["summary"]
        assert report["committed_step"] >= report["notice_step"], report["summary"]
