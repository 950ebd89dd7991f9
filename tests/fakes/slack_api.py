"""A local Slack Web API: real HTTP on 127.0.0.1, Slack's wire protocol, Slack's limits.

``slack_sdk.WebClient(base_url=fake.api_url, token="xoxb-test")`` talks to it exactly as
it talks to slack.com: JSON or form-encoded POSTs to ``/api/<method>``, a bearer token,
``{"ok": …}`` answers, 429 with ``Retry-After``. Files upload v2 works end to end:
``files.getUploadURLExternal`` hands out an upload URL on this same server, the client
POSTs the raw bytes there, and ``files.completeUploadExternal`` shares them.

What it enforces, like Slack:

- **Tokens.** Every API call must carry one of ``tokens`` (``Authorization: Bearer`` or a
  ``token`` field), else ``{"ok": false, "error": "not_authed" | "invalid_auth"}``.
- **Rate limit of chat.postMessage**, per channel: a token bucket holding ``burst``
  posts that refills one post every ``post_interval_s`` (Slack: about one message per
  second per channel, "short bursts allowed"; ``burst=3`` by default). Over it:
  HTTP 429, ``Retry-After`` and ``{"ok": false, "error": "ratelimited"}``. Slack sends
  whole seconds; with ``whole_second_retry_after=False`` the header carries the exact
  wait as a decimal (``"0.037"``), so tests can shrink the window to a few
  milliseconds and keep the same mechanism without waiting whole seconds.
- **Threads.** A ``thread_ts`` must be the ts of a message in that channel, else
  ``thread_not_found``. (Slack itself is laxer here; the fake is strict on purpose so a
  reply posted under a made-up ts fails loudly instead of landing in the wrong place.)
- **App-level tokens.** ``apps.connections.open`` (Socket Mode) takes only one of
  ``app_tokens`` (``xapp-…``), and every other method refuses them, with Slack's
  ``not_allowed_token_type``. It answers the ``ws://`` URL of the attached
  :class:`tests.fakes.slack_socket.FakeSocketMode` (``socket_mode``), each with a
  one-time ticket, as Slack hands out a fresh ``wss://`` URL per connection.
- **Slack's limits**: ``text`` at most 40,000 characters (``msg_too_long``); at most 50
  blocks per message and 100 in a view; section text 3,000, header 150, fields 10 ×
  2,000, context elements 10, button text 75 and value 2,000, action_id and block_id
  255, options 100 × (75, 150); else ``invalid_blocks``. The blocks' text together at
  most 13,000 characters (Slack's undocumented ceiling, about 13,200), else
  ``msg_blocks_too_long``.
- **Directory**: ``users.list`` (paginated by ``limit`` and ``cursor``),
  ``usergroups.list``, ``users.info`` (:meth:`FakeSlack.calls_to` counts them).

Tests can inject failures (:meth:`FakeSlack.fail_next`: an error answer, an HTTP
status, or a reset connection), make one channel refuse everything
(:meth:`FakeSlack.set_channel_error`), and read every call (:attr:`FakeSlack.calls`),
every message with its edits (:meth:`FakeSlack.messages`) and every uploaded file.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl

from slack_sdk import WebClient

from tests.fakes.loopback import ClosedOnExit

API_PREFIX = "/api/"
UPLOAD_PREFIX = "/upload/v1/"
#: Fields the Web API takes as JSON even in a form-encoded body.
_JSON_FIELDS = ("blocks", "attachments", "view", "files", "metadata")
_BEARER = re.compile(r"^Bearer\s+(\S+)$")


@dataclass(frozen=True)
class Call:
    """One request the fake answered."""

    #: API method ("chat.postMessage"), or "upload" for a POST to an upload URL.
    method: str
    #: The request's arguments, JSON fields decoded (the token is left out).
    args: dict[str, Any]
    #: time.monotonic() when it arrived.
    time: float
    #: The bearer token it carried, if any.
    token: str | None
    #: HTTP status answered (0 for a reset connection).
    status: int
    #: The answer's "ok".
    ok: bool
    #: The answer's "error", if any.
    error: str | None = None
    #: Retry-After sent with a 429, in seconds.
    retry_after: float | None = None


@dataclass
class FakeMessage:
    """A message as the channel shows it now, and what it looked like before."""

    channel: str
    ts: str
    text: str
    blocks: list[dict[str, Any]] | None
    thread_ts: str | None
    #: Earlier (text, blocks) versions, oldest first; one per chat.update.
    edits: list[tuple[str, list[dict[str, Any]] | None]] = field(default_factory=list)
    #: Files shared into the channel with this message (completeUploadExternal).
    files: list[str] = field(default_factory=list)


@dataclass
class UploadedFile:
    """A file from files upload v2."""

    id: str
    filename: str
    length: int
    title: str | None = None
    data: bytes | None = None
    channel: str | None = None
    thread_ts: str | None = None
    completed: bool = False


@dataclass(frozen=True)
class _Failure:
    method: str | None
    error: str | None
    status: int | None
    reset: bool
    retry_after: str | None


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        answer = self.server.fake._handle(self.path, dict(self.headers.items()), body)
        if answer is None:
            self._reset()
            return
        status, payload, headers = answer
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        content_type = "text/plain" if isinstance(payload, bytes) else "application/json"
        self.send_header("Content-Type", f"{content_type}; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST

    def _reset(self) -> None:
        # SO_LINGER 0: close() sends RST, the client sees "connection reset by peer".
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass  # the connection was reset on purpose

    def log_message(self, format: str, *args: Any) -> None:
        return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, fake: FakeSlack) -> None:
        self.fake = fake
        super().__init__(("127.0.0.1", 0), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        return None  # reset connections are the point of some tests


class FakeSlack(ClosedOnExit):
    """The Slack Web API on 127.0.0.1:<port>; use as a context manager."""

    def __init__(
        self,
        *,
        tokens: Iterable[str] = ("xoxb-test",),
        post_interval_s: float = 1.0,
        burst: int = 3,
        whole_second_retry_after: bool = True,
        team_id: str = "T0TEST",
        bot_user_id: str = "U0BOT",
        app_tokens: Iterable[str] = (),
    ) -> None:
        self.tokens = set(tokens)
        #: App-level tokens, for Socket Mode's apps.connections.open only.
        self.app_tokens = set(app_tokens)
        #: Where apps.connections.open sends a client: anything with ``open_url()``
        #: (:class:`tests.fakes.slack_socket.FakeSocketMode` attaches itself here).
        self.socket_mode: Any = None
        self.post_interval_s = post_interval_s
        self.burst = burst
        self.whole_second_retry_after = whole_second_retry_after
        self.team_id = team_id
        self.bot_user_id = bot_user_id
        self.cond = threading.Condition()
        self.calls: list[Call] = []
        self.files: dict[str, UploadedFile] = {}
        #: Published App Home views by user id; opened and updated modals by view id.
        self.home_views: dict[str, dict[str, Any]] = {}
        self.views: dict[str, dict[str, Any]] = {}
        #: Workspace directory for users.info, usergroups.list, conversations.info.
        self.users: dict[str, dict[str, Any]] = {}
        self.usergroups: dict[str, dict[str, Any]] = {}
        self.channels: dict[str, dict[str, Any]] = {}
        self.channel_members: dict[str, set[str]] = {}
        #: Trigger ids views.open refuses as expired.
        self.expired_triggers: set[str] = set()
        self._messages: dict[str, list[FakeMessage]] = {}
        self._channel_errors: dict[str, str] = {}
        self._failures: deque[_Failure] = deque()
        self._buckets: dict[str, tuple[float, float]] = {}
        self._ts = itertools.count(100)
        self._ids = itertools.count(1)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        """What ``WebClient(base_url=…)`` takes."""
        return f"{self.url}{API_PREFIX}"

    def start(self) -> FakeSlack:
        server = _Server(self)
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def client(self, token: str | None = None, **kwargs: Any) -> WebClient:
        """A real WebClient pointed at this server."""
        return WebClient(
            base_url=self.api_url, token=token or next(iter(sorted(self.tokens))), **kwargs
        )

    def __enter__(self) -> FakeSlack:
        return self.start() if self._server is None else self

    # ------------------------------------------------------------------ test controls

    def fail_next(
        self,
        times: int = 1,
        *,
        method: str | None = None,
        error: str | None = None,
        status: int | None = None,
        reset: bool = False,
        retry_after: str | None = None,
    ) -> None:
        """Fail the next ``times`` calls (of ``method``, or any call) before any other check.

        ``error``: HTTP 200 ``{"ok": false, "error": error}``. ``status``: that HTTP status
        (``retry_after`` sets its header; a 429 says "ratelimited", others "fatal_error").
        ``reset``: the connection is reset after the request is read, with no answer.
        """
        if sum(x is not None and x is not False for x in (error, status, reset or None)) != 1:
            raise ValueError("give exactly one of error=, status= or reset=True")
        with self.cond:
            self._failures.extend(
                _Failure(method, error, status, reset, retry_after) for _ in range(times)
            )

    @property
    def failures_left(self) -> int:
        with self.cond:
            return len(self._failures)

    def set_channel_error(self, channel: str, error: str | None) -> None:
        """Answer every call naming ``channel`` with ``error`` (channel_not_found …); None clears."""
        with self.cond:
            if error is None:
                self._channel_errors.pop(channel, None)
            else:
                self._channel_errors[channel] = error

    def add_user(self, user_id: str, name: str, *, is_admin: bool = False) -> None:
        with self.cond:
            self.users[user_id] = {
                "id": user_id,
                "team_id": self.team_id,
                "name": name,
                "real_name": name.title(),
                "profile": {"display_name": name, "real_name": name.title()},
                "is_admin": is_admin,
                "is_owner": False,
                "is_bot": False,
                "deleted": False,
                "tz": "UTC",
            }

    def add_usergroup(self, group_id: str, handle: str, users: Iterable[str]) -> None:
        with self.cond:
            self.usergroups[group_id] = {
                "id": group_id,
                "team_id": self.team_id,
                "handle": handle,
                "name": handle,
                "is_usergroup": True,
                "users": list(users),
            }

    def add_channel(
        self,
        channel_id: str,
        name: str,
        *,
        is_member: bool = True,
        is_private: bool = False,
        members: Iterable[str] = (),
    ) -> None:
        """A channel for conversations.info; ``members`` are the people in it, for
        users.conversations (``is_member`` is the bot's own membership)."""
        with self.cond:
            self.channels[channel_id] = {
                "id": channel_id,
                "name": name,
                "is_channel": True,
                "is_private": is_private,
                "is_archived": False,
                "is_member": is_member,
            }
            self.channel_members[channel_id] = set(members)

    # ------------------------------------------------------------------ reading

    def calls_to(self, method: str) -> list[Call]:
        with self.cond:
            return [c for c in self.calls if c.method == method]

    def messages(self, channel: str) -> list[FakeMessage]:
        """Messages in the channel, in posting order (thread replies included)."""
        with self.cond:
            return list(self._messages.get(channel, []))

    def message(self, channel: str, ts: str) -> FakeMessage | None:
        with self.cond:
            return next((m for m in self._messages.get(channel, []) if m.ts == ts), None)

    def replies(self, channel: str, thread_ts: str) -> list[FakeMessage]:
        with self.cond:
            return [m for m in self._messages.get(channel, []) if m.thread_ts == thread_ts]

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until ``predicate()`` holds (checked after each request) or timeout."""
        with self.cond:
            return self.cond.wait_for(predicate, timeout)

    # ------------------------------------------------------------------ serving

    def _handle(self, path: str, headers: dict[str, str], body: bytes) -> _Answer | None:
        now = time.monotonic()
        if path.startswith(UPLOAD_PREFIX):
            with self.cond:
                uploaded = self._upload(path[len(UPLOAD_PREFIX) :], body, now=now)
                self.cond.notify_all()
                return uploaded
        method = path[len(API_PREFIX) :].split("?", 1)[0] if path.startswith(API_PREFIX) else ""
        args = _decode(headers, body)
        token = _token(headers, args)
        answer: _Answer | None
        with self.cond:
            failure = self._take_failure(method)
            if failure is not None:
                answer = _injected(failure)
            else:
                answer = self._answer(method, args, token, now=now)
            status, payload, extra = (0, {"ok": False}, {}) if answer is None else answer
            retry = extra.get("Retry-After")
            self.calls.append(
                Call(
                    method=method,
                    args=args,
                    time=now,
                    token=token,
                    status=status,
                    ok=bool(isinstance(payload, dict) and payload.get("ok")),
                    error=payload.get("error") if isinstance(payload, dict) else None,
                    retry_after=float(retry) if retry is not None else None,
                )
            )
            self.cond.notify_all()
            return answer

    def _take_failure(self, method: str) -> _Failure | None:
        for index, failure in enumerate(self._failures):
            if failure.method is None or failure.method == method:
                del self._failures[index]
                return failure
        return None

    def _answer(
        self, method: str, args: dict[str, Any], token: str | None, *, now: float
    ) -> _Answer:
        handler = _METHODS.get(method)
        if handler is None:
            return 404, {"ok": False, "error": "unknown_method"}, {}
        if token is None:
            return 200, {"ok": False, "error": "not_authed"}, {}
        app_level = method in _APP_LEVEL_METHODS
        if token in (self.tokens if app_level else self.app_tokens):
            return 200, {"ok": False, "error": "not_allowed_token_type"}, {}
        if token not in (self.app_tokens if app_level else self.tokens):
            return 200, {"ok": False, "error": "invalid_auth"}, {}
        for key in ("channel", "channel_id"):
            error = self._channel_errors.get(str(args.get(key, "")))
            if error is not None:
                return 200, {"ok": False, "error": error}, {}
        return handler(self, args, now)

    # ------------------------------------------------------------------ methods

    def _next_ts(self) -> str:
        return f"1700000000.{next(self._ts):06d}"

    def _next_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):08d}"

    def _rate_limit(self, channel: str, now: float) -> float:
        """Take one post from the channel's bucket; the seconds to wait when it is empty."""
        tokens, last = self._buckets.get(channel, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) / self.post_interval_s)
        if tokens >= 1.0:
            self._buckets[channel] = (tokens - 1.0, now)
            return 0.0
        self._buckets[channel] = (tokens, now)
        return (1.0 - tokens) * self.post_interval_s

    def _retry_after(self, wait: float) -> str:
        if self.whole_second_retry_after:
            return str(max(1, math.ceil(wait)))
        return f"{max(wait, 0.001):.3f}"

    def _auth_test(self, args: dict[str, Any], now: float) -> _Answer:
        return _ok(
            url="https://fake.slack.com/",
            team="Fake Team",
            user="trainbot",
            team_id=self.team_id,
            user_id=self.bot_user_id,
            bot_id="B0BOT",
            is_enterprise_install=False,
        )

    def _post_message(self, args: dict[str, Any], now: float) -> _Answer:
        channel = str(args.get("channel") or "")
        if not channel:
            return _error("channel_not_found")
        problem = _message_problem(args)
        if problem:
            return _error(problem)
        thread_ts = args.get("thread_ts") or None
        if thread_ts is not None and self.message(channel, str(thread_ts)) is None:
            return _error("thread_not_found")
        wait = self._rate_limit(channel, now)
        if wait > 0:
            return (
                429,
                {"ok": False, "error": "ratelimited"},
                {"Retry-After": self._retry_after(wait)},
            )
        message = FakeMessage(
            channel=channel,
            ts=self._next_ts(),
            text=str(args.get("text") or ""),
            blocks=args.get("blocks"),
            thread_ts=str(thread_ts) if thread_ts else None,
        )
        self._messages.setdefault(channel, []).append(message)
        return _ok(channel=channel, ts=message.ts, message=_as_dict(message, self.bot_user_id))

    def _update(self, args: dict[str, Any], now: float) -> _Answer:
        channel = str(args.get("channel") or "")
        message = self.message(channel, str(args.get("ts") or ""))
        if message is None:
            return _error("message_not_found")
        problem = _message_problem(args)
        if problem:
            return _error(problem)
        message.edits.append((message.text, message.blocks))
        message.text = str(args.get("text") or "")
        message.blocks = args.get("blocks")
        return _ok(channel=channel, ts=message.ts, text=message.text)

    def _post_ephemeral(self, args: dict[str, Any], now: float) -> _Answer:
        if not args.get("user"):
            return _error("user_not_found")
        problem = _message_problem(args)
        if problem:
            return _error(problem)
        return _ok(message_ts=self._next_ts())

    def _views_open(self, args: dict[str, Any], now: float) -> _Answer:
        trigger = args.get("trigger_id")
        if not trigger:
            return _error("invalid_arguments")
        if trigger in self.expired_triggers:
            return _error("expired_trigger_id")
        return self._store_view(args.get("view"), view_id=None)

    def _views_push(self, args: dict[str, Any], now: float) -> _Answer:
        """A view pushed over an open modal: the same checks and answer as views.open (the
        stack itself is Slack's client's business)."""
        return self._views_open(args, now)

    def _views_update(self, args: dict[str, Any], now: float) -> _Answer:
        view_id = args.get("view_id")
        if not view_id and args.get("external_id"):
            view_id = next(
                (k for k, v in self.views.items() if v.get("external_id") == args["external_id"]),
                None,
            )
        if not view_id or view_id not in self.views:
            return _error("not_found")
        return self._store_view(args.get("view"), view_id=str(view_id))

    def _store_view(self, view: Any, *, view_id: str | None) -> _Answer:
        if not isinstance(view, dict) or "type" not in view:
            return _error("invalid_arguments")
        problem = _blocks_problem(view.get("blocks", []), limit=MAX_VIEW_BLOCKS)
        if problem:
            return _error(problem)
        view_id = view_id or self._next_id("V")
        stored = {**view, "id": view_id, "team_id": self.team_id}
        self.views[view_id] = stored
        return _ok(view=stored)

    def _views_publish(self, args: dict[str, Any], now: float) -> _Answer:
        user = args.get("user_id")
        view = args.get("view")
        if not user:
            return _error("invalid_arguments")
        if not isinstance(view, dict) or view.get("type") != "home":
            return _error("invalid_arguments")
        problem = _blocks_problem(view.get("blocks", []), limit=MAX_VIEW_BLOCKS)
        if problem:
            return _error(problem)
        self.home_views[str(user)] = view
        return _ok(view={**view, "id": self._next_id("V")})

    def _get_upload_url(self, args: dict[str, Any], now: float) -> _Answer:
        filename = args.get("filename")
        try:
            length = int(args.get("length") or 0)
        except ValueError:
            length = 0
        if not filename or length <= 0:
            return _error("invalid_arguments")
        file_id = self._next_id("F")
        self.files[file_id] = UploadedFile(id=file_id, filename=str(filename), length=length)
        return _ok(upload_url=f"{self.url}{UPLOAD_PREFIX}{file_id}", file_id=file_id)

    def _upload(self, file_id: str, body: bytes, *, now: float) -> _Answer:
        upload = self.files.get(file_id)
        self.calls.append(
            Call(
                method="upload",
                args={"file_id": file_id, "bytes": len(body)},
                time=now,
                token=None,
                status=200 if upload else 404,
                ok=upload is not None,
            )
        )
        if upload is None:
            return 404, {"ok": False, "error": "file_not_found"}, {}
        upload.data = body
        return 200, f"OK - {len(body)}".encode(), {}

    def _complete_upload(self, args: dict[str, Any], now: float) -> _Answer:
        entries = args.get("files")
        if not isinstance(entries, list) or not entries:
            return _error("invalid_arguments")
        channel = args.get("channel_id") or None
        thread_ts = args.get("thread_ts") or None
        if thread_ts is not None and (
            channel is None or self.message(str(channel), str(thread_ts)) is None
        ):
            return _error("thread_not_found")
        done = []
        for entry in entries:
            upload = self.files.get(str(entry.get("id")))
            if upload is None or upload.data is None:
                return _error("file_not_found")
            if len(upload.data) != upload.length:
                return _error("file_upload_size_mismatch")
            done.append(upload)
        for entry, upload in zip(entries, done, strict=True):
            upload.title = entry.get("title") or upload.filename
            upload.channel = str(channel) if channel else None
            upload.thread_ts = str(thread_ts) if thread_ts else None
            upload.completed = True
        if channel is not None:
            share = FakeMessage(
                channel=str(channel),
                ts=self._next_ts(),
                text=str(args.get("initial_comment") or ""),
                blocks=None,
                thread_ts=str(thread_ts) if thread_ts else None,
                files=[u.id for u in done],
            )
            self._messages.setdefault(str(channel), []).append(share)
        return _ok(files=[{"id": u.id, "name": u.filename, "title": u.title} for u in done])

    def _connections_open(self, args: dict[str, Any], now: float) -> _Answer:
        if self.socket_mode is None:  # Socket Mode is off in the app's settings
            return _error("socket_mode_not_enabled")
        return _ok(url=self.socket_mode.open_url())

    def _usergroups_list(self, args: dict[str, Any], now: float) -> _Answer:
        include = str(args.get("include_users", "")).lower() in ("1", "true")
        groups = [
            {k: v for k, v in g.items() if k != "users" or include}
            for g in self.usergroups.values()
        ]
        return _ok(usergroups=groups)

    def _users_list(self, args: dict[str, Any], now: float) -> _Answer:
        """Every member of the workspace, deactivated ones included, ``limit`` at a time."""
        members = [self.users[k] for k in sorted(self.users)]
        start = int(args.get("cursor") or 0)
        limit = int(args.get("limit") or 200)
        more = start + limit < len(members)
        return _ok(
            members=members[start : start + limit],
            response_metadata={"next_cursor": str(start + limit) if more else ""},
        )

    def _users_info(self, args: dict[str, Any], now: float) -> _Answer:
        user = self.users.get(str(args.get("user") or ""))
        return _ok(user=user) if user else _error("user_not_found")

    def _users_conversations(self, args: dict[str, Any], now: float) -> _Answer:
        """The user's channels as a bot token sees them: public ones, and private ones
        only where the bot is a member too; paginated by ``limit`` and ``cursor``."""
        user = str(args.get("user") or "")
        found = [
            channel
            for channel_id, channel in sorted(self.channels.items())
            if user in self.channel_members.get(channel_id, ())
            and (not channel["is_private"] or channel["is_member"])
        ]
        start = int(args.get("cursor") or 0)
        limit = int(args.get("limit") or 100)
        page = found[start : start + limit]
        more = start + limit < len(found)
        return _ok(
            channels=page, response_metadata={"next_cursor": str(start + limit) if more else ""}
        )

    def _conversations_info(self, args: dict[str, Any], now: float) -> _Answer:
        channel = self.channels.get(str(args.get("channel") or ""))
        return _ok(channel=channel) if channel else _error("channel_not_found")


