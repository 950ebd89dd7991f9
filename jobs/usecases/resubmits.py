"""Resubmitting a run: ``/train resubmit``, in one place.

:func:`resubmit` is the use-case the front ends call (through :mod:`jobs.usecases.service`). A run
awaiting confirmation is confirmed, a recovering one gets its next attempt now, and a
run that is over (stopped, failed, stopped at its budget cap) gets a new run
(:func:`successor`) that carries the spend so far and resumes the newest checkpoint, or
a copy of the one at or before a step (:func:`resubmit_from`), and may change its spec
on the way (:func:`resubmit_changed`): the changes are validated as a launch's overrides
are, the checks they need run again, and both threads record old → new and who changed
it (an ``env`` key only as changed, added or removed: its value may be a credential).

The next attempt of the *same* run (after a preemption, or an exit code the spec lists)
is the run's recovery, :mod:`jobs.runs.recovery`: a recovering run's resubmit asks it
for that attempt now, rather than launching one itself, so that it is recorded and
reported as the one the backoff would have launched.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlmodel import Session

from jobs import preflight, spend
from jobs.database.db import detach, session_scope
from jobs.database.models import Run, new_id
from jobs.domain import format as fmt
from jobs.domain.actor import Actor, may_touch
from jobs.domain.errors import ConflictError, SpecError
from jobs.domain.lifecycle import RunState
from jobs.domain.locations import check_prefix, checkpoint_root
from jobs.process.deps import Deps
from jobs.runs import (
    budget_then_launch,
    card,
    checkpoint_prefix,
    get_run,
    move_run,
    next_attempt_now,
    refresh_card,
    run_hours,
    say,
    spec_of,
)
from jobs.runs.start import confirm, preflight_then_launch
from jobs.spec.changes import (
    Change,
    apply_changes,
    change_record,
    changed_paths,
    checks_for,
    hidden_change,
)
from jobs.usecases.code_pin import pin_code, short_commit
from runner.errors import RunnerError
from runner.layout import copy_step, list_committed
from runner.store import run_store

__all__ = [
    "FINISHED",
    "copy_then_launch",
    "describe_changes",
    "raise_budget",
    "resubmit",
    "resubmit_changed",
    "resubmit_from",
    "successor",
]

#: The states a run is over in, that a resubmit starts a successor of.
FINISHED = (RunState.STOPPED, RunState.FAILED, RunState.BUDGET_EXCEEDED)


def resubmit(
    deps: Deps,
    run_id: str,
    actor: Actor,
    *,
    budget_usd: float | None = None,
    from_step: int | None = None,
    overrides: Sequence[str] = (),
    max_price: float | None = None,
) -> Run:
    """Launch a run again from its newest checkpoint (or confirm one awaiting it).

    The budget goes on: a finished run's resubmit carries its spend, and one whose hard
    cap is reached stays stopped unless ``budget_usd`` raises the budget, which is
    recorded with who raised it (the cap would otherwise be walked around by resubmitting).

    ``from_step``: resume from the newest committed checkpoint at or before that step
    instead (the offer after a divergence); see :func:`resubmit_from`.

    ``overrides`` (``key.path=value``) and ``max_price`` (``resubmit.max_price``) change
    the spec of the new run; see :func:`resubmit_changed`.
    """
    if budget_usd is not None and not 0 < budget_usd < float("inf"):
        raise SpecError(f"budget.usd must be a positive number of dollars (got {budget_usd})")
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        may_touch(actor, run)
        state = run.state
    changes = [*overrides, *([f"resubmit.max_price={max_price}"] if max_price else [])]
    if from_step is not None and changes:
        raise SpecError(
            "from= and changes go one at a time: resubmit from the step first, then stop "
            "that run and resubmit it with the changes"
        )
    if from_step is not None:
        return resubmit_from(deps, run_id, actor, from_step=from_step, budget_usd=budget_usd)
    if changes:
        return resubmit_changed(deps, run_id, actor, overrides=changes, budget_usd=budget_usd)
    if state in (RunState.AWAITING_CONFIRMATION, RunState.RECOVERING) and budget_usd is not None:
        with session_scope(deps.engine) as session:
            run = get_run(session, run_id)
            spent = spend.run_spent(session, run_id)
            raise_budget(deps, run, budget_usd, actor=actor, was=run.budget_usd, spent=spent)
            session.add(run)
    if state == RunState.AWAITING_CONFIRMATION:
        return confirm(deps, run_id, actor)
    if state not in (
        RunState.STOPPED,
        RunState.FAILED,
        RunState.BUDGET_EXCEEDED,
        RunState.RECOVERING,
    ):
        raise ConflictError(
            f"{run_id} is {state.value}; only a stopped, failed or recovering run "
            "can be resubmitted"
        )
    if state != RunState.RECOVERING:
        # A finished run is final: resubmitting starts a new run that resumes its checkpoints.
        with session_scope(deps.engine) as session:
            old = get_run(session, run_id)
            run, carried = successor(
                deps,
                session,
                old,
                actor=actor,
                budget_usd=budget_usd,
                # The new run resumes the old run's checkpoints: same store directory.
                prefix=checkpoint_prefix(old),
                step=old.last_committed_step,
                reason=f"resubmit of {old.id}",
            )
            budget = run.budget_usd
            if budget_usd is None and budget is not None and carried > 0:
                say(
                    deps,
                    run,
                    "info",
                    f"{run.id} continues {old.id}: {fmt.usd(carried)} of its "
                    f"{fmt.usd(budget)} budget is already spent.",
                )
            thresholds = spec_of(run).budget.thresholds
            detach(session, run)
        # A new run: its own cloud budget, as every way into LAUNCHING gets.
        deps.background(budget_then_launch, deps, run.id, budget=budget, thresholds=thresholds)
        return run
    deps.background(next_attempt_now, deps, run_id)
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        detach(session, run)
        return run


def resubmit_from(
    deps: Deps, run_id: str, actor: Actor, *, from_step: int, budget_usd: float | None
) -> Run:
    """A new run that resumes a finished run from the newest checkpoint at or before
    ``from_step``.

    The new run gets its own checkpoint directory, and the chosen checkpoint is copied
    into it (in the background, before the launch), so that "newest" there can never be
    a later step of the run it continues: the diverged run's checkpoints stay where they
    were, untouched, for debugging. Its first attempt is also told the step
    (``TRAINBOT_RESUME_MAX_STEP``), so the runner restores it even from a shared store.
    """
    if from_step < 0:
        raise SpecError(f"from= takes a step number, 0 or more (got {from_step})")
    with session_scope(deps.engine) as session:
        old = get_run(session, run_id)
        if old.state not in (RunState.STOPPED, RunState.FAILED, RunState.BUDGET_EXCEEDED):
            raise ConflictError(
                f"{run_id} is {old.state.value}; only a stopped or failed run can be "
                f"resubmitted from a step. Stop it first: /train stop {run_id}"
            )
        last = old.last_committed_step
        if last is None:
            raise ConflictError(
                f"{run_id} has no committed checkpoint to resume from step {from_step}: "
                f"launch it again instead"
            )
        if from_step > last:
            raise ConflictError(
                f"step {from_step} is past {run_id}'s last committed checkpoint (step {last}); "
                f"give from={last} or less, or resubmit without from= to resume from step {last}"
            )
        root = checkpoint_root(
            old.checkpoint_uri,
            default=deps.settings.checkpoint_uri,
            allowed=deps.settings.checkpoint_locations,
        )
        src_prefix = check_prefix(checkpoint_prefix(old))
    src = run_store(root, src_prefix)
    try:
        committed = [e.step for e in list_committed(src)]
    except RunnerError as exc:
        raise ConflictError(
            f"cannot list {run_id}'s checkpoints in {src.uri} to resume from step "
            f"{from_step}: {exc}"
        ) from exc
    chosen = max((step for step in committed if step <= from_step), default=None)
    if chosen is None:
        have = ", ".join(str(step) for step in committed[:10]) or "none"
        raise ConflictError(
            f"{run_id} has no committed checkpoint at or before step {from_step} "
            f"(its checkpoints: {have}); give a later step"
        )
    later = [step for step in committed if step > chosen]
    with session_scope(deps.engine) as session:
        old = get_run(session, run_id)
        run, _ = successor(
            deps,
            session,
            old,
            actor=actor,
            budget_usd=budget_usd,
            # Its own directory (no prefix): the chosen step is copied there.
            prefix=None,
            step=chosen,
            reason=f"resubmit of {old.id} from step {chosen}",
        )
        deps.journal.record(
            "resubmitted_from",
            run.id,
            from_run=old.id,
            from_step=chosen,
            asked_step=from_step,
            later_steps_kept=later,
            by=actor.user,
        )
        kept = (
            f" {old.id}'s later checkpoints (steps {', '.join(map(str, later))}) stay in "
            f"its own directory, for debugging."
            if later
            else ""
        )
        say(
            deps,
            run,
            "info",
            f"{actor.user} resubmitted {old.id} from step {chosen}"
            + (
                f" (the newest checkpoint at or before step {from_step})"
                if chosen != from_step
                else ""
            )
            + f": {run.id} starts from a copy of that checkpoint.{kept}",
        )
        say(deps, old, "info", f"{actor.user} resubmitted {old.id} from step {chosen} as {run.id}.")
        detach(session, run)
    deps.background(copy_then_launch, deps, run.id, src_prefix=src_prefix, step=chosen)
    return run


def copy_then_launch(deps: Deps, run_id: str, *, src_prefix: str, step: int) -> None:
    """Copy the chosen checkpoint into the new run's own directory, then launch it; a
    failed copy fails the run, saying why, rather than launching it from nothing."""
    with session_scope(deps.engine) as session:
        run = get_run(session, run_id)
        root = checkpoint_root(
            run.checkpoint_uri,
            default=deps.settings.checkpoint_uri,
            allowed=deps.settings.checkpoint_locations,
        )
        dst_prefix = check_prefix(checkpoint_prefix(run))
        budget, thresholds = run.budget_usd, spec_of(run).budget.thresholds
    try:
        copy_step(run_store(root, src_prefix), run_store(root, dst_prefix), step)
    except RunnerError as exc:
        with session_scope(deps.engine) as session:
            run = get_run(session, run_id)
            reason = f"could not copy checkpoint step {step} from {src_prefix}: {exc}"
            move_run(session, run, RunState.FAILED, now=deps.clock(), reason=reason)
            deps.journal.record("run_finished", run.id, state="FAILED", reason=reason)
            say(deps, run, "error", f"Run {run.id} failed: {reason}.")
            refresh_card(deps, session, run)
        return
    budget_then_launch(deps, run_id, budget=budget, thresholds=thresholds)


def successor(
    deps: Deps,
    session: Session,
    old: Run,
    *,
    actor: Actor,
    budget_usd: float | None,
    prefix: str | None,
    step: int | None,
    reason: str,
    spec: dict[str, Any] | None = None,
    checks: bool = False,
    profiled: bool = True,
) -> tuple[Run, float]:
    """Create the run that continues ``old``, move it to launching (to preflight when
    ``checks`` must run first) and post its card.

    ``spec``: its spec when the resubmit changes it (the old run's otherwise).
    ``profiled``: it keeps the old run's projection and is not profiled again (a change
    of where or what it runs on measures anew). Its budget counts what the runs before
    it spent; returns the run and that spend.
    """
    now = deps.clock()
    spend.accrue(session, now=now)  # the old run's last attempt, to its end
    carried, budget = spend.resubmit_budget(session, old, raised_usd=budget_usd)
    hours = run_hours(session, old, now=now)  # max_hours counts them, as the cap the spend
    run = Run(
        id=new_id("r"),
        spec_name=old.spec_name,
        spec=old.spec if spec is None else spec,
        requester=actor.user,
        channel=old.channel,
        checkpoint_uri=old.checkpoint_uri,
        checkpoint_prefix=prefix,
        budget_usd=budget,
        carried_usd=round(carried, 6) or None,
        carried_hours=round(hours, 6) or None,
        budget_raised_by=old.budget_raised_by,
        target_steps=old.target_steps,
        last_committed_step=step,
        checkpoint_interval_s=old.checkpoint_interval_s,
        projection={**old.projection, "carried_from": old.id}
        if profiled and old.projection
        else None,
        created_at=now,
        updated_at=now,
    )
    session.add(run)
    session.flush()
    asked = old.projection or {}
    if asked.get("asked") and not asked.get("answer"):
        # A resubmit answers the projection's question as Continue would: its button
        # must not start a second run.
        answer = {"choice": "continue", "by": actor.user, "at": now.isoformat(), "as": run.id}
        old.projection = {**asked, "answer": answer}
        session.add(old)
    move_run(session, run, RunState.PREFLIGHT, now=now, reason=reason if checks else None)
    if not checks:
        move_run(session, run, RunState.LAUNCHING, now=now, reason=reason)
    ref = deps.notifier.post(card(session, run))
    run.thread_ts = ref.ts
    session.add(run)
    session.flush()
    if budget_usd is not None:
        raise_budget(deps, run, budget_usd, actor=actor, was=old.budget_usd, spent=carried)
        session.add(run)
    return run, carried


def raise_budget(
    deps: Deps, run: Run, usd: float, *, actor: Actor, was: float | None, spent: float
) -> None:
    """Set a run's budget from ``budget.usd=`` on a resubmit, as if the spec had said it
    (so a hard cap applies to it), and record who raised it: on the run, in the journal
    and in the run's thread."""
    run.budget_usd = usd
    run.budget_raised_by = actor.user
    run.spec = {**run.spec, "budget": {**(run.spec.get("budget") or {}), "usd": usd}}
    deps.journal.record(
        "budget_raised", run.id, usd=usd, was_usd=was, by=actor.user, spent_usd=round(spent, 2)
    )
    say(
        deps,
        run,
        "info",
        f"{actor.user} set the budget of {run.id} to {fmt.usd(usd)} (was {fmt.usd(was)}); "
        f"{fmt.usd(spent)} is already spent.",
    )


