"""The emergency checkpoint on a preemption notice: written when it saves more than it
costs, skipped when the newest checkpoint is only a moment of work old; its margin taken
from the writes measured (the resumed checkpoint's too) and the supervisor's deadline; and
the commit event carries the stall of the save."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from runner import EXIT_PREEMPTED
from runner.checkpoint import list_committed
from runner.errors import RunnerError
from runner.preemption import Notice, PreemptionFlag, write_notice
from runner.session import EverySeconds, EverySteps, Session, SessionConfig
from runner.store import LocalStore
from tests.runner.stand_ins import Recorder, Weights

#: Large enough that writing it takes clearly longer than a step that does nothing.
STATE_FLOATS = 8 << 20  # 32 MiB
#: For the tests that train on through a window of a few seconds: small enough that a
#: flush at the notice and a second one (with its margin) fit, even on a loaded machine.
TRAIN_ON_FLOATS = 2 << 20  # 8 MiB


def _notice(window_s: float = 60.0) -> Notice:
    now = time.monotonic()
    return Notice(source="signal", reason="SIGTERM", received_at=now, deadline=now + window_s)


def _session(
    root: Path,
    sink: Recorder,
    flag: PreemptionFlag,
    *,
    run_id: str = "r-flush",
    store: LocalStore | None = None,
    decision: EverySteps | None = None,
    **config: Any,
) -> Session:
    """Run ``run_id``'s session in ``root`` (its store, unless given, a LocalStore there),
    saving every 3 steps unless ``decision`` says otherwise; a 60 s window by default."""
    config.setdefault("window_s", 60.0)
    return Session(
        SessionConfig(run_id=run_id, checkpoint_uri=str(root), **config),
        sink=sink,
        store=store or LocalStore(root / run_id),
        flag=flag,
        decision=decision or EverySteps(3),
        install_signals=False,
    )


def _train(session: Session, *, notice_at: int, step_s: float) -> None:
    """Steps of ``step_s`` each; the notice arrives during step ``notice_at``."""
    weights = Weights(STATE_FLOATS)
    with session as s:
        s.track(weights=weights)
        for step in s.steps(100):
            weights.t[step] += 1.0
            if step_s:
                time.sleep(step_s)
            if step == notice_at:
                s.flag.set(_notice())


def test_no_flush_when_the_newest_checkpoint_is_a_moment_of_work_old(tmp_path: Path) -> None:
    """The notice comes one instant step after a periodic save: redoing that step costs
    less than writing the state again, so the runner exits at once and the next attempt
    resumes from the periodic checkpoint."""
    sink, flag = Recorder(), PreemptionFlag()
    session = _session(tmp_path, sink, flag)
    _train(session, notice_at=3, step_s=0.0)  # saved after step 3; stops after step 4
    assert session.exit_code == EXIT_PREEMPTED
    assert session.step == 4 and session.committed_step == 3
    assert [e.step for e in list_committed(LocalStore(tmp_path / "r-flush"))] == [3]
    assert any("no emergency checkpoint" in d["message"] for d in sink.of("log"))


def test_flush_when_the_work_since_the_newest_checkpoint_outweighs_a_write(
    tmp_path: Path,
) -> None:
    """Steps slower than a write ran since the periodic save: the flush saves them."""
    sink, flag = Recorder(), PreemptionFlag()
    session = _session(tmp_path, sink, flag)
    # Write the state once alone first, to know how long a write takes on this machine.
    probe = Recorder()
    with _session(tmp_path / "probe", probe, PreemptionFlag()) as s:
        s.track(weights=Weights(STATE_FLOATS))
        for _ in s.steps(3):
            pass
    write_s = max(d["write_s"] for d in probe.of("checkpoint_committed"))
    _train(session, notice_at=4, step_s=2 * write_s)  # two slow steps after the save at 3
    assert session.exit_code == EXIT_PREEMPTED
    assert session.step == 5 and session.committed_step == 5
    assert [e.step for e in list_committed(LocalStore(tmp_path / "r-flush"))] == [3, 5]
    assert not any("no emergency checkpoint" in d["message"] for d in sink.of("log"))


def test_a_stop_request_always_flushes(tmp_path: Path) -> None:
    """A deliberate stop must end on a checkpoint of the last step, however recent the
    previous one: its exit code says whether it did."""
    sink, flag = Recorder(), PreemptionFlag()
    session = _session(tmp_path, sink, flag)
    weights = Weights(STATE_FLOATS)
    with session as s:
        s.track(weights=weights)
        for step in s.steps(100):
            weights.t[step] += 1.0
            if step == 3:
                now = time.monotonic()
                s.flag.set(Notice("stop", "stop requested", now, now + 60))
    assert session.exit_code == 0 and session.committed_step == session.step == 4


def test_the_commit_event_carries_the_stall(tmp_path: Path) -> None:
    sink = Recorder()
    with _session(tmp_path, sink, PreemptionFlag()) as s:
        s.track(weights=Weights(STATE_FLOATS))
        for _ in s.steps(6):
            pass
    commits = sink.of("checkpoint_committed")
    assert [c["step"] for c in commits] == [3, 6]
    for c in commits:
        assert c["stall_s"] >= 0 and c["write_s"] > 0
    # The periodic save at 3 copies the state into staging buffers: that copy is its stall.
    assert commits[0]["stall_s"] > 0


# --- training on through the notice window --------------------------------------------------


def _train_through(root: Path, sink: Recorder, *, window_s: float, source: str = "signal"):  # type: ignore[no-untyped-def]
    """A session that trains on after a notice during step 20 (after a few measured
    saves); returns it, the notice's deadline and when the session ended."""
    session = _session(root, sink, PreemptionFlag(), window_s=window_s, train_through_notice=True)
    weights = Weights(TRAIN_ON_FLOATS)
    deadline = 0.0
    with session as s:
        s.track(weights=weights)
        for step in s.steps(100_000):
            weights.t[step] += 1.0
            time.sleep(0.01)
            if step == 20:
                now = time.monotonic()
                deadline = now + window_s
                s.flag.set(Notice(source=source, reason="test", received_at=now, deadline=deadline))
    return session, deadline, time.monotonic()


