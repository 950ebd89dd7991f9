"""The control plane's HTTP server: runner ingest, health, metrics, and mounted apps.

A plain WSGI application with a small router, served by the standard library's
``wsgiref`` on a pool of long-lived threads, each answer written in one piece (no web
framework: four routes do not need one, and the Slack app mounts under ``/slack/`` as a
WSGI app of its own):

- ``POST /v1/events``: :class:`jobs.ingest.IngestService`, JSON in and out;
- ``POST /v1/credentials``: short-lived checkpoint-store credentials for the caller's own
  run (:class:`CredentialBroker`, on AWS :mod:`jobs.providers.aws_credentials`), with the
  same runner token; 404 when no broker is configured;
- ``GET /healthz``: 200 when the database answers ``SELECT 1``, 503 when it does not;
- ``GET /metrics``: Prometheus text (events, batches by status, ingest latency, open alerts).

The server is the edge that faces instances on the internet, so it never trusts a
request: a body larger than the limit is refused with 413 *before* it is read, a body
without ``Content-Length`` gets 411, a client that stalls is cut off by a socket timeout,
a client that disconnects or speaks broken HTTP costs one quiet log line, and nothing a
request does stops the next one from being served. Errors are logged through
:mod:`logging`, never printed to stderr, and never with the request's token.
"""

from __future__ import annotations

import io
import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from sqlalchemy import Engine, func, select, text
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session

from jobs.errors import NotFound, PermissionDenied
from jobs.ingest import IngestResult, IngestService
from jobs.models import Alert, AlertState, Run
from jobs.providers.base import ProviderError
from jobs.runs import checkpoint_prefix

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

__all__ = [
    "CREDENTIALS_PATH",
    "EVENTS_PATH",
    "ControlPlaneApp",
    "CredentialBroker",
    "IngestMetrics",
    "ServerHandle",
    "serve",
]

log = logging.getLogger(__name__)

EVENTS_PATH = "/v1/events"
CREDENTIALS_PATH = "/v1/credentials"
#: A credentials request carries no body to speak of; a bigger one is refused unread.
_CREDENTIALS_MAX_BODY = 4096
#: Seconds a connection may sit idle (headers or body half sent) before it is dropped.
SOCKET_TIMEOUT_S = 30.0
#: After refusing a body unread, how long and how much to drain before closing.
LINGER_S = 5.0  # a slow client on a busy machine still gets to read its 413
LINGER_MAX_BYTES = 64 << 20
#: Over-limit bodies up to this many times the limit are read and dropped before the 413.
DRAIN_FACTOR = 16
#: Threads answering requests at most; more connections than this wait their turn.
MAX_HANDLER_THREADS = 128
#: Upper bounds of the ingest latency histogram, in seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

_JSON_TYPE = "application/json"
#: Set in the WSGI environ when a request body was refused without being read.
_UNREAD_BODY = "trainbot.unread_body"
_PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
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


