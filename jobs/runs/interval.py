"""The checkpoint interval of a resubmitted attempt, from the save cost the run measured.

Preflight chose an ``"auto"`` interval from a dry run; before each resubmit the
interval follows what the run's own saves cost on its own hardware. Within an attempt the
session does the same (``runner.session.MeasuredInterval``), given the rule's M
(:func:`auto_interval_mtbp`).
"""

from __future__ import annotations

import math
import statistics

from sqlmodel import Session, col, select

from jobs.database.models import Attempt, EventRow, Run
from jobs.process.deps import Deps
from jobs.runs.rows import dry_run_findings
from jobs.spec import JobSpec
from runner.preemption import MEASURED_SAVES_MIN, choose_interval

#: Newest commits of the run the measured cost is taken from.
MEASURED_SAVES_MAX = 200


def auto_interval_mtbp(run: Run, spec: JobSpec) -> float | None:
    """The M of an ``"auto"`` interval (preflight's rule: the mean time between the
    preemptions that lose work); None for an interval the spec gives, or without one."""
    return None if spec.checkpoint.interval_s is not None else _lossy_mtbp(run)


def _lossy_mtbp(run: Run) -> float | None:
    mtbp = dry_run_findings(run).interval_mtbp_s
    return mtbp if mtbp is not None and mtbp > 0 else None


def measured_interval(session: Session, run: Run) -> float | None:
    """The ``"auto"`` interval for the checkpoint cost the run itself has measured.

    Preflight chose the interval from a dry run on the control plane's CPU; the run's own
    saves, on its own hardware, say what a save really costs. The rule is preflight's
    (:func:`runner.preemption.choose_interval`), with the same M, and C and the floor
    from the run: the median stall of its periodic saves (those the loop went on from;
    a final or emergency save copies nothing) and the median write time. None until
    enough periodic saves are known, or without preflight's M.
    """
    lossy_mtbp = _lossy_mtbp(run)
    if lossy_mtbp is None:
        return None
    last_steps = dict(
        session.exec(select(Attempt.id, Attempt.last_step).where(Attempt.run_id == run.id)).all()
    )
    rows = session.exec(
        select(EventRow.attempt_id, EventRow.data)
        .where(EventRow.run_id == run.id, EventRow.type == "checkpoint_committed")
        .order_by(col(EventRow.id).desc())
        .limit(MEASURED_SAVES_MAX)
    ).all()
    writes: list[float] = []
    stalls: list[float] = []
    for attempt_id, data in rows:
        write, stall, step = data.get("write_s"), data.get("stall_s"), data.get("step")
        if isinstance(write, int | float) and write > 0:
            writes.append(float(write))
        last = last_steps.get(attempt_id)
        periodic = isinstance(step, int) and last is not None and step < last
        if periodic and isinstance(stall, int | float) and stall > 0:
            stalls.append(float(stall))
    if len(stalls) < MEASURED_SAVES_MIN or not writes:
        return None
    return choose_interval(
        write_s=statistics.median(writes),
        stall_s=statistics.median(stalls),
        mtbp_s=lossy_mtbp,
        flush_fits_window=False,  # M above already counts only the preemptions losing work
    ).interval_s


def follow_measured_cost(deps: Deps, session: Session, run: Run) -> None:
    """Before a resubmit, move an ``"auto"`` interval to the run's measured cost."""
    interval = measured_interval(session, run)
    current = run.checkpoint_interval_s
    if interval is None or (current and math.isclose(interval, current, rel_tol=0.02)):
        return
    run.checkpoint_interval_s = interval
    session.add(run)
    deps.journal.record(
        "checkpoint_interval", run.id, interval_s=round(interval, 3), previous_s=current
    )
