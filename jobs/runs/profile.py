"""Profile the start of a real run, project the whole run, and ask before overspending.

A run's first attempt (any attempt while the run has no projection) gets a profile
window when it is made (:func:`window`): ``profile.steps`` or ``profile.minutes``, else
one epoch. The ingest API sees the window end (``jobs.ingest.effects``) and calls
:func:`project` once, off its request thread. The projection is made from what the
runner measured on the target instance: the median step time, the data-wait fraction
and the device utilisation, with the price the attempt pays and the checkpoint interval
it uses. When it passes the budget or ``max_hours``, or the input pipeline starves the
device, the run is stopped at a checkpoint the way the hard cap stops it (the runner
flushes, the instance goes) and its thread asks: Continue (a resubmit from that
checkpoint, optionally with a raised budget) or Stop. Otherwise the thread gets the
projection and the run goes on.
"""

from __future__ import annotations

import logging
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timedelta

from sqlmodel import Session, select

from jobs import preflight
from jobs.database.db import session_scope
from jobs.database.metrics import run_metrics
from jobs.database.models import Attempt, EventRow, Run
from jobs.domain.lifecycle import RunState
from jobs.outbound.notify import ProjectionMessage
from jobs.process.deps import Deps
from jobs.runs.cards import refresh_card
from jobs.runs.rows import channel_of, move_run, run_hours, spec_of
from jobs.spec import JobSpec
from jobs.spend import run_spent

__all__ = ["DEFAULT_MINUTES", "epochs", "project", "projection_reasons", "window"]

log = logging.getLogger(__name__)

#: The window when neither the spec nor the command says how long an epoch is.
DEFAULT_MINUTES = 10.0
#: With a GPU, a data-wait share above this names the input as why utilisation is low
#: (the low-utilisation rule's threshold).
INPUT_BOUND = 0.25
#: Points read back for the figures: the newest of the window.
_MAX_POINTS = 5000
_EPOCHS = re.compile(r"--epochs(?:=|\s+)(\d{1,9})(?:\s|$)")


def epochs(command: Sequence[str]) -> int | None:
    """The run's epochs from ``--epochs N`` / ``--epochs=N`` (last one wins), if given."""
    found = [int(n) for n in _EPOCHS.findall(" ".join(command) + " ")]
    return found[-1] if found and found[-1] > 0 else None


