"""Turn preemption into a flag the training loop checks between steps.

A spot instance is taken back with little warning: SIGTERM from the local provider or an
orchestrator, a notice on AWS's instance metadata (``spot/instance-action``, about 120 s
before the end) or GCE's (``instance/preempted``, about 30 s). Whatever the source, the
only thing that happens at once is that a :class:`PreemptionFlag` is set; the loop sees it
at the next step boundary, decides with :func:`flush_fits` whether an emergency checkpoint
fits the time left, and exits with ``EXIT_PREEMPTED``. Nothing is done inside a signal
handler except setting plain attributes, so an interrupted lock holder cannot deadlock.

Only the standard library is used: the runner must stay light on every instance.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from types import FrameType, TracebackType
from typing import Any, Protocol
from urllib.parse import quote, urlsplit

from runner.errors import RunnerError

__all__ = [
    "ASSUMED_BANDWIDTH_BPS",
    "AWS_TOKEN_TTL_S",
    "SOURCES",
    "WINDOWS_S",
    "AwsSpotPoller",
    "GcpPreemptedPoller",
    "Notice",
    "Poller",
    "Pollers",
    "PreemptionConfigError",
    "PreemptionError",
    "PreemptionFlag",
    "SignalHandlers",
    "SignalSetupError",
    "aws_notice",
    "flush_fits",
    "start_pollers",
    "termination_window_s",
    "write_seconds",
]

log = logging.getLogger(__name__)

#: Where a notice can come from.
SOURCES = ("signal", "aws", "gcp", "stop")
#: With no write bandwidth measured yet, an emergency checkpoint is attempted only when at
#: least this much time is left: AWS's 120 s window qualifies, GCE's 30 s does not, since a
#: torn flush there would cost the upload and still lose the step.
#: Write bandwidth assumed before any save has been measured: a cautious figure for an
#: object store over the network (25 MB/s), so a first emergency flush of a small state
#: still happens and one of many gigabytes is not started in a 30 s window.
#: Termination windows of the providers: seconds between the notice and the kill.
WINDOWS_S = {"aws": 120.0, "gcp": 30.0}
ASSUMED_BANDWIDTH_BPS = 25e6
#: How often a main-thread waiter re-reads the flag: a signal handler cannot wake it
#: through an Event (that takes a lock), so it notices within this long instead.
_WAIT_SLICE_S = 0.05
#: AWS's maximum token lifetime; the poller asks for it and refreshes before it ends.
AWS_TOKEN_TTL_S = 21600


class PreemptionError(RunnerError):
    """Preemption handling could not be set up."""


class SignalSetupError(PreemptionError):
    """Signal handlers could not be installed."""


class PreemptionConfigError(PreemptionError):
    """A preemption source, metadata URL or termination window is not usable."""


@dataclass(frozen=True)
class Notice:
    """That the instance is going away, and by when."""

    #: "signal", "aws", "gcp" or "stop" (a stop request, e.g. from the control plane).
    source: str
    #: Human text: "SIGTERM", "spot instance-action terminate at 2026-11-29T17:05:00Z".
    reason: str
    #: time.monotonic() when the notice was seen.
    received_at: float
    #: time.monotonic() by which the instance will be killed.
    deadline: float

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"notice source {self.source!r} is not one of {', '.join(SOURCES)}")


class PreemptionFlag:
    """Set once by whoever sees preemption first; read by the loop between steps.

    Thread-safe without a lock on the setting path: notices are appended to a list (one
    atomic operation under the GIL) and merged when read. A signal handler runs on the
    main thread between bytecodes, possibly while that thread holds some lock; taking any
    lock there could deadlock, so :meth:`set` takes none and only wakes waiters through
    an Event when it runs on another thread (which can never be a signal handler).
    """

    def __init__(self) -> None:
        self._notices: list[Notice] = []
        self._wake = threading.Event()

    def set(self, notice: Notice) -> None:
        """Record a notice. The first one is kept; a later one may only bring the deadline
        forward, because the instance dies at the earliest deadline anyone announced."""
        current = self.notice
        if current is None or notice.deadline < current.deadline:
            self._notices.append(notice)
        if threading.current_thread() is not threading.main_thread():
            self._wake.set()

    @property
    def is_set(self) -> bool:
        return bool(self._notices)

    @property
    def notice(self) -> Notice | None:
        """The first notice, with the earliest deadline seen since."""
        notices = tuple(self._notices)
        if not notices:
            return None
        first = notices[0]
        deadline = min(n.deadline for n in notices)
        return first if deadline == first.deadline else replace(first, deadline=deadline)

    def time_left(self, now: float | None = None) -> float | None:
        """Seconds until the deadline (never below 0); None when no notice was seen."""
        notice = self.notice
        if notice is None:
            return None
        now = time.monotonic() if now is None else now
        return max(0.0, notice.deadline - now)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the flag is set or ``timeout`` passes; True when set.

        Waits in short slices so that a flag set by a signal handler (which does not
        touch the Event) is seen within ``_WAIT_SLICE_S``.
        """
        end = None if timeout is None else time.monotonic() + timeout
        while not self.is_set:
            slice_s = _WAIT_SLICE_S
            if end is not None:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return False
                slice_s = min(slice_s, remaining)
            self._wake.wait(slice_s)
        return True


