"""The control plane's HTTP server: runner ingest, health, metrics, and mounted apps.

A plain WSGI application with a small router (no web framework: a handful of routes do
not need one, and the Slack app mounts under ``/slack/`` as a WSGI app of its own):

- ``POST /v1/events``: :class:`jobs.ingest.IngestService`, JSON in and out;
- ``POST /v1/credentials``: short-lived checkpoint-store credentials for the caller's own
  run (:class:`CredentialBroker`: on AWS :mod:`jobs.providers.aws.credentials`, on GCP
  :mod:`jobs.providers.gcp.credentials`), with the same runner token; 404 when no broker
  is configured;
- ``POST /v1/dry-run``: a cloud dry run's instance reports its phase and its report, with
  the dry run's own token (:class:`jobs.ingest.dry_run.DryRunIngest`); the same token
  gets credentials for the run's dry-run directory from ``/v1/credentials``;
- ``GET /v1/runner-wheel[?sha256=HEX]``: the control plane's own trainbot wheel, which
  its instances install (:mod:`jobs.providers.runner_install`, "wheel" mode), to a live
  attempt's or dry run's token only; from memory in chunks, with its length and its
  sha256 (``X-Trainbot-Wheel-Sha256``, ``ETag``); 503 while it is still being built;

and, on a second listener of their own (the admin port, :class:`AdminApp`, loopback by
default), never on the public one:

- ``GET /healthz`` (liveness): 200 while the process answers; never asks the database,
  so a database blip restarts no replica;
- ``GET /readyz`` (readiness): 200 when the database answers ``SELECT 1`` and the public
  port accepts; 503 when the database does not, or once the replica drains for shutdown;
- ``GET /metrics``: Prometheus exposition from :mod:`jobs.web.prometheus` (OpenMetrics when
  the scraper asks for it).

**The server is waitress**, run in-process by :func:`serve` (``trainbot serve``, the
tests' control planes, the benchmarks), chosen over the alternatives because:

- it reads and parses every request on one asynchronous loop and hands the application
  only complete requests, on a fixed pool of threads. A client that trickles its headers
  or its body (slowloris) holds a socket, never a thread, and is dropped at its
  request deadline; gunicorn's sync and threaded workers and cheroot
  give each such client a thread for as long as it trickles;
- it is pure Python, threaded, and runs in-process (a listener per port): it fits a
  synchronous app (Bolt's sync App, SQLAlchemy sessions, STYLE 11) and the tests' port 0.
  gunicorn is a pre-fork master that owns the process (signals, workers): awkward to run
  from a test or next to the scheduler's threads, and Unix only; an async server would
  need an async app.

The server is the edge that faces instances on the internet, so it never trusts a
request. The limits, and where each is enforced:

- **Body size.** A request whose ``Content-Length`` is over the server's cap
  (:data:`DRAIN_FACTOR` times the largest route limit) is refused 413 by waitress from
  its headers, unread. A body over its route's limit but under the cap is received by
  waitress (spooled to a temporary file past 512 KiB, not held in memory) and refused
  413 by the route without being parsed: receiving it lets the client read its 413
  instead of a connection reset. The cap counts the de-chunked bytes of a chunked upload
  as they arrive.
- **No length.** ``POST /v1/events`` without ``Content-Length`` gets 411. Chunked uploads
  are accepted: waitress de-chunks them within the cap and the route sees their length,
  so a proxy that re-chunks a runner's batch does not break ingest.
- **Slow clients.** Every request's head and body must arrive within
  :data:`REQUEST_DEADLINE_S` of its first byte, however steadily it trickles; a connection
  silent for :data:`CHANNEL_TIMEOUT_S` (idle keep-alive) is closed. One client address
  holds at most :data:`MAX_CONNECTIONS_PER_CLIENT` connections; at
  :data:`CONNECTION_LIMIT` the connection with the oldest unfinished request makes room
  for a new one (:mod:`jobs.web.http_listener`). A request being answered is never cut off.
- **Probes and scrapes never queue behind the public port.** The admin port is another
  socket, loop thread and thread pool: a public port full of slow clients, or all of its
  threads busy, does not delay ``/healthz``, so an attack on the public port never gets
  a healthy replica restarted, and a replica that answers ``/healthz`` still serves runners.
- **Broken clients.** Broken HTTP gets a JSON 400 and one log line; a client that hangs
  up costs at most one line (waitress's socket-error tracebacks are off). Nothing a
  request does stops the next one from being served. Errors go through :mod:`logging`,
  never to stderr, and never with the request's token.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session

from jobs.database.models import Run
from jobs.domain.errors import NotFound, PermissionDenied
from jobs.domain.locations import dry_run_prefix
from jobs.ingest import IngestResult, IngestService
from jobs.ingest.dry_run import DryRunIngest
from jobs.providers.base import ProviderError
from jobs.providers.runner_install import SERVED_WHEELS, WHEEL_ROUTE, ServedWheel, ServedWheels
from jobs.runs import checkpoint_prefix
from jobs.web.admin import ADMIN_PATHS, AdminApp
from jobs.web.http_listener import Limits, Listening, listen
from jobs.web.prometheus import ControlPlaneMetrics
from runner.wire import DRY_RUN_ROUTE
from runner.wire.dry_run import MAX_BODY_BYTES as _DRY_RUN_MAX_BODY

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

__all__ = [
    "ADMIN_PATHS",
    "CHANNEL_TIMEOUT_S",
    "CONNECTION_LIMIT",
    "CREDENTIALS_PATH",
    "EVENTS_PATH",
    "MAX_CONNECTIONS_PER_CLIENT",
    "REQUEST_DEADLINE_S",
    "RUNNER_WHEEL_PATH",
    "THREADS",
    "AdminApp",
    "ControlPlaneApp",
    "CredentialBroker",
    "ServerHandle",
    "serve",
]

log = logging.getLogger(__name__)

EVENTS_PATH = "/v1/events"
CREDENTIALS_PATH = "/v1/credentials"
RUNNER_WHEEL_PATH = WHEEL_ROUTE
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
#: A credentials request carries no body to speak of; a bigger one is refused unread.
_CREDENTIALS_MAX_BODY = 4096
#: Seconds a connection may stay silent (idle keep-alive, a response left unread)
#: before it is closed.
CHANNEL_TIMEOUT_S = 30.0
#: Seconds a request's head and body may take to arrive, from its first byte (from the
#: connection's opening for its first request): a runner's largest batch on a slow link
#: takes a fraction of it; a client trickling a line every few seconds is closed at it
#: (``TRAINBOT_REQUEST_DEADLINE_S``).
REQUEST_DEADLINE_S = 20.0
#: How often the deadlines and the silence are checked, in seconds.
_CLEANUP_INTERVAL_S = 1.0
#: Connections held open at once; at the limit the one with the oldest unfinished
#: request makes room for a new one. Far above the clients a control plane has (runners
#: batch once a second, Slack's requests are short).
CONNECTION_LIMIT = 1000
#: Connections at once from one client address (``TRAINBOT_MAX_CONNECTIONS_PER_CLIENT``;
#: 0: no cap, for a server behind a proxy where every client has the proxy's address).
#: A runner holds one at a time; a NAT gateway in front of two hundred runners, or a
#: local provider's runners on 127.0.0.1, fit under it with room for a slow moment.
MAX_CONNECTIONS_PER_CLIENT = 256
#: Threads running the application: requests answered at once. Requests are short
#: (slow work goes to the service's pool), so a few more than the cores keep the CPU busy
#: while some wait on the database; a burst queues for a moment instead of thrashing.
THREADS = 12
#: The server's body cap is this many times the largest route limit: an over-limit body
#: up to the cap is received and dropped, so its client reads the 413, not a reset.
DRAIN_FACTOR = 4
#: The cap's floor, for apps that do not say their limit (a mounted Slack app's 1 MiB).
_DEFAULT_MAX_BODY = 1 << 20
#: The admin port's limits: probes and scrapes are few, short and bodiless.
_ADMIN_LIMITS = Limits(
    threads=2,
    connection_limit=64,
    channel_timeout_s=30.0,
    request_deadline_s=5.0,
    max_connections_per_client=16,
    max_request_body_size=4096,
)

_JSON_TYPE = "application/json"
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Content Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class _Reply:
    """A response before it is sent."""

    def __init__(
        self, status: int, body: bytes, content_type: str, headers: Sequence[tuple[str, str]] = ()
    ) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = list(headers)

    @classmethod
    def json(
        cls, status: int, body: dict[str, Any], headers: Sequence[tuple[str, str]] = ()
    ) -> _Reply:
        return cls(status, json.dumps(body).encode("utf-8"), _JSON_TYPE, headers)

    def send(self, start_response: StartResponse) -> Iterable[bytes]:
        headers = [
            ("Content-Type", self.content_type),
            ("Content-Length", str(len(self.body))),
            *self.headers,
        ]
        start_response(f"{self.status} {_REASONS.get(self.status, 'Unknown')}", headers)
        return [self.body]


class _WheelReply(_Reply):
    """A served wheel, sent in chunks from the bytes read once at its offer."""

    def __init__(self, wheel: ServedWheel) -> None:
        super().__init__(200, b"", "application/octet-stream")
        self.wheel = wheel

    def send(self, start_response: StartResponse) -> Iterable[bytes]:
        served = self.wheel
        start_response(
            "200 OK",
            [
                ("Content-Type", "application/octet-stream"),
                ("Content-Length", str(len(served.data))),
                ("X-Trainbot-Wheel-Sha256", served.wheel.sha256),
                ("ETag", served.etag),
                ("Content-Disposition", f'attachment; filename="{served.wheel.file_name}"'),
                ("Cache-Control", "no-store"),
            ],
        )
        return served.chunks()


def _error(status: int, message: str, headers: Sequence[tuple[str, str]] = ()) -> _Reply:
    return _Reply.json(status, {"error": message}, headers)


class CredentialBroker(Protocol):
    """Hands a runner credentials for its own run's checkpoints, and nothing else."""

    def issue(
        self, *, checkpoint_uri: str, run_prefix: str, run_id: str, attempt_id: str
    ) -> dict[str, Any]:
        """The answer for the run's store, for ``{checkpoint_uri}/{run_prefix}/``: AWS
        ``credential_process`` JSON, or GCP ``{"Version": 1, "Kind": "gcp-access-token",
        "AccessToken", "Expiration"}`` (see ``runner.store.broker``). Raises
        NotFound when the store is not one it serves, PermissionDenied when the prefix
        cannot be scoped, ProviderError when the cloud refused or failed."""
        ...