def resubmit_changed(
    deps: Deps,
    run_id: str,
    actor: Actor,
    *,
    overrides: Sequence[str],
    budget_usd: float | None,
) -> Run:
    """A new run that resumes a finished run's newest checkpoint with its spec changed.

    The changes are checked as a launch's overrides are (the keys a resubmit may change,
    reserved env, bounded values); the old run's checkpoint location is checked again,
    since the new run reads it. The checks the changes need run before it launches (a
    new region: quota, capacity, data locality; new env or command: none).
    """
    with session_scope(deps.engine) as session:
        old = get_run(session, run_id)
        may_touch(actor, old)
        if old.state not in FINISHED:
            raise ConflictError(
                f"{run_id} is {old.state.value}; stop it first (/train stop {run_id}): its "
                "runner flushes a checkpoint, and the resubmit with your changes resumes "
                "from it"
            )
        spec = apply_changes(old.spec, overrides, name=old.spec_name)
        # A new code.ref is pinned to its commit now, as at a submit; otherwise the run
        # keeps the commit it had.
        keys = {text.partition("=")[0].strip() for text in overrides}
        spec = pin_code(spec, again=any(k == "code" or k.startswith("code.") for k in keys))
        new_spec = spec.model_dump(mode="json")
        changes = changed_paths(old.spec, new_spec)
        checkpoint_root(
            old.checkpoint_uri,
            default=deps.settings.checkpoint_uri,
            allowed=deps.settings.checkpoint_locations,
        )
        prefix = check_prefix(checkpoint_prefix(old))
        checks = checks_for(changes)
        # A new place or a new command measures anew: it is profiled again.
        moved = any(k.startswith("resources.") or k == "command" for k, _, _ in changes)
        run, _ = successor(
            deps,
            session,
            old,
            spec=new_spec,
            checks=bool(checks),
            profiled=not moved,
            actor=actor,
            budget_usd=budget_usd,
            prefix=prefix,
            step=old.last_committed_step,
            reason=f"resubmit of {old.id} with changes",
        )
        run.target_steps = preflight.target_steps(spec.command)
        session.add(run)
        listed = [change_record(change) for change in changes]
        deps.journal.record(
            "resubmit_changed", run.id, from_run=old.id, by=actor.user, changes=listed,
            checks=list(checks), step=old.last_committed_step,
        )  # fmt: skip
        what = describe_changes(changes)
        again = f" Checking {', '.join(checks)} again before it launches." if checks else ""
        resume = (
            f"from step {old.last_committed_step}"
            if old.last_committed_step is not None
            else "from the start (no checkpoint was committed)"
        )
        say(
            deps, run, "info",
            f"{actor.user} resubmitted {old.id} as {run.id}, resuming {resume}, with "
            f"{what}.{again}",
        )  # fmt: skip
        say(deps, old, "info", f"{actor.user} resubmitted {old.id} as {run.id} with {what}.")
        detach(session, run)
    if checks:
        deps.background(preflight_then_launch, deps, run.id, checks=checks)
    else:
        # A new run: its own cloud budget, as every way into LAUNCHING gets.
        thresholds = spec_of(run).budget.thresholds
        deps.background(
            budget_then_launch, deps, run.id, budget=run.budget_usd, thresholds=thresholds
        )
    return run


def describe_changes(changes: Sequence[Change]) -> str:
    """``env.LR changed; resources.zones: [us-east-1a] → [us-east-1b]``: an ``env`` value
    is never shown (it may be a credential), only that it changed."""
    if not changes:
        return "no changes (every value given is what it was)"
    parts = [_described(change) for change in changes[:20]]
    more = f"; and {len(changes) - 20} more" if len(changes) > 20 else ""
    return "changes " + "; ".join(parts) + more


def _described(change: Change) -> str:
    key, old, new = change
    if key == "code.commit":
        return f"code: {short_commit(old)} → {short_commit(new)}"
    hidden = hidden_change(change)
    return f"{key} {hidden}" if hidden else f"{key}: {_shown(old)} → {_shown(new)}"


def _shown(value: Any) -> str:
    if value is None:
        return "(unset)"
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."
