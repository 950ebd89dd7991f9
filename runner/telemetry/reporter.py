"""The Reporter: ships spooled events to the ingest API in batches, retried until acked.

Each event carries (attempt, seq), so a retried batch is deduplicated by the server.
"""

from __future__ import annotations

import email.utils
import http.client
import logging
import random
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from time import monotonic
from time import time as unix_now
from typing import Any

from runner.errors import WireError
from runner.store.broker import post_request
from runner.telemetry.sink import EventSink
from runner.telemetry.spool import Batch, Spool
from runner.wire import NODE_SEQ_SPAN, Event, encode_batch
from runner.wire import validate_payload as _validate

log = logging.getLogger(__name__)

#: First retry delay; doubles per failure up to max_backoff_s.
_BASE_BACKOFF_S = 0.25
#: How much of an error response body goes into the log.
_BODY_LOG_CHARS = 500
#: Events the control plane must hear at once, not at the next flush interval: a notice
#: leaves a window of seconds, and the exit is the attempt's report.
_PROMPT = frozenset({"preemption_notice", "exit"})


@dataclass
class _Response:
    #: HTTP status, or None when no response came (refused, reset, timeout).
    status: int | None
    detail: str = ""
    retry_after: float | None = None


def _parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - unix_now())
    except (TypeError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class _Pacing:
    """How the sender batches, waits and backs off: the Reporter's settings, checked."""

    batch_max: int
    flush_interval_s: float
    timeout_s: float
    max_backoff_s: float

    def __post_init__(self) -> None:
        if (
            self.batch_max < 1
            or self.flush_interval_s <= 0
            or self.timeout_s <= 0
            or self.max_backoff_s <= 0
        ):
            raise ValueError("batch_max, flush_interval_s, timeout_s, max_backoff_s must be > 0")


@dataclass
class _SendState:
    failures: int = 0
    limit: int = 0


class Reporter(EventSink):
    """Ships events to the ingest API from a durable spool (:mod:`runner.telemetry.spool`).

    Responses: 2xx acknowledges; network errors, 5xx, 408, 429 and unexpected statuses
    are retried with capped exponential backoff (honouring Retry-After); 401/403 mean
    the attempt's token was revoked, so sending stops and the spool is kept; 413 halves
    the batch; 400/422 (and 413 on one event) drop the batch with an error naming the
    response, so one bad event cannot block the stream.
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        attempt: str,
        run: str,
        spool_dir: Path,
        node: int = 0,
        batch_max: int = 500,
        flush_interval_s: float = 1.0,
        timeout_s: float = 5.0,
        max_backoff_s: float = 30.0,
    ) -> None:
        self._pacing = _Pacing(batch_max, flush_interval_s, timeout_s, max_backoff_s)
        self.url = url
        self._token = token
        #: This runner's node of a multi-node attempt: its seqs start at node × NODE_SEQ_SPAN.
        self._node = node
        self._spool = Spool(
            Path(spool_dir), attempt=attempt, run=run, first_seq=node * NODE_SEQ_SPAN
        )
        self._opener = urllib.request.build_opener()
        self._cond = threading.Condition()
        self._flush_wanted = False
        self._stopping = False
        self._revoked = False
        self._thread = threading.Thread(target=self._run, name=f"telemetry-{attempt}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:  # never the token
        return f"Reporter(url={self.url!r}, attempt={self._spool.attempt!r})"

    @property
    def pending(self) -> int:
        """Events spooled and not yet acknowledged (nor dropped)."""
        return self._spool.pending

    @property
    def revoked(self) -> bool:
        """The server refused the token; nothing more will be sent by this Reporter."""
        return self._revoked

    def emit(self, type: str, data: Mapping[str, Any], *, time: float | None = None) -> Event:
        """Validate, number and spool one event; the sender thread ships it later."""
        payload = _validate(type, data)
        event = self._spool.append(type, unix_now() if time is None else time, payload)
        prompt = type in _PROMPT
        if prompt or self._spool.pending >= self._pacing.batch_max:
            with self._cond:
                self._flush_wanted = self._flush_wanted or prompt
                self._cond.notify_all()
        return event

    def flush(self, timeout: float) -> bool:
        """Send now; True once everything emitted so far is acknowledged (or dropped)."""
        deadline = monotonic() + timeout
        with self._cond:
            target = self._spool.appended
            self._flush_wanted = True
            self._cond.notify_all()
            while self._spool.consumed < target:
                remaining = deadline - monotonic()
                if remaining <= 0 or self._revoked or not self._thread.is_alive():
                    return False
                self._cond.wait(remaining)
            return True

    def close(self, timeout: float = 10.0) -> None:
        """Flush best-effort, stop the sender; whatever is unsent stays in the spool."""
        deadline = monotonic() + timeout
        if self._thread.is_alive() and not self._revoked:
            self.flush(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - monotonic()))
        self._spool.close()
        if self.pending:
            log.info(
                "telemetry closed with %d events unsent, kept in %s",
                self.pending,
                self._spool.directory,
            )

    # The sender thread.

    def _run(self) -> None:
        state = _SendState(limit=self._pacing.batch_max)
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._stopping
                        or self._flush_wanted
                        or self._spool.pending >= self._pacing.batch_max
                    ),
                    timeout=self._pacing.flush_interval_s,
                )
                self._flush_wanted = False
                if self._stopping:
                    return
            try:
                self._drain(state)
            except Exception:  # never let the sender die silently; the spool keeps the events
                log.exception(
                    "telemetry sender failed; retrying after %.0f s", self._pacing.max_backoff_s
                )
                self._sleep(self._pacing.max_backoff_s)

    def _drain(self, state: _SendState) -> None:
        """Send until the spool is empty, the token is revoked or we are stopping."""
        while not self._stopping and not self._revoked:
            batch = self._spool.read_batch(state.limit)
            if batch.count == 0:
                return
            if not batch.events:  # only corrupt lines
                self._commit(batch)
                continue
            try:
                body = encode_batch(batch.events, node=self._node)
            except WireError as exc:  # cannot happen for events that passed emit; never block
                log.error(
                    "dropped unencodable telemetry events of attempt %s: %s",
                    self._spool.attempt,
                    exc,
                )
                self._commit(batch)
                continue
            response = self._post(body)
            status = response.status
            if status is not None and 200 <= status < 300:
                if state.failures:
                    log.info("telemetry delivered again after %d failed tries", state.failures)
                state.failures, state.limit = 0, self._pacing.batch_max
                self._commit(batch)
            elif status in (401, 403):
                log.warning(
                    "telemetry token for attempt %s was refused (HTTP %d): the attempt has "
                    "ended or its token was revoked; stopped sending, %d events kept in %s",
                    self._spool.attempt,
                    status,
                    self._spool.pending,
                    self._spool.directory,
                )
                with self._cond:
                    self._revoked = True
                    self._cond.notify_all()
            elif status == 413 and len(batch.events) > 1:
                state.limit = max(1, len(batch.events) // 2)
            elif status in (400, 413, 422):
                first, last = batch.events[0].seq, batch.events[-1].seq
                log.error(
                    "telemetry batch seq %d..%d of attempt %s was rejected (HTTP %d: %s); "
                    "dropped it so later events still flow",
                    first,
                    last,
                    self._spool.attempt,
                    status,
                    response.detail,
                )
                state.failures, state.limit = 0, self._pacing.batch_max
                self._commit(batch)
            else:
                state.failures += 1
                self._back_off(state, response)

    def _commit(self, batch: Batch) -> None:
        self._spool.commit(batch)
        with self._cond:
            self._cond.notify_all()

    def _back_off(self, state: _SendState, response: _Response) -> None:
        problem = f"HTTP {response.status}" if response.status else "no response"
        if response.detail:
            problem += f": {response.detail}"
        if response.retry_after is not None:
            delay = min(response.retry_after, self._pacing.max_backoff_s)
        else:
            ceiling = min(
                self._pacing.max_backoff_s, _BASE_BACKOFF_S * 2 ** min(state.failures - 1, 30)
            )
            delay = random.uniform(ceiling / 2, ceiling)
        if state.failures == 1:
            log.warning(
                "telemetry to %s failed (%s); %d events spooled in %s, retrying with backoff",
                self.url,
                problem,
                self._spool.pending,
                self._spool.directory,
            )
        else:
            log.debug(
                "telemetry retry %d failed (%s); next in %.2f s", state.failures, problem, delay
            )
        self._sleep(delay)

    def _sleep(self, seconds: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._stopping, timeout=seconds)

    def _post(self, body: bytes) -> _Response:
        request = post_request(self.url, self._token, body)
        try:
            with self._opener.open(request, timeout=self._pacing.timeout_s) as reply:
                reply.read()
                return _Response(reply.status)
        except urllib.error.HTTPError as exc:
            try:
                detail = exc.read(_BODY_LOG_CHARS * 4).decode("utf-8", "replace")
            except (OSError, http.client.HTTPException):
                detail = ""
            return _Response(
                exc.code,
                detail.strip()[:_BODY_LOG_CHARS],
                _parse_retry_after(exc.headers.get("Retry-After") if exc.headers else None),
            )
        except (OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", None) or exc
            return _Response(None, str(reason))

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