def test_training_goes_on_through_the_window_and_the_flush_lands_before_the_deadline(
    tmp_path: Path,
) -> None:
    sink = Recorder()

    session, deadline, ended = _train_through(tmp_path, sink, window_s=3.0)

    assert session.exit_code == EXIT_PREEMPTED
    # Done, checkpoint written, by the deadline (no kill comes in process; a second of
    # slack for a machine loaded enough to slow the write past 1.5 times its estimate).
    assert ended < deadline + 1.0
    # It keeps 1.5 measured writes, a step and the report's time: most of 3 s of 10 ms
    # steps on a quiet machine, a third of that under -n 2 beside other work.
    assert session.step > 21 + 30, "the loop went on after the notice"
    committed = [e.step for e in list_committed(LocalStore(tmp_path / "r-flush"))]
    assert committed[-1] == session.step  # the emergency checkpoint is the last step
    # No periodic save after the notice: only the emergency one is newer than step 21.
    assert [s for s in committed if s > 21] == [session.step]
    assert len(sink.of("preemption_notice")) == 1
    assert sink.of("preemption_notice")[0]["time_left_s"] > 2.5


def _noticed_at_step_3(session: Session, window_s: float = 6.0) -> Session:
    """Train 8 MiB of weights, 10 ms a step, with a notice of ``window_s`` during step 3:
    the loop sees it at step 4."""
    weights = Weights(TRAIN_ON_FLOATS)
    with session as s:
        s.track(weights=weights)
        for step in s.steps(100_000):
            weights.t[step] += 1.0
            if step == 3:
                now = time.monotonic()
                s.flag.set(Notice("signal", "test", received_at=now, deadline=now + window_s))
            time.sleep(0.01)
    return session


