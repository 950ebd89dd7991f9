"""Local instance-metadata servers that speak AWS IMDSv2 and GCE's metadata protocol.

Real HTTP on 127.0.0.1 (port 0), so the runner's pollers are tested over the wire exactly
as they talk to 169.254.169.254 and metadata.google.internal.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import parse_qs, urlsplit

from tests.fakes.loopback import ClosedOnExit, LoopbackServer, QuietHandler, reply

__all__ = ["FakeGceMetadata", "FakeImds", "Seen"]

_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
_TOKEN_HEADER = "X-aws-ec2-metadata-token"
_ACTION_PATH = "/latest/meta-data/spot/instance-action"
_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
_CREDENTIALS_PATH = "/latest/meta-data/iam/security-credentials/"


@dataclass(frozen=True)
class Seen:
    """One request as the fake saw it."""

    method: str
    #: Path with query string.
    path: str
    #: The status the fake answered.
    status: int
    #: Whether the request carried an IMDSv2 token header (AWS only).
    had_token: bool = False


class _Handler(QuietHandler):
    fake: _FakeServer

    def do_GET(self) -> None:
        self.fake._handle(self, "GET")

    def do_PUT(self) -> None:
        self.fake._handle(self, "PUT")

    def reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        reply(self, status, body, None, headers=(headers or {}).items())


class _FakeServer(ClosedOnExit):
    """A threaded HTTP server with a request log and injectable failures."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self.seen: list[Seen] = []
        self._failures: list[int] = []
        self._closing = False
        self._server = LoopbackServer(type("Handler", (_Handler,), {"fake": self}))
        self.url = self._server.url

    def fail_next(self, count: int, *, status: int = 500) -> None:
        """Answer the next ``count`` requests with ``status`` and no body."""
        with self._lock:
            self._failures.extend([status] * count)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._server.close()

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)

    def _handle(self, req: _Handler, method: str) -> None:
        with self._lock:
            failure = self._failures.pop(0) if self._failures else None
        if failure is not None:
            self._record(Seen(method, req.path, failure))
            req.reply(failure, b"")
            return
        self._serve(req, method)

    def _serve(self, req: _Handler, method: str) -> None:
        raise NotImplementedError


