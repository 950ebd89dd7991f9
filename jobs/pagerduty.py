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

The bridge listens to the :class:`~jobs.notify.Journal` (``alert_escalated``,
``alert_acknowledged``, ``alert_resolved``), which every path that changes an alert
already records to, and never blocks it: :meth:`PagerDutyBridge.record` only queues.
One background thread sends the events in order (an acknowledge never overtakes its
trigger), reading the alert from the database after the caller's transaction, and
retries as the API asks: 429 and 5xx with backoff, 400 never (the event is invalid;
it is logged). Acknowledge and resolve are sent only for alerts that paged.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine
from sqlmodel import Session

from jobs.backoff import Backoff
from jobs.errors import TrainbotError
from jobs.models import Alert, Severity

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
    #: ``trigger``, ``acknowledge`` or ``resolve``.
    action: str
    alert_id: str


class PagerDutyBridge:
    """A :class:`~jobs.notify.Journal` that forwards alert escalations, acknowledgements
    and resolutions to PagerDuty from a background thread, retrying with backoff."""

    def __init__(
        self,
        client: EventsClient,
        *,
        engine: Engine,
        source: str = "trainbot",
        max_attempts: int = 8,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        """``source``: what PagerDuty shows as the event's origin (the control plane's
        URL); ``max_attempts``: tries per event before it is given up and logged."""
        self._client = client
        self._engine = engine
        self._source = source
        self._max_attempts = max_attempts
        self._backoff = Backoff(backoff_s, max_backoff_s)
        self._stop = threading.Event()
        self._sleep = sleep or self._stop.wait
        self._cond = threading.Condition()
        self._queue: deque[_Event] = deque()
        self._busy = False
        self._closed = False
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
            self._queue.append(_Event(action, alert_id))
            self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued event is sent or given up; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.flush(timeout)
        self._stop.set()
        self._thread.join(timeout=1.0)

    # ------------------------------------------------------------------ worker

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                event = self._queue.popleft()
                self._busy = True
            try:
                self._deliver(event)
            except Exception:  # one bad event must not end the bridge
                log.exception("PagerDuty: could not send %s for %s", event.action, event.alert_id)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _deliver(self, event: _Event) -> None:
        paged, payload = self._payload(event)
        if not paged:
            return
        key = dedup_key(event.alert_id)
        for attempt in range(1, self._max_attempts + 1):
            try:
                self._client.send(event.action, key, payload)
                return
            except PagerDutyRejected as exc:
                log.error("PagerDuty: %s", exc)
                return
            except PagerDutyUnavailable as exc:
                if attempt == self._max_attempts or self._stop.is_set():
                    log.error("PagerDuty: %s; gave up after %d tries", exc, attempt)
                    return
                delay = self._backoff.delay(attempt, retry_after_s=exc.retry_after_s)
                log.warning("PagerDuty: %s; retrying in %.1f s", exc, delay)
                self._sleep(delay)

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