_Answer = tuple[int, dict[str, Any] | bytes, dict[str, str]]

_METHODS: dict[str, Callable[[FakeSlack, dict[str, Any], float], _Answer]] = {
    "auth.test": FakeSlack._auth_test,
    "chat.postMessage": FakeSlack._post_message,
    "chat.update": FakeSlack._update,
    "chat.postEphemeral": FakeSlack._post_ephemeral,
    "views.open": FakeSlack._views_open,
    "views.push": FakeSlack._views_push,
    "views.update": FakeSlack._views_update,
    "views.publish": FakeSlack._views_publish,
    "files.getUploadURLExternal": FakeSlack._get_upload_url,
    "files.completeUploadExternal": FakeSlack._complete_upload,
    "usergroups.list": FakeSlack._usergroups_list,
    "users.info": FakeSlack._users_info,
    "users.list": FakeSlack._users_list,
    "conversations.info": FakeSlack._conversations_info,
    "users.conversations": FakeSlack._users_conversations,
    "apps.connections.open": FakeSlack._connections_open,
}
#: Methods that take an app-level token (and only one).
_APP_LEVEL_METHODS = frozenset({"apps.connections.open"})


def _ok(**data: Any) -> _Answer:
    return 200, {"ok": True, **data}, {}


def _error(error: str) -> _Answer:
    return 200, {"ok": False, "error": error}, {}