def test_a_resumed_session_saves_at_the_notice_then_trains_on(tmp_path: Path) -> None:
    """A notice before this process has saved anything: the state at the notice is
    flushed at once, and the loop trains on while a second flush still fits after it."""
    first = Recorder()
    with _session(tmp_path, first, PreemptionFlag()) as s:
        s.track(weights=Weights(TRAIN_ON_FLOATS))
        for _ in s.steps(3):
            pass
    sink = Recorder()
    session = _session(
        tmp_path,
        sink,
        PreemptionFlag(),
        decision=EverySteps(100_000),  # no save of its own before the notice
        window_s=6.0,
        train_through_notice=True,
    )
    _noticed_at_step_3(session)  # step 3: the first step after the restore
    assert session.exit_code == EXIT_PREEMPTED
    assert session.step > 4 + 20, "the loop went on after the notice"
    committed = [e.step for e in list_committed(LocalStore(tmp_path / "r-flush"))]
    assert committed == [3, 4, session.step]
    [exit_] = sink.of("exit")
    flushes = exit_["flush"]["flushes"]
    # The second landed (it is committed), though on a loaded machine it may land after
    # the exit left, the report's time before the deadline, and the report then says so.
    assert [f["step"] for f in flushes] == [4, session.step] and flushes[0]["landed"]
    assert exit_["flush"]["notice_step"] == 4
    if flushes[1]["landed"]:
        assert exit_["flush"]["given_up_steps"] == 0


def _first_attempt(root: Path, *, measured_write_bps: float | None) -> Session:
    """A first attempt (an empty store) with a 6 s notice at step 3, before any save."""
    session = _session(
        root,
        Recorder(),
        PreemptionFlag(),
        run_id="r-first",
        decision=EverySteps(100_000),
        window_s=6.0,
        train_through_notice=True,
        measured_write_bps=measured_write_bps,
    )
    return _noticed_at_step_3(session)


@pytest.mark.parametrize("measured", [False, True], ids=["nothing-measured", "dry-run-measured"])
def test_a_first_attempt_saves_at_the_notice_then_trains_on(tmp_path: Path, measured: bool) -> None:
    """Nothing saved or restored yet, with or without the write the dry run measured
    (``TRAINBOT_MEASURED_WRITE_BPS``): the flush at the notice is started at once, so the
    steps before the notice are committed whatever the write costs on this machine, and
    its own write is the measurement the loop trains on by (issue 29: a write slower than
    the dry run's left a first attempt with nothing committed)."""
    bps = None
    if measured:
        dry = Recorder()
        with _session(tmp_path / "dry", dry, PreemptionFlag()) as s:
            s.track(weights=Weights(TRAIN_ON_FLOATS))
            for _ in s.steps(3):
                pass
        [commit] = [d for d in dry.of("checkpoint_committed") if d["step"] == 3]
        bps = commit["bytes"] / commit["write_s"]

    session = _first_attempt(tmp_path / "run", measured_write_bps=bps)

    assert session.exit_code == EXIT_PREEMPTED
    assert session.step > 4 + 20, "the loop went on after the notice"
    committed = [e.step for e in list_committed(LocalStore(tmp_path / "run" / "r-first"))]
    assert committed == [4, session.step]


def test_the_measured_write_is_read_from_the_environment() -> None:
    config = SessionConfig.from_env(
        {"TRAINBOT_MEASURED_WRITE_BPS": "125000000", "TRAINBOT_MEASURED_STALL_S": "0.02"}
    )
    assert config.measured_write_bps == 125e6 and config.measured_stall_s == 0.02
    with pytest.raises(RunnerError, match="TRAINBOT_MEASURED_WRITE_BPS"):
        SessionConfig.from_env({"TRAINBOT_MEASURED_WRITE_BPS": "fast"})