class ControlPlaneApp:
    """The WSGI application: a fixed route table plus apps mounted under prefixes."""

    def __init__(
        self,
        engine: Engine,
        ingest: IngestService,
        *,
        metrics: ControlPlaneMetrics | None = None,
        clock: Callable[[], float] = time.perf_counter,
        credentials: CredentialBroker | None = None,
        wheels: ServedWheels | None = None,
    ) -> None:
        """``metrics``: the registry to record into and serve (default: a new one of this
        app's own, reading the figures of ``engine``); ``wheels``: the runner wheels it
        serves (default: those this process's providers offer)."""
        self._engine = engine
        self._ingest = ingest
        self._dry_runs = DryRunIngest(engine)
        self._credentials = credentials
        self._wheels = SERVED_WHEELS if wheels is None else wheels
        self.metrics = metrics if metrics is not None else ControlPlaneMetrics(engine)
        self._clock = clock
        self._mounts: list[tuple[str, WSGIApplication]] = []
        self._routes: dict[str, dict[str, Callable[[WSGIEnvironment], _Reply]]] = {
            EVENTS_PATH: {"POST": self._events},
            CREDENTIALS_PATH: {"POST": self._issue_credentials},
            DRY_RUN_ROUTE: {"POST": self._dry_run_report},
            RUNNER_WHEEL_PATH: {"GET": self._runner_wheel},
        }
        #: The admin port's app: health, readiness and metrics (:func:`serve` runs it).
        self.admin = AdminApp(engine, self.metrics)

    @property
    def max_body_bytes(self) -> int:
        """The largest body a route takes (a runner batch); :func:`serve` caps on it."""
        return max(self._ingest.max_body_bytes, _DEFAULT_MAX_BODY)

    def mount(self, prefix: str, app: WSGIApplication) -> None:
        """Serve ``app`` for every path under ``prefix`` (``/slack/`` → ``/slack/events``).

        The mounted app sees ``SCRIPT_NAME`` extended by the prefix and ``PATH_INFO``
        relative to it, as WSGI middleware does; the longest matching prefix wins.
        """
        clean = "/" + prefix.strip("/")
        if clean == "/":
            raise ValueError("mount a prefix such as '/slack', not '/'")
        self._mounts.append((clean, app))
        self._mounts.sort(key=lambda item: len(item[0]), reverse=True)

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        for prefix, app in self._mounts:
            if path == prefix or path.startswith(prefix + "/"):
                environ["SCRIPT_NAME"] = environ.get("SCRIPT_NAME", "") + prefix
                environ["PATH_INFO"] = path[len(prefix) :] or "/"
                return app(environ, start_response)
        methods = self._routes.get(path)
        if methods is None:
            if path in ADMIN_PATHS:
                message = f"{path} is served on the admin port (TRAINBOT_ADMIN_PORT), not here"
                return _error(404, message).send(start_response)
            return _error(404, f"no such endpoint {path!r}").send(start_response)
        method = environ.get("REQUEST_METHOD", "GET")
        handler = methods.get(method)
        if handler is None:
            allowed = ", ".join(sorted(methods))
            return _error(405, f"{path} takes {allowed}, not {method}", [("Allow", allowed)]).send(
                start_response
            )
        try:
            reply = handler(environ)
        except Exception:  # one broken request must not look like a dead server
            log.exception("%s %s failed", method, path)
            reply = _error(500, "internal error; see the control plane's log")
        return reply.send(start_response)

    # --- routes -----------------------------------------------------------------------

    def _events(self, environ: WSGIEnvironment) -> _Reply:
        started = self._clock()
        result = self._ingest_request(environ)
        self.metrics.record_ingest(result.status, result.body, self._clock() - started)
        headers = [("Retry-After", "5")] if result.status == 503 else []
        return _Reply.json(result.status, result.body, headers)

    def _ingest_request(self, environ: WSGIEnvironment) -> IngestResult:
        """Check the framing, read the body (only when it fits), hand it to the service.

        The server has already received the body (within its cap); one over this
        route's limit is left unread in its buffer and dropped with the request.
        """
        raw_length = (environ.get("CONTENT_LENGTH") or "").strip()
        if not raw_length:
            return IngestResult(411, {"error": "send the batch with a Content-Length header"})
        try:
            length = int(raw_length)
        except ValueError:
            length = -1
        if length < 0:
            return IngestResult(400, {"error": f"Content-Length {raw_length!r} is not valid"})
        limit = self._ingest.max_body_bytes
        if length > limit:
            return IngestResult(
                413,
                {
                    "error": f"batch of {length} bytes is over the {limit}-byte limit; "
                    "send fewer events per batch"
                },
            )
        body = _read_exactly(environ["wsgi.input"], length)
        if len(body) < length:
            return IngestResult(400, {"error": f"body ended after {len(body)} of {length} bytes"})
        return self._ingest.handle(environ.get("HTTP_AUTHORIZATION"), body)

    def _issue_credentials(self, environ: WSGIEnvironment) -> _Reply:
        """Credentials scoped to the token's run, for a live attempt only.

        The token is checked against the database on every call (not the look-up cache),
        so an attempt that ended a moment ago gets nothing. Neither the token nor the
        credentials are ever logged.
        """
        try:
            length = int((environ.get("CONTENT_LENGTH") or "0").strip() or "0")
        except ValueError:
            return _error(400, "Content-Length is not valid")
        if length > _CREDENTIALS_MAX_BODY or length < 0:
            return _error(413, "a credentials request takes no body")
        _read_exactly(environ["wsgi.input"], length)
        authorization = environ.get("HTTP_AUTHORIZATION")
        dry_run = None
        try:
            runner = self._ingest.runner_of(authorization)
            if runner is None:
                dry_run = self._dry_runs.principal(authorization)
        except SQLAlchemyError as exc:
            log.warning("credentials: the database failed: %s", type(exc).__name__)
            return _error(503, "the database is unavailable: retry later", [("Retry-After", "5")])
        if dry_run is not None:
            # A dry run's instance: its run's dry-run directory, and nothing else.
            runner = (dry_run.run_id, dry_run.dry_run_id)
        if runner is None:
            return _error(
                401,
                "unknown or revoked runner token (send 'Authorization: Bearer <token>'): "
                "the attempt has ended or the token is wrong",
            )
        run_id, attempt_id = runner
        if self._credentials is None:
            return _error(
                404,
                "the credential broker is not configured on this control plane (set "
                "TRAINBOT_AWS_RUNNER_STORAGE_ROLE_ARN on AWS or "
                "TRAINBOT_GCP_RUNNER_STORAGE_SERVICE_ACCOUNT on GCP): the runner uses its "
                "instance's own credentials",
            )
        with Session(self._engine) as session:
            run = session.get(Run, run_id)
            if run is None:  # pragma: no cover - an attempt's run is never deleted
                return _error(404, f"run {run_id} does not exist")
            checkpoint_uri, prefix = run.checkpoint_uri or "", checkpoint_prefix(run)
        if dry_run is not None:
            prefix = dry_run_prefix(run_id)
        try:
            body = self._credentials.issue(
                checkpoint_uri=checkpoint_uri,
                run_prefix=prefix,
                run_id=run_id,
                attempt_id=attempt_id,
            )
        except NotFound as exc:
            return _error(404, f"the credential broker is not configured for this run: {exc}")
        except PermissionDenied as exc:
            log.warning("credentials for attempt %s refused: %s", attempt_id, exc)
            return _error(403, str(exc))
        except ProviderError as exc:
            log.warning("credentials for attempt %s failed: %s", attempt_id, exc)
            return _error(
                503, "the cloud did not issue credentials: retry later", [("Retry-After", "5")]
            )
        return _Reply.json(200, body, [("Cache-Control", "no-store")])

    def _runner_wheel(self, environ: WSGIEnvironment) -> _Reply:
        """The wheel an instance installs, to a live attempt's (or node's) or dry run's
        token; ``?sha256=`` picks the one its boot script names (a replica of another
        build answers 404, and the instance tries again)."""
        if (environ.get("CONTENT_LENGTH") or "0").strip() not in ("", "0"):
            return _error(413, f"GET {RUNNER_WHEEL_PATH} takes no body")
        authorization = environ.get("HTTP_AUTHORIZATION")
        try:
            known = self._ingest.runner_of(authorization) is not None or (
                self._dry_runs.principal(authorization) is not None
            )
        except SQLAlchemyError as exc:
            log.warning("runner wheel: the database failed: %s", type(exc).__name__)
            return _error(503, "the database is unavailable: retry later", [("Retry-After", "5")])
        if not known:
            return _error(
                401,
                "unknown or revoked runner token (send 'Authorization: Bearer <token>'): "
                "the attempt has ended or the token is wrong",
            )
        query = parse_qs(environ.get("QUERY_STRING") or "")
        digest = (query.get("sha256") or [None])[0]
        if digest is not None and not _SHA256.fullmatch(digest):
            return _error(400, "sha256 takes the wheel's 64 hex digits")
        served = self._wheels.find(digest)
        if served is not None:
            return _WheelReply(served)
        if self._wheels.preparing:
            return _error(
                503, "the runner wheel is still being built: retry", [("Retry-After", "5")]
            )
        which = f" of sha256 {digest}" if digest else ""
        return _error(
            404,
            f"this control plane has no runner wheel{which}: it serves the wheel its providers "
            "install in wheel mode (TRAINBOT_<CLOUD>_RUNNER_INSTALL), of its own build",
        )

    def _dry_run_report(self, environ: WSGIEnvironment) -> _Reply:
        """A dry run's phase or report (:class:`DryRunIngest`); the token is never logged."""
        try:
            length = int((environ.get("CONTENT_LENGTH") or "").strip())
        except ValueError:
            return _error(411, "send the report with a valid Content-Length header")
        if length < 0 or length > _DRY_RUN_MAX_BODY:
            return _error(413, f"a dry-run report takes at most {_DRY_RUN_MAX_BODY} bytes")
        body = _read_exactly(environ["wsgi.input"], length)
        if len(body) < length:
            return _error(400, f"body ended after {len(body)} of {length} bytes")
        result = self._dry_runs.handle(environ.get("HTTP_AUTHORIZATION"), body)
        headers = [("Retry-After", "5")] if result.status == 503 else []
        return _Reply.json(result.status, result.body, headers)


