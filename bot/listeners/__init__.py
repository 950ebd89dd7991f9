"""Bolt listeners, one module per topic: ``runs`` (the /train command and the launch
modal), ``alerts`` (the buttons on alerts and preflight reports), ``home`` (the App Home).

Every listener acknowledges first: it answers Slack at once (well inside its 3 s) with
what can be decided without I/O — a parse error, help, a channel that is not allowed —
and hands the rest to the work pool (:meth:`ListenerContext.later`), which does it after
the answer has gone and replies. The pool is the app's own (:class:`bot.workpool.WorkPool`:
a few threads, whose work waits until the answers being written are out), not the
control plane's background pool (where preflight dry runs take minutes). This is what
Bolt's lazy listeners do, without their per-request deep copy of the request. What the
listeners share lives here: that context, idempotency keys, and how a reply reaches the
person who asked.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackRequestError
from slack_sdk.webhook import WebhookClient

from bot.auth import Authorizer, Caller
from jobs.outbound.notify import Notifier, TextMessage
from jobs.process.deps import Deps
from jobs.usecases import service

__all__ = [
    "ListenerContext",
    "action_key",
    "caller_from_action",
    "caller_from_command",
    "caller_from_event",
    "caller_from_view",
    "command_key",
    "first_time",
    "reply",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ListenerContext:
    """What every listener works with."""

    deps: Deps
    auth: Authorizer
    #: Where the work after an acknowledgement runs.
    work: Executor

    def later(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        """Run ``fn`` on the work pool; a failure is logged with its traceback, and the
        person who asked has already had their acknowledgement."""

        def guarded() -> None:
            try:
                fn(*args, **kwargs)
            except Exception:
                log.exception("Slack work %s failed", getattr(fn, "__name__", fn))

        try:
            self.work.submit(guarded)
        except RuntimeError:  # the pool is shut down: the app is stopping
            log.warning("Slack work %s dropped: the app is stopping", getattr(fn, "__name__", fn))


# ----------------------------------------------------------------------------- who asked


def caller_from_command(body: Mapping[str, Any]) -> Caller:
    """A slash command's form fields."""
    return Caller(
        team=body.get("user_team") or body.get("team_id"),
        user=str(body.get("user_id") or ""),
        channel=body.get("channel_id"),
        channel_name=body.get("channel_name"),
    )


def caller_from_action(body: Mapping[str, Any]) -> Caller:
    """An interactive payload (``block_actions``): a button in a message or the App Home."""
    channel = body.get("channel") or {}
    container = body.get("container") or {}
    return Caller(
        team=(body.get("user") or {}).get("team_id") or (body.get("team") or {}).get("id"),
        user=str((body.get("user") or {}).get("id") or ""),
        channel=channel.get("id") or container.get("channel_id"),
        channel_name=channel.get("name"),
    )


def caller_from_view(body: Mapping[str, Any], *, channel: str | None) -> Caller:
    """A modal submission: the channel comes from the modal's private metadata, which we
    wrote when we opened it and Slack returns signed."""
    return Caller(
        team=(body.get("user") or {}).get("team_id") or (body.get("team") or {}).get("id"),
        user=str((body.get("user") or {}).get("id") or ""),
        channel=channel,
    )


def caller_from_event(body: Mapping[str, Any]) -> Caller:
    """An Events API envelope (``app_home_opened``)."""
    event = body.get("event") or {}
    return Caller(
        team=event.get("user_team") or body.get("team_id"),
        user=str(event.get("user") or ""),
        channel=None,
    )


# ----------------------------------------------------------------------------- once each


def command_key(body: Mapping[str, Any], headers: Mapping[str, Any]) -> str:
    """The idempotency key of a slash command.

    Slack gives every command invocation its own ``trigger_id`` and sends the same one
    on every retry, so it names the command. Without one (a hand-built request), the
    team, channel, user, text and signed timestamp together stand in for it.
    """
    team = body.get("team_id") or "-"
    trigger = body.get("trigger_id")
    if trigger:
        return f"slack:{team}:{trigger}"
    timestamp = _header(headers, "x-slack-request-timestamp")
    parts = [team, body.get("channel_id"), body.get("user_id"), body.get("text"), timestamp]
    digest = hashlib.sha256("\x1f".join(str(p or "") for p in parts).encode()).hexdigest()
    return f"slack:{team}:h{digest[:32]}"


def action_key(body: Mapping[str, Any], action: Mapping[str, Any]) -> str:
    """The idempotency key of a button press: its trigger id and which button."""
    team = (body.get("team") or {}).get("id") or "-"
    trigger = body.get("trigger_id") or action.get("action_ts") or ""
    return f"slack:{team}:{trigger}:{action.get('action_id', '')}"


def first_time(deps: Deps, key: str, kind: str) -> bool:
    """True for the first delivery of a request; False for Slack's retries and replays."""
    return service.remember_command(deps, key, kind)


def _header(headers: Mapping[str, Any], name: str) -> str | None:
    value = headers.get(name)
    if isinstance(value, list | tuple):
        return str(value[0]) if value else None
    return None if value is None else str(value)


def is_retry(headers: Mapping[str, Any]) -> bool:
    """Whether Slack marked this delivery as a retry of one it thinks went unanswered."""
    return _header(headers, "x-slack-retry-num") is not None


def reply(
    client: WebClient,
    body: Mapping[str, Any],
    caller: Caller,
    text: str,
    *,
    ephemeral: bool = True,
    notifier: Notifier | None = None,
) -> None:
    """Answer the person who asked: through the request's ``response_url`` when it has
    one (it works in any channel the command was typed in, even ones the bot is not a
    member of), else with ``chat.postEphemeral``; a public answer without a
    ``response_url`` goes through ``notifier``, which keeps to the channel's rate limit.

    A reply that cannot be delivered is logged, never raised: the work it reports on
    is already done, and the user's retry must not redo it.
    """
    response_url = body.get("response_url")
    try:
        if response_url:
            payload = {
                "text": text,
                "response_type": "ephemeral" if ephemeral else "in_channel",
                "replace_original": False,
            }
            result = WebhookClient(str(response_url), timeout=10).send_dict(payload)
            if result.status_code >= 300:
                log.warning("response_url answered %s: %s", result.status_code, result.body)
        elif caller.channel is None:
            # No channel (the App Home): a direct message is the only place to say it.
            client.chat_postMessage(channel=caller.user, text=text)
        elif not ephemeral and notifier is not None:
            notifier.post(TextMessage(channel=caller.channel, kind="info", text=text))
        else:
            client.chat_postEphemeral(channel=caller.channel, user=caller.user, text=text)
    except (SlackApiError, SlackRequestError, OSError) as exc:
        log.warning("could not deliver a reply to %s: %s", caller.user, exc)
