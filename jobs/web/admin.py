"""The admin port's app: ``/healthz``, ``/readyz`` and ``/metrics``.

:func:`jobs.web.server.serve` runs it on a listener of its own, so that probes and scrapes
never queue behind the public port, and the public port shows nobody the figures.

Liveness and readiness ask different questions, because a platform acts on them
differently: a failing liveness probe restarts the container, a failing readiness probe
only takes it out of the load balancer.

- ``/healthz`` (liveness): this process answers. It never touches the database, so a
  database blip, which every replica sees at once, does not restart every replica (a
  restart would not bring the database back, and would drop the requests in flight).
- ``/readyz`` (readiness): the database answers ``SELECT 1`` and the public port takes
  connections; 503 otherwise (the database away, or the replica draining to stop).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from sqlalchemy import Engine, text

from jobs.web.prometheus import ControlPlaneMetrics

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

__all__ = ["ADMIN_PATHS", "AdminApp"]

log = logging.getLogger(__name__)

#: The admin port's paths; the public port answers 404 for them.
ADMIN_PATHS = ("/healthz", "/readyz", "/metrics")
_REASONS = {
    200: "OK",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class _Answer(NamedTuple):
    status: int
    body: bytes
    content_type: str
    headers: Sequence[tuple[str, str]] = ()


def _json(status: int, body: object, headers: Sequence[tuple[str, str]] = ()) -> _Answer:
    return _Answer(status, json.dumps(body).encode("utf-8"), "application/json", headers)


class AdminApp:
    """The admin port's WSGI app: ``/healthz``, ``/readyz`` and ``/metrics``, unauthenticated.

    It lives on a listener of its own (loopback, or the pod network), so a public port
    full of slow clients never delays a probe or a scrape, and the runners' public port
    shows nobody the control plane's figures.
    """

    def __init__(
        self,
        engine: Engine,
        metrics: ControlPlaneMetrics,
        *,
        accepting: Callable[[], bool] = lambda: True,
    ) -> None:
        """``accepting``: whether the public port takes connections (``/readyz``)."""
        self._engine = engine
        self.metrics = metrics
        self._accepting = accepting
        self._routes: dict[str, Callable[[WSGIEnvironment], _Answer]] = {
            "/healthz": self._healthz,
            "/readyz": self._readyz,
            "/metrics": self._metrics,
        }

    def watching(self, accepting: Callable[[], bool]) -> AdminApp:
        """The same app, ready only while ``accepting()`` (the public listener's state)."""
        return AdminApp(self._engine, self.metrics, accepting=accepting)

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        handler = self._routes.get(path)
        if handler is None:
            reply = _json(
                404, {"error": f"no such endpoint {path!r}; this port serves {ADMIN_PATHS}"}
            )
        elif environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            reply = _json(405, {"error": f"{path} takes GET"}, [("Allow", "GET, HEAD")])
        else:
            try:
                reply = handler(environ)
            except Exception:  # a broken scrape must not look like a dead server
                log.exception("GET %s failed", path)
                reply = _json(500, {"error": "internal error; see the control plane's log"})
        status, body, content_type, headers = reply
        start_response(
            f"{status} {_REASONS[status]}",
            [("Content-Type", content_type), ("Content-Length", str(len(body))), *headers],
        )
        return [body]

    def _database(self) -> str | None:
        """None when the database answers ``SELECT 1``, else why not."""
        try:
            with self._engine.connect() as connection:
                connection.execute(text("SELECT 1"))
        except Exception as exc:
            log.warning("health check: the database did not answer: %s", exc)
            return f"unavailable ({type(exc).__name__})"
        return None

    def _healthz(self, environ: WSGIEnvironment) -> _Answer:
        # The process alone: see the module doc for why the database is not asked here.
        return _json(200, {"ok": True})

    def _readyz(self, environ: WSGIEnvironment) -> _Answer:
        problem = self._database()
        accepting = self._accepting()
        body = {
            "ready": problem is None and accepting,
            "db": problem or "ok",
            "public": "accepting" if accepting else "closed",
        }
        return _json(200 if body["ready"] else 503, body)

    def _metrics(self, environ: WSGIEnvironment) -> _Answer:
        body, content_type = self.metrics.exposition(environ.get("HTTP_ACCEPT"))
        return _Answer(200, body, content_type)