def _injected(failure: _Failure) -> _Answer | None:
    if failure.reset:
        return None
    if failure.error is not None:
        return _error(failure.error)
    assert failure.status is not None
    headers = {"Retry-After": failure.retry_after} if failure.retry_after else {}
    error = "ratelimited" if failure.status == 429 else "fatal_error"
    return failure.status, {"ok": False, "error": error}, headers


def _decode(headers: dict[str, str], body: bytes) -> dict[str, Any]:
    content_type = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
    text = body.decode("utf-8", errors="replace")
    args: dict[str, Any]
    if content_type.startswith("application/json"):
        try:
            loaded = json.loads(text) if text else {}
        except json.JSONDecodeError:
            loaded = {}
        args = loaded if isinstance(loaded, dict) else {}
    else:
        args = dict(parse_qsl(text, keep_blank_values=True))
    for key in _JSON_FIELDS:
        value = args.get(key)
        if isinstance(value, str):
            try:
                args[key] = json.loads(value)
            except json.JSONDecodeError:
                pass
    return args


def _token(headers: dict[str, str], args: dict[str, Any]) -> str | None:
    auth = next((v for k, v in headers.items() if k.lower() == "authorization"), "")
    match = _BEARER.match(auth.strip())
    token = match.group(1) if match else args.pop("token", None)
    args.pop("token", None)
    return str(token) if token else None


