"""What a committed batch's new events change on their attempt and run.

Heartbeat, last seq and step, step time, ``started`` → ``RUNNING``, the preemption
notice, the restored step, committed checkpoints and the run's progress: applied in the
batch's transaction, so the facts derived from events never disagree with the events
stored.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine, bindparam, case, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite

from jobs.database.models import Attempt, Checkpoint, Run, table_of
from jobs.domain.errors import IllegalTransition
from jobs.domain.lifecycle import AttemptState, transition
from jobs.ingest.windows import Point
from jobs.ingest.writers import event_datetime
from runner.wire import Batch, Event, json_safe

log = logging.getLogger(__name__)

_ATTEMPTS = table_of(Attempt)
_RUNS = table_of(Run)
_CHECKPOINTS = table_of(Checkpoint)


@dataclass
class Applied:
    """What one committed batch changed, for the callbacks and the rules."""

    accepted: int
    duplicates: int
    run_id: str
    attempt_number: int
    #: New events of LIFECYCLE_EVENTS types, in seq order.
    lifecycle: list[Event] = field(default_factory=list)
    #: New observations for the rules, per event type: (time, data), in seq order.
    observations: dict[str, list[Point]] = field(default_factory=dict)
    #: New alerts the training script raised (``session.alert``): (time, data).
    script_alerts: list[Point] = field(default_factory=list)
    last_step: int | None = None
    last_committed_step: int | None = None
    budget_usd: float | None = None
    preemption_times: tuple[float, ...] = ()
    max_time: float = 0.0
    #: The attempt's profile window ended with this batch (``jobs.runs.profile``): the
    #: projection is due, once.
    profile_due: bool = False


@dataclass
class Changes:
    """What a batch's new events change on its attempt and run, worked out before anything
    is written, so that each database writes them its own way."""

    #: The parameters of the attempt's UPDATE (``Effects._update_attempt``): None leaves a
    #: column as it is.
    attempt: dict[str, Any]
    #: ``checkpoints`` rows to upsert, one per step (the last report of a step wins).
    checkpoints: list[dict[str, Any]]
    #: The run's step and last committed step to move forward to (None: no change).
    top_step: int | None
    top_committed: int | None
    #: The attempt's profile window ended with this batch (it is marked once, after).
    profile_ended: bool


class Outcome(NamedTuple):
    """What the rules need of the run after the batch's writes."""

    last_step: int | None
    last_committed_step: int | None
    budget_usd: float | None
    #: When the run's preempted or lost attempts ended (unix seconds).
    preemption_times: tuple[float, ...]


