"""The PagerDuty bridge: escalated alerts page PagerDuty too (Events API v2).

For teams whose on-call lives in PagerDuty. With ``TRAINBOT_PAGERDUTY_ROUTING_KEY`` set,
an unacknowledged critical alert that escalates (:func:`jobs.alerts.escalate_due`)
sends ``trigger``; acknowledging it in chat sends ``acknowledge``; resolving it,
by hand or because the rule cleared, sends ``resolve``. All three carry the alert id as
``dedup_key``, so PagerDuty keeps one incident per alert, and a repeated trigger (each
escalation page sends one) only adds to it.

Why at escalation rather than at opening: the escalation delay is the time the chat
channel has to pick the alert up; PagerDuty wakes people, and should not for an alert
someone acknowledged in Slack a minute after it opened.

The bridge listens to the :class:`~jobs.outbound.notify.Journal` (``alert_escalated``,
``alert_acknowledged``, ``alert_resolved``), which every path that changes an alert
already records to, and never blocks it on PagerDuty: :meth:`PagerDutyBridge.record`
only queues. Acknowledge and resolve are sent only for alerts that paged.

**Queued in the database, so a replica's death loses nothing.** Each event is a row of
``pagerduty_outbox`` (:class:`jobs.database.replica_tables.PagerDutyOutbox`), written
before anything is sent, in its own short
transaction (on PostgreSQL at once; on SQLite, whose one writer
the caller's transaction holds, by the worker just after it). A row is its owner's while
the owner renews ``owner_until``; a replica killed with its rows unsent stops renewing,
and after ``hold_s`` another replica, or the same one restarted, claims them (``FOR
UPDATE SKIP LOCKED`` on PostgreSQL, so two never take the same row) and sends them. A
replica that stops cleanly hands its rows over at once.

One background thread per replica sends its rows in order, and never a row while an
earlier one of the same alert is unsent, whoever holds it: an acknowledge never
overtakes its trigger. It reads the alert from the database when it sends, and retries
as the API asks: 429 and 5xx with backoff (``next_at`` on the row, so the backoff
survives the replica too), 400 never (the event is invalid; it is logged). A row is
marked done (``sent``, ``refused``, ``gave_up``, ``not_paged``) after PagerDuty answers:
a replica killed between PagerDuty's 202 and that mark has its event sent again by the
next, which PagerDuty folds into the same incident (the alert id is the ``dedup_key``).
So: delivered at least once, never lost, and in practice once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Engine, delete, exists, func, insert, or_, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session

from jobs.database.db import claim_rows, session_scope
from jobs.database.models import Alert, table_of, utcnow
from jobs.database.replica_tables import PagerDutyOutbox
from jobs.domain.errors import TrainbotError
from jobs.domain.severity import Severity
from jobs.outbound.backoff import Backoff

__all__ = [
    "EventsClient",
    "PagerDutyBridge",
    "PagerDutyError",
    "PagerDutyRejected",
    "PagerDutyUnavailable",
    "dedup_key",
]

log = logging.getLogger(__name__)

#: The Events API v2 endpoint, under the base URL.
ENQUEUE_PATH = "/v2/enqueue"
#: PagerDuty's limits on ``payload.summary`` and ``dedup_key``.
MAX_SUMMARY = 1024
MAX_DEDUP_KEY = 255
#: Done rows are kept this long.
KEEP_DONE = timedelta(days=1)
_OUTBOX = table_of(PagerDutyOutbox)
_GONE = datetime(1970, 1, 1, tzinfo=timezone.utc)
_SEVERITY = {Severity.CRITICAL: "critical", Severity.WARNING: "warning", Severity.INFO: "info"}
#: Journal records the bridge acts on, and the event action each sends.
_ACTIONS = {
    "alert_escalated": "trigger",
    "alert_acknowledged": "acknowledge",
    "alert_resolved": "resolve",
}


class PagerDutyError(TrainbotError):
    """PagerDuty did not take an event."""


class PagerDutyRejected(PagerDutyError):
    """PagerDuty refused the event as invalid (400): sending it again cannot help."""


class PagerDutyUnavailable(PagerDutyError):
    """PagerDuty is rate limiting (429), failing (5xx) or unreachable: retry later."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        #: What the answer's ``Retry-After`` asked for, if it said.
        self.retry_after_s = retry_after_s