#: Slack's documented limits (Block Kit reference, chat.postMessage); exceeding one
#: fails the whole call.
MAX_TEXT = 40_000
MAX_MESSAGE_BLOCKS = 50
MAX_VIEW_BLOCKS = 100
MAX_SECTION_TEXT = 3000
MAX_HEADER_TEXT = 150
MAX_CONTEXT_ELEMENTS = 10
MAX_FIELDS = 10
MAX_FIELD_TEXT = 2000
MAX_BUTTON_TEXT = 75
MAX_BUTTON_VALUE = 2000
MAX_ACTION_ID = 255
MAX_BLOCK_ID = 255
MAX_ACTIONS_ELEMENTS = 25
MAX_OPTIONS = 100
MAX_OPTION_TEXT = 75
MAX_OPTION_VALUE = 150
#: Not documented, but observed (slackapi/bolt-js#2509): the text of a message's blocks
#: taken together may not exceed about 13,200 characters, else ``msg_blocks_too_long``.
MAX_BLOCKS_TOTAL_TEXT = 13_000


def _message_problem(args: dict[str, Any]) -> str | None:
    blocks = args.get("blocks")
    text = args.get("text")
    if not text and not blocks and not args.get("attachments"):
        return "no_text"
    if text is not None and len(str(text)) > MAX_TEXT:
        return "msg_too_long"
    if blocks is not None:
        problem = _blocks_problem(blocks, limit=MAX_MESSAGE_BLOCKS)
        if problem:
            return problem
        if sum(len(t) for t in _texts(blocks)) > MAX_BLOCKS_TOTAL_TEXT:
            return "msg_blocks_too_long"
    return None