class SlowStore(LocalStore):
    """A local store whose large writes take a while to land, like an object store's."""

    def open_write(self, key: str) -> Any:
        inner = super().open_write(key)
        close = inner.close

        def slow_close() -> None:
            time.sleep(0.3)
            close()

        inner.close = slow_close  # type: ignore[method-assign]
        return inner


def test_a_save_in_flight_at_the_notice_does_not_hold_up_the_notice_step(
    tmp_path: Path,
) -> None:
    """The notice comes while this process's first save (of step 3) is still being
    written: one save at a time, so the flush of the notice's step gives that save up if
    less than 90 % of it is written (the notice's state supersedes it), or else waits for
    it; then the loop trains on."""
    sink = Recorder()
    session = _session(
        tmp_path,
        sink,
        PreemptionFlag(),
        store=SlowStore(tmp_path / "r-flush"),
        window_s=6.0,
        train_through_notice=True,
    )
    _noticed_at_step_3(session)  # just after the save of step 3 started
    assert session.exit_code == EXIT_PREEMPTED
    assert session.step > 4 + 20, "the loop went on after the notice"
    committed = [e.step for e in list_committed(LocalStore(tmp_path / "r-flush"))]
    assert committed in ([3, 4, session.step], [4, session.step])
    [exit_] = sink.of("exit")
    assert exit_["flush"]["flushes"][0]["step"] == 4 and exit_["flush"]["flushes"][0]["landed"]
    # A save given up is not a failure: nothing says it failed.
    assert sink.of("checkpoint_failed") == []


def test_the_supervisors_deadline_overrides_the_signals(tmp_path: Path) -> None:
    """Under ``exec`` the SIGTERM comes a poll after the notice and carries no deadline;
    the supervisor's notice file does. The session trains on only until that deadline."""
    sink = Recorder()
    notice_file = tmp_path / "notice.json"
    session = _session(
        tmp_path,
        sink,
        PreemptionFlag(),
        window_s=30.0,
        train_through_notice=True,
        notice_file=str(notice_file),
    )
    weights = Weights(TRAIN_ON_FLOATS)
    real_deadline = signal_deadline = 0.0
    with session as s:
        s.track(weights=weights)
        for step in s.steps(100_000):
            weights.t[step] += 1.0
            time.sleep(0.01)
            if step == 20:
                now = time.monotonic()
                real_deadline, signal_deadline = now + 3.0, now + 30.0
                write_notice(notice_file, Notice("aws", "instance-action", now, real_deadline))
                s.flag.set(Notice("signal", "SIGTERM", received_at=now, deadline=signal_deadline))
    ended = time.monotonic()
    assert session.exit_code == EXIT_PREEMPTED
    assert session.step > 21 and ended < real_deadline + 1.0 < signal_deadline
    committed = [e.step for e in list_committed(LocalStore(tmp_path / "r-flush"))]
    assert committed[-1] == session.step


def test_a_window_too_short_to_train_in_stops_at_once(tmp_path: Path) -> None:
    sink = Recorder()

    session, _, _ = _train_through(tmp_path, sink, window_s=0.05)

    assert session.exit_code == EXIT_PREEMPTED
    assert session.step == 21  # the notice came during step 20: no step after it


def test_a_stop_request_never_trains_on(tmp_path: Path) -> None:
    sink = Recorder()

    session, _, _ = _train_through(tmp_path, sink, window_s=30.0, source="stop")

    assert session.step == 21
    committed = [e.step for e in list_committed(LocalStore(tmp_path / "r-flush"))]
    assert committed[-1] == 21


def test_the_environment_switches_training_on_through_the_window() -> None:
    assert not SessionConfig.from_env({}).train_through_notice
    assert SessionConfig.from_env({"TRAINBOT_TRAIN_THROUGH_NOTICE": "1"}).train_through_notice
    assert not SessionConfig.from_env({"TRAINBOT_TRAIN_THROUGH_NOTICE": "off"}).train_through_notice
    with pytest.raises(RunnerError, match="TRAINBOT_TRAIN_THROUGH_NOTICE='maybe'"):
        SessionConfig.from_env({"TRAINBOT_TRAIN_THROUGH_NOTICE": "maybe"})


