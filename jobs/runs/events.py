"""What a runner event does to its attempt and run, once the ingest API has stored it.

``started`` moves the run to RUNNING, ``exit`` ends the attempt
(:func:`jobs.runs.end.end_attempt`); the rest are told to the run's thread and journal.
"""

from __future__ import annotations

from typing import Any

from jobs.database.db import session_scope
from jobs.database.models import Attempt, Run
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.domain.output import env_values, redact_output
from jobs.outbound.notify import TextMessage
from jobs.process.deps import Deps
from jobs.runs.cards import refresh_card, say
from jobs.runs.end import end_attempt
from jobs.runs.rows import channel_of, move_run

#: The runner events the journal keeps as they are, with the fields of theirs it keeps.
_JOURNALED: dict[str, tuple[str, ...]] = {
    "checkpoint_committed": ("step", "bytes", "write_s"),
    "preemption_notice": ("source", "time_left_s"),
}


def _journal(deps: Deps, run: Run, attempt: Attempt, type_: str, data: dict[str, Any]) -> None:
    fields = {name: data.get(name) for name in _JOURNALED[type_]}
    deps.journal.record(type_, run.id, attempt=attempt.number, **fields)


def on_attempt_event(deps: Deps, attempt_id: str, type_: str, data: dict[str, Any]) -> None:
    """React to a runner event that the ingest API has stored."""
    now = deps.clock()
    ended: tuple[AttemptState, int | None, str] | None = None
    log_tail: str | None = None
    with session_scope(deps.engine) as session:
        attempt = session.get(Attempt, attempt_id)
        run = session.get(Run, attempt.run_id) if attempt else None
        if attempt is None or run is None:
            return
        if type_ == "started" and run.state in (RunState.LAUNCHING, RunState.RECOVERING):
            move_run(session, run, RunState.RUNNING, now=now)
            refresh_card(deps, session, run)
        elif type_ == "restored":
            step = int(data.get("step") or 0)
            if step > 0 and attempt.started_at is not None:
                # Booting and restoring a resumed attempt is paid time that makes no progress.
                attempt.lost_seconds += max(0.0, (now - attempt.started_at).total_seconds())
                session.add(attempt)
            if step > 0:
                deps.journal.record("resumed", run.id, attempt=attempt.number, step=step)
                say(deps, run, "resumed", f"Attempt {attempt.number} resumed at step {step}.")
        elif type_ == "checkpoint_committed":
            _journal(deps, run, attempt, type_, data)
            refresh_card(deps, session, run)
        elif type_ == "preemption_notice" and run.state.is_terminal():
            # We stopped it (a person, the budget cap): the SIGTERM its runner saw is ours.
            say(
                deps,
                run,
                "stopping",
                f"Attempt {attempt.number} is stopping: its runner flushes a checkpoint first.",
            )
        elif type_ == "preemption_notice":
            _journal(deps, run, attempt, type_, data)
            left = data.get("time_left_s")
            say(
                deps,
                run,
                "preempted",
                f"Preemption notice for attempt {attempt.number} ({data.get('source')}); "
                + (f"{left:.0f} s to flush a checkpoint." if isinstance(left, int | float) else ""),
            )
        elif type_ == "log" and data.get("level") in ("warning", "error"):
            # The runner's own warnings (a script under exec that wrote nothing it could
            # sync, say) are for the people watching the run, not only its log.
            message = str(data.get("message") or "")
            # Its text names the script's files: never markup (no <!channel> from a name).
            message = message.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            if len(message) > 1500:
                message = message[:1500] + f"… ({len(message)} characters)"
            deps.journal.record("runner_warning", run.id, attempt=attempt.number)
            # One message per run, edited with a count: a batch of 300 warnings is one
            # line in the thread, not five minutes of the channel's Slack queue.
            deps.notifier.post(
                TextMessage(
                    channel=channel_of(run),
                    thread_ts=run.thread_ts,
                    kind="warning",
                    text=f"Attempt {attempt.number}: {message}",
                    run_id=run.id,
                    fold=f"runner-warnings:{run.id}",
                )
            )
        elif type_ == "exit":
            code = int(data.get("code", 1))
            reason = str(data.get("reason", "failed"))
            state = {
                "succeeded": AttemptState.SUCCEEDED,
                "preempted": AttemptState.PREEMPTED,
                "stopped": AttemptState.TERMINATED,
            }.get(reason, AttemptState.FAILED)
            ended = (state, code, f"runner exited {code} ({reason})")
            if reason == "setup_failed":
                # Its own end: the command never ran, and another instance would fail alike.
                first = str(data.get("log_tail") or "").partition("\n")[0].strip()
                detail = first[:300] or "a setup command failed"
                ended = (
                    state,
                    code,
                    f"setup failed: {detail}; fix the spec's setup (or code) and resubmit",
                )
            if reason == "secret_unavailable":
                # Its own end too: the instance's role cannot read a secret of the spec.
                first = str(data.get("log_tail") or "").partition("\n")[0].strip()
                detail = first[:300] or "a secret could not be read"
                ended = (
                    state,
                    code,
                    f"secret unavailable: {detail}; create it or let the instance role "
                    "read it, then resubmit",
                )
            if reason == "image_unavailable":
                # Its own end: the spec's image cannot run on such an instance.
                first = str(data.get("log_tail") or "").partition("\n")[0].strip()
                detail = first[:300] or "the container image could not run"
                ended = (state, code, f"image unavailable: {detail}")
            tail = data.get("log_tail")
            if isinstance(tail, str) and tail:
                log_tail = redact_output(tail, env_values(run.spec))
    if ended is not None:
        end_attempt(
            deps,
            attempt_id,
            state=ended[0],
            exit_code=ended[1],
            reason=ended[2],
            log_tail=log_tail,
        )
