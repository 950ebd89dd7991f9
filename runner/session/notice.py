"""A preemption notice's window when the loop trains on through it: save first, then
train on, and say what happened.

At the notice the state is flushed at once (the loop stalls for its snapshot only; the
write runs in the background), so the steps before the notice are safe however slow the
write turns out to be. The loop then trains on for as long as a second flush, of the
newest step, still fits after the first one lands; the margin follows what the writes
are doing now, in this window: the first flush's own progress while it runs, its write
time once it has landed. A first flush running slow ends the training at once, so the
machine's time goes to it: a slow write costs the steps after the notice, never the ones
before it. Pure bookkeeping over times passed in: the session does the saving.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runner.checkpoint.write import WriteProgress

#: Room left for the write to slow down further than it has in this window: the second
#: flush is started only while ``stall + NOTICE_SAFETY * write`` fits the time left, with
#: ``write`` the first flush's (or, while it runs, its projected) write time.
NOTICE_SAFETY = 1.5
#: The share of a flush that must be written before its own pace is taken for its speed.
PACE_SHARE = 0.25
#: Seconds of the window kept back for the exit event, which carries the report, to leave
#: the instance before the kill: under ``trainbot-runner exec`` the supervisor reads the
#: session's events every 0.2 s (``Supervisor.poll_s``) and then sends the exit over HTTP,
#: and the kill at the deadline ends both processes. The flushes are planned to land, and
#: waited for, only until ``deadline - REPORT_S``; a window shorter than that trains on
#: not at all. Nearly free: the control plane ends the attempt (and its bill) at the exit.
REPORT_S = 0.4


@dataclass
class Flush:
    """One checkpoint written in a notice window."""

    #: The step it saves.
    step: int
    #: Seconds after the notice it was started.
    started_s: float
    #: Whether it was committed before the session stopped waiting for it.
    landed: bool = False
    #: Seconds its write took (first request to manifest), once it landed.
    write_s: float | None = None
    #: Whether it failed (an error from the store), as opposed to still writing.
    failed: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "started_s": round(self.started_s, 3),
            "landed": self.landed,
            "write_s": self.write_s,
        }


@dataclass
class NoticeWindow:
    """The plan and the record of one notice window (times: ``time.monotonic()``)."""

    #: The step the loop was at when it saw the notice: the one flushed first.
    notice_step: int
    #: When the notice was received.
    received_at: float
    #: Seconds from the notice to the deadline, as known when the loop saw it.
    window_s: float | None
    flushes: list[Flush] = field(default_factory=list)
    #: Why training stopped before the deadline, in words ("" while it goes on).
    stopped_because: str = ""
    #: The step training stopped at.
    stopped_step: int | None = None
    #: Whether the notice came while the session was still restoring and it gave the
    #: restore up (no room left in the window for a step and a flush after it).
    restore_given_up: bool = False

    # -- the record

    def started(self, step: int, *, now: float) -> Flush:
        flush = Flush(step=step, started_s=max(0.0, now - self.received_at))
        self.flushes.append(flush)
        return flush

    def landed(self, step: int, *, write_s: float) -> None:
        for flush in self.flushes:
            if flush.step == step and not flush.landed:
                flush.landed, flush.write_s = True, write_s

    def failed(self, step: int) -> None:
        for flush in self.flushes:
            if flush.step == step and not flush.landed:
                flush.failed = True

    @property
    def first(self) -> Flush | None:
        return self.flushes[0] if self.flushes else None

    # -- the plan

    def train_on(
        self,
        *,
        left: float,
        step_s: float,
        stall_s: float,
        progress: WriteProgress | None,
        estimate_s: float | None,
    ) -> bool:
        """Whether the loop may take another step: only while a second flush of the step
        after it would still fit once the first has landed (every term from this window's
        writes where it has one: the first flush's progress, then its write time).

        ``progress`` is the save in flight (None: none), ``estimate_s`` what a write of
        this state took lately in this process, at its slowest (None: nothing measured).
        """
        first = self.first
        if first is None or first.failed:
            return self._stop("the flush at the notice failed")
        if first.landed:
            write_s = max(first.write_s or 0.0, estimate_s or 0.0)
            # Else the time has come for the second flush (not an early stop).
            return step_s + stall_s + NOTICE_SAFETY * write_s <= left
        if progress is None or progress.step != first.step:
            return True  # it has just landed; the commit's callback is on its way
        total_s = projected_write_s(progress, estimate_s)
        remaining = max(0.0, total_s - progress.elapsed_s)
        if remaining + step_s + stall_s + NOTICE_SAFETY * total_s <= left:
            return True
        return self._stop(
            f"the flush at the notice was running slow (projected {total_s:.1f} s to write)"
        )

    def second_fits(self, *, left: float, stall_s: float, estimate_s: float | None) -> bool:
        """Whether the newest step may still be flushed: the first landed, and its write
        time (or the slowest lately, if slower) fits what is left. Without the room to
        slow down that :meth:`train_on` kept: the loop stopped with it, less what its last
        step overran (a loaded machine's steps run long), and a second flush that does
        not land costs nothing the first has not kept."""
        first = self.first
        if first is None or not first.landed or first.write_s is None:
            return False
        return stall_s + max(first.write_s, estimate_s or 0.0) <= left

    def _stop(self, why: str) -> bool:
        if not self.stopped_because:
            self.stopped_because = why
        return False

    # -- the report

    def report(self, *, step: int, committed_step: int | None, now: float) -> dict[str, Any]:
        """What happened, for the exit event and the run's thread: which flush landed, how
        long it took against the window, and what was given up."""
        given_up = step - committed_step if committed_step is not None else step
        data: dict[str, Any] = {
            "notice_step": self.notice_step,
            "window_s": self.window_s,
            "used_s": round(max(0.0, now - self.received_at), 3),
            "flushes": [f.as_dict() for f in self.flushes],
            "committed_step": committed_step,
            "trained_on_steps": max(0, step - self.notice_step),
            "given_up_steps": max(0, given_up),
        }
        if self.restore_given_up:
            data["restore_given_up"] = True
        data["summary"] = summarize(self, step=step, committed_step=committed_step)
        return data


def projected_write_s(progress: WriteProgress, estimate_s: float | None) -> float:
    """The whole write time of the save in flight: never less than the time it has
    taken, nor than the writes measured lately; from its own pace (bytes written over
    time taken) once :data:`PACE_SHARE` of it is written, since the first chunks also
    pay for starting the write and say little about its speed."""
    projected = max(progress.elapsed_s, estimate_s or 0.0)
    if progress.total > 0 and progress.done >= PACE_SHARE * progress.total:
        projected = max(projected, progress.elapsed_s * progress.total / progress.done)
    return projected


def _flush_words(flush: Flush, window_s: float | None) -> str:
    of = f" of the {window_s:.3g} s window" if window_s else ""
    if flush.landed and flush.write_s is not None:
        end = flush.started_s + flush.write_s
        return (
            f"step {flush.step} ({flush.started_s:.1f} s after the notice, written in "
            f"{flush.write_s:.2g} s, landed {end:.1f} s into the notice{of})"
        )
    state = "failed" if flush.failed else "did not land in time (still being written at the exit)"
    return f"step {flush.step} {state} (started {flush.started_s:.1f} s into the notice{of})"


def summarize(window: NoticeWindow, *, step: int, committed_step: int | None) -> str:
    """One sentence for a tired on-call engineer."""
    if window.restore_given_up:
        return _restore_words(window, committed_step=committed_step)
    landed = [f for f in window.flushes if f.landed]
    missed = [f for f in window.flushes if not f.landed]
    parts: list[str] = []
    if landed:
        parts.append("flushed " + "; then ".join(_flush_words(f, window.window_s) for f in landed))
    elif committed_step is not None and committed_step >= window.notice_step:
        parts.append(f"step {committed_step} was already committed at the notice")
    for flush in missed:
        parts.append(_flush_words(flush, window.window_s))
    trained = step - window.notice_step
    if trained > 0:
        parts.append(f"trained on {trained} steps after the notice")
    if window.stopped_because:
        parts.append(f"stopped early: {window.stopped_because}")
    if committed_step is None:
        parts.append(f"nothing committed: the next attempt starts from step 0 ({step} lost)")
    elif step > committed_step:
        parts.append(
            f"gave up the {step - committed_step} steps after step {committed_step}, "
            "which the next attempt redoes"
        )
    else:
        parts.append("nothing given up")
    return "; ".join(parts)


def _restore_words(window: NoticeWindow, *, committed_step: int | None) -> str:
    """The sentence of an attempt noticed while it was still restoring."""
    of = f" {window.window_s:.3g} s" if window.window_s is not None else ""
    head = (
        f"the notice came while the attempt was still restoring; with no room left in "
        f"the{of} window for a step and a flush after it, the restore was given up"
    )
    if committed_step is None:
        return f"{head}; nothing was trained in this attempt, so nothing was lost"
    return (
        f"{head}; nothing was trained since step {committed_step}, so nothing was lost: "
        f"the next attempt resumes from step {committed_step}"
    )
