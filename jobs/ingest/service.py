"""The runner events API: authenticate a batch, store it once, apply it, evaluate the alerts.

One batch is one database transaction; lifecycle callbacks and the alert rules run after
the commit. How a batch flows, and why: ``docs/architecture.md``, section "Ingest".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, Row, and_, bindparam, select, text
from sqlalchemy.exc import SQLAlchemyError

from jobs.database.models import Attempt, EventRow, MetricBlock, Run, table_of, utcnow
from jobs.ingest.auth import REVOKED, Principal, Tokens, bearer
from jobs.ingest.effects import Applied, Changes, Effects
from jobs.ingest.postgres import AttemptCache, AttemptView, BatchTransaction
from jobs.ingest.windows import WINDOW_EVENTS, Point, Windows, script_signals
from jobs.ingest.writers import EventWrites, Kinds, SqliteWriter, event_writes
from jobs.process.logs import log_context
from jobs.rules import Rule, Signal
from runner.errors import WireError
from runner.wire import NODE_SEQ_SPAN, Batch, Event, decode_batch_columns

log = logging.getLogger(__name__)

#: Event types the service layer reacts to; passed to ``on_attempt_event`` once each.
LIFECYCLE_EVENTS = frozenset(
    {"started", "checkpoint_committed", "preemption_notice", "exit", "restored", "dry_run"}
)
#: ``log`` events of these levels reach ``on_attempt_event`` too: the runner's warnings
#: are for the people watching the run (its info lines stay in the events table).
LOUD_LOG_LEVELS = frozenset({"warning", "error"})
#: Event types whose ``step`` (a 64-bit count on the wire) is the attempt's progress.
_STEP_EVENTS = frozenset({"metrics", "heartbeat", "checkpoint_committed", "restored"})

#: The last seq a node's batch is checked against: above every seq, so always checked.
_I64_MAX = 2**63 - 1

_ATTEMPTS = table_of(Attempt)
_EVENTS = table_of(EventRow)
#: Whether the PostgreSQL server can compress TOAST with lz4 (NULL before PostgreSQL 14).
_HAS_LZ4 = text(
    "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"
)
_BLOCKS = table_of(MetricBlock)

SignalSink = Callable[[str, list[Signal], datetime], None]
AttemptEventSink = Callable[[str, str, dict[str, Any]], None]


@dataclass(frozen=True)
class IngestResult:
    """What the HTTP layer sends back: a status and a JSON body."""

    #: 200 stored (or already stored); 400 malformed; 401 unknown or revoked token;
    #: 403 token of another attempt; 413 too large; 503 database unavailable; 500 a bug.
    status: int
    #: ``{"accepted": n, "duplicates": m}`` or ``{"error": "..."}``.
    body: dict[str, Any]


def _error(status: int, message: str) -> IngestResult:
    return IngestResult(status, {"error": message})


def _unavailable(exc: SQLAlchemyError) -> IngestResult:
    # The driver's message names the table or the connection problem, never parameters.
    reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    log.warning("ingest: the database failed, batch not stored: %s", reason[0] if reason else exc)
    return _error(503, "the database is unavailable; the batch was not stored: retry later")


class IngestService:
    """The runner events API, independent of HTTP: ``handle(authorization, body)``.

    Thread-safe; one instance serves every request thread of the process.
    ``on_profile_due(attempt)`` is told once when an attempt's profile window ends
    (:mod:`jobs.runs.profile`). ``rules_for(run)`` picks a run's alert rules
    (default: the rules on the stream, :func:`jobs.rules.rules_on`, with the thresholds of
    the run's spec); it is called when the run's window is built, the first batch after
    start or after :meth:`forget_run`. ``attempt_token(attempt id)`` is the attempt's
    runner token as the control plane derives it (``Deps.runner_token``): with it, the
    nodes after the first of a multi-node attempt are told apart by their own tokens
    (:mod:`jobs.ingest.auth`); without it, only attempts' own tokens are accepted.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        rules_for: Callable[[Run], Sequence[Rule]] | None = None,
        on_signals: SignalSink | None = None,
        on_attempt_event: AttemptEventSink | None = None,
        on_profile_due: Callable[[str], None] | None = None,
        now: Callable[[], datetime] = utcnow,
        max_body_bytes: int = 8 << 20,
        attempt_token: Callable[[str], str] | None = None,
    ) -> None:
        self._engine = engine
        self._on_signals = on_signals
        self._on_attempt_event = on_attempt_event
        self._on_profile_due = on_profile_due
        self._now = now
        self.max_body_bytes = max_body_bytes
        self._postgres = engine.dialect.name == "postgresql"
        self._tokens = Tokens(engine, attempt_token=attempt_token)
        self._windows = Windows(engine, rules_for=rules_for)
        self._effects = Effects(engine)
        self._sqlite_writer = SqliteWriter()
        #: PostgreSQL: the attempts' rows as the last batches left them.
        self._attempts = AttemptCache()
        #: Whether the server compresses TOAST with lz4 (PostgreSQL 14 and newer, built
        #: with it); asked at the first batch.
        self._lz4: bool | None = None
        self._build_statements()

    # --- the request ----------------------------------------------------------------

    def handle(self, authorization: str | None, body: bytes) -> IngestResult:
        """Authenticate, decode, store and apply one batch; never raises."""
        try:
            return self._handle(authorization, body)
        except Exception:  # a bug must not take the server down; the runner retries
            log.exception("ingest failed unexpectedly; the batch was not stored")
            return _error(500, "internal error while storing the batch; it will be retried")

    def forget_run(self, run_id: str) -> None:
        """Drop a run's window and rules (it ended, or its spec changed); rebuilt on demand."""
        self._windows.forget(run_id)

    def _handle(self, authorization: str | None, body: bytes) -> IngestResult:
        if len(body) > self.max_body_bytes:
            return _error(
                413,
                f"batch of {len(body)} bytes is over the {self.max_body_bytes}-byte limit; "
                "send fewer events per batch",
            )
        token = bearer(authorization)
        if token is None:
            return _error(401, "missing 'Authorization: Bearer <runner token>' header")
        try:
            principal = self._tokens.of_token(token)
        except SQLAlchemyError as exc:
            return _unavailable(exc)
        if principal is None:
            return _error(401, REVOKED)
        try:
            batch = decode_batch_columns(body)
        except WireError as exc:
            return _error(400, str(exc))
        if batch.attempt != principal.attempt_id or batch.run != principal.run_id:
            return _error(
                403,
                f"this token belongs to attempt {principal.attempt_id} of run "
                f"{principal.run_id}, but the batch is for attempt {batch.attempt} of run "
                f"{batch.run}: a token is scoped to its attempt",
            )
        if batch.node != principal.node:
            # Node 0's token alone reports the run's progress and its end.
            return _error(
                403,
                f"this token belongs to node {principal.node} of attempt "
                f"{principal.attempt_id}, but the batch is node {batch.node}'s: each node "
                "of an attempt sends with its own token",
            )
        # Node 0 too (a single-node attempt's one runner): a seq of its past 2**40 would
        # take node 1's place, and node 1's own events would be dropped as repeats.
        low, high = batch.node * NODE_SEQ_SPAN, (batch.node + 1) * NODE_SEQ_SPAN
        if not low <= min(batch.seqs) <= max(batch.seqs) < high:
            return _error(
                400,
                f"node {batch.node}'s events must have seqs from {low} to {high - 1} "
                "(node × 2**40 up): the nodes of an attempt share it, and each numbers its "
                "events in its own range",
            )
        # Whatever is logged from here on names the run and attempt (JSON logs).
        with log_context(run_id=principal.run_id, attempt_id=principal.attempt_id):
            kinds = Kinds.of(batch.types)
            now = self._now()
            try:
                applied = self._store(principal, batch, kinds, now=now)
            except SQLAlchemyError as exc:
                return _unavailable(exc)
            if applied is None:
                self._tokens.drop(principal.token_hash)
                return _error(401, REVOKED)
            if applied.accepted:
                self._after_commit(principal.attempt_id, applied, now=now)
            return IngestResult(
                200, {"accepted": applied.accepted, "duplicates": applied.duplicates}
            )

    # --- tokens ---------------------------------------------------------------------

    def runner_of(self, authorization: str | None) -> tuple[str, str] | None:
        """``(run id, attempt id)`` of the live attempt whose token is the bearer, else None.

        Asks the database, not the look-up cache, so a token revoked a moment ago gets
        nothing (callers that hand out something, unlike a batch, cannot re-check later).
        Raises SQLAlchemyError when the database is unavailable.
        """
        token = bearer(authorization)
        if token is None:
            return None
        principal = self._tokens.of_token(token, cached=False)
        return None if principal is None else (principal.run_id, principal.attempt_id)

    def _build_statements(self) -> None:
        """Build the statements once; SQLAlchemy's cache then compiles each once."""
        attempts = _ATTEMPTS.c
        events = _EVENTS.c
        columns = [
            attempts.token_hash,
            attempts.number,
            attempts.state,
            attempts.last_step,
            attempts.last_seq,
            attempts.started_at,
            attempts.preemption_notice_at,
            attempts.profile_until_step,
            attempts.profile_until_s,
            attempts.profiled_at,
        ]
        self._read_attempt = select(*columns).where(attempts.id == bindparam("attempt_id"))
        self._existing_seqs = select(events.seq).where(
            and_(
                events.attempt_id == bindparam("attempt_id"),
                events.seq.between(bindparam("low"), bindparam("high")),
            )
        )
        blocks = _BLOCKS.c
        self._existing_block_seqs = select(blocks.seqs).where(
            and_(
                blocks.attempt_id == bindparam("attempt_id"),
                blocks.first_seq <= bindparam("high"),
                blocks.last_seq >= bindparam("low"),
            )
        )

    # --- the transaction ------------------------------------------------------------

    def _store(
        self, principal: Principal, batch: Batch, kinds: Kinds, *, now: datetime
    ) -> Applied | None:
        """One transaction; ``None`` when the token was revoked meanwhile.

        Each event's ``data`` column gets :attr:`runner.wire.Batch.texts`: the payload as
        standard JSON text that decodes to the values the rules saw (an integer sent for a
        float field stored as the float it became), made once by the decoder.
        """
        if self._postgres:
            return self._store_postgres(principal, batch, kinds, now=now)
        with self._engine.begin() as connection:
            params = {"attempt_id": principal.attempt_id}
            attempt = connection.execute(self._read_attempt, params).first()
            if attempt is None or attempt.token_hash != principal.token_hash:
                return None
            applied, writes = self._prepare(connection, principal, batch, kinds, attempt, now=now)
            if writes is None:
                return applied
            events, changes = writes
            self._sqlite_writer.insert(connection, events)
            outcome = self._effects.apply(connection, changes, run_id=principal.run_id)
            self._effects.finish(connection, changes, outcome, applied=applied, now=now)
        return applied

    def _store_postgres(
        self, principal: Principal, batch: Batch, kinds: Kinds, *, now: datetime
    ) -> Applied | None:
        """:meth:`_store` on PostgreSQL: one round trip when the attempt's row is as the
        last batch left it, two otherwise (see :mod:`jobs.ingest.postgres`)."""
        attempt_id = principal.attempt_id
        with self._engine.connect() as connection:
            if self._lz4 is None:
                self._lz4 = bool(connection.execute(_HAS_LZ4).scalar())
                connection.rollback()
            known = self._attempts.get(attempt_id)
            if (
                known is not None
                and known.token_hash == principal.token_hash
                and not batch.node
                and (known.last_seq is None or min(batch.seqs) > known.last_seq)
            ):  # every event is new: nothing to look up first
                with BatchTransaction(connection, lz4=self._lz4) as transaction:
                    done = self._write_postgres(
                        transaction, connection, principal, batch, kinds, known, now=now
                    )
                if done is not None:
                    return done
            with BatchTransaction(connection, lz4=self._lz4) as transaction:
                attempt = transaction.read(attempt_id)
                if attempt is None or attempt.token_hash != principal.token_hash:
                    self._attempts.put(attempt_id, None)
                    return None
                done = self._write_postgres(
                    transaction, connection, principal, batch, kinds, attempt, now=now
                )
            if done is None:  # the row is locked since it was read: cannot happen
                raise RuntimeError(f"attempt {attempt_id} changed under its lock")
            return done

    def _write_postgres(
        self,
        transaction: BatchTransaction,
        connection: Connection,
        principal: Principal,
        batch: Batch,
        kinds: Kinds,
        attempt: AttemptView,
        *,
        now: datetime,
    ) -> Applied | None:
        """Work the batch out from ``attempt`` and write it; None when the attempt's row
        was no longer ``attempt`` (nothing was written)."""
        applied, writes = self._prepare(connection, principal, batch, kinds, attempt, now=now)
        if writes is None:
            return applied  # every event was stored already: rolled back, nothing to do
        events, changes = writes
        written = transaction.commit_batch(
            events,
            changes,
            attempt=attempt,
            run_id=principal.run_id,
            profiled=changes.profile_ended,
        )
        self._attempts.put(principal.attempt_id, written.attempt)
        if not written.written:
            return None
        applied.profile_due = changes.profile_ended
        self._effects.tell(written.outcome, applied)
        return applied

    def _prepare(
        self,
        connection: Connection,
        principal: Principal,
        batch: Batch,
        kinds: Kinds,
        attempt: Row[Any] | AttemptView,
        *,
        now: datetime,
    ) -> tuple[Applied, tuple[EventWrites, Changes] | None]:
        """What the batch's new events are and change, from the attempt as read (and
        locked); the writes are None when every event was stored already."""
        attempt_id = principal.attempt_id
        # A node after the first numbers its events from node × NODE_SEQ_SPAN, above
        # the attempt's high-water mark (node 0's): its batches are always checked.
        last_seq = _I64_MAX if batch.node else attempt.last_seq
        new = self._new_events(connection, last_seq, attempt_id, batch)
        applied = Applied(
            accepted=len(new),
            duplicates=len(batch) - len(new),
            run_id=principal.run_id,
            attempt_number=attempt.number,
        )
        if not new:
            return applied, None
        # The hot path: whole columns, no object per event (see writers.event_writes).
        types, times = new.types, new.times
        if new is not batch:  # some were stored already
            kinds = Kinds.of(types)
        data = new.data
        # Only node 0 reports the run's progress (see runner.supervisor).
        metrics = [] if batch.node else [data[i] for i in kinds.metrics]
        steps = [d["step"] for d in metrics]
        step_times = [s for s in (d["step_time_s"] for d in metrics) if s == s]  # not NaN
        applied.observations["metrics"] = list(
            zip([times[i] for i in kinds.metrics], metrics, strict=True)
        )
        system: list[Point] = []
        for index in kinds.others:  # a few per batch
            if types[index] == "system":
                system.append((times[index], data[index]))
            elif batch.node:
                self._from_other_node(new.event(index), applied)
            else:
                self._rare(new.event(index), attempt.number, steps, applied)
        applied.observations["system"] = system
        applied.max_time = max(times)
        events = event_writes(
            attempt_id=attempt_id,
            run_id=principal.run_id,
            new=new,
            kinds=kinds,
            now=now,
            suffix="+00:00" if self._postgres else "",
        )
        changes = self._effects.changes(
            attempt,
            new,
            steps=steps,
            step_times=step_times,
            applied=applied,
            now=now,
            node=batch.node,
        )
        return applied, (events, changes)

    @staticmethod
    def _from_other_node(event: Event, applied: Applied) -> None:
        """A node after the first of a multi-node attempt: its notice and its warnings are
        told; the run's progress, start and end are node 0's to report (a node's exit
        ends the attempt through the provider's status of the gang)."""
        kind, data = event.type, event.data
        if kind == "preemption_notice" or (kind == "log" and data.get("level") in LOUD_LOG_LEVELS):
            applied.lifecycle.append(event)

    @staticmethod
    def _rare(event: Event, attempt_number: int, steps: list[int], applied: Applied) -> None:
        """Everything but metrics and system: a few per batch at most."""
        kind, data = event.type, event.data
        if kind in _STEP_EVENTS:
            step = data["step"]  # the wire's Count; None: a heartbeat before training
            if step is not None:
                steps.append(step)
        if kind in WINDOW_EVENTS:
            applied.observations.setdefault(kind, []).append(
                (event.time, {**data, "attempt": attempt_number})
            )
        elif kind == "alert":
            applied.script_alerts.append((event.time, {**data, "attempt": attempt_number}))
        if kind in LIFECYCLE_EVENTS or (kind == "log" and data.get("level") in LOUD_LOG_LEVELS):
            applied.lifecycle.append(event)

    def _new_events(
        self, connection: Connection, last_seq: int | None, attempt_id: str, batch: Batch
    ) -> Batch:
        """The events not stored yet (the first of each seq): usually the whole batch."""
        seqs = batch.seqs
        low = min(seqs)
        existing: set[int] = set()
        if last_seq is not None and low <= last_seq:
            bounds = {"attempt_id": attempt_id, "low": low, "high": max(seqs)}
            existing = set(connection.execute(self._existing_seqs, bounds).scalars())
            for stored in connection.execute(self._existing_block_seqs, bounds).scalars():
                existing.update(stored)
        if not existing and len(set(seqs)) == len(seqs):
            return batch
        keep: list[int] = []
        for index, seq in enumerate(seqs):
            if seq not in existing:
                existing.add(seq)
                keep.append(index)
        return batch.select(keep)

    # --- after the commit -------------------------------------------------------------

    def _after_commit(self, attempt_id: str, applied: Applied, *, now: datetime) -> None:
        if self._on_attempt_event is not None:
            for event in applied.lifecycle:
                try:
                    self._on_attempt_event(attempt_id, event.type, event.data)
                except Exception:
                    log.exception("on_attempt_event(%s, %s) failed", attempt_id, event.type)
        if applied.profile_due and self._on_profile_due is not None:
            try:
                self._on_profile_due(attempt_id)
            except Exception:
                log.exception("on_profile_due(%s) failed", attempt_id)
        try:
            signals = self._windows.evaluate(applied, now=now)
            if applied.script_alerts:
                signals = [*signals, *script_signals(applied, now=now)]
        except Exception:
            log.exception("alert rules of run %s failed on a batch", applied.run_id)
            return
        if signals and self._on_signals is not None:
            try:
                self._on_signals(applied.run_id, signals, now)
            except Exception:
                log.exception("on_signals for run %s failed", applied.run_id)