def test_an_auto_interval_follows_the_save_cost_this_process_measures(tmp_path: Path) -> None:
    """The control plane's "auto" interval came from a dry run on another machine; once
    this process has measured three periodic saves, the interval is the same rule for
    their median stall and write, and the session says so."""
    from runner.preemption import MEASURED_SAVES_MIN, choose_interval

    sink = Recorder()
    # A tiny starting interval: saves come every step until the rule moves it.
    config = SessionConfig(
        run_id="r-flush", checkpoint_uri=str(tmp_path), every_s=1e-6, auto_mtbp_s=3600.0
    )
    session = Session(
        config,
        sink=sink,
        store=LocalStore(tmp_path / "r-flush"),
        flag=PreemptionFlag(),
        install_signals=False,
    )
    weights = Weights(1 << 16)
    with session as s:
        s.track(weights=weights)
        for step in s.steps(400):
            weights.t[step] += 1.0
            time.sleep(0.01)
            if s.decision.seconds > 1.0:  # type: ignore[attr-defined]
                break
    commits = sink.of("checkpoint_committed")
    periodic = commits[:MEASURED_SAVES_MIN]  # steps 1, 2, 3: each a periodic save
    assert [c["step"] for c in periodic] == [1, 2, 3]
    expected = choose_interval(
        write_s=sorted(c["write_s"] for c in periodic)[1],
        stall_s=sorted(c["stall_s"] for c in periodic)[1],
        mtbp_s=3600.0,
        flush_fits_window=False,
    ).interval_s
    assert expected > 1.0  # Daly for a few ms of stall and an hour: seconds, not 1 us
    # Each commit says the interval in effect from it on: the given one, then the rule's
    # (a save started before the third commit came may move it again, by its own cost).
    assert [c["interval_s"] for c in periodic] == [1e-6, 1e-6, pytest.approx(expected)]
    assert s.decision.seconds > 1.0  # type: ignore[attr-defined]
    moved = [e for e in sink.of("log") if "checkpoint interval" in e["message"]]
    assert "was 1e-06 s" in moved[0]["message"]


def test_a_given_interval_stays_what_the_spec_says(tmp_path: Path) -> None:
    """Without the rule's M (an interval the spec gives), the measured cost moves nothing."""
    config = SessionConfig(run_id="r", checkpoint_uri=str(tmp_path), every_s=30.0)
    assert config.measured_interval() is None
    assert config.decision() == EverySeconds(30.0)
    env = {"TRAINBOT_CHECKPOINT_INTERVAL_S": "30", "TRAINBOT_CHECKPOINT_AUTO_MTBP_S": "6000"}
    auto = SessionConfig.from_env(env)
    assert auto.auto_mtbp_s == 6000.0
    measured = auto.measured_interval()
    assert measured is not None and measured.seconds == 30.0 and measured.mtbp_s == 6000.0


def test_the_measured_interval_moves_only_on_enough_saves_and_a_real_change() -> None:
    from runner.session import MeasuredInterval

    policy = MeasuredInterval(50.0, mtbp_s=5000.0)
    assert policy.observe(write_s=2.0, stall_s=1.0) is None
    assert policy.observe(write_s=2.0, stall_s=0.0) is None  # no stall measured: not counted
    assert policy.observe(write_s=2.0, stall_s=1.0) is None  # two of three
    assert policy.observe(write_s=2.0, stall_s=1.0) == pytest.approx(99.0)  # √(2·1·5000) − 1
    assert policy.seconds == pytest.approx(99.0)
    assert policy.observe(write_s=2.0, stall_s=1.02) is None  # within 2 %: left alone
    assert policy.should_save(step=5, now=99.5, last_step=4, last_time=0.0)
    assert not policy.should_save(step=5, now=98.5, last_step=4, last_time=0.0)
