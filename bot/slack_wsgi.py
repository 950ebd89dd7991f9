"""The Slack app on the control plane's HTTP server, and in Socket Mode.

Slack calls ``POST /slack/events`` for slash commands, interactivity and events alike.
:class:`SlackEndpoint` is the WSGI app mounted under ``/slack``: it checks the request's
v0 signature *before* anything parses the body, then hands the request to Bolt (whose
own signature check stays on as a second lock). Checking first matters because Bolt
parses the body before it verifies it, and a malformed timestamp or body would make it
answer 500 and log a traceback; here anything unsigned, stale (more than five minutes
either way), malformed or tampered gets a plain 401 and touches nothing. While a request
is being answered (until the server has written the answer), the listeners' work pool
holds back its work, so acknowledgements never wait behind it (:mod:`bot.workpool`).

:func:`attach` is what ``trainbot serve`` runs when Slack is configured: it builds the
Bolt app over the control plane's dependencies and mounts it; :meth:`SlackFrontEnd.start`
also opens a Socket Mode connection when an app-level token is set, for teams whose
control plane has no public address.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slack_bolt import App, BoltRequest, BoltResponse
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackRequestError
from sqlalchemy.engine import Engine

from bot.api import API_PATH, CommandsApi, TokenAuthorizer
from bot.app import SlackSetupError, build_app, work_pool
from bot.auth import Policy
from bot.plots import LOSS_CURVE_FILENAME, loss_curve_png
from bot.slack_notifier import AttachmentsFn, SlackNotifier
from bot.slack_outbox import Outbox
from bot.workpool import WorkPool
from jobs.database.db import session_scope
from jobs.database.metrics import run_metrics
from jobs.outbound.notify import AlertMessage, Message

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

    from slack_bolt.adapter.socket_mode import SocketModeHandler

    from jobs.process.bootstrap import ControlPlane

__all__ = [
    "EVENTS_PATH",
    "MAX_AGE_S",
    "MAX_BODY_BYTES",
    "SLACK_PREFIX",
    "SlackEndpoint",
    "SlackFrontEnd",
    "attach",
    "loss_curve_attachment",
    "signature_problem",
]

log = logging.getLogger(__name__)

#: Where the endpoint is mounted on the control plane's server.
SLACK_PREFIX = "/slack"
#: The path under the prefix: Slack's request URL is ``https://HOST/slack/events``.
EVENTS_PATH = "/events"
#: Slack's window: a request signed longer ago than this (or this far ahead) is a replay.
MAX_AGE_S = 300
#: Slack's payloads are a few kilobytes; anything far larger is not from Slack.
MAX_BODY_BYTES = 1 << 20

_STATUS = {
    200: "200 OK",
    401: "401 Unauthorized",
    404: "404 Not Found",
    405: "405 Method Not Allowed",
    411: "411 Length Required",
    413: "413 Content Too Large",
    500: "500 Internal Server Error",
}


def signature_problem(
    secret: str,
    *,
    body: bytes,
    timestamp: str | None,
    signature: str | None,
    now: float,
    max_age_s: float = MAX_AGE_S,
) -> str | None:
    """Why a request's Slack signature is not acceptable, or None when it is.

    The v0 scheme: ``v0=`` + hex HMAC-SHA256 of ``v0:{timestamp}:{body}`` keyed with the
    signing secret, over the raw bytes, compared in constant time.
    """
    if not timestamp or not signature:
        return "no signature or timestamp header"
    if not timestamp.isascii() or not timestamp.isdigit():
        return "the timestamp is not a number"
    if abs(now - int(timestamp)) > max_age_s:
        return "the timestamp is outside the five-minute window"
    base = b"v0:" + timestamp.encode("ascii") + b":" + body
    expected = "v0=" + hmac.new(secret.encode("utf-8"), base, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected.encode("ascii"), signature.encode("utf-8", "replace")):
        return "the signature does not match"
    return None


def _headers(environ: WSGIEnvironment) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in environ.items():
        if key.startswith("HTTP_"):
            out[key[5:].lower().replace("_", "-")] = str(value)
        elif key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            out[key.lower().replace("_", "-")] = str(value)
    return out


class SlackEndpoint:
    """WSGI app: ``POST /events`` → signature check → Bolt."""

    def __init__(
        self,
        app: App,
        *,
        signing_secret: str,
        clock: Callable[[], float] = time.time,
        max_body_bytes: int = MAX_BODY_BYTES,
        work: WorkPool | None = None,
    ) -> None:
        """``work``: the listeners' work pool, told while a request is being answered so
        its work waits (see :mod:`bot.workpool`)."""
        self.app = app
        self._secret = signing_secret
        self._clock = clock
        self._max_body = max_body_bytes
        self._work = work

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        work = self._work
        if work is None:
            status, headers, body = self._handle(environ)
            start_response(_STATUS.get(status, f"{status} Unknown"), headers)
            return [body]
        work.enter()
        try:
            status, headers, body = self._handle(environ)
            start_response(_STATUS.get(status, f"{status} Unknown"), headers)
        except BaseException:
            work.leave()
            raise
        # The server calls close() once the answer is written: only then may work start.
        return _Answer(body, on_close=work.leave)

    def _handle(self, environ: WSGIEnvironment) -> tuple[int, list[tuple[str, str]], bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path != EVENTS_PATH:
            return _plain(404, f"no such endpoint; Slack posts to {SLACK_PREFIX}{EVENTS_PATH}")
        if environ.get("REQUEST_METHOD") != "POST":
            return _plain(405, "POST only", [("Allow", "POST")])
        raw_length = str(environ.get("CONTENT_LENGTH") or "").strip()
        if not raw_length.isdigit():
            return _plain(411, "send the body with a Content-Length")
        length = int(raw_length)
        if length > self._max_body:
            return _plain(413, "body too large for a Slack request")
        body = environ["wsgi.input"].read(length) if length else b""
        headers = _headers(environ)
        problem = signature_problem(
            self._secret,
            body=body,
            timestamp=headers.get("x-slack-request-timestamp"),
            signature=headers.get("x-slack-signature"),
            now=self._clock(),
        )
        if problem is not None:
            log.warning(
                "refused a Slack request from %s: %s", environ.get("REMOTE_ADDR", "?"), problem
            )
            return _plain(401, "invalid request signature")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:  # signed, so Slack's, but not UTF-8: nothing we can use
            return _plain(401, "invalid request body")
        response = self.dispatch(text, headers, query=str(environ.get("QUERY_STRING") or ""))
        return response.status, _bolt_headers(response), response.body.encode("utf-8")

    def dispatch(self, body: str, headers: Mapping[str, str], *, query: str = "") -> BoltResponse:
        """Hand a verified request to Bolt; an unexpected failure is a logged 500."""
        try:
            return self.app.dispatch(BoltRequest(body=body, query=query, headers=dict(headers)))
        except Exception:
            log.exception("the Slack app failed on a request")
            return BoltResponse(status=500, body="")


class _Answer:
    """A WSGI response body that says when the server is done with it (PEP 3333 close)."""

    def __init__(self, body: bytes, *, on_close: Callable[[], None]) -> None:
        self._body = body
        self._on_close: Callable[[], None] | None = on_close

    def __iter__(self) -> Iterator[bytes]:
        yield self._body

    def close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


def _bolt_headers(response: BoltResponse) -> list[tuple[str, str]]:
    out = [(k, v) for k, values in response.headers.items() for v in values]
    if not any(k.lower() == "content-length" for k, _ in out):
        out.append(("Content-Length", str(len(response.body.encode("utf-8")))))
    return out


def _plain(
    status: int, message: str, extra: list[tuple[str, str]] | None = None
) -> tuple[int, list[tuple[str, str]], bytes]:
    body = json.dumps({"error": message}).encode("utf-8")
    headers = [
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(body))),
        *(extra or []),
    ]
    return status, headers, body


@dataclass
class SlackFrontEnd:
    """The Slack app attached to a control plane: HTTP endpoint, and Socket Mode if set."""

    app: App
    endpoint: SlackEndpoint
    #: The pool the listeners' work runs on (owned here, shut down by close()).
    work: WorkPool
    app_token: str | None = None
    socket: SocketModeHandler | None = field(default=None, init=False)

    def start(self) -> None:
        """Open the Socket Mode connection when an app-level token is configured.

        Slack refusing the token, or a Web API that cannot be reached, is a
        :class:`SlackSetupError` saying what to fix, and nothing is left running. Once
        connected, the client reconnects by itself when Slack asks it to or the
        connection drops.
        """
        if self.app_token is None or self.socket is not None:
            return
        if not self.app_token.startswith("xapp-"):
            raise SlackSetupError(
                "TRAINBOT_SLACK_APP_TOKEN is not an app-level token (they start with xapp-): "
                "generate one with the connections:write scope under the app's Basic "
                "Information, App-Level Tokens"
            )
        from slack_bolt.adapter.socket_mode import SocketModeHandler

        handler = SocketModeHandler(self.app, self.app_token)
        # Acknowledgements over the socket come first too: the work waits for them.
        listeners = handler.client.socket_mode_request_listeners
        listeners[:] = [_in_foreground(self.work, listener) for listener in listeners]
        try:
            handler.connect()
        except SlackApiError as exc:
            handler.close()
            error = exc.response.get("error") if exc.response is not None else None
            raise SlackSetupError(
                f"Slack refused to open a Socket Mode connection ({error or exc}): check "
                "TRAINBOT_SLACK_APP_TOKEN (an xapp- token with connections:write) and that "
                "Socket Mode is enabled in the app's settings"
            ) from None
        except (SlackRequestError, OSError) as exc:
            handler.close()
            raise SlackSetupError(
                f"could not reach Slack to open a Socket Mode connection ({exc}); check the "
                "network, or unset TRAINBOT_SLACK_APP_TOKEN to take requests over HTTP only"
            ) from None
        self.socket = handler
        if handler.client.is_connected():
            log.info("Slack Socket Mode connected")
        else:
            log.warning("Slack Socket Mode could not connect yet; it keeps trying")

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()
            self.socket = None
        # Bolt's executor first (no new work is handed over after it), then the work.
        listeners = self.app.listener_runner.listener_executor
        if isinstance(listeners, ThreadPoolExecutor):
            listeners.shutdown(wait=True, cancel_futures=False)
        self.work.shutdown(wait=True, cancel_futures=False)


def _in_foreground(work: WorkPool, listener: Callable[..., None]) -> Callable[..., None]:
    """A Socket Mode request listener that tells ``work`` while it is answering."""

    def answer(*args: Any) -> None:
        work.enter()
        try:
            listener(*args)
        finally:
            work.leave()

    return answer


def loss_curve_attachment(engine: Engine, *, max_points: int = 5000) -> AttachmentsFn:
    """The notifier's ``attachments``: a divergent-loss alert gets its run's loss curve.

    Called by the notifier's worker after the alert is posted, so the query and the
    drawing never hold up the request or the transaction that opened the alert.
    """

    def attachments(msg: Message) -> tuple[str, bytes] | None:
        if not isinstance(msg, AlertMessage) or msg.rule != "divergent_loss" or not msg.run_id:
            return None
        with session_scope(engine) as session:
            newest = run_metrics(session.connection(), msg.run_id, limit=max_points)
        points = sorted(
            (int(p.data["step"]), _float_or_none(p.data.get("loss")))
            for p in newest
            if isinstance(p.data.get("step"), int)
        )
        if not points:
            return None
        steps, losses = zip(*points, strict=True)
        png = loss_curve_png(list(steps), list(losses), title=f"{msg.run_id}: loss")
        return LOSS_CURVE_FILENAME, png

    return attachments


def _float_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def attach(
    cp: ControlPlane, *, client: WebClient, notifier: SlackNotifier | None = None
) -> SlackFrontEnd:
    """Build the Bolt app over ``cp``'s dependencies and mount it at ``/slack``, and
    the commands API for people's tokens at ``/v1/commands`` (:mod:`bot.api`).

    With ``notifier`` (the one ``cp`` posts through), a divergent-loss alert also gets
    its loss curve attached, unless the notifier already has an attachments function;
    on PostgreSQL (several replicas) the notifier writes what it queues to the shared
    outbox (:mod:`bot.slack_outbox`), which other replicas send if this one dies, and
    paces each channel with them.
    """
    settings = cp.settings
    if settings.slack_signing_secret is None:
        raise SlackSetupError(
            "TRAINBOT_SLACK_SIGNING_SECRET is not set: the Slack app cannot check that "
            "requests come from Slack; copy it from the app's Basic Information page"
        )
    secret = settings.slack_signing_secret.get_secret_value()
    work = work_pool()
    app = build_app(cp.deps, settings=settings, client=client, work=work)
    endpoint = SlackEndpoint(app, signing_secret=secret, work=work)
    cp.app.mount(SLACK_PREFIX, endpoint)
    # The same verbs for the command-line client, with tokens issued by /train token.
    api_auth = TokenAuthorizer(
        Policy.from_settings(settings), client=client, journal=cp.deps.journal
    )
    cp.app.mount(API_PATH, CommandsApi(cp.deps, auth=api_auth))
    if notifier is not None and notifier.attachments is None:
        notifier.attachments = loss_curve_attachment(cp.deps.engine)
    if notifier is not None:
        cp.app.metrics.watch_post_queue(notifier)  # its depth and 429s on /metrics
        if notifier.outbox is None and cp.deps.engine.dialect.name == "postgresql":
            # Held as long as the scheduler lease: a dead replica's posts go out then.
            hold = cp.deps.hold_s / 2
            notifier.use_outbox(Outbox(cp.deps.engine, owner=cp.deps.replica, hold_s=hold))
    token = settings.slack_app_token.get_secret_value() if settings.slack_app_token else None
    return SlackFrontEnd(app=app, endpoint=endpoint, work=work, app_token=token)