def _read_exactly(stream: Any, length: int) -> bytes:
    """Up to ``length`` bytes; fewer only when the client went away."""
    parts: list[bytes] = []
    remaining = length
    while remaining > 0:
        try:
            chunk = stream.read(min(remaining, 1 << 20))
        except OSError:  # a timeout or a reset: the client went away
            break
        if not chunk:
            break
        parts.append(chunk)
        remaining -= len(chunk)
    return b"".join(parts)


# --- serving ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerHandle:
    """A running control plane server: its public port and its admin port."""

    #: The public port's ``http://host:port`` (Slack, runner ingest).
    url: str
    #: The public port (the real one when 0 was asked for).
    port: int
    #: The admin port's ``http://host:port`` (health, readiness, metrics); None without one.
    admin_url: str | None
    #: The admin port; None without one.
    admin_port: int | None
    _public: Listening
    _admin: Listening | None

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop accepting on the public port, let the requests being answered finish (up
        to ``timeout``), close its connections; then the admin port, which answered
        probes (``/readyz``: 503) all along."""
        self._public.shutdown(timeout)
        if self._admin is not None:
            self._admin.shutdown(1.0)


def serve(
    app: WSGIApplication,
    host: str = "127.0.0.1",
    port: int = 8787,
    *,
    admin_host: str = "127.0.0.1",
    admin_port: int | None = 0,
    max_body_bytes: int | None = None,
    request_deadline_s: float | None = None,
    max_connections_per_client: int | None = None,
) -> ServerHandle:
    """Serve ``app`` with waitress on background threads; ``port=0`` picks a free port.

    A :class:`ControlPlaneApp` gets its :class:`AdminApp` on ``admin_host:admin_port``
    (another listener, loop and thread pool; ``None``: no admin port). ``max_body_bytes``:
    the largest body a route takes (default: the app's own ``max_body_bytes`` for a
    :class:`ControlPlaneApp`, else 1 MiB); the server refuses bodies over
    :data:`DRAIN_FACTOR` times it unread. ``request_deadline_s`` and
    ``max_connections_per_client``: the public port's bounds (default
    :data:`REQUEST_DEADLINE_S`, :data:`MAX_CONNECTIONS_PER_CLIENT`; 0 turns the cap off).
    """
    if max_body_bytes is None:
        max_body_bytes = (
            app.max_body_bytes if isinstance(app, ControlPlaneApp) else _DEFAULT_MAX_BODY
        )
    # waitress warns at each request that waits for a thread; a burst is normal here, so
    # only its errors are logged.
    logging.getLogger("waitress.queue").setLevel(logging.ERROR)
    limits = Limits(
        threads=THREADS,
        connection_limit=CONNECTION_LIMIT,
        channel_timeout_s=CHANNEL_TIMEOUT_S,
        request_deadline_s=REQUEST_DEADLINE_S if request_deadline_s is None else request_deadline_s,
        max_connections_per_client=(
            MAX_CONNECTIONS_PER_CLIENT
            if max_connections_per_client is None
            else max_connections_per_client
        ),
        max_request_body_size=DRAIN_FACTOR * max_body_bytes + 1,
        cleanup_interval_s=_CLEANUP_INTERVAL_S,
    )
    public = listen(app, host, port, name="public", limits=limits)
    log.info("control plane listening on %s", public.url)
    admin: Listening | None = None
    if isinstance(app, ControlPlaneApp) and admin_port is not None:
        try:
            admin = listen(
                app.admin.watching(lambda: public.accepting),
                admin_host,
                admin_port,
                name="admin",
                limits=_ADMIN_LIMITS,
            )
        except BaseException:
            public.shutdown(0.1)
            raise
        log.info("health, readiness and metrics on %s", admin.url)
    return ServerHandle(
        url=public.url,
        port=public.port,
        admin_url=admin.url if admin is not None else None,
        admin_port=admin.port if admin is not None else None,
        _public=public,
        _admin=admin,
    )
