"""``/train`` in Slack, and the launch modal it opens when no spec is given.

The listener answers within Slack's 3 s with what needs no I/O: help, a parse error
(with the usage line), a channel that is not allowed. Everything else is acknowledged
with an empty 200 and then done on the work pool: permission checks that may need the
Web API, the service call, the reply. A launch's public record
is its root message, posted by the notifier; the person who typed the command gets an
ephemeral confirmation.

A command is handled once however often Slack delivers it: its ``trigger_id`` is the
key. A launch passes the key to :func:`jobs.usecases.service.submit`, which returns the run the
first delivery created; every other command records the key and a repeat does nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from slack_bolt import Ack, App, BoltRequest
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackRequestError

from bot import replies, views
from bot.auth import (
    CHANNEL_DENIED,
    EXTERNAL_DENIED,
    LAUNCH_DENIED,
    NOT_IN_CHANNEL,
    ONCALL_DENIED,
    Caller,
    not_yours,
    redact_command,
)
from bot.commands import Command, CommandError, parse
from bot.dispatch import ask_for, dispatch
from bot.listeners import (
    ListenerContext,
    caller_from_command,
    caller_from_view,
    command_key,
    first_time,
    reply,
)
from bot.mentions import escape
from bot.verbs import VERBS
from jobs.domain.errors import TrainbotError
from jobs.usecases import service

__all__ = [
    "CHANNEL_DENIED",
    "COMMAND",
    "EXTERNAL_DENIED",
    "LAUNCH_DENIED",
    "MODAL_CALLBACK",
    "NOT_IN_CHANNEL",
    "ONCALL_DENIED",
    "Plan",
    "not_yours",
    "plan_command",
    "register",
]

log = logging.getLogger(__name__)

#: The slash command (deploy/slack-manifest.yaml).
COMMAND = "/train"
#: ``callback_id`` of the launch modal.
MODAL_CALLBACK = views.LAUNCH_MODAL_CALLBACK


@dataclass(frozen=True)
class Plan:
    """What to do with a command, decided from the payload without I/O."""

    caller: Caller
    #: Said in the acknowledgement; nothing else happens.
    answer: str | None = None
    #: Why the request is refused (audited when it is answered).
    denied: str | None = None
    #: The command to run after the acknowledgement (or whose form to open).
    command: Command | None = None
    #: Open the launch modal instead of running ``command``.
    modal: bool = False


def plan_command(ctx: ListenerContext, body: Mapping[str, Any]) -> Plan:
    caller = caller_from_command(body)
    if not caller.user:
        return Plan(caller, answer="This request names no user; nothing was done.")
    # Only what the configuration alone can tell, before the answer; a channel allowed by
    # name is checked against Slack's name for it after the answer (run_command).
    if ctx.auth.channel_verdict(caller.channel) is False:
        return Plan(caller, answer=CHANNEL_DENIED, denied="channel not allowed")
    try:
        command = parse(str(body.get("text") or ""))
    except CommandError as exc:
        return Plan(caller, answer=str(exc))
    verb = VERBS.get(type(command))  # none: the dispatcher refuses it
    if verb is not None and verb.answer is not None:  # help: the command alone answers it
        return Plan(caller, answer=verb.answer(command))
    if verb is not None and verb.wants_form is not None and verb.wants_form(command):
        return Plan(caller, command=command, modal=True)
    return Plan(caller, command=command)


def register(app: App, ctx: ListenerContext) -> None:
    def train(ack: Ack, body: dict[str, Any], request: BoltRequest, client: WebClient) -> None:
        plan = plan_command(ctx, body)
        if plan.answer is not None:
            ack(text=plan.answer, response_type="ephemeral")
            if plan.denied is not None:  # the audit writes to the journal: after the answer
                text = redact_command(f"{COMMAND} {body.get('text', '')}".strip())
                ctx.later(ctx.auth.deny, plan.caller, action=text, reason=plan.denied)
            return
        ack()
        if plan.modal and plan.command is not None:
            ctx.later(_open_modal, ctx, client, body, plan.command)
        elif plan.command is not None:
            key = command_key(body, request.headers)
            ctx.later(run_command, ctx, client, body, plan.caller, plan.command, key=key)

    def launch_modal(ack: Ack, body: dict[str, Any], client: WebClient) -> None:
        text, errors = _modal_command_text(body)
        if errors:
            ack(response_action="errors", errors=errors)
            return
        ack()
        ctx.later(_submit_modal, ctx, client, body, text)

    app.command(COMMAND)(train)
    app.view(MODAL_CALLBACK)(launch_modal)


def _submit_modal(
    ctx: ListenerContext, client: WebClient, body: Mapping[str, Any], text: str
) -> None:
    view = body.get("view") or {}
    caller = caller_from_view(body, channel=_modal_channel(view))
    key = f"slack:{caller.team or '-'}:{view.get('id', '')}"
    run_command(ctx, client, body, caller, parse(text), key=key)


def run_command(
    ctx: ListenerContext,
    client: WebClient,
    body: Mapping[str, Any],
    caller: Caller,
    command: Command,
    *,
    key: str,
) -> None:
    """Check permission, call the service once per key, and reply to the caller."""
    deps = ctx.deps
    try:
        first = first_time(deps, key, command.verb)
    except TrainbotError as exc:  # the database is unavailable: say so, change nothing
        reply(client, body, caller, escape(replies.error(str(exc))))
        return
    verb = VERBS.get(type(command))
    if not first and not (verb is not None and verb.keyed):
        log.info("ignored a repeated %s command (%s)", command.verb, key)
        return
    # A keyed verb (launch, preflight) runs on every delivery: the key makes the service
    # return the run the first one created, so a delivery that died half-way is finished
    # by a retry.
    # Permission is decided by the dispatcher, as for every front end, when it acts.
    result = dispatch(deps, command, caller, auth=ctx.auth, key=key, audit=first)
    if not first:
        return
    # A private verb's reply (a launch's, whose public record is the run's card) and every
    # error go to the caller alone: the dispatcher marks them ephemeral.
    reply(client, body, caller, result.text, ephemeral=result.ephemeral, notifier=deps.notifier)


# ----------------------------------------------------------------------------- the modal


def _open_modal(
    ctx: ListenerContext, client: WebClient, body: Mapping[str, Any], command: Command
) -> None:
    caller = caller_from_command(body)
    # The form only asks; its submission is decided again. Saying no now (by the verb's
    # own permission) spares filling it in for nothing.
    ask = replace(ask_for(ctx.deps, command), action=f"{command.verb} (form)")
    denial = ctx.auth.authorize(caller, ask)
    if denial is not None:
        reply(client, body, caller, denial.text)
        return
    view = views.launch_modal(
        service.specs(ctx.deps), private_metadata=json.dumps({"channel": caller.channel})
    )
    try:
        client.views_open(trigger_id=str(body.get("trigger_id") or ""), view=view)
    except (SlackApiError, SlackRequestError, OSError) as exc:
        log.warning("could not open the launch modal: %s", exc)
        reply(
            client,
            body,
            caller,
            replies.error(
                "the launch form could not be opened; type /train launch <spec> instead. "
                f"Specs: {', '.join(service.specs(ctx.deps)) or 'none'}"
            ),
        )


def _modal_channel(view: Mapping[str, Any]) -> str | None:
    try:
        meta = json.loads(view.get("private_metadata") or "{}")
    except json.JSONDecodeError:
        return None
    channel = meta.get("channel") if isinstance(meta, dict) else None
    return str(channel) if channel else None


def _modal_command_text(body: Mapping[str, Any]) -> tuple[str, dict[str, str]]:
    """The modal's fields as ``launch <spec> <overrides>``, or errors by block id
    (Slack shows them under the fields, and the modal stays open)."""
    values = ((body.get("view") or {}).get("state") or {}).get("values") or {}
    spec, overrides = views.read_launch_modal(values)
    if not spec:
        return "", {"spec": "Choose a spec."}
    text = f"launch {spec} {overrides}".strip()
    try:
        parse(text)
    except CommandError as exc:
        # A form's error is shown as plain text: the unescaped message.
        return "", {"overrides": exc.plain.splitlines()[0][:150]}
    return text, {}
