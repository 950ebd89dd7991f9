"""Issue 29: a preemption notice that comes while the attempt is still restoring.

A session in a process of its own restores a committed checkpoint through a store whose
reads are paced to take several seconds (a loaded machine, a slow bucket), and gets a
SIGTERM with a 1.5 s window while it reads. It must give the restore up and report its
exit, with a flush report that says so, before the deadline (the test SIGKILLs it there,
as the provider does); exit 75; nothing committed lost; the next attempt restores the same
step. A restore fast enough for the window goes on as before: the loop trains on and
flushes.

The child is this module run as a script (``python -m tests.runner.test_notice_during_restore``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from runner import EXIT_PREEMPTED
from runner.checkpoint import list_committed, restore_latest
from runner.preemption import Notice
from runner.preemption.relay import write_notice
from runner.session import EverySteps, Session, SessionConfig
from runner.store import LocalStore
from runner.telemetry import follow_file
from tests.paths import ROOT
from tests.runner.paced_store import SlowReads
from tests.runner.stand_ins import Recorder, Weights

RUN = "r-restore"
#: The state: 4 MiB.
STATE_FLOATS = 1 << 20
STATE_BYTES = 4 * STATE_FLOATS
#: The step the first attempt commits.
COMMITTED = 5
STEP_S = 0.01


def _child(argv: Sequence[str]) -> None:
    """The attempt: restore through the slow store, then train (the notice ends it)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--read-s", type=float, required=True)
    parser.add_argument("--no-prefetch", action="store_true")
    parser.add_argument("--step-s", type=float, default=STEP_S)
    parser.add_argument("--stepping-file", type=Path, required=True)
    args = parser.parse_args(argv)
    store = SlowReads(LocalStore(Path(args.root) / RUN), STATE_BYTES / args.read_s)
    weights = Weights(STATE_FLOATS)
    with Session.from_env(store=store, prefetch=not args.no_prefetch) as s:
        s.track(weights=weights)
        for step in s.steps(100_000):
            if not args.stepping_file.exists():
                args.stepping_file.touch()  # the script's own step has begun
            weights.t[step % STATE_FLOATS] += 1.0
            time.sleep(args.step_s)
    sys.exit(s.exit_code)


# --- the test's side ---------------------------------------------------------------------


def _first_attempt(root: Path) -> None:
    """Commit step :data:`COMMITTED` on a fast store."""
    config = SessionConfig(run_id=RUN, checkpoint_uri=str(root))
    session = Session(
        config,
        sink=Recorder(),
        store=LocalStore(root / RUN),
        decision=EverySteps(100),
        install_signals=False,
        prefetch=False,
    )
    weights = Weights(STATE_FLOATS)
    with session as s:
        s.track(weights=weights)
        for step in s.steps(COMMITTED):
            weights.t[step] += 1.0
    assert [e.step for e in list_committed(LocalStore(root / RUN))] == [COMMITTED]