class IngestMetrics:
    """Counters of the ingest route, rendered as Prometheus text; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events = {"accepted": 0, "duplicate": 0}
        self._batches: dict[int, int] = {}
        self._buckets = [0] * len(LATENCY_BUCKETS)
        self._latency_sum = 0.0
        self._latency_count = 0

    def record(self, result: IngestResult, seconds: float) -> None:
        """Count one answered batch and how long it took."""
        with self._lock:
            self._batches[result.status] = self._batches.get(result.status, 0) + 1
            if result.status == 200:
                self._events["accepted"] += int(result.body.get("accepted", 0))
                self._events["duplicate"] += int(result.body.get("duplicates", 0))
            for index, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    self._buckets[index] += 1
            self._latency_sum += seconds
            self._latency_count += 1

    def render(self, *, open_alerts: int | None) -> str:
        """The exposition text; ``open_alerts`` is omitted when the database could not say."""
        with self._lock:
            lines = [
                "# HELP trainbot_ingest_events_total Runner events received, by result.",
                "# TYPE trainbot_ingest_events_total counter",
                *(
                    f'trainbot_ingest_events_total{{result="{k}"}} {v}'
                    for k, v in self._events.items()
                ),
                "# HELP trainbot_ingest_batches_total Runner batches answered, by HTTP status.",
                "# TYPE trainbot_ingest_batches_total counter",
                *(
                    f'trainbot_ingest_batches_total{{status="{k}"}} {v}'
                    for k, v in sorted(self._batches.items())
                ),
                "# HELP trainbot_ingest_latency_seconds Time to answer one runner batch.",
                "# TYPE trainbot_ingest_latency_seconds histogram",
                *(
                    f'trainbot_ingest_latency_seconds_bucket{{le="{bound}"}} {count}'
                    for bound, count in zip(LATENCY_BUCKETS, self._buckets, strict=True)
                ),
                f'trainbot_ingest_latency_seconds_bucket{{le="+Inf"}} {self._latency_count}',
                f"trainbot_ingest_latency_seconds_sum {self._latency_sum:.6f}",
                f"trainbot_ingest_latency_seconds_count {self._latency_count}",
            ]
        if open_alerts is not None:
            lines += [
                "# HELP trainbot_alerts_open Alerts open or acknowledged, not yet resolved.",
                "# TYPE trainbot_alerts_open gauge",
                f"trainbot_alerts_open {open_alerts}",
            ]
        return "\n".join(lines) + "\n"


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

    def send(self, start_response: StartResponse) -> list[bytes]:
        headers = [
            ("Content-Type", self.content_type),
            ("Content-Length", str(len(self.body))),
            *self.headers,
        ]
        start_response(f"{self.status} {_REASONS.get(self.status, 'Unknown')}", headers)
        return [self.body]


def _error(status: int, message: str, headers: Sequence[tuple[str, str]] = ()) -> _Reply:
    return _Reply.json(status, {"error": message}, headers)


class CredentialBroker(Protocol):
    """Hands a runner credentials for its own run's checkpoints, and nothing else."""

    def issue(
        self, *, checkpoint_uri: str, run_prefix: str, run_id: str, attempt_id: str
    ) -> dict[str, Any]:
        """``credential_process`` JSON for ``{checkpoint_uri}/{run_prefix}/``. Raises
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
        metrics: IngestMetrics | None = None,
        clock: Callable[[], float] = time.perf_counter,
        credentials: CredentialBroker | None = None,
    ) -> None:
        self._engine = engine
        self._ingest = ingest
        self._credentials = credentials
        self.metrics = metrics or IngestMetrics()
        self._clock = clock
        self._mounts: list[tuple[str, WSGIApplication]] = []
        self._routes: dict[str, dict[str, Callable[[WSGIEnvironment], _Reply]]] = {
            EVENTS_PATH: {"POST": self._events},
            CREDENTIALS_PATH: {"POST": self._issue_credentials},
            "/healthz": {"GET": self._healthz},
            "/metrics": {"GET": self._metrics},
        }

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
        self.metrics.record(result, self._clock() - started)
        headers = [("Retry-After", "5")] if result.status == 503 else []
        return _Reply.json(result.status, result.body, headers)

    def _ingest_request(self, environ: WSGIEnvironment) -> IngestResult:
        """Check the framing, read the body (only when it fits), hand it to the service."""
        environ[_UNREAD_BODY] = True
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
            if length <= DRAIN_FACTOR * limit:
                # Read and drop it, so the client reads the 413 rather than a reset; a
                # body far over the limit is refused unread (the linger below helps).
                _discard(environ["wsgi.input"], length)
                environ[_UNREAD_BODY] = False
            return IngestResult(
                413,
                {
                    "error": f"batch of {length} bytes is over the {limit}-byte limit; "
                    "send fewer events per batch"
                },
            )
        environ[_UNREAD_BODY] = False
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
            environ[_UNREAD_BODY] = True
            return _error(413, "a credentials request takes no body")
        _read_exactly(environ["wsgi.input"], length)
        try:
            runner = self._ingest.runner_of(environ.get("HTTP_AUTHORIZATION"))
        except SQLAlchemyError as exc:
            log.warning("credentials: the database failed: %s", type(exc).__name__)
            return _error(503, "the database is unavailable: retry later", [("Retry-After", "5")])
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
                "TRAINBOT_AWS_RUNNER_STORAGE_ROLE_ARN): the runner uses its instance's own "
                "credentials",
            )
        with Session(self._engine) as session:
            run = session.get(Run, run_id)
            if run is None:  # pragma: no cover - an attempt's run is never deleted
                return _error(404, f"run {run_id} does not exist")
            checkpoint_uri, prefix = run.checkpoint_uri or "", checkpoint_prefix(run)
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

    def _healthz(self, environ: WSGIEnvironment) -> _Reply:
        try:
            with self._engine.connect() as connection:
                connection.execute(text("SELECT 1"))
        except Exception as exc:
            log.warning("health check: the database did not answer: %s", exc)
            return _Reply.json(503, {"ok": False, "db": f"unavailable ({type(exc).__name__})"})
        return _Reply.json(200, {"ok": True, "db": "ok"})

    def _metrics(self, environ: WSGIEnvironment) -> _Reply:
        open_alerts: int | None = None
        try:
            with self._engine.connect() as connection:
                open_alerts = connection.execute(
                    select(func.count())
                    .select_from(Alert)
                    .where(Alert.state.in_([AlertState.OPEN, AlertState.ACKED]))  # type: ignore[attr-defined]
                ).scalar_one()
        except Exception as exc:
            log.warning("metrics: could not count open alerts: %s", exc)
        body = self.metrics.render(open_alerts=open_alerts).encode("utf-8")
        return _Reply(200, body, _PROMETHEUS_TYPE)


def _discard(stream: Any, length: int) -> None:
    left = length
    while left > 0:
        chunk = stream.read(min(left, 1 << 16))
        if not chunk:
            return
        left -= len(chunk)


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


# --- serving -------------------------------------------------------------------------------


class _LogStream(io.TextIOBase):
    """``wsgi.errors`` for wsgiref: what it would print to stderr goes to the log."""

    def write(self, text: str) -> int:
        if text.strip():
            log.warning("wsgi: %s", text.rstrip())
        return len(text)


class _RequestHandler(WSGIRequestHandler):
    timeout = SOCKET_TIMEOUT_S
    #: Buffer the response: wsgiref writes the status line, each header block and the
    #: body separately, and unbuffered each write is a system call that lets another
    #: thread take the interpreter (and keep it for up to 5 ms) before the next one.
    #: Buffered, a small answer leaves in one ``send`` when wsgiref flushes after the body.
    wbufsize = 1 << 16
    _environ: dict[str, Any] | None = None

    def get_environ(self) -> dict[str, Any]:
        self._environ = super().get_environ()
        return self._environ

    def handle(self) -> None:
        super().handle()
        if self._environ is not None and self._environ.get(_UNREAD_BODY):
            self._linger()

    def _linger(self) -> None:
        """Half-close, then drain what the client still sends, briefly, before closing.

        Closing a socket with unread request bytes makes the kernel send a reset, and a
        client still sending its body then sees "connection reset" instead of the 413
        it was answered; draining for a moment lets it read the answer.
        """
        deadline = time.monotonic() + LINGER_S
        drained = 0
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            while drained < LINGER_MAX_BYTES:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.connection.settimeout(remaining)
                chunk = self.connection.recv(1 << 16)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:
        # The request line carries no token (it travels in a header); access logs are
        # debug-level so a busy ingest does not flood the log.
        log.debug("%s %s", self.address_string(), format % args)

    def get_stderr(self) -> io.TextIOBase:
        return _LogStream()


class _HandlerPool:
    """Long-lived threads that answer connections, one at a time each.

    Starting a thread per connection costs more than answering a small request, and the
    accepting thread waits for each new thread to start; here a connection is queued for
    a thread that is already waiting, and a new one is started only when none is spare.
    At most ``max_threads`` exist; beyond that, connections wait their turn. Threads are
    daemons, so a client that stalls never holds up the process's exit.
    """

    def __init__(self, handle: Callable[[Any, Any], None], max_threads: int) -> None:
        self._handle = handle
        self._max = max_threads
        self._queue: queue.SimpleQueue[tuple[Any, Any] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        #: Threads waiting (or about to wait) for a connection, less connections queued.
        self._spare = 0
        self._threads = 0
        self._closed = False

    def submit(self, request: Any, client_address: Any) -> None:
        with self._lock:
            self._spare -= 1
            grow = self._spare < 0 and self._threads < self._max and not self._closed
            if grow:
                self._threads += 1
                name = f"http-{self._threads}"
        self._queue.put((request, client_address))
        if grow:
            threading.Thread(target=self._work, name=name, daemon=True).start()

    def close(self) -> None:
        """Let every thread end once it is done with its connection."""
        with self._lock:
            self._closed = True
            threads = self._threads
        for _ in range(threads):
            self._queue.put(None)

    def _work(self) -> None:
        while True:
            with self._lock:
                self._spare += 1
            item = self._queue.get()
            if item is None:
                return
            self._handle(*item)


class _ThreadingServer(WSGIServer):
    """wsgiref's server, answering on a :class:`_HandlerPool`."""

    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[WSGIRequestHandler]) -> None:
        super().__init__(address, handler)
        self._pool = _HandlerPool(self._answer, MAX_HANDLER_THREADS)

    def process_request(self, request: Any, client_address: Any) -> None:
        self._pool.submit(request, client_address)

    def _answer(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)

    def server_close(self) -> None:
        super().server_close()
        self._pool.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.warning("request from %s failed", client_address[0], exc_info=True)


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


@dataclass(frozen=True)
class ServerHandle:
    """A running server: where it listens, and how to stop it."""

    #: ``http://host:port``.
    url: str
    #: The bound port (the real one when 0 was asked for).
    port: int
    _server: _ThreadingServer
    _thread: threading.Thread

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop accepting, close the socket, and wait for the serving loop to end."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout)


def serve(app: WSGIApplication, host: str = "127.0.0.1", port: int = 8787) -> ServerHandle:
    """Serve ``app`` on threads in the background; ``port=0`` picks a free port."""
    server_class = _ThreadingServer6 if ":" in host else _ThreadingServer  # IPv6 literal
    server = server_class((host, port), _RequestHandler)
    server.set_app(app)
    bound = server.server_address[1]
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="http", daemon=True
    )
    thread.start()
    shown = f"[{host}]" if ":" in host else host
    log.info("control plane listening on http://%s:%d", shown, bound)
    return ServerHandle(url=f"http://{shown}:{bound}", port=bound, _server=server, _thread=thread)