def _texts(value: Any) -> Iterable[str]:
    """Every ``text`` string inside blocks, however deep."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "text" and isinstance(item, str):
                yield item
            else:
                yield from _texts(item)
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item)


def _text_of(obj: Any) -> str | None:
    """A text object's string; None when ``obj`` is not a text object."""
    if isinstance(obj, dict) and obj.get("type") in ("plain_text", "mrkdwn"):
        text = obj.get("text")
        return text if isinstance(text, str) else None
    return None


def _too_long(obj: Any, limit: int) -> bool:
    """A text object that is missing, empty or longer than ``limit``."""
    text = _text_of(obj)
    return text is None or not text or len(text) > limit


def _element_problem(element: Any) -> bool:
    if not isinstance(element, dict) or "type" not in element:
        return True
    if len(str(element.get("action_id", ""))) > MAX_ACTION_ID:
        return True
    kind = element["type"]
    if kind == "button":
        if _too_long(element.get("text"), MAX_BUTTON_TEXT):
            return True
        if len(str(element.get("value", ""))) > MAX_BUTTON_VALUE:
            return True
    if kind == "static_select":
        options = element.get("options")
        if not isinstance(options, list) or not options or len(options) > MAX_OPTIONS:
            return True
        for option in options:
            if not isinstance(option, dict) or _too_long(option.get("text"), MAX_OPTION_TEXT):
                return True
            if len(str(option.get("value", ""))) > MAX_OPTION_VALUE:
                return True
    return False