class Attempt:
    """What the child did: its events (with when the test read each), its code, whether
    the test had to kill it at the deadline, and when the notice was sent."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any], float]] = []
        self.code: int | None = None
        self.killed = False
        self.signalled_at = 0.0
        self.deadline = 0.0
        self.seen_before_notice: list[str] = []
        self.stderr = ""

    def of(self, type_: str) -> list[tuple[dict[str, Any], float]]:
        return [(d, at) for t, d, at in self.events if t == type_]


def _run_attempt(
    root: Path,
    *,
    read_s: float,
    window_s: float,
    train_on: bool,
    prefetch: bool = True,
    step_s: float = STEP_S,
    notice_on: str = "started",
) -> Attempt:
    """Start the child and send it SIGTERM once it has sent ``notice_on`` ("started": it
    is restoring then), or for ``"stepping"`` once its first step's body has begun.
    At the deadline the child is SIGKILLed, as a spot instance's end does, unless its exit
    (which is what the control plane waits for) has been written by then: it is then left
    to end, to see how it ends."""
    events_path = root / f"events-{time.monotonic_ns()}.jsonl"
    events_path.touch()
    # The deadline, written before the signal as the supervisor writes it: the child's
    # is then this test's, not the moment its handler ran (later on a loaded machine).
    notice_path = events_path.with_suffix(".notice")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINBOT_")}
    env.update(
        PYTHONPATH=str(ROOT),
        TRAINBOT_RUN_ID=RUN,
        TRAINBOT_CHECKPOINT_URI=str(root),
        TRAINBOT_EVENTS_FILE=str(events_path),
        TRAINBOT_TERMINATION_WINDOW_S=str(window_s),
        TRAINBOT_TRAIN_THROUGH_NOTICE="1" if train_on else "0",
        TRAINBOT_NOTICE_FILE=str(notice_path),
        OMP_NUM_THREADS="1",
    )
    cmd = [sys.executable, "-m", "tests.runner.test_notice_during_restore", str(root)]
    stepping = events_path.with_suffix(".stepping")
    cmd += ["--read-s", str(read_s), "--step-s", str(step_s), "--stepping-file", str(stepping)]
    cmd += [] if prefetch else ["--no-prefetch"]
    follower = follow_file(events_path)
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    attempt = Attempt()
    give_up_at = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < give_up_at:
        now = time.monotonic()
        attempt.events.extend((t, dict(d), now) for t, _, d in follower)
        due = (
            stepping.exists()
            if notice_on == "stepping"
            else any(t == notice_on for t, _, _ in attempt.events)
        )
        if not attempt.signalled_at and due:
            attempt.seen_before_notice = [t for t, _, _ in attempt.events]
            attempt.signalled_at = time.monotonic()
            attempt.deadline = attempt.signalled_at + window_s
            write_notice(
                notice_path, Notice("signal", "test", attempt.signalled_at, attempt.deadline)
            )
            proc.send_signal(signal.SIGTERM)
        if attempt.deadline and now >= attempt.deadline and not attempt.of("exit"):
            proc.kill()  # the instance goes away, and no exit has left it
            attempt.killed = True
            break
        time.sleep(0.005)
    if proc.poll() is None and not attempt.killed:
        proc.kill()
        pytest.fail("the attempt did not end in time")
    _, attempt.stderr = proc.communicate(timeout=30)
    attempt.events.extend((t, dict(d), time.monotonic()) for t, _, d in follower)
    attempt.code = proc.returncode
    return attempt


@pytest.mark.parametrize(
    ("prefetch", "train_on"),
    [(True, True), (False, False)],
    ids=["prefetched-train-on", "read-at-restore-no-train-on"],
)
def test_a_notice_while_restoring_reports_the_exit_before_the_deadline(
    tmp_path: Path, prefetch: bool, train_on: bool
) -> None:
    """The read takes 8 s and the window is 1.5 s: the restore is given up, the exit and
    its report arrive before the deadline, nothing committed is lost. With train-on the
    session reads on until a flush no longer fits (the report's time before the deadline);
    without, it gives up at once."""
    _first_attempt(tmp_path)
    attempt = _run_attempt(tmp_path, read_s=8.0, window_s=1.5, train_on=train_on, prefetch=prefetch)
    assert "restored" not in attempt.seen_before_notice
    exits = attempt.of("exit")
    assert not attempt.killed, f"killed at the deadline with no exit: {attempt.stderr}"
    assert attempt.code == EXIT_PREEMPTED, attempt.stderr
    [(exit_data, read_at)] = exits
    print(f"\nexit read {attempt.deadline - read_at:.2f} s before the deadline")
    assert read_at < attempt.deadline
    assert exit_data["code"] == EXIT_PREEMPTED and exit_data["reason"] == "preempted"
    report = exit_data["flush"]
    assert report["restore_given_up"] is True
    assert report["committed_step"] == report["notice_step"] == COMMITTED
    assert report["given_up_steps"] == 0 and report["flushes"] == []
    assert "restore was given up" in report["summary"]
    assert f"resumes from step {COMMITTED}" in report["summary"]
    assert not attempt.of("restored")
    assert "Traceback" not in attempt.stderr, attempt.stderr
    # Nothing committed is lost, and the next attempt restores the same step.
    store = LocalStore(tmp_path / RUN)
    assert [e.step for e in list_committed(store)] == [COMMITTED]
    assert restore_latest(store).step == COMMITTED


def test_a_restore_that_fits_the_window_trains_on_and_flushes(tmp_path: Path) -> None:
    """The read takes 1 s of a 5 s window: the session restores, trains on after the
    notice and flushes as it always has; the next attempt resumes from that flush."""
    _first_attempt(tmp_path)
    attempt = _run_attempt(tmp_path, read_s=1.0, window_s=5.0, train_on=True)
    assert "restored" not in attempt.seen_before_notice
    assert not attempt.killed, f"killed at the deadline with no exit: {attempt.stderr}"
    assert attempt.code == EXIT_PREEMPTED, attempt.stderr
    [(restored, _)] = attempt.of("restored")
    assert restored["step"] == COMMITTED
    [(exit_data, read_at)] = attempt.of("exit")
    assert read_at < attempt.deadline
    report = exit_data["flush"]
    assert "restore_given_up" not in report
    assert report["notice_step"] == COMMITTED and report["trained_on_steps"] > 0
    committed = report["committed_step"]
    assert committed is not None and committed >= COMMITTED
    assert restore_latest(LocalStore(tmp_path / RUN)).step >= committed


def test_a_step_running_past_the_deadline_still_reports_the_exit(tmp_path: Path) -> None:
    """The notice comes during a 4 s step of the script's (once its body has begun: a
    notice before it is seen by the session and answered at once, with no guard), with a
    1.5 s window: the main thread is not back before the kill, so the exit guard sends the exit, with what is
    committed, before the deadline; the loop's own end later sends no second one."""
    _first_attempt(tmp_path)
    attempt = _run_attempt(
        tmp_path, read_s=0.2, window_s=1.5, train_on=False, step_s=4.0, notice_on="stepping"
    )
    assert not attempt.killed, f"killed at the deadline with no exit: {attempt.stderr}"
    [(exit_data, read_at)] = attempt.of("exit")
    print(f"\nexit read {attempt.deadline - read_at:.2f} s before the deadline")
    assert read_at < attempt.deadline
    report = exit_data["flush"]
    assert exit_data["code"] == EXIT_PREEMPTED and report["late"] is True
    assert report["committed_step"] == COMMITTED and report["given_up_steps"] == 0
    assert "had not handed control back" in report["summary"], report["summary"]
    # Left to end (no kill in this test), it stops after its step, as preempted.
    assert attempt.code == EXIT_PREEMPTED, attempt.stderr
    assert "Traceback" not in attempt.stderr, attempt.stderr
    assert restore_latest(LocalStore(tmp_path / RUN)).step == COMMITTED


if __name__ == "__main__":
    _child(sys.argv[1:])