class Effects:
    """The statements that apply a batch's side effects, built once per engine so that
    SQLAlchemy compiles each once."""

    def __init__(self, engine: Engine) -> None:
        postgres = engine.dialect.name == "postgresql"
        attempts = _ATTEMPTS.c
        runs = _RUNS.c
        self._read_run = select(runs.last_step, runs.last_committed_step, runs.budget_usd).where(
            runs.id == bindparam("run_id")
        )
        self._preemptions = select(attempts.ended_at).where(
            attempts.run_id == bindparam("run_id"),
            # Not in_(): an expanding IN is re-rendered on every execution.
            or_(attempts.state == AttemptState.PREEMPTED, attempts.state == AttemptState.LOST),
            attempts.ended_at.is_not(None),
        )

        def keep(name: str, col: Any) -> Any:
            """SET col = COALESCE(:name, col): a NULL parameter leaves the column as it is."""
            return func.coalesce(bindparam(name, type_=col.type), col)

        # One statement for every batch, so SQLAlchemy compiles it once; building the
        # UPDATE from the changed columns cost a compilation-cache look-up of a new
        # statement per batch, five times the price of executing it.
        self._update_attempt = (
            update(_ATTEMPTS)
            .where(attempts.id == bindparam("attempt_id"))
            .values(
                last_heartbeat=bindparam("p_now", type_=attempts.last_heartbeat.type),
                last_seq=bindparam("p_last_seq", type_=attempts.last_seq.type),
                last_step=keep("p_last_step", attempts.last_step),
                step_time_s=keep("p_step_time_s", attempts.step_time_s),
                resumed_from_step=keep("p_resumed_from_step", attempts.resumed_from_step),
                started_at=keep("p_started_at", attempts.started_at),
                preemption_notice_at=keep("p_notice_at", attempts.preemption_notice_at),
                state=keep("p_state", attempts.state),
            )
        )
        # Untyped: the rows arrive already in the database's form (JSON text, and times
        # as the text of SQLite's DATETIME or a timestamptz literal; see writers.time_texts),
        # which keeps the per-row Python to the minimum; this is the hot path.
        dialect_insert = postgresql.insert if postgres else sqlite.insert
        ckpt_insert = dialect_insert(_CHECKPOINTS)
        self._upsert_checkpoint = ckpt_insert.on_conflict_do_update(
            index_elements=["run_id", "step"],
            set_={
                "attempt_id": ckpt_insert.excluded.attempt_id,
                "uri": ckpt_insert.excluded.uri,
                "bytes": ckpt_insert.excluded.bytes,
                "committed_at": ckpt_insert.excluded.committed_at,
                "metrics": ckpt_insert.excluded.metrics,
                "deleted_at": None,
            },
        )

        # Rare: once per profiled attempt. The WHERE makes it once even if two batches race.
        self._mark_profiled = (
            update(_ATTEMPTS)
            .where(attempts.id == bindparam("attempt_id"), attempts.profiled_at.is_(None))
            .values(profiled_at=bindparam("p_now", type_=attempts.profiled_at.type))
        )

        # Both run columns in one statement; a NULL parameter leaves its column as it is,
        # and neither ever moves back.
        def forward(name: str, col: Any) -> Any:
            value = bindparam(name, type_=col.type)
            return case(
                (value.is_(None), col),
                (col.is_(None), value),
                (col < value, value),
                else_=col,
            )

        self._update_run = (
            update(_RUNS)
            .where(runs.id == bindparam("run_id"))
            .values(
                last_step=forward("p_step", runs.last_step),
                last_committed_step=forward("p_committed", runs.last_committed_step),
            )
        )
        # What the rules need of the run comes back from the same statement where the
        # database can (PostgreSQL; SQLite 3.35 and newer): one statement less a batch.
        self._update_returns = bool(engine.dialect.update_returning)
        if self._update_returns:
            self._update_run = self._update_run.returning(
                runs.last_step, runs.last_committed_step, runs.budget_usd
            )

    def changes(
        self,
        attempt: Any,
        new: Batch,
        *,
        steps: list[int],
        step_times: list[float],
        applied: Applied,
        now: datetime,
        node: int = 0,
    ) -> Changes:
        """What the new events change on the attempt and run (nothing is written yet).
        ``node``: a multi-node attempt's node that sent them; the attempt's high-water seq
        is node 0's (the others' batches are always checked for repeats)."""
        run_id, attempt_id = applied.run_id, new.attempt
        top_seq = attempt.last_seq if node else max(new.seqs)
        top_step = max(steps) if steps else None
        # The attempt row is locked (FOR UPDATE / BEGIN IMMEDIATE): what was read is current.
        # None leaves a column as it is (see _update_attempt).
        values: dict[str, Any] = {
            "attempt_id": attempt_id,
            "p_now": now,
            "p_last_seq": top_seq
            if attempt.last_seq is None or top_seq is None
            else max(attempt.last_seq, top_seq),
            "p_last_step": top_step
            if top_step is not None and (attempt.last_step is None or top_step > attempt.last_step)
            else None,
            "p_step_time_s": statistics.median(step_times) if step_times else None,
            "p_resumed_from_step": None,
            "p_started_at": None,
            "p_notice_at": None,
            "p_state": None,
        }
        state = attempt.state
        committed: dict[int, dict[str, Any]] = {}
        for event in applied.lifecycle:
            kind, data = event.type, event.data
            if kind == "started":
                state = self._started(state, attempt_id)
                if attempt.started_at is None and values["p_started_at"] is None:
                    values["p_started_at"] = event_datetime(event.time)
            elif kind == "restored":
                values["p_resumed_from_step"] = data["step"]
            elif kind == "preemption_notice" and attempt.preemption_notice_at is None:
                if values["p_notice_at"] is None:
                    values["p_notice_at"] = event_datetime(event.time)
            elif kind == "checkpoint_committed":
                # The last report of a step wins, as a later upsert of it would.
                committed.pop(data["step"], None)
                committed[data["step"]] = self._checkpoint(event, new, run_id, attempt_id)
        if state != attempt.state:
            values["p_state"] = state
        return Changes(
            attempt=values,
            checkpoints=list(committed.values()),
            top_step=top_step,
            top_committed=max(committed) if committed else None,
            profile_ended=attempt.profiled_at is None
            and _profile_ended(attempt, top_step, applied.max_time),
        )

    @staticmethod
    def _checkpoint(event: Event, new: Batch, run_id: str, attempt_id: str) -> dict[str, Any]:
        """The ``checkpoints`` row of a ``checkpoint_committed`` event."""
        data = event.data
        step = data["step"]
        metrics = data.get("metrics")
        if not isinstance(metrics, Mapping):
            at_step = _last_metrics_at(new.types, new.data, step)
            metrics = {}
            if at_step is not None:
                metrics = dict(at_step.get("metrics") or {})
                if at_step.get("loss") is not None:
                    metrics["loss"] = at_step["loss"]
        return {
            "run_id": run_id,
            "attempt_id": attempt_id,
            "step": step,
            "uri": data["uri"],
            "bytes": data["bytes"],
            "committed_at": event_datetime(event.time),
            "metrics": json_safe(dict(metrics)),
            "deleted_at": None,
        }

    def apply(self, connection: Connection, changes: Changes, *, run_id: str) -> Outcome:
        """Write ``changes`` one statement each (SQLite, where a statement is a function
        call; PostgreSQL writes them all in one: :mod:`jobs.ingest.postgres`)."""
        connection.execute(self._update_attempt, changes.attempt)
        for row in changes.checkpoints:
            connection.execute(self._upsert_checkpoint, row)
        run = None
        if changes.top_step is not None or changes.top_committed is not None:
            params = {"p_step": changes.top_step, "p_committed": changes.top_committed}
            updated = connection.execute(self._update_run, {"run_id": run_id, **params})
            if self._update_returns:
                run = updated.first()
        if run is None:
            run = connection.execute(self._read_run, {"run_id": run_id}).first()
        preemptions = tuple(
            t.timestamp()
            for t in connection.execute(self._preemptions, {"run_id": run_id}).scalars()
        )
        if run is None:
            return Outcome(None, None, None, preemptions)
        return Outcome(run.last_step, run.last_committed_step, run.budget_usd, preemptions)

    def finish(
        self,
        connection: Connection,
        changes: Changes,
        outcome: Outcome,
        *,
        applied: Applied,
        now: datetime,
    ) -> None:
        """Mark the attempt profiled when its window ended (once), and tell ``applied``
        what the rules need of the run."""
        if changes.profile_ended:
            marked = connection.execute(
                self._mark_profiled,
                {"attempt_id": changes.attempt["attempt_id"], "p_now": now},
            )
            applied.profile_due = marked.rowcount == 1
        self.tell(outcome, applied)

    @staticmethod
    def tell(outcome: Outcome, applied: Applied) -> None:
        """Tell ``applied`` what the rules need of the run."""
        applied.last_step = outcome.last_step
        applied.last_committed_step = outcome.last_committed_step
        applied.budget_usd = outcome.budget_usd
        applied.preemption_times = outcome.preemption_times

    @staticmethod
    def _started(state: AttemptState, attempt_id: str) -> AttemptState:
        """``started`` moves a booting attempt to RUNNING; any other state stays as it is."""
        try:
            if state is AttemptState.REQUESTED:
                state = transition(state, AttemptState.PROVISIONING, subject_id=attempt_id)
            if state is AttemptState.PROVISIONING:
                state = transition(state, AttemptState.RUNNING, subject_id=attempt_id)
        except IllegalTransition as exc:  # cannot happen from the states above; be safe
            log.warning("ignored 'started' of attempt %s: %s", attempt_id, exc)
        if state.is_terminal():
            log.info("attempt %s reported 'started' after it ended (%s)", attempt_id, state)
        return state


def _profile_ended(attempt: Any, top_step: int | None, max_time: float) -> bool:
    """Whether the attempt's profile window (a step, or seconds after launch) is over."""
    until_step, until_s = attempt.profile_until_step, attempt.profile_until_s
    if until_step is not None and top_step is not None and top_step >= until_step:
        return True
    started = attempt.started_at
    return until_s is not None and started is not None and max_time - started.timestamp() >= until_s


def _last_metrics_at(
    types: Sequence[str], data: Sequence[Mapping[str, Any]], step: int
) -> Mapping[str, Any] | None:
    """The data of the last metrics event at ``step``: a checkpoint's metrics by default."""
    for index in range(len(types) - 1, -1, -1):
        if types[index] == "metrics" and data[index]["step"] == step:
            return data[index]
    return None
