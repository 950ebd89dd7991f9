""" "New run from YAML": a global shortcut opens a modal where a spec is pasted whole.

The submission is checked before Slack's 3 s are up, with what needs no I/O: the text is
read, bounded and validated exactly as a spec file is (:func:`jobs.spec.spec_from_text`),
and the channel must be one trainbot works in. A problem comes back as
``response_action: errors``, its message under the input it is about, and the modal stays
open to fix it. A good spec is launched as ``/train launch`` launches one: the same
dispatcher, so the same authorisation (only launchers start compute; a private channel
only for its members), keyed by the view so a retried submission launches once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from slack_bolt import Ack, App
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackRequestError

from bot.auth import CHANNEL_DENIED, EXTERNAL_DENIED, LAUNCH_DENIED
from bot.commands import Launch
from bot.listeners import ListenerContext, caller_from_view, reply
from bot.listeners.runs import run_command
from bot.views.modal import PASTE_YAML_ACTION
from bot.views.spec_yaml import (
    CHANNEL_BLOCK,
    SPEC_BLOCK,
    YAML_MODAL_CALLBACK,
    YAML_SHORTCUT,
    read_yaml_modal,
    yaml_modal,
)
from jobs.domain.errors import SpecError
from jobs.spec import JobSpec, spec_from_text

__all__ = ["PASTED_NAME", "register", "validate_pasted"]

log = logging.getLogger(__name__)

#: The spec's name when the pasted YAML gives none.
PASTED_NAME = "pasted"
#: Characters of an error shown under an input; the rest is cut with a note.
MAX_ERROR_CHARS = 1500

EMPTY = "Paste a spec: at least a command, such as  command: python train.py"
NO_CHANNEL = "Choose the channel the run reports in."
UNEXPECTED = "This spec could not be checked (an unexpected error, logged for the operator)."
NOT_OPENED = (
    "The YAML form could not be opened (Slack refused it, or answered too late). "
    "Try the shortcut again, or launch a spec by name: /train specs lists them."
)


def validate_pasted(text: str) -> JobSpec:
    """The pasted spec, validated as a file is; SpecError says what to fix."""
    if not text.strip():
        raise SpecError(EMPTY)
    return spec_from_text(text, name=PASTED_NAME, where="the pasted spec")


def register(app: App, ctx: ListenerContext) -> None:
    def shortcut(ack: Ack, body: dict[str, Any], client: WebClient) -> None:
        ack()
        ctx.later(_open, ctx, client, body)

    def submitted(ack: Ack, body: dict[str, Any], client: WebClient) -> None:
        view = body.get("view") or {}
        text, channel = read_yaml_modal((view.get("state") or {}).get("values") or {})
        errors: dict[str, str] = {}
        spec: JobSpec | None = None
        try:
            spec = validate_pasted(text)
        except SpecError as exc:
            errors[SPEC_BLOCK] = _fit(str(exc))
        except Exception:
            log.exception("a pasted spec could not be checked")
            errors[SPEC_BLOCK] = UNEXPECTED
        if not channel:
            errors[CHANNEL_BLOCK] = NO_CHANNEL
        elif ctx.auth.channel_verdict(channel) is False:
            errors[CHANNEL_BLOCK] = CHANNEL_DENIED
        if errors or spec is None:
            ack(response_action="errors", errors=errors)
            return
        # Closes this form and, when it was opened over the launch form, that one too.
        ack(response_action="clear")
        ctx.later(_launch, ctx, client, body, spec.name, text, channel)

    def paste_button(ack: Ack, body: dict[str, Any], client: WebClient) -> None:
        ack()
        ctx.later(_open, ctx, client, body, push=True)

    app.shortcut(YAML_SHORTCUT)(shortcut)
    app.action(PASTE_YAML_ACTION)(paste_button)
    app.view(YAML_MODAL_CALLBACK)(submitted)


def _open(
    ctx: ListenerContext, client: WebClient, body: Mapping[str, Any], *, push: bool = False
) -> None:
    """Open the modal: from the shortcut, or (``push``) over the launch form, from its
    button, with the form's channel chosen for the run."""
    caller = caller_from_view(body, channel=None)
    channel = _launch_form_channel(body) if push else None
    # The form only asks (its submission is decided again, in full): someone who may not
    # launch is told now, not after pasting a spec.
    refusal = None
    if ctx.auth.is_external(caller):
        refusal = ("external user", EXTERNAL_DENIED)
    elif not ctx.auth.may_launch(caller, fresh=True):
        refusal = ("may not launch", LAUNCH_DENIED)
    if refusal is not None:
        ctx.auth.deny(caller, action="launch (YAML form)", reason=refusal[0])
        reply(client, body, caller, refusal[1])
        return
    trigger = str(body.get("trigger_id") or "")
    try:
        if push:
            client.views_push(trigger_id=trigger, view=yaml_modal(channel=channel))
        else:
            client.views_open(trigger_id=trigger, view=yaml_modal())
    except (SlackApiError, SlackRequestError, OSError) as exc:
        log.warning("could not open the YAML form: %s", exc)
        reply(client, body, caller, NOT_OPENED)


def _launch(
    ctx: ListenerContext,
    client: WebClient,
    body: Mapping[str, Any],
    name: str,
    text: str,
    channel: str,
) -> None:
    view = body.get("view") or {}
    caller = caller_from_view(body, channel=channel)
    key = f"slack:{caller.team or '-'}:{view.get('id', '')}"
    run_command(ctx, client, body, caller, Launch(spec=name, spec_text=text), key=key)


def _launch_form_channel(body: Mapping[str, Any]) -> str | None:
    """The channel the launch form was opened in (its private metadata, which we wrote)."""
    try:
        meta = json.loads((body.get("view") or {}).get("private_metadata") or "{}")
    except json.JSONDecodeError:
        return None
    channel = meta.get("channel") if isinstance(meta, dict) else None
    return str(channel) if channel else None


def _fit(message: str) -> str:
    if len(message) <= MAX_ERROR_CHARS:
        return message
    return message[: MAX_ERROR_CHARS - 40].rstrip() + f"\n… ({len(message):,} characters in all)"
