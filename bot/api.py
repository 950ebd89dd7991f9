"""``POST /v1/commands``: the ``/train`` verbs over HTTP, for the command-line client and CI.

The request carries a person's token (``Authorization: Bearer tbt_…``, issued by
``/train token``) and the text of a command as it would be typed after ``/train``::

    {"text": "launch my-run budget.usd=5", "spec": "<the YAML of my-run.yaml>"}

The token stands for the person who asked for it, in the channel they asked in; the
command goes through the same dispatcher and the same authoriser as in Slack
(:func:`bot.dispatch.dispatch`), so a person who may not launch, or a run that is not
theirs, is refused here exactly as in chat, and the refusal is audited the same way.
A ``spec`` is a spec file's text (``trainbot launch spec.yaml``), read and validated as
a file in the specs directory is (:func:`jobs.spec.spec_from_text`); only ``launch``
takes one. An ``Idempotency-Key`` header makes a launch once per key and person: a
retry (a CI job's, after a timeout) gets the run the first request created.

The answer is JSON: ``{"ok", "status", "text", "run_id", "alert_id"}``, ``text`` being
the reply as plain text (no Slack escaping). ``status`` and the HTTP status say how it
went: ``ok`` 200, ``invalid`` 400 (the text does not parse), ``refused`` 403,
``failed`` 422 (no such run, a spec with problems: the text says what to fix); an
unknown, revoked or expired token gets 401 and runs nothing.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from bot import commands
from bot.auth import Ask, Authorizer, Caller, Denial
from bot.dispatch import dispatch
from jobs.domain.errors import TrainbotError
from jobs.process.deps import Deps
from jobs.web import api_tokens

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

__all__ = ["API_PATH", "MAX_BODY_BYTES", "CommandsApi", "TokenAuthorizer"]

log = logging.getLogger(__name__)

#: Where :func:`bot.slack_wsgi.attach` mounts it on the control plane's public port.
API_PATH = "/v1/commands"
#: A command and a spec file (at most ``MAX_SPEC_FILE_CHARS`` characters, checked with
#: the spec's own message) fit; anything bigger is refused unread.
MAX_BODY_BYTES = 2 << 20

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Content Too Large",
    422: "Unprocessable Content",
    503: "Service Unavailable",
}
_HTTP_STATUS = {"ok": 200, "invalid": 400, "refused": 403, "failed": 422}
_MENTION = re.compile(r"<@([A-Z0-9]+)>")

TOKEN_CHANNEL_LEFT = (
    "Your token was issued in a channel you are no longer a member of (or that trainbot "
    "no longer takes commands in), so it cannot act there. Rejoin it, or get a token in "
    "your training channel with /train token."
)


class TokenAuthorizer(Authorizer):
    """Slack's rules for a request made with a person's token.

    The token was issued by ``/train token``, which is refused to anyone outside the
    team's workspace, so its holder is one of the team; what stands in for the signed
    workspace id is that they are still a member of the channel the token was issued in
    (``users.conversations``, cached as for buttons). Everything else is Slack's rule.
    """

    def is_external(self, caller: Caller) -> bool:
        return False

    def decide(self, caller: Caller, ask: Ask) -> Denial | None:
        if caller.channel is None or not self.is_member(caller.user, caller.channel):
            return Denial("not a member of the token's channel", TOKEN_CHANNEL_LEFT, ask.run)
        return super().decide(caller, ask)


class CommandsApi:
    """The WSGI app mounted at :data:`API_PATH`."""

    def __init__(
        self, deps: Deps, *, auth: Authorizer, max_body_bytes: int = MAX_BODY_BYTES
    ) -> None:
        self._deps = deps
        self._auth = auth
        self._max_body = max_body_bytes

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        status, body, headers = self._handle(environ)
        data = json.dumps(body).encode("utf-8")
        start_response(
            f"{status} {_REASONS.get(status, 'Unknown')}",
            [
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(data))),
                ("Cache-Control", "no-store"),
                *headers,
            ],
        )
        return [data]

    def _handle(
        self, environ: WSGIEnvironment
    ) -> tuple[int, dict[str, Any], list[tuple[str, str]]]:
        if (environ.get("PATH_INFO") or "/") != "/":
            return _error(404, f"no such endpoint; commands are posted to {API_PATH}")
        if environ.get("REQUEST_METHOD") != "POST":
            return _error(405, f"{API_PATH} takes POST", [("Allow", "POST")])
        raw_length = str(environ.get("CONTENT_LENGTH") or "").strip()
        if not raw_length.isdigit():
            return _error(411, "send the command with a Content-Length")
        length = int(raw_length)
        if length > self._max_body:
            return _error(413, f"the request is over {self._max_body:,} bytes")
        # The token first: nothing of the body is read for a caller we do not know.
        token = _bearer(environ.get("HTTP_AUTHORIZATION"))
        try:
            holder = api_tokens.holder(self._deps, token)
        except TrainbotError as exc:
            log.warning("commands API: the database failed: %s", type(exc).__name__)
            return _error(503, "the database is unavailable: retry later", [("Retry-After", "5")])
        if holder is None:
            return _error(
                401,
                "unknown, revoked or expired token: send 'Authorization: Bearer <token>' "
                "with a token from /train token in Slack",
                [("WWW-Authenticate", 'Bearer realm="trainbot"')],
            )
        try:
            request = json.loads(environ["wsgi.input"].read(length) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, 'the body is not JSON: send {"text": "<command>"}')
        text = request.get("text") if isinstance(request, dict) else None
        spec = request.get("spec") if isinstance(request, dict) else None
        if not isinstance(text, str) or not (spec is None or isinstance(spec, str)):
            return _error(400, 'send {"text": "<command>", "spec": "<spec YAML, optional>"}')
        try:
            command = commands.parse(text)
        except commands.CommandError as exc:
            return 400, _answer("invalid", exc.plain), []
        if spec is not None:
            if not isinstance(command, commands.Launch) or command.spec is None:
                return 400, _answer("invalid", "A spec file goes with launch <name> only."), []
            command = replace(command, spec_text=spec)
        caller = Caller(team=None, user=holder.user, channel=holder.channel)
        # A retried launch (CI after a timeout) with the same key returns the first's run.
        retry_key = str(environ.get("HTTP_IDEMPOTENCY_KEY") or "").strip()[:200]
        key = f"api:{holder.user}:{retry_key}" if retry_key else None
        reply = dispatch(self._deps, command, caller, auth=self._auth, key=key, markup="plain")
        body = _answer(reply.outcome, _MENTION.sub(r"@\1", reply.text))
        body |= {"run_id": reply.run_id, "alert_id": reply.alert_id}
        return _HTTP_STATUS[reply.outcome], body, []


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def _answer(status: str, text: str) -> dict[str, Any]:
    return {"ok": status == "ok", "status": status, "text": text}


def _error(
    status: int, message: str, headers: list[tuple[str, str]] | None = None
) -> tuple[int, dict[str, Any], list[tuple[str, str]]]:
    return status, {"ok": False, "status": "error", "error": message}, headers or []
