"""Where a run's paid time went: the accounting of bench_goodput, over plain rows.

Paid time is what the attempt rows say (``ended_at − started_at``, summed, as
``jobs.background.tasks.run_summary`` sums it). Each attempt's span is cut at the times its
runner's events give (one clock: the control plane and the runner share the machine):

    launched ─ startup ─ up ─ set-up ─ first step … last step ─ tail ──────── ┐
      (processes start,  (restore,  steps and the time      (waiting for a       │
       imports)           the model) between them            save, the flush)    │
    ┌───────────────────────────────────────────────────────────────────────────┘
    └ shutdown ─ process end ─ lag ─ ended_at
      (teardown after the      (the control plane noticing)
       last commit)

``up`` is when the training process has imported what it runs (its own mark, an ``up``
event; without one, the supervisor's ``started``, when it spawned the process). Start-up,
shutdown and lag are real process and control-plane costs that a time compression cannot
shrink; so is the loop's fixed work between two steps (reporting the
step's metrics, looking at the flag: the same microseconds after a 100 ms step as after
a 3 s one), measured as the median gap between consecutive steps of an attempt, times
the gaps (a gap with a save in it is an outlier the median leaves out; the save's stall
stays at scale, as it is proportional to the state). :func:`account` counts these at
their wall length in ``goodput`` (one second of them is one second at scale, every other
wall second is ``compression`` seconds) and as they fell in ``goodput_wall``.

Progress is the time of the steps that were kept: every step of a finished run, or up to
the newest commit of one stopped early, each at the time it took in the last attempt
that ran it (the earlier runs of it were redone).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

#: Attempt states in which the instance was taken away.
PREEMPTED = frozenset({"PREEMPTED", "LOST"})


@dataclass(frozen=True)
class AttemptRow:
    """What the database says of one attempt (epoch seconds)."""

    id: str
    number: int
    launched: float | None
    ended: float | None
    state: str


@dataclass(frozen=True)
class RunEvent:
    """One event of the runner, as stored (epoch seconds)."""

    attempt_id: str
    type: str
    time: float
    data: Mapping[str, Any]


@dataclass
class Split:
    """Seconds of paid time by where they went (one attempt, or a run's sum)."""

    paid: float = 0.0
    startup: float = 0.0
    setup: float = 0.0
    steps: float = 0.0
    loop: float = 0.0
    #: The part of ``loop`` that is fixed work per step (not simulated, not compressed).
    reporting: float = 0.0
    tail: float = 0.0
    shutdown: float = 0.0
    lag: float = 0.0

    def __iadd__(self, other: Split) -> Split:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self


def split_attempt(
    attempt: AttemptRow, events: Sequence[RunEvent], *, killed_at: float | None, end: float
) -> Split:
    """Cut one attempt's paid span. ``killed_at``: when its process died without saying
    so (the SIGKILL after a termination window), used when there is no ``exit`` event."""
    launched = attempt.launched
    assert launched is not None
    metrics = [e for e in events if e.type == "metrics"]
    up = next((e.time for e in events if e.type == "up"), None)
    started = up if up is not None else next((e.time for e in events if e.type == "started"), None)
    exit_event = next((e.time for e in events if e.type == "exit"), None)
    commits = [e.time for e in events if e.type == "checkpoint_committed"]
    exited = exit_event is not None
    proc_end = exit_event if exit_event is not None else killed_at if killed_at is not None else end
    proc_end = min(max(proc_end, launched), end)
    ready = proc_end if started is None else min(max(started, launched), proc_end)
    s = Split(paid=end - launched, startup=ready - launched, lag=end - proc_end)
    if not metrics:
        s.setup = proc_end - ready
        return s
    first_start = max(ready, metrics[0].time - float(metrics[0].data["step_time_s"]))
    last_end = min(max(metrics[-1].time, first_start), proc_end)
    s.setup = first_start - ready
    s.steps = sum(float(e.data["step_time_s"]) for e in metrics)
    s.loop = (last_end - first_start) - s.steps
    gaps = [b.time - float(b.data["step_time_s"]) - a.time for a, b in itertools.pairwise(metrics)]
    if gaps:
        s.reporting = min(max(0.0, s.loop), max(0.0, statistics.median(gaps)) * len(gaps))
        s.loop -= s.reporting
    # After the last step and the last commit, a process that ends by itself spends real
    # time tearing down (interpreters, the supervisor's polling): not simulated work.
    done = max([last_end, *(c for c in commits if c <= proc_end)])
    s.shutdown = proc_end - done if exited else 0.0
    s.tail = proc_end - last_end - s.shutdown
    return s


def periodic_stalls(events: Sequence[RunEvent]) -> list[float]:
    """Stalls of one attempt's periodic saves: Daly's C. A save the loop went on from (a
    later step was reported) is periodic; the last save of an attempt (the final one, or
    the emergency flush) writes a state nothing changes any more, without a copy."""
    last_step = max((int(e.data["step"]) for e in events if e.type == "metrics"), default=None)
    return [
        float(e.data["stall_s"])
        for e in events
        if e.type == "checkpoint_committed"
        and isinstance(e.data.get("stall_s"), int | float)
        and last_step is not None
        and int(e.data["step"]) < last_step
    ]


def account(
    attempts: Sequence[AttemptRow],
    events: Iterable[RunEvent],
    *,
    kept_steps: int,
    compression: float,
    killed_at: Mapping[str, float],
    now: float,
    default_step_s: float,
) -> dict[str, Any]:
    """The figures of one run. ``killed_at``: attempt id → when a kill without an exit
    event would have ended its process."""
    by_attempt: dict[str, list[RunEvent]] = {}
    for e in sorted(events, key=lambda e: e.time):
        by_attempt.setdefault(e.attempt_id, []).append(e)
    total = Split()
    step_times: list[float] = []
    kept_by_step: dict[int, float] = {}  # step -> its time in the last attempt that ran it
    writes: list[float] = []
    stalls: list[float] = []
    commit_gaps: list[float] = []
    early, committed = 0, False
    for a in sorted(attempts, key=lambda a: a.number):
        evs = by_attempt.get(a.id, [])
        commits = [e for e in evs if e.type == "checkpoint_committed"]
        committed = committed or bool(commits)
        early += a.state in PREEMPTED and not committed
        if a.launched is None:
            continue
        total += split_attempt(
            a, evs, killed_at=killed_at.get(a.id), end=a.ended if a.ended is not None else now
        )
        writes += [float(e.data["write_s"]) for e in commits]
        stalls += periodic_stalls(evs)
        commit_gaps += [y.time - x.time for x, y in itertools.pairwise(commits)]
        for e in evs:
            if e.type != "metrics":
                continue
            step_times.append(float(e.data["step_time_s"]))
            kept_by_step[int(e.data["step"])] = float(e.data["step_time_s"])
    median_step = statistics.median(step_times) if step_times else default_step_s
    kept = range(1, kept_steps + 1)
    # A kept step whose event died with its process counts at the median step time.
    progress = sum(kept_by_step.get(s, median_step) for s in kept)
    uncompressed = total.startup + total.reporting + total.shutdown + total.lag
    at_scale_paid = total.paid - uncompressed * (1 - 1 / compression)
    return {
        "attempts": len(attempts),
        "preemptions": sum(1 for a in attempts if a.state in PREEMPTED),
        "preempted_before_first_checkpoint": early,
        "steps_kept": kept_steps,
        "goodput": _r(progress / at_scale_paid) if at_scale_paid > 0 else None,
        "goodput_wall": _r(progress / total.paid) if total.paid > 0 else None,
        "paid_s": _r(total.paid, 2),
        "progress_s": _r(progress, 2),
        "breakdown_s": {
            "startup": _r(total.startup, 2),
            "setup_restore": _r(total.setup, 2),
            "steps_kept": _r(progress, 2),
            "steps_redone": _r(max(0.0, total.steps - progress), 2),
            "loop_overhead": _r(total.loop, 2),
            "loop_reporting": _r(total.reporting, 3),
            "tail": _r(total.tail, 2),
            "shutdown": _r(total.shutdown, 2),
            "control_plane_lag": _r(total.lag, 2),
        },
        "step_s_median": _r(median_step, 5),
        "steps_imputed": sum(1 for s in kept if s not in kept_by_step),
        "checkpoints": len(writes),
        "write_s_median": _r(statistics.median(writes)) if writes else None,
        "stall_s_median": _r(statistics.median(stalls)) if stalls else None,
        "commit_gap_s_median": _r(statistics.median(commit_gaps)) if commit_gaps else None,
    }


def _r(value: float, digits: int = 4) -> float:
    return round(value, digits)
