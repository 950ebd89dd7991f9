"""What the session does once a preemption notice (or a stop request) is seen: train on
through the window after saving first, or stop and flush if the flush is worth it; then
say what the flushes did. A part of :class:`~runner.session.Session`, kept apart so each
module holds one concept: the loop and its saves there, the notice window here.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from runner import EXIT_FAILED, EXIT_PREEMPTED, EXIT_SUCCEEDED
from runner.preemption import read_notice, write_seconds
from runner.session.exit_guard import GUARD_S
from runner.session.notice import REPORT_S, NoticeWindow

if TYPE_CHECKING:
    from runner.checkpoint import CheckpointWriter
    from runner.preemption import PreemptionFlag
    from runner.session.config import SessionConfig
    from runner.telemetry import EventSink

log = logging.getLogger("runner.session.core")

#: A save in flight at the notice less written than this share is given up for the
#: flush of the notice's step: its rest would be written at the window's pace (often
#: slower) ahead of the notice's state, which supersedes it. Only a nearly written one is
#: waited for (at 0.5, a later attempt's notice flush started 0.6-0.9 s into a 2 s window
#: behind the rest of a periodic save slowed down 4x, on a machine at load 15-27).
CANCEL_BELOW = 0.9


class OnNotice:
    """The session's behaviour on a notice (a mixin: the state is the session's)."""

    if TYPE_CHECKING:
        config: SessionConfig
        sink: EventSink
        flag: PreemptionFlag
        writer: CheckpointWriter
        step: int
        committed_step: int | None
        stop_reason: str | None
        exit_code: int
        _step_s: float
        _last_save_step: int
        _last_save_time: float
        _notice_reported: bool
        _relayed: bool
        _window: NoticeWindow | None
        _flush_report: dict[str, Any] | None

        def _checkpoint_bytes(self) -> int: ...
        def _write_measured(self) -> tuple[float | None, float]: ...
        def _flush_fits(self, nbytes: int, left: float | None) -> bool: ...
        def _save(self, *, copy: bool = True) -> None: ...
        def _mark_exit_sent(self) -> bool: ...
        def _reading_step(self) -> int | None: ...

    def _train_on(self) -> bool:
        """Whether the loop may take another step after a preemption notice.

        Save first, then train on (:mod:`runner.session.notice`): at the notice the state
        is flushed at once, and the loop goes on for as long as a second flush of the
        newest step would still fit once the first has landed, by what the writes in
        this window are doing (the deadline itself comes from the supervisor, see
        :meth:`_read_relayed_notice`). Without a known deadline, or with
        ``train_through_notice`` off, the loop stops.
        """
        self._read_relayed_notice()
        left = self.flag.time_left()
        if not self.config.train_through_notice or left is None:
            return False
        self._report_notice(left)
        window = self._open_window(left)
        if not window.flushes:
            self._flush_first(window)
        stall, estimate = self._write_now()
        go_on = window.train_on(
            left=self._time_left() or 0.0,
            step_s=self._step_s,
            stall_s=stall,
            progress=self.writer.progress(),
            estimate_s=estimate,
        )
        if not go_on:
            window.stopped_step = self.step
        return go_on

    def _time_left(self) -> float | None:
        """Seconds left for the flushes: to the deadline, less the time the exit report
        needs to leave the instance (:data:`~runner.session.notice.REPORT_S`); None with
        no deadline known."""
        left = self.flag.time_left()
        return None if left is None else max(0.0, left - REPORT_S)

    def _write_now(self) -> tuple[float, float | None]:
        """The stall of the recent saves, and the slowest recent write of this state
        (None: nothing measured)."""
        bandwidth, stall = self._write_measured()
        nbytes = self._checkpoint_bytes()
        return stall, write_seconds(nbytes, bandwidth) if bandwidth else None

    def _open_window(self, left: float | None) -> NoticeWindow:
        if self._window is None:
            notice = self.flag.notice
            self._window = NoticeWindow(
                notice_step=self.step,
                received_at=notice.received_at if notice else time.monotonic(),
                window_s=left,
            )
        return self._window

    def _flush_first(self, window: NoticeWindow) -> None:
        """The flush at the notice: the state as it is, copied (the loop goes on)."""
        flush = window.started(self.step, now=time.monotonic())
        if self.committed_step == self.step:
            window.landed(self.step, write_s=self._last_write_s())
        elif not (self.writer.in_flight and self._last_save_step == self.step):
            # An older save in flight is given up unless mostly written: the notice's
            # state comes first, and would otherwise wait for the rest of that write at
            # the window's (often slower) pace. One save at a time.
            progress = self.writer.progress()
            if progress is not None and progress.done < CANCEL_BELOW * progress.total:
                self.writer.cancel()
            self._save()
            flush.started_s = max(0.0, self._last_save_time - window.received_at)

    def _last_write_s(self) -> float:
        last = self.writer.last_commit
        if last is not None:
            return last.write_s
        bandwidth, _ = self._write_measured()
        return write_seconds(self._checkpoint_bytes(), bandwidth)

    def _read_relayed_notice(self) -> None:
        """Take the real deadline from the supervisor's notice file once it is there: the
        SIGTERM it sent carries none, and came a poll (or a metadata poll) after the
        notice. It can only bring the deadline forward."""
        path = self.config.notice_file
        if self._relayed or not path:
            return
        notice = read_notice(path)
        if notice is not None:
            self._relayed = True
            self.flag.set(notice)

    def _report_notice(self, left: float | None) -> None:
        if self._notice_reported:
            return
        self._notice_reported = True
        notice = self.flag.notice
        self.sink.emit(
            "preemption_notice",
            {"source": notice.source if notice else "signal", "time_left_s": left},
        )

    def _notice_source(self) -> str | None:
        notice = self.flag.notice
        return notice.source if notice else None

    def _send_late_exit(self) -> None:
        """The exit guard's exit (:mod:`runner.session.exit_guard`), sent from its thread
        when the main thread has not come back by then: a step of the script's still
        running, or anything else stuck. Not after a stop request, which no kill follows."""
        if self._notice_source() == "stop" or not self._mark_exit_sent():
            return
        report = self._late_report()
        log.warning("preempted: %s", report["summary"])
        self.sink.emit("exit", {"code": EXIT_PREEMPTED, "reason": "preempted", "flush": report})

    def _late_report(self) -> dict[str, Any]:
        """What is known just before the kill, the main thread being elsewhere: the
        notice window's record if the loop opened one, the newest committed step (during
        a restore, the one being read) and the steps done since."""
        notice = self.flag.notice
        now = time.monotonic()
        committed = self.committed_step
        if committed is None:
            committed = self._reading_step()
        step = max(self.step, committed or 0)
        window = self._window or NoticeWindow(
            notice_step=step,
            received_at=notice.received_at if notice else now,
            window_s=notice.deadline - notice.received_at if notice else None,
        )
        report = window.report(step=step, committed_step=committed, now=now)
        report["late"] = True
        report["summary"] = (
            f"the training script had not handed control back to trainbot {GUARD_S:.2g} s "
            "before the kill (a step still running, or the restore), so this report was "
            "sent without it: " + report["summary"]
        )
        return report

    # -- checkpoints

    def _flush_on_notice(self) -> None:
        stopped = time.monotonic()  # the loop has just ended
        self._read_relayed_notice()
        left = self.flag.time_left()
        self._report_notice(left)
        window = self._open_window(left)
        self._wait_in_window()  # the save in flight (the flush at the notice, if any)
        if window.flushes and self.stop_reason == "preempted":
            # Trained on after the flush at the notice: the newest step, if it still fits.
            stall, estimate = self._write_now()
            left = self._time_left() or 0.0
            fits = window.second_fits(left=left, stall_s=stall, estimate_s=estimate)
            if self.committed_step != self.step and fits:
                self._flush_last(window)
        elif self._should_flush(stopped):
            self._flush_last(window)
        if self.stop_reason == "stopped":
            self.exit_code = EXIT_SUCCEEDED if self.committed_step == self.step else EXIT_FAILED
        else:
            # Resumable either way: from the newest checkpoint, or from the start if none.
            self.exit_code = EXIT_PREEMPTED
            self._flush_report = window.report(
                step=self.step, committed_step=self.committed_step, now=time.monotonic()
            )
            log.info("preempted: %s", self._flush_report["summary"])

    def _flush_last(self, window: NoticeWindow) -> None:
        """Write the step the loop ended at and wait for it in the window. The wait is
        timed from when the save is handed to the writer, not from before its snapshot:
        on a loaded machine that snapshot alone can take a good part of the time the
        exit report needs (issue 29)."""
        window.started(self.step, now=time.monotonic())
        # The loop has ended: the state is written from where it is, without a copy.
        self._save(copy=False)
        self._wait_in_window()

    def _wait_in_window(self) -> None:
        """Wait for the save in flight, but not into the time the exit report needs."""
        try:
            self.writer.wait(timeout=self._time_left())
        except TimeoutError:
            pass

    def _should_flush(self, stopped: float) -> bool:
        """Whether to write the current step now that the loop has stopped on a notice or
        a stop request (the save in flight is finished by then)."""
        if self.stop_reason == "preempted" and self._flush_costs_more(stopped):
            return False  # the next attempt redoes the few steps since the newest checkpoint
        if self.committed_step == self.step:
            return False
        left = self._time_left()
        nbytes = self._checkpoint_bytes()
        if self._flush_fits(nbytes, left):
            return True
        msg = (
            f"no time for an emergency checkpoint of {nbytes} bytes "
            f"({left:.1f}s left); resuming from step {self.committed_step}"
        )
        log.warning(msg)
        self.sink.emit("log", {"level": "warning", "message": msg})
        return False

    def _flush_costs_more(self, stopped: float) -> bool:
        """Whether writing the current step would take longer than redoing the steps done
        since the newest checkpoint's snapshot (both are paid time that makes no progress).

        Only when that checkpoint is this process's last save (a failed save proves
        nothing) and a write was measured; the work is timed from the save to the loop's
        end, which over-counts for a process that has not saved yet, so it then flushes.
        """
        last = self.writer.last_commit
        if last is None or self.committed_step == self.step:
            return False
        if self.committed_step != self._last_save_step:
            return False
        work_s = stopped - self._last_save_time
        if work_s >= last.write_s:
            return False
        msg = (
            f"no emergency checkpoint: the steps since step {self.committed_step} took "
            f"{work_s:.2f}s, less than the {last.write_s:.2f}s a checkpoint takes to write; "
            f"resuming from step {self.committed_step}"
        )
        log.info(msg)
        self.sink.emit("log", {"level": "info", "message": msg})
        return True