def _block_problem(block: Any) -> bool:
    if not isinstance(block, dict) or "type" not in block:
        return True
    if len(str(block.get("block_id", ""))) > MAX_BLOCK_ID:
        return True
    kind = block["type"]
    if kind == "section":
        text, fields = block.get("text"), block.get("fields")
        if text is None and not fields:
            return True
        if text is not None and _too_long(text, MAX_SECTION_TEXT):
            return True
        if fields is not None:
            if not isinstance(fields, list) or len(fields) > MAX_FIELDS:
                return True
            if any(_too_long(f, MAX_FIELD_TEXT) for f in fields):
                return True
        accessory = block.get("accessory")
        return accessory is not None and _element_problem(accessory)
    if kind == "header":
        return (
            _too_long(block.get("text"), MAX_HEADER_TEXT)
            or _text_of(block.get("text")) is None
            or block["text"].get("type") != "plain_text"
        )
    if kind == "context":
        elements = block.get("elements")
        if not isinstance(elements, list) or not elements or len(elements) > MAX_CONTEXT_ELEMENTS:
            return True
        return any(_too_long(e, MAX_SECTION_TEXT) for e in elements if "text" in e)
    if kind == "actions":
        elements = block.get("elements")
        if not isinstance(elements, list) or not elements or len(elements) > MAX_ACTIONS_ELEMENTS:
            return True
        return any(_element_problem(e) for e in elements)
    if kind == "input":
        return _input_problem(block)
    return False