def dedup_key(alert_id: str) -> str:
    """The incident key for an alert: its id, stable across trigger, acknowledge, resolve."""
    return alert_id[:MAX_DEDUP_KEY]


class EventsClient:
    """One ``POST /v2/enqueue`` at a time; typed errors for what the API answers."""

    def __init__(self, routing_key: str, *, url: str, timeout_s: float = 10.0) -> None:
        self._routing_key = routing_key
        self._endpoint = url.rstrip("/") + ENQUEUE_PATH
        self._timeout = timeout_s

    def send(self, action: str, key: str, payload: dict[str, Any] | None = None) -> str:
        """Send one event; returns the ``dedup_key`` PagerDuty accepted it under (202)."""
        body: dict[str, Any] = {
            "routing_key": self._routing_key,
            "event_action": action,
            "dedup_key": key,
        }
        if payload is not None:
            body["payload"] = payload
            body["client"] = "trainbot"
        request = urllib.request.Request(
            self._endpoint,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Accept": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                answer = _json(response.read())
                return str(answer.get("dedup_key") or key)
        except urllib.error.HTTPError as exc:
            answer = _json(exc.read())
            said = answer.get("message") or exc.reason
            errors = "; ".join(str(e) for e in answer.get("errors") or ())
            if exc.code == 429 or exc.code >= 500:
                raise PagerDutyUnavailable(
                    f"PagerDuty answered {exc.code} ({said}) to {action} {key}",
                    retry_after_s=_seconds(exc.headers.get("Retry-After")),
                ) from None
            raise PagerDutyRejected(
                f"PagerDuty refused {action} {key} with {exc.code}: {said}"
                + (f" ({errors})" if errors else "")
                + "; check TRAINBOT_PAGERDUTY_ROUTING_KEY is an Events API v2 integration key"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            raise PagerDutyUnavailable(
                f"could not reach PagerDuty for {action} {key}: {exc}"
            ) from None


@dataclass(frozen=True)
class _Event:
    #: Its outbox row; None while it waits in memory to be written (SQLite).
    row: int | None
    #: ``trigger``, ``acknowledge`` or ``resolve``.
    action: str
    alert_id: str
    #: Failed tries so far.
    tries: int = 0


class PagerDutyBridge:
    """A :class:`~jobs.outbound.notify.Journal` that forwards alert escalations, acknowledgements
    and resolutions to PagerDuty through the ``pagerduty_outbox`` table, from a
    background thread, retrying with backoff."""

    def __init__(
        self,
        client: EventsClient,
        *,
        engine: Engine,
        source: str = "trainbot",
        owner: str | None = None,
        hold_s: float = 30.0,
        poll_s: float = 1.0,
        max_attempts: int = 8,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
    ) -> None:
        """``source``: what PagerDuty shows as the event's origin (the control plane's
        URL); ``owner``: this replica's name on the rows it queues (default: unique to
        the process); ``hold_s``: how long its rows stay its own without a renewal;
        ``poll_s``: how often it looks for rows to adopt or retry; ``max_attempts``:
        tries per event before it is given up and logged."""
        self._client = client
        self._engine = engine
        self._source = source
        self.owner = owner or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._hold = timedelta(seconds=hold_s)
        self._poll_s = poll_s
        self._max_attempts = max_attempts
        self._backoff = Backoff(backoff_s, max_backoff_s)
        # SQLite: the journal records inside the caller's write transaction, which a
        # second writer would wait on; the worker writes the row after it commits.
        self._write_at_once = engine.dialect.name == "postgresql"
        self._cond = threading.Condition()
        self._pending: deque[_Event] = deque()
        self._busy = False
        self._closed = False
        self._stopped = False
        self._renewed = 0.0
        self._thread = threading.Thread(target=self._work, name="trainbot-pagerduty", daemon=True)
        self._thread.start()

    def record(self, type: str, run: str | None, /, **data: Any) -> None:
        action = _ACTIONS.get(type)
        alert_id = data.get("alert_id")
        if action is None or not isinstance(alert_id, str):
            return
        with self._cond:
            if self._closed:
                log.warning("PagerDuty: closed; %s for alert %s not sent", action, alert_id)
                return
        event = _Event(None, action, alert_id)
        written = False
        if self._write_at_once:
            try:
                self._insert(event)
                written = True
            except (SQLAlchemyError, TrainbotError) as exc:  # the worker writes it later
                log.warning("PagerDuty: could not queue %s for %s: %s", action, alert_id, exc)
        with self._cond:
            if not written:
                self._pending.append(event)
            self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every event this replica queued or adopted is sent or given up;
        False on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                idle = not self._pending and not self._busy
            if idle and not self._unsent():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._cond:
                self._cond.notify_all()
                self._cond.wait(min(left, 0.05))

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then stop; what is left
        is handed to the other replicas at once."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.flush(timeout)
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=1.0)
        try:
            with session_scope(self._engine) as session:
                session.execute(
                    update(_OUTBOX)
                    .where(_OUTBOX.c.owner == self.owner, _OUTBOX.c.done_at.is_(None))
                    .values(owner_until=_GONE)
                )
        except (SQLAlchemyError, TrainbotError) as exc:
            log.warning("PagerDuty: could not hand the unsent events over: %s", exc)

    # ------------------------------------------------------------------ the table

    def _insert(self, event: _Event) -> None:
        now = utcnow()
        with session_scope(self._engine) as session:
            session.execute(
                insert(_OUTBOX).values(
                    action=event.action,
                    alert_id=event.alert_id,
                    owner=self.owner,
                    owner_until=now + self._hold,
                    tries=0,
                    next_at=now,
                    created_at=now,
                )
            )

    def _unsent(self) -> int:
        """This replica's rows not done yet (-1: the database did not answer)."""
        try:
            with session_scope(self._engine) as session:
                return int(
                    session.execute(
                        select(func.count())
                        .select_from(_OUTBOX)
                        .where(_OUTBOX.c.owner == self.owner, _OUTBOX.c.done_at.is_(None))
                    ).scalar_one()
                )
        except (SQLAlchemyError, TrainbotError):
            return -1

    def _claim(self) -> _Event | None:
        """The next due row this replica may send, claimed: its own, or one whose owner
        stopped renewing it; never one behind an unsent earlier row of its alert (an
        acknowledge never overtakes its trigger)."""
        now = utcnow()
        o, earlier = _OUTBOX.c, _OUTBOX.alias("earlier").c
        due = (
            select(o.id)
            .where(
                o.done_at.is_(None),
                o.next_at <= now,
                or_(o.owner == self.owner, o.owner_until < now),
                ~exists().where(
                    earlier.alert_id == o.alert_id, earlier.id < o.id, earlier.done_at.is_(None)
                ),
            )
            .order_by(o.id)
            .limit(1)
        )
        take = (
            update(_OUTBOX)
            .values(owner=self.owner, owner_until=now + self._hold)
            .returning(o.id, o.action, o.alert_id, o.tries, o.owner)
        )
        with session_scope(self._engine) as session:
            rows = claim_rows(session, due, o.id, take)
        if not rows:
            return None
        row = rows[0]
        return _Event(row.id, row.action, row.alert_id, row.tries)

    def _finish(self, event: _Event, outcome: str) -> None:
        with session_scope(self._engine) as session:
            session.execute(
                update(_OUTBOX)
                .where(_OUTBOX.c.id == event.row)
                .values(done_at=utcnow(), outcome=outcome)
            )

    def _retry_later(self, event: _Event, delay_s: float) -> None:
        with session_scope(self._engine) as session:
            session.execute(
                update(_OUTBOX)
                .where(_OUTBOX.c.id == event.row)
                .values(tries=event.tries + 1, next_at=utcnow() + timedelta(seconds=delay_s))
            )

    def _renew(self) -> None:
        """Keep this replica's unsent rows its own for another ``hold_s``."""
        clock = time.monotonic()
        if clock - self._renewed < self._hold.total_seconds() / 3:
            return
        now = utcnow()
        with session_scope(self._engine) as session:
            session.execute(
                update(_OUTBOX)
                .where(_OUTBOX.c.owner == self.owner, _OUTBOX.c.done_at.is_(None))
                .values(owner_until=now + self._hold)
            )
            # Done rows are kept a day, for whoever asks what was sent.
            session.execute(delete(_OUTBOX).where(_OUTBOX.c.done_at < now - KEEP_DONE))
        self._renewed = clock

    # ------------------------------------------------------------------ worker

    def _work(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                pending = list(self._pending)
                self._busy = True
            try:
                for queued in pending:  # SQLite's, or written when the database was down
                    self._insert(queued)
                    with self._cond:
                        self._pending.popleft()
                self._renew()
                claimed = self._claim()
                wait = self._poll_s if claimed is None else self._deliver(claimed)
            except Exception:  # the database is away, or a bug: never end the bridge
                log.exception("PagerDuty: the outbox failed; trying again")
                wait = self._poll_s
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
            if wait > 0:
                with self._cond:
                    if not self._pending and not self._stopped:
                        self._cond.wait(wait)

    def _deliver(self, event: _Event) -> float:
        """Send a claimed row once; how long to wait before looking for the next (0: at
        once; the backoff when PagerDuty asked to wait)."""
        paged, payload = self._payload(event)
        if not paged:
            self._finish(event, "not_paged")
            return 0.0
        try:
            self._client.send(event.action, dedup_key(event.alert_id), payload)
        except PagerDutyRejected as exc:
            log.error("PagerDuty: %s", exc)
            self._finish(event, "refused")
            return 0.0
        except PagerDutyUnavailable as exc:
            tries = event.tries + 1
            if tries >= self._max_attempts:
                log.error("PagerDuty: %s; gave up after %d tries", exc, tries)
                self._finish(event, "gave_up")
                return 0.0
            delay = self._backoff.delay(tries, retry_after_s=exc.retry_after_s)
            log.warning("PagerDuty: %s; retrying in %.1f s", exc, delay)
            self._retry_later(event, delay)
            return min(delay, self._poll_s)
        self._finish(event, "sent")
        return 0.0

    def _payload(self, event: _Event) -> tuple[bool, dict[str, Any] | None]:
        """Whether the alert paged (if not, PagerDuty has no incident to change), and the
        trigger's payload (None for acknowledge and resolve)."""
        with Session(self._engine) as session:
            alert = session.get(Alert, event.alert_id)
            if alert is None:
                return False, None
            if event.action != "trigger":
                # The page was committed long before anyone acknowledged or resolved.
                return alert.escalation_level > 0, None
            # A trigger is read as the escalation's transaction may still be committing:
            # the journal's record is what says it paged.
            where = f"run {alert.run_id}" if alert.run_id else "team budget"
            summary = f"{alert.title} ({where}, alert {alert.id})"
            if len(summary) > MAX_SUMMARY:
                summary = summary[: MAX_SUMMARY - 1] + "…"
            return True, {
                "summary": summary,
                "source": self._source,
                "severity": _SEVERITY.get(alert.severity, "critical"),
                "timestamp": alert.first_seen.isoformat(),
                "component": alert.run_id or "team",
                "group": alert.message_channel or "",
                "class": alert.rule,
                "custom_details": {
                    "alert_id": alert.id,
                    "run_id": alert.run_id,
                    "rule": alert.rule,
                    "detail": alert.detail,
                    "hint": alert.hint,
                    "count": alert.count,
                    "acknowledge": f"/train ack {alert.id}",
                },
            }


def _json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None