_Handler = Callable[[int, FrameType | None], Any] | int | None


class SignalHandlers:
    """Install flag-setting handlers for the duration of a ``with`` block.

    Like Lightning's signal connector: the originals are saved on entry and restored on
    exit, so the runner composes with whatever the training script installed. A SIGINT
    that arrives after this block already received a signal is passed to the original
    SIGINT handler (by default Python's, which raises KeyboardInterrupt): Ctrl-C once
    asks for a clean stop at the next step, Ctrl-C twice still interrupts at once.
    Repeated SIGTERMs only re-set the flag; orchestrators follow up with SIGKILL anyway.
    """

    def __init__(
        self,
        flag: PreemptionFlag,
        *,
        window_s: float,
        signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
    ) -> None:
        self._flag = flag
        self._window_s = window_s
        self._signals = tuple(signals)
        self._originals: dict[int, _Handler] = {}
        self._received = False

    def __enter__(self) -> SignalHandlers:
        if threading.current_thread() is not threading.main_thread():
            raise SignalSetupError(
                "preemption signal handlers can only be installed from the main thread "
                f"(this is {threading.current_thread().name!r}); enter SignalHandlers "
                "where the training loop starts, before starting other threads"
            )
        if self._originals:
            raise SignalSetupError("these SignalHandlers are already installed; use a new one")
        self._received = False
        for signum in self._signals:
            self._originals[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        originals, self._originals = self._originals, {}
        for signum, original in originals.items():
            # None: the handler was not installed from Python; the default is the best guess.
            signal.signal(signum, signal.SIG_DFL if original is None else original)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Runs between bytecodes on the main thread: plain attribute writes only.
        if signum == signal.SIGINT and self._received:
            self._escalate(signum, frame)
            return
        self._received = True
        now = time.monotonic()
        self._flag.set(
            Notice(
                source="signal",
                reason=signal.Signals(signum).name,
                received_at=now,
                deadline=now + self._window_s,
            )
        )

    def _escalate(self, signum: int, frame: FrameType | None) -> None:
        original = self._originals.get(signum)
        if callable(original):
            original(signum, frame)
        elif original != signal.SIG_IGN:
            raise KeyboardInterrupt


def flush_fits(
    *,
    nbytes: int,
    bandwidth_bps: float | None,
    time_left_s: float | None,
    overhead_s: float = 1.0,
    safety: float = 1.5,
) -> bool:
    """Whether an emergency checkpoint of ``nbytes`` can finish before the deadline.

    A flush that cannot finish is worse than none: it spends the window and leaves a torn
    step. The estimate is ``overhead_s + safety * nbytes / bandwidth_bps <= time_left_s``
    from the write bandwidth measured on earlier saves. With no measurement yet it assumes
    :data:`ASSUMED_BANDWIDTH_BPS`. With no deadline known
    (``time_left_s`` None) it always fits.
    """
    if nbytes < 0:
        raise ValueError(f"checkpoint size must be >= 0 bytes, got {nbytes}")
    if time_left_s is None:
        return True
    return overhead_s + safety * write_seconds(nbytes, bandwidth_bps) <= time_left_s


def write_seconds(nbytes: int, bandwidth_bps: float | None) -> float:
    """How long writing ``nbytes`` takes at the measured bandwidth, or at
    :data:`ASSUMED_BANDWIDTH_BPS` with no measurement yet."""
    if bandwidth_bps is None or bandwidth_bps <= 0:
        bandwidth_bps = ASSUMED_BANDWIDTH_BPS
    return nbytes / bandwidth_bps


#: When the emergency checkpoint fits the termination window, the share of preemptions
#: still assumed to come without a usable notice (a lost host, a notice that never
#: arrives, a kill before the flush ends). Only those need periodic checkpoints.
UNANNOUNCED_SHARE = 0.1


def daly_interval(checkpoint_s: float, mtbp_s: float) -> float:
    """Daly's first-order optimum √(2CM) − C, never shorter than one checkpoint."""
    if not (checkpoint_s > 0 and mtbp_s > 0 and math.isfinite(checkpoint_s * mtbp_s)):
        raise RunnerError("Daly's interval needs a positive checkpoint time and MTBP")
    return max(checkpoint_s, math.sqrt(2 * checkpoint_s * mtbp_s) - checkpoint_s)


@dataclass(frozen=True)
class IntervalChoice:
    """A checkpoint interval and the figures it came from (all seconds)."""

    #: Seconds between checkpoints: max(``floor_s``, Daly(``cost_s``, ``mtbp_s``)).
    interval_s: float
    #: Daly's C: how long one save blocks the loop (the stall; the write if unmeasured).
    cost_s: float
    #: Daly's M: mean time between the preemptions that lose the work since the last
    #: checkpoint, i.e. those whose emergency checkpoint does not fit.
    mtbp_s: float
    #: The write time: one save in flight at a time, so no interval is shorter.
    floor_s: float


def choose_interval(
    *,
    write_s: float,
    stall_s: float | None,
    mtbp_s: float,
    flush_fits_window: bool,
    unannounced_share: float = UNANNOUNCED_SHARE,
) -> IntervalChoice:
    """The checkpoint interval for an asynchronous writer.

    C is the stall, because the write runs beside the next steps; the write time is the
    floor. M counts only preemptions that lose work: all of them when the emergency
    checkpoint does not fit the termination window, else the ``unannounced_share`` that
    comes without a usable notice (the others cost a flush, whatever the interval).
    """
    if not (write_s > 0 and math.isfinite(write_s)):
        raise RunnerError(f"the checkpoint write time must be positive (got {write_s})")
    if not 0 < unannounced_share <= 1:
        raise RunnerError(f"unannounced_share must be in (0, 1] (got {unannounced_share})")
    cost = stall_s if stall_s is not None and stall_s > 0 else write_s
    effective = mtbp_s / unannounced_share if flush_fits_window else mtbp_s
    interval = max(write_s, daly_interval(cost, effective))
    return IntervalChoice(interval_s=interval, cost_s=cost, mtbp_s=effective, floor_s=write_s)


# --- metadata pollers ------------------------------------------------------------------


class Poller(Protocol):
    """A background watcher that sets the flag when its metadata server says so."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    @property
    def running(self) -> bool: ...


class _Unavailable(Exception):
    """The metadata server answered, but not usefully; retried like a network error."""


#: What a network problem with the metadata server looks like; the pollers retry these.
_NETWORK_ERRORS = (OSError, http.client.HTTPException, _Unavailable)


@dataclass(frozen=True)
class _Reply:
    status: int
    body: bytes
    etag: str | None


class _Endpoint:
    """A metadata server's base URL, checked once. Plain http.client, no urllib: proxy
    variables must never route a link-local metadata request elsewhere."""

    def __init__(self, base_url: str, *, what: str) -> None:
        parts = urlsplit(base_url)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme != "http" or not parts.hostname or port == -1:
            raise PreemptionConfigError(
                f"{what} metadata URL {base_url!r} is not usable; give an http:// URL such "
                "as http://169.254.169.254 (AWS) or http://metadata.google.internal (GCP)"
            )
        self.host = parts.hostname
        self.port = port or 80
        self.prefix = parts.path.rstrip("/")

    def connect(self, *, timeout: float) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        conn.connect()
        return conn


def _exchange(
    conn: http.client.HTTPConnection, method: str, path: str, headers: Mapping[str, str]
) -> _Reply:
    conn.request(method, path, headers=dict(headers))
    resp = conn.getresponse()
    body = resp.read()
    return _Reply(status=resp.status, body=body, etag=resp.getheader("ETag"))


def _parse_wallclock(text: str) -> float:
    """Seconds since the epoch of an ISO 8601 time; naive times are UTC (as AWS's are)."""
    stamp = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()


def aws_notice(body: bytes, *, received_at: float, wall_now: float, window_s: float) -> Notice:
    """The notice for an ``instance-action`` answer. The deadline comes from AWS's
    wall-clock ``time``, moved onto the monotonic clock; if that is unreadable, the
    usual window from ``received_at`` stands in."""
    action, when = "unknown", ""
    deadline = received_at + window_s
    try:
        doc = json.loads(body)
        action = str(doc.get("action", action))
        when = str(doc["time"])
        deadline = received_at + (_parse_wallclock(when) - wall_now)
    except (ValueError, TypeError, KeyError, AttributeError):
        log.debug("unreadable spot instance-action %r; assuming %.0f s", body[:200], window_s)
    reason = f"spot instance-action {action}" + (f" at {when}" if when else "")
    return Notice(source="aws", reason=reason, received_at=received_at, deadline=deadline)


class _PollerThread:
    """The start/stop life of a daemon thread that sleeps on an Event, so stop() is prompt."""

    name = "trainbot-poller"

    def __init__(self) -> None:
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._guarded, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._interrupt()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _guarded(self) -> None:
        try:
            self._run()
        except Exception:  # a watcher that dies silently is worse than a noisy one
            log.exception("%s stopped unexpectedly; preemption notices from it are lost", self)

    def _run(self) -> None:
        raise NotImplementedError

    def _interrupt(self) -> None:
        """Abort a request in flight, for pollers that block on one."""


class AwsSpotPoller(_PollerThread):
    """Poll IMDSv2 ``spot/instance-action``, which appears about two minutes before AWS
    interrupts a spot instance (before the SIGTERM the shutdown sends, if any)."""

    name = "trainbot-aws-spot-poller"

    def __init__(
        self,
        flag: PreemptionFlag,
        *,
        base_url: str = "http://169.254.169.254",
        interval_s: float = 5.0,
        window_s: float = 120.0,
        timeout_s: float = 2.0,
        token_ttl_s: int = AWS_TOKEN_TTL_S,
    ) -> None:
        super().__init__()
        self._flag = flag
        self._endpoint = _Endpoint(base_url, what="AWS")
        self._interval_s = interval_s
        self._window_s = window_s
        self._timeout_s = timeout_s
        self._token_ttl_s = token_ttl_s
        self._token: str | None = None
        self._token_renew_at = 0.0

    def __repr__(self) -> str:
        return f"AwsSpotPoller({self._endpoint.host}:{self._endpoint.port})"

    def _run(self) -> None:
        while not self._stopping.is_set():
            if self.poll_once():
                return
            self._stopping.wait(self._interval_s)

    def poll_once(self) -> bool:
        """Ask once; True when a notice was seen (and the flag set). Never raises for
        network trouble: the metadata server may be briefly unreachable."""
        try:
            reply = self._get_action()
            if reply.status == 401:  # token expired or revoked: one fresh try
                self._token = None
                reply = self._get_action()
        except _NETWORK_ERRORS as exc:
            log.debug("AWS metadata not reachable (%s); polling again", exc)
            return False
        if reply.status == 404:
            return False
        if reply.status != 200:
            log.debug("AWS instance-action answered HTTP %s; polling again", reply.status)
            return False
        notice = aws_notice(
            reply.body,
            received_at=time.monotonic(),
            wall_now=time.time(),
            window_s=self._window_s,
        )
        self._flag.set(notice)
        log.warning("preemption notice from AWS: %s", notice.reason)
        return True

    def _get_action(self) -> _Reply:
        token = self._ensure_token()
        path = self._endpoint.prefix + "/latest/meta-data/spot/instance-action"
        return self._request("GET", path, {"X-aws-ec2-metadata-token": token})

    def _ensure_token(self) -> str:
        if self._token is not None and time.monotonic() < self._token_renew_at:
            return self._token
        asked_at = time.monotonic()
        reply = self._request(
            "PUT",
            self._endpoint.prefix + "/latest/api/token",
            {"X-aws-ec2-metadata-token-ttl-seconds": str(self._token_ttl_s)},
        )
        if reply.status != 200 or not reply.body.strip():
            raise _Unavailable(f"token request answered HTTP {reply.status}")
        self._token = reply.body.decode("ascii", "replace").strip()
        # Renew a quarter-TTL (at most a minute) early, counted from before the request.
        self._token_renew_at = asked_at + self._token_ttl_s - min(60.0, self._token_ttl_s / 4)
        return self._token

    def _request(self, method: str, path: str, headers: Mapping[str, str]) -> _Reply:
        conn = self._endpoint.connect(timeout=self._timeout_s)
        try:
            return _exchange(conn, method, path, headers)
        finally:
            conn.close()


class GcpPreemptedPoller(_PollerThread):
    """Long-poll GCE's ``instance/preempted``, which turns TRUE about 30 s before the
    instance is stopped. Each long poll is bounded by ``timeout_s`` on the server side,
    and stop() shuts the pending socket down, so stopping never waits for one."""

    name = "trainbot-gcp-preempted-poller"

    def __init__(
        self,
        flag: PreemptionFlag,
        *,
        base_url: str = "http://metadata.google.internal",
        window_s: float = 30.0,
        timeout_s: float = 10.0,
        retry_s: float = 1.0,
        max_retry_s: float = 30.0,
    ) -> None:
        super().__init__()
        self._flag = flag
        self._endpoint = _Endpoint(base_url, what="GCP")
        self._window_s = window_s
        self._timeout_sec = max(1, math.ceil(timeout_s))
        self._retry_s = retry_s
        self._max_retry_s = max_retry_s
        self._lock = threading.Lock()  # guards _conn between the poller and stop()
        self._conn: http.client.HTTPConnection | None = None

    def __repr__(self) -> str:
        return f"GcpPreemptedPoller({self._endpoint.host}:{self._endpoint.port})"

    def _run(self) -> None:
        etag: str | None = None
        first = True
        backoff = self._retry_s
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                value, etag = self._ask(etag, wait=not first)
            except _NETWORK_ERRORS as exc:
                if self._stopping.is_set():
                    return
                log.debug("GCE metadata not reachable (%s); retrying in %.1f s", exc, backoff)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, self._max_retry_s)
                continue
            backoff = self._retry_s
            if value == "TRUE":
                now = time.monotonic()
                self._flag.set(
                    Notice(
                        source="gcp",
                        reason="GCE instance preempted",
                        received_at=now,
                        deadline=now + self._window_s,
                    )
                )
                log.warning("preemption notice from GCE metadata")
                return
            # A long poll that answers FALSE early means the server is not waiting; do
            # not spin on it.
            if not first and time.monotonic() - started < self._timeout_sec / 2:
                self._stopping.wait(self._retry_s)
            first = False

    def _ask(self, etag: str | None, *, wait: bool) -> tuple[str, str | None]:
        path = self._endpoint.prefix + "/computeMetadata/v1/instance/preempted"
        if wait:
            path += f"?wait_for_change=true&timeout_sec={self._timeout_sec}"
            if etag:
                path += "&last_etag=" + quote(etag, safe="")
        conn = self._endpoint.connect(timeout=self._timeout_sec + 2.0)
        with self._lock:
            if self._stopping.is_set():
                conn.close()
                raise _Unavailable("stopping")
            self._conn = conn
        try:
            reply = _exchange(conn, "GET", path, {"Metadata-Flavor": "Google"})
        finally:
            with self._lock:
                self._conn = None
            conn.close()
        if reply.status != 200:
            raise _Unavailable(f"instance/preempted answered HTTP {reply.status}")
        value = reply.body.decode("ascii", "replace").strip().upper()
        return value, reply.etag or etag

    def _interrupt(self) -> None:
        with self._lock:
            conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)