class FakeImds(_FakeServer):
    """AWS instance metadata with ``http-tokens=required`` (IMDSv2 only).

    ``PUT /latest/api/token`` with the TTL header gives a token that lives that many
    seconds; every GET needs a live token or gets 401. ``spot/instance-action`` is 404
    until :meth:`schedule_interruption`.
    """

    def __init__(self) -> None:
        self._tokens: dict[str, float] = {}
        self._action: bytes | None = None
        self._role: tuple[str, bytes] | None = None
        super().__init__()

    def schedule_interruption(self, action: str, at_wallclock: float | str) -> None:
        """Publish an interruption notice. ``at_wallclock``: seconds since the epoch, or
        the exact ``time`` text to send (to test unreadable times)."""
        if isinstance(at_wallclock, str):
            when = at_wallclock
        else:
            stamp = datetime.fromtimestamp(at_wallclock, tz=timezone.utc)
            when = stamp.strftime("%Y-%m-%dT%H:%M:%SZ")
        with self._lock:
            self._action = json.dumps({"action": action, "time": when}).encode()

    def give_role(
        self, name: str, *, access_key: str, secret_key: str, session_token: str = ""
    ) -> None:
        """An instance profile: its role's credentials under ``iam/security-credentials/``."""
        stamp = datetime.fromtimestamp(time.time() + 3600, tz=timezone.utc)
        answer = {
            "Code": "Success",
            "Type": "AWS-HMAC",
            "AccessKeyId": access_key,
            "SecretAccessKey": secret_key,
            "Token": session_token,
            "Expiration": stamp.strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        with self._lock:
            self._role = (name, json.dumps(answer).encode())

    def expire_tokens(self) -> None:
        """Revoke every token issued so far, as if their TTL had run out."""
        with self._lock:
            self._tokens.clear()

    @property
    def token_puts(self) -> int:
        return self._count(lambda s: s.method == "PUT" and s.status == 200)

    @property
    def unauthorized(self) -> int:
        return self._count(lambda s: s.status == 401)

    @property
    def gets_without_token(self) -> int:
        return self._count(lambda s: s.method == "GET" and not s.had_token)

    @property
    def action_gets(self) -> int:
        return self._count(lambda s: s.method == "GET" and s.path == _ACTION_PATH)

    def _count(self, pred: Callable[[Seen], bool]) -> int:
        with self._lock:
            return sum(1 for s in self.seen if pred(s))

    def _serve(self, req: _Handler, method: str) -> None:
        path = urlsplit(req.path).path
        token = req.headers.get(_TOKEN_HEADER)
        status, body, headers = self._answer(req, method, path, token)
        self._record(Seen(method, req.path, status, had_token=token is not None))
        req.reply(status, body, {"Content-Type": "text/plain", **headers})

    def _answer(
        self, req: _Handler, method: str, path: str, token: str | None
    ) -> tuple[int, bytes, dict[str, str]]:
        if method == "PUT":
            if path != "/latest/api/token":
                return 405, b"", {}
            if req.headers.get("X-Forwarded-For"):
                return 403, b"", {}
            try:
                ttl = int(req.headers.get(_TTL_HEADER, ""))
            except ValueError:
                return 400, b"", {}
            if not 1 <= ttl <= 21600:
                return 400, b"", {}
            new = secrets.token_urlsafe(32)
            with self._lock:
                self._tokens[new] = time.monotonic() + ttl
            return 200, new.encode(), {_TTL_HEADER: str(ttl)}
        with self._lock:
            expiry = self._tokens.get(token or "")
            if expiry is None or expiry <= time.monotonic():
                return 401, b"", {}
            action = self._action
            role = self._role
        if role is not None and path.startswith(_CREDENTIALS_PATH):
            if path == _CREDENTIALS_PATH:
                return 200, role[0].encode(), {}
            if path == _CREDENTIALS_PATH + role[0]:
                return 200, role[1], {}
        if path != _ACTION_PATH or action is None:
            return 404, b"", {}
        return 200, action, {}


class FakeGceMetadata(_FakeServer):
    """GCE metadata for ``instance/preempted``, with ``wait_for_change``, ``last_etag``
    and ``timeout_sec``. Requests without ``Metadata-Flavor: Google`` get 403."""

    #: How long a long poll waits when the client gives no timeout_sec.
    default_timeout_sec = 60

    def __init__(self) -> None:
        self._preempted = False
        self._version = itertools.count()
        self._etag = self._new_etag()
        self.pending = 0
        super().__init__()

    def preempt(self) -> None:
        """Flip ``preempted`` to TRUE and answer every pending long poll."""
        with self._lock:
            self._preempted = True
            self._etag = self._new_etag()
            self._lock.notify_all()

    def wait_pending(self, count: int = 1, *, timeout: float = 5.0) -> bool:
        """Wait until ``count`` long polls are blocked in the server."""
        with self._lock:
            return self._lock.wait_for(lambda: self.pending >= count, timeout)

    @property
    def forbidden(self) -> int:
        with self._lock:
            return sum(1 for s in self.seen if s.status == 403)

    def _new_etag(self) -> str:
        seed = f"{self._preempted}-{next(self._version)}".encode()
        return hashlib.sha256(seed).hexdigest()[:16]

    def _serve(self, req: _Handler, method: str) -> None:
        status, body, headers = self._answer(req, method)
        self._record(Seen(method, req.path, status))
        req.reply(status, body, {"Content-Type": "application/text", **headers})

    def _answer(self, req: _Handler, method: str) -> tuple[int, bytes, dict[str, str]]:
        parts = urlsplit(req.path)
        if req.headers.get("Metadata-Flavor") != "Google" or req.headers.get("X-Forwarded-For"):
            return 403, b"Missing Metadata-Flavor:Google header.\n", {}
        if method != "GET":
            return 405, b"", {}
        if parts.path != _PREEMPTED_PATH:
            return 404, b"", {}
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        wait = query.get("wait_for_change", "false").lower() == "true"
        try:
            timeout = int(query.get("timeout_sec", self.default_timeout_sec))
        except ValueError:
            return 400, b"timeout_sec must be an integer\n", {}
        last = query.get("last_etag")
        with self._lock:
            if wait:
                # Without last_etag: wait for the next change. With a stale one: answer now.
                seen = self._etag if last is None else last
                self.pending += 1
                self._lock.notify_all()
                try:
                    self._lock.wait_for(
                        lambda: self._etag != seen or self._closing, timeout=max(0, timeout)
                    )
                finally:
                    self.pending -= 1
            value = b"TRUE" if self._preempted else b"FALSE"
            etag = self._etag
        return 200, value, {"ETag": etag, "Metadata-Flavor": "Google"}
