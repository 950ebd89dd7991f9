"""Preemptions: one attempt preempted, its automatic resubmission, and preemptions that
keep coming (the zone has no spare capacity)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jobs.domain import format as fmt
from jobs.rules.base import (
    TIME,
    Obs,
    RunContext,
    Severity,
    Signal,
    Thresholded,
    Trigger,
    attempt_of,
    integer,
    number,
    of_type,
)
from runner import EXIT_PREEMPTED

__all__ = ["AutoResubmit", "Preemption", "RepeatedPreemptions"]


def _is_preemption(obs: Obs) -> bool:
    if obs.type == "preemption_notice":
        return True
    if obs.type != "exit":
        return False
    reason = obs.data.get("reason")
    if reason is not None:  # the runner's reason wins: a stop may also exit with 75
        return reason == "preempted"
    return integer(obs.data, "code") == EXIT_PREEMPTED


class Preemption(Thresholded):
    """An attempt is being, or was, preempted; trainbot resubmits it on its own.

    The alert is a warning, not a page: it tells people why the run paused and how much
    work is at stake, and the lifecycle dedups the notice and the exit of one attempt.
    """

    name = "preemption"
    trigger = Trigger.PREEMPTED

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        by_attempt: dict[int, list[Obs]] = {}
        kinds = ("preemption_notice", "exit")
        for obs in sorted([o for o in window if o.type in kinds], key=TIME):
            if _is_preemption(obs):
                by_attempt.setdefault(attempt_of(obs, ctx), []).append(obs)
        return [self._signal(n, events, ctx) for n, events in sorted(by_attempt.items())]

    def _signal(self, attempt: int, events: list[Obs], ctx: RunContext) -> Signal:
        notice = next((o for o in events if o.type == "preemption_notice"), None)
        exited = next((o for o in events if o.type == "exit"), None)
        parts: list[str] = []
        data: dict[str, Any] = {"attempt": attempt}
        if notice is not None:
            source = notice.data.get("source", "the provider")
            left = number(notice.data, "time_left_s")
            when = f", {left:.0f} s to termination" if left is not None else ""
            parts.append(f"notice from {source} at {fmt.clock(notice.time)}{when}")
            data.update(source=source, time_left_s=left)
        if exited is not None:
            code = integer(exited.data, "code")
            cause = exited.data.get("cause")
            if code is not None:
                parts.append(f"the runner exited with code {code} (preempted)")
            else:  # the control plane saw the end (the provider, a lost heartbeat)
                parts.append(f"the attempt ended: {cause}" if cause else "the attempt ended")
            data["exited"] = True
            flush = exited.data.get("flush")
            if isinstance(flush, dict) and isinstance(flush.get("summary"), str):
                # What the runner's flushes did in the window: which landed, how long
                # they took against it, what was given up.
                parts.append(flush["summary"])
                data["flush"] = flush
        if ctx.last_committed_step is None:
            at_stake = "no checkpoint is committed yet, so the next attempt starts from step 0"
        else:
            at_stake = f"the next attempt resumes from step {ctx.last_committed_step}"
            if ctx.current_step is not None and ctx.current_step > ctx.last_committed_step:
                lost = ctx.current_step - ctx.last_committed_step
                at_stake += f" (up to {lost} steps since then are lost)"
        verb = "was" if exited is not None else "is being"
        return Signal(
            rule=self.name,
            key=f"attempt-{attempt}",
            severity=Severity.WARNING,
            title=f"Run {ctx.run_id} attempt {attempt} {verb} preempted",
            detail="; ".join(parts),
            hint=f"Nothing to do: trainbot resubmits it; {at_stake}.",
            data=data,
        )


class AutoResubmit(Thresholded):
    """trainbot resubmitted a preempted run; says how much work the preemption cost."""

    name = "auto_resubmit"
    trigger = Trigger.RESUBMITTED

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        signals = []
        for obs in of_type(window, "resubmitted"):
            attempt = attempt_of(obs, ctx)
            steps = integer(obs.data, "lost_steps")
            seconds = number(obs.data, "lost_seconds")
            zone = obs.data.get("zone")
            where = f" in {zone}" if zone else ""
            lost = (
                f"{steps if steps is not None else 'unknown'} steps "
                f"({fmt.duration(seconds) if seconds is not None else 'unknown time'})"
            )
            signals.append(
                Signal(
                    rule=self.name,
                    key=f"attempt-{attempt}",
                    severity=Severity.INFO,
                    title=f"Run {ctx.run_id} resubmitted as attempt {attempt}{where}",
                    detail=f"lost {lost} of work since the last committed checkpoint",
                    hint=(
                        "Nothing to do. If preemptions keep costing this much, checkpoint "
                        "more often."
                    ),
                    data={
                        "attempt": attempt,
                        "lost_steps": steps,
                        "lost_seconds": seconds,
                        "zone": zone,
                    },
                )
            )
        return signals


class RepeatedPreemptions(Thresholded):
    """Preempted again and again: the zone has no spare capacity and the run makes no progress.

    Counts ``ctx.preemption_times`` (one per preempted attempt, from the database), not
    window events, so a notice and an exit of the same attempt count once.
    """

    name = "repeated_preemptions"
    trigger = Trigger.PREEMPTED

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        span = self.cfg.repeated_window_s
        recent = sorted(t for t in ctx.preemption_times if now - span <= t <= now)
        if len(recent) < self.cfg.repeated_preemptions:
            return []
        return [
            Signal(
                rule=self.name,
                key="repeated",
                severity=Severity.CRITICAL,
                title=(
                    f"Run {ctx.run_id} preempted {len(recent)} times "
                    f"in the last {fmt.duration(span)}"
                ),
                detail=(
                    f"{len(recent)} preemptions since {fmt.clock(recent[0])} "
                    f"(alert at {self.cfg.repeated_preemptions}); now on attempt "
                    f"{ctx.attempt_number}"
                ),
                hint=(
                    "Spot capacity here is scarce: relaunch in another zone or region, or on "
                    "on-demand capacity; every preemption also loses the work since the last "
                    "checkpoint."
                ),
                data={"count": len(recent), "attempt": ctx.attempt_number},
            )
        ]