# --- wiring ------------------------------------------------------------------------------


class Pollers:
    """The pollers one runner started; stop them all on the way out."""

    def __init__(self, pollers: Sequence[Poller]) -> None:
        self.pollers = tuple(pollers)

    def stop(self) -> None:
        for poller in self.pollers:
            poller.stop()

    def __enter__(self) -> Pollers:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def termination_window_s(env: Mapping[str, str] | None = None, *, default: float) -> float:
    """The termination window from ``TRAINBOT_TERMINATION_WINDOW_S``, else ``default``."""
    env = os.environ if env is None else env
    raw = env.get("TRAINBOT_TERMINATION_WINDOW_S", "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise PreemptionConfigError(
            f"TRAINBOT_TERMINATION_WINDOW_S={raw!r} is not a positive number of seconds; "
            "set it to e.g. 120 (AWS) or 30 (GCP), or unset it for the provider's default"
        )
    return value


def _parse_sources(sources: str) -> list[str]:
    names = [part.strip().lower() for part in sources.split(",") if part.strip()]
    unknown = [name for name in names if name not in ("aws", "gcp", "none")]
    if unknown:
        raise PreemptionConfigError(
            f"unknown preemption source {unknown[0]!r} in {sources!r}; use a comma list of "
            "'aws' and 'gcp', or 'none' for a local run"
        )
    if "none" in names and len(names) > 1:
        raise PreemptionConfigError(
            f"preemption sources {sources!r} combine 'none' with others; give either "
            "'none' or a list of 'aws' and 'gcp'"
        )
    return list(dict.fromkeys(name for name in names if name != "none"))


def start_pollers(
    flag: PreemptionFlag, *, sources: str, env: Mapping[str, str] | None = None
) -> Pollers:
    """Start the metadata pollers named in ``sources`` ("aws", "gcp", "aws,gcp", "none"
    or "" for local runs). Everything is validated before any thread starts."""
    env = os.environ if env is None else env
    pollers: list[_PollerThread] = []
    for name in _parse_sources(sources):
        if name == "aws":
            pollers.append(
                AwsSpotPoller(
                    flag,
                    base_url=env.get("TRAINBOT_AWS_METADATA_URL") or "http://169.254.169.254",
                    window_s=termination_window_s(env, default=120.0),
                )
            )
        else:
            pollers.append(
                GcpPreemptedPoller(
                    flag,
                    base_url=env.get("TRAINBOT_GCP_METADATA_URL")
                    or "http://metadata.google.internal",
                    window_s=termination_window_s(env, default=30.0),
                )
            )
    for poller in pollers:
        poller.start()
    return Pollers(pollers)
