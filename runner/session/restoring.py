"""Restoring with a preemption notice in view: the read of the checkpoint runs on a
background thread while the session watches the flag, and a notice that leaves the
window no room for the restore, a step and a flush after it ends the attempt at once,
with its exit report, instead of at the kill with none (issue 29: on a loaded machine an
attempt noticed 2 s before its kill was still restoring 5 s in). Nothing is lost by
giving a restore up: nothing has been trained since the checkpoint being read. A part of
:class:`~runner.session.Session`, as :mod:`runner.session.on_notice` is.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Any

from runner import EXIT_PREEMPTED
from runner.checkpoint.restore import Reading
from runner.preemption import flush_fits
from runner.session.notice import NoticeWindow

if TYPE_CHECKING:
    from runner.checkpoint import Prefetch, Restored
    from runner.preemption import PreemptionFlag
    from runner.session.config import SessionConfig
    from runner.store import Store
    from runner.telemetry import EventSink

log = logging.getLogger("runner.session.core")

#: How often the wait for a checkpoint read looks at the preemption flag (seconds): a
#: notice is acted on this late at most.
WATCH_S = 0.05


class Restoring:
    """The session's restore read (a mixin: the state is the session's)."""

    #: The read under way (the last one, once over).
    _reading: Reading | None = None

    if TYPE_CHECKING:
        config: SessionConfig
        sink: EventSink
        store: Store
        flag: PreemptionFlag
        prefetch: Prefetch | None
        stop_reason: str | None
        exit_code: int
        _step_s: float
        _window: NoticeWindow | None
        _flush_report: dict[str, Any] | None

        def _read_relayed_notice(self) -> None: ...
        def _report_notice(self, left: float | None) -> None: ...
        def _notice_source(self) -> str | None: ...
        def _time_left(self) -> float | None: ...
        def _write_measured(self) -> tuple[float | None, float]: ...
        def _send_preempted_exit(self) -> None: ...

    def _read_latest(self, below: int | None) -> Restored:
        """The checkpoint to restore: the prefetched one, or the newest below ``below``.

        Either read is waited for with the flag in view (:meth:`_await_read`)."""
        prefetch, self.prefetch = self.prefetch, None
        if prefetch is not None:
            self._reading = prefetch
            self._await_read(prefetch)
            restored = prefetch.take()
            if restored is not None:
                return restored
        self._reading = reading = Reading(self.store, below=below)
        self._await_read(reading)
        return reading.result()

    def _reading_step(self) -> int | None:
        """The step a restore is reading (or read); None before it has listed the store."""
        return self._reading.step if self._reading is not None else None

    def _await_read(self, reading: Reading) -> None:
        """Wait for ``reading`` to end; on a notice that leaves no room for it, cancel it
        and end the attempt (:meth:`_give_up_restore`, which does not return)."""
        while not reading.wait(WATCH_S):
            if not self._restore_worth_finishing(reading):
                reading.cancel()
                self._give_up_restore(reading)

    def _restore_worth_finishing(self, reading: Reading) -> bool:
        """Whether to go on reading: yes without a notice, or on a stop request (which
        ends on a checkpoint of the restored step anyway); after a preemption notice only
        while the loop would still train on once it is restored, i.e. while one step and
        a flush of the state still fit the time left less the report's. Without
        ``train_through_notice`` the loop would stop at once with nothing to flush, so a
        restore gains nothing; without the checkpoint's size (its manifest not read yet)
        no flush is sure to fit."""
        if not self.flag.is_set:
            return True
        self._read_relayed_notice()
        if self._notice_source() == "stop":
            return True
        left = self._time_left()
        if left is None:
            return True
        manifest = reading.manifest
        if not self.config.train_through_notice or manifest is None:
            return False
        bandwidth, stall = self._write_measured()
        if manifest.write_s > 0 and manifest.bytes > 0:
            # The write that committed it, on the run's store (the slowest figure known).
            restored_bps = manifest.bytes / manifest.write_s
            bandwidth = restored_bps if bandwidth is None else min(bandwidth, restored_bps)
        return flush_fits(
            nbytes=manifest.bytes,
            bandwidth_bps=bandwidth,
            stall_s=stall,
            time_left_s=max(0.0, left - self._step_s),
        )

    def _give_up_restore(self, reading: Reading) -> None:
        """End a preempted attempt that is still restoring: its exit, with a flush report
        that says so, is sent at once; then ``SystemExit(75)`` leaves the caller's
        ``with`` block as a preempted loop's end does (the session closes cleanly)."""
        notice = self.flag.notice
        now = time.monotonic()
        received = notice.received_at if notice else now
        window_s = notice.deadline - notice.received_at if notice else None
        self._report_notice(self.flag.time_left())
        step = reading.step
        window = NoticeWindow(
            notice_step=step or 0, received_at=received, window_s=window_s, restore_given_up=True
        )
        self._window = window
        self.stop_reason = "preempted"
        self.exit_code = EXIT_PREEMPTED
        self._flush_report = window.report(step=step or 0, committed_step=step, now=now)
        log.info("preempted: %s", self._flush_report["summary"])
        self._send_preempted_exit()
        print(
            f"trainbot: preempted while restoring: {self._flush_report['summary']}",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(EXIT_PREEMPTED)
