"""The run's thread says what a preempted attempt's flushes did (issue 29): the exit
event's ``flush`` report, made by the runner's own notice window and carried over the
wire, rendered in the preemption alert."""

from __future__ import annotations

from jobs.rules import Obs, Preemption, RunContext
from runner.session.notice import NoticeWindow
from runner.wire import Event, decode_batch, encode_batch

NOW = 1_700_000_000.0


def _report() -> dict[str, object]:
    """A 120 s window: step 120 flushed at the notice in 9.5 s, training went on to step
    180, whose flush did not land before the deadline."""
    window = NoticeWindow(notice_step=120, received_at=0.0, window_s=120.0)
    window.started(120, now=0.01)
    window.landed(120, write_s=9.5)
    window.started(180, now=101.0)
    return window.report(step=180, committed_step=120, now=119.9)


def test_the_preemption_alert_says_which_flush_landed_and_what_was_given_up() -> None:
    data = {"code": 75, "reason": "preempted", "flush": _report()}
    # The report travels as the runner sends it.
    sent = Event(attempt="a-1", seq=0, type="exit", time=NOW, run="r-1", data=data)
    [received] = decode_batch(encode_batch([sent]))
    window = [
        Obs(NOW - 120, "preemption_notice", {"source": "aws", "time_left_s": 120}),
        Obs(NOW, "exit", dict(received.data)),
    ]
    ctx = RunContext(
        run_id="r-1",
        last_heartbeat=None,
        preemption_times=(),
        attempt_number=1,
        last_committed_step=120,
        current_step=180,
    )
    (signal,) = Preemption().evaluate(window, now=NOW, ctx=ctx)
    assert "code 75" in signal.detail
    assert "step 120 (0.0 s after the notice, written in 9.5 s" in signal.detail
    assert "of the 120 s window" in signal.detail
    assert "step 180 did not land in time" in signal.detail
    assert "gave up the 60 steps after step 120" in signal.detail
    assert signal.data["flush"]["given_up_steps"] == 60


def test_an_exit_without_a_report_reads_as_before() -> None:
    window = [Obs(NOW, "exit", {"code": 75, "reason": "preempted"})]
    ctx = RunContext("r-1", None, (), 1, None, None)
    (signal,) = Preemption().evaluate(window, now=NOW, ctx=ctx)
    assert "flush" not in signal.data and "given up" not in signal.detail