def window(spec: JobSpec, run: Run, *, start_step: int) -> tuple[int | None, float | None]:
    """Where a new attempt's profile ends: (step, seconds after launch); both None when
    it is not profiled (profile disabled, or the run has its projection)."""
    profile = spec.profile
    if not profile.enabled or run.projection:
        return None, None
    seconds = profile.minutes * 60.0 if profile.minutes is not None else None
    steps = profile.steps
    if steps is None and seconds is None:
        target, n = run.target_steps, epochs(spec.command)
        if target and n:
            steps = max(1, target // n)
        elif target:
            steps = max(1, target // 10)
        else:
            seconds = DEFAULT_MINUTES * 60.0
    return (start_step + steps if steps is not None else None), seconds


def projection_reasons(
    spec: JobSpec,
    *,
    cost_usd: float | None,
    budget_usd: float | None,
    hours_in_all: float | None,
    gpu_util: float | None,
    data_wait: float | None,
) -> list[str]:
    """Why the run should stop and ask, in words; empty: it goes on."""
    reasons: list[str] = []
    if cost_usd is not None and budget_usd and cost_usd > budget_usd:
        reasons.append(f"it would cost ${cost_usd:,.2f}, past its budget of ${budget_usd:,.2f}")
    if hours_in_all is not None and spec.max_hours is not None and hours_in_all > spec.max_hours:
        reasons.append(
            f"it would run {hours_in_all:.1f} h, past its max_hours of {spec.max_hours:g}"
        )
    if data_wait is not None:
        cfg = spec.alerts
        if gpu_util is not None and gpu_util < cfg.low_util_percent and data_wait > INPUT_BOUND:
            reasons.append(
                f"the GPU is {gpu_util:.0f}% busy and {data_wait:.0%} of each step waits for "
                "data: the input pipeline is the bottleneck"
            )
        elif gpu_util is None and data_wait > cfg.data_wait_fraction:
            reasons.append(
                f"{data_wait:.0%} of each step waits for data: the input pipeline is the bottleneck"
            )
    return reasons


def project(deps: Deps, attempt_id: str) -> ProjectionMessage | None:
    """Make the run's projection from its profiled attempt, post it, and stop the run at
    a checkpoint to ask when it should not go on (``stopped``: the caller ends the
    attempt, :func:`jobs.runs.end.project_then_stop`). None when there is nothing to project
    (the run ended, or has its projection)."""
    now = deps.clock()
    with session_scope(deps.engine) as session:
        attempt = session.get(Attempt, attempt_id)
        run = session.get(Run, attempt.run_id) if attempt is not None else None
        if attempt is None or run is None or run.projection or run.state.is_terminal():
            return None
        if attempt.state.is_terminal():
            return None
        spec = spec_of(run)
        msg = _message(deps, session, run, attempt, spec, now=now)
        ask = bool(msg.reasons) and spec.profile.ask
        msg = replace(msg, stopped=ask)
        run.projection = {**_figures(msg), "asked": ask, "made_at": now.isoformat()}
        deps.journal.record("projection", run.id, attempt=attempt.number, **run.projection)
        deps.notifier.post(msg)
        if ask:
            reason = "profile: " + "; ".join(msg.reasons) + "; waiting for Continue or Stop"
            move_run(session, run, RunState.STOPPED, now=now, reason=reason)
            deps.journal.record(
                "run_finished", run.id, state="STOPPED", by="trainbot", reason=reason
            )
            refresh_card(deps, session, run)
        session.add(run)
    return msg


def _message(
    deps: Deps, session: Session, run: Run, attempt: Attempt, spec: JobSpec, *, now: datetime
) -> ProjectionMessage:
    points = run_metrics(session.connection(), run.id, attempt_id=attempt.id, limit=_MAX_POINTS)
    step_times = [
        float(t)
        for p in points
        if isinstance(t := p.data.get("step_time_s"), int | float) and math.isfinite(t) and t > 0
    ]
    waits = [
        float(w)
        for p in points
        if isinstance(w := p.data.get("data_wait_fraction"), int | float) and math.isfinite(w)
    ]
    utils = [
        float(u)
        for data in session.exec(
            select(EventRow.data).where(
                EventRow.attempt_id == attempt.id, EventRow.type == "system"
            )
        ).all()
        if isinstance(data, dict) and isinstance(u := data.get("gpu_util"), int | float)
    ]
    step_time = statistics.median(step_times) if step_times else attempt.step_time_s
    data_wait = statistics.fmean(waits) if waits else None
    gpu_util = statistics.fmean(utils) if utils else None
    step = run.last_step or attempt.last_step or 0
    remaining = max(0, run.target_steps - step) if run.target_steps else None
    price = (attempt.price_per_hour or 0.0) * attempt.instances
    interval = run.checkpoint_interval_s
    compute_s = remaining * step_time if remaining is not None and step_time else None
    preemptions = lost_s = None
    if compute_s is not None:
        mtbp = deps.settings.assumed_mtbp_s or preflight.assumed_mtbp_s(
            deps.providers.get(attempt.provider, deps.provider)
        )
        preemptions = compute_s / mtbp if attempt.spot else 0.0
        # Each preemption loses half an interval on average, and the start-up this attempt
        # measured (launch to its first step) again.
        first = points[0].time if points else None
        started = attempt.started_at.timestamp() if attempt.started_at else None
        startup = max(0.0, first - started) if first is not None and started is not None else 0.0
        lost_s = preemptions * ((interval or 0.0) / 2 + startup)
    hours_left = (compute_s + (lost_s or 0.0)) / 3600 if compute_s is not None else None
    spent = run_spent(session, run.id)
    cost = spent + hours_left * price if hours_left is not None else None
    hours_in_all = run_hours(session, run, now=now) + (hours_left or 0.0)
    reasons = projection_reasons(
        spec,
        cost_usd=cost,
        budget_usd=run.budget_usd,
        hours_in_all=hours_in_all if hours_left is not None else None,
        gpu_util=gpu_util,
        data_wait=data_wait,
    )
    suggested = None
    if cost is not None and run.budget_usd and cost > run.budget_usd:
        suggested = float(math.ceil(cost * 1.1))  # the projection, with a tenth to spare
    return ProjectionMessage(
        channel=channel_of(run),
        thread_ts=run.thread_ts,
        run_id=run.id,
        zone=attempt.zone or attempt.region,
        step=step,
        target_steps=run.target_steps,
        step_time_s=step_time,
        data_wait=data_wait,
        gpu_util=gpu_util,
        finish_at=now + timedelta(hours=hours_left) if hours_left is not None else None,
        hours_left=hours_left,
        cost_usd=cost,
        spent_usd=spent,
        budget_usd=run.budget_usd,
        max_hours=spec.max_hours,
        reasons=tuple(reasons),
        price_per_hour=price,
        preemptions=preemptions,
        lost_s=lost_s,
        interval_s=interval,
        suggested_budget_usd=suggested,
    )


def _figures(msg: ProjectionMessage) -> dict[str, object]:
    """The projection as stored on the run (JSON-able)."""
    return {
        "step": msg.step,
        "step_time_s": msg.step_time_s,
        "data_wait": msg.data_wait,
        "gpu_util": msg.gpu_util,
        "hours_left": msg.hours_left,
        "cost_usd": msg.cost_usd,
        "budget_usd": msg.budget_usd,
        "finish_at": msg.finish_at.isoformat() if msg.finish_at else None,
        "preemptions": msg.preemptions,
        "lost_s": msg.lost_s,
        "interval_s": msg.interval_s,
        "price_per_hour": msg.price_per_hour,
        "reasons": list(msg.reasons),
        "suggested_budget_usd": msg.suggested_budget_usd,
    }