#: Slack's limits on an input block: its label, and a text input's length and placeholder.
MAX_INPUT_LABEL = 2000
MAX_TEXT_INPUT = 3000
MAX_INPUT_PLACEHOLDER = 150
_INPUT_ELEMENTS = frozenset(
    {"plain_text_input", "static_select", "conversations_select", "channels_select"}
)


def _input_problem(block: dict[str, Any]) -> bool:
    """An input block Slack refuses: no plain-text label, an element of a kind it does not
    take, a text input longer than 3,000 characters, a placeholder over 150."""
    label = block.get("label")
    if not isinstance(label, dict) or label.get("type") != "plain_text":
        return True
    if _too_long(label, MAX_INPUT_LABEL):
        return True
    element = block.get("element")
    if not isinstance(element, dict) or element.get("type") not in _INPUT_ELEMENTS:
        return True
    if not element.get("action_id"):
        return True
    placeholder = element.get("placeholder")
    if placeholder is not None and _too_long(placeholder, MAX_INPUT_PLACEHOLDER):
        return True
    if element["type"] == "plain_text_input":
        most = element.get("max_length", MAX_TEXT_INPUT)
        return not isinstance(most, int) or not 1 <= most <= MAX_TEXT_INPUT
    return False


def _blocks_problem(blocks: Any, *, limit: int) -> str | None:
    """``invalid_blocks`` for more than ``limit`` blocks or one that breaks a limit."""
    if not isinstance(blocks, list) or len(blocks) > limit:
        return "invalid_blocks"
    if any(_block_problem(block) for block in blocks):
        return "invalid_blocks"
    return None


def _as_dict(message: FakeMessage, bot_user_id: str) -> dict[str, Any]:
    data: dict[str, Any] = {
        "type": "message",
        "user": bot_user_id,
        "text": message.text,
        "ts": message.ts,
    }
    if message.blocks is not None:
        data["blocks"] = message.blocks
    if message.thread_ts:
        data["thread_ts"] = message.thread_ts
    return data
