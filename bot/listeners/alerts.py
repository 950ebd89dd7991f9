"""The buttons: Acknowledge, Snooze, Stop run, Resubmit (and Resubmit from step N on an
alert whose run trainbot stopped) on alerts; Launch anyway on a preflight report with
warnings, Stage the data on one whose dataset is in another region; Continue
(optionally with a raised budget) and Stop on a projection that stopped its run to ask.

Each press is acknowledged at once (an empty 200) and handled on the work pool: the
caller and channel come from the signed payload, the button's value names the alert or
run, and a press is handled once however often Slack delivers it (its trigger id is
the key). The result shows up where everyone sees it — the alert message updated in
place with who acknowledged it and when, the run's card and thread — so the person who
pressed gets a private reply only when something went wrong or was already done.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from slack_bolt import Ack, App
from slack_sdk import WebClient

from bot import replies, views
from bot.auth import Ask, Caller
from bot.commands import CommandError, parse_duration
from bot.listeners import ListenerContext, action_key, caller_from_action, first_time, reply
from bot.mentions import escape
from bot.verbs import ANYONE, Permission
from jobs.database.db import session_scope
from jobs.database.models import Alert, Run
from jobs.domain.errors import TrainbotError
from jobs.staging import service as staging
from jobs.usecases import service

__all__ = ["ACTIONS", "DEFAULT_SNOOZE_S", "register"]

log = logging.getLogger(__name__)

#: A Snooze button without a duration silences the alert for this long.
DEFAULT_SNOOZE_S = 3600

_ALERT_ID = re.compile(r"al-[a-z0-9]{1,64}")


@dataclass(frozen=True)
class Target:
    """What a button acts on: its channel (where permission is checked), its run and
    that run's owner."""

    id: str
    channel: str | None
    owner: str | None
    #: The run it is (or the alert is about), for the audit.
    run: str | None = None


Handler = Callable[[ListenerContext, Caller, str], str | None]


def _acknowledge(ctx: ListenerContext, caller: Caller, alert_id: str) -> str | None:
    alert = service.acknowledge(ctx.deps, alert_id, ctx.auth.actor(caller))
    if alert.acked_by and alert.acked_by != caller.user:
        return f"{alert.id} was already acknowledged by <@{alert.acked_by}>."
    return None  # the alert message now says who and when, for everyone


def _snooze(ctx: ListenerContext, caller: Caller, value: str) -> str | None:
    alert_id, seconds = _snooze_choice(value)
    alert = service.snooze(ctx.deps, alert_id, seconds, ctx.auth.actor(caller))
    return replies.snoozed(alert.id, alert.snoozed_until)


def _snooze_choice(value: str) -> tuple[str, int]:
    """(alert id, seconds) from the Snooze menu's value (``al-x|4h``, see
    :func:`bot.views.snooze_value`), or a bare alert id for the default snooze."""
    try:
        alert_id, duration = views.parse_snooze_value(value)
    except ValueError:
        alert_id, duration = value.strip(), ""
    if not _ALERT_ID.fullmatch(alert_id):
        raise CommandError(f"the Snooze menu sent {value[:60]!r}, which names no alert")
    return alert_id, parse_duration(duration) if duration else DEFAULT_SNOOZE_S


def _stop(ctx: ListenerContext, caller: Caller, run_id: str) -> str | None:
    run = service.stop(ctx.deps, run_id, ctx.auth.actor(caller))
    return replies.stopped(run.id)


def _resubmit(ctx: ListenerContext, caller: Caller, run_id: str) -> str | None:
    run = service.resubmit(ctx.deps, run_id, ctx.auth.actor(caller))
    return replies.resubmitted(run_id, run.id)


def _resubmit_from(ctx: ListenerContext, caller: Caller, value: str) -> str | None:
    run_id, step = _resubmit_from_choice(value)
    run = service.resubmit(ctx.deps, run_id, ctx.auth.actor(caller), from_step=step)
    return replies.resubmitted_from(run_id, run.id, run.last_committed_step)


def _resubmit_from_choice(value: str) -> tuple[str, int]:
    try:
        return views.parse_resubmit_from_value(value)
    except ValueError:
        raise CommandError(
            f"the Resubmit button sent {value[:60]!r}, which names no run and step"
        ) from None


def _launch_anyway(ctx: ListenerContext, caller: Caller, run_id: str) -> str | None:
    service.confirm(ctx.deps, run_id, ctx.auth.actor(caller))
    return None  # the thread says who confirmed; the card shows the launch


def _stage_data(ctx: ListenerContext, caller: Caller, run_id: str) -> str | None:
    return staging.stage_run(ctx.deps, run_id, ctx.auth.actor(caller))


def _continue_profiled(ctx: ListenerContext, caller: Caller, value: str) -> str | None:
    try:
        run_id, budget = views.parse_continue_value(value)
    except ValueError:
        raise CommandError(
            f"the Continue button sent {value[:60]!r}, which names no run and budget"
        ) from None
    run = service.continue_profiled(ctx.deps, run_id, ctx.auth.actor(caller), budget_usd=budget)
    return replies.resubmitted(run_id, run.id)


def _stop_profiled(ctx: ListenerContext, caller: Caller, run_id: str) -> str | None:
    service.stop_profiled(ctx.deps, run_id, ctx.auth.actor(caller))
    return None  # the run's thread says who chose Stop


@dataclass(frozen=True)
class Button:
    """What a button acts on and who may press it, in the words a ``/train`` verb's
    permission uses (:class:`bot.verbs.Permission`)."""

    #: What its value names: "run" or "alert".
    kind: str
    handler: Handler
    #: Who may press it, beyond being a member of the message's channel: ``changes_run``
    #: for the run's requester or an admin, ``starts_compute`` for launchers only.
    policy: Permission


#: The run's requester or an admin.
_OWNER = Permission(changes_run=True)
#: The run's requester or an admin, and only while they may start compute.
_OWNER_STARTS = Permission(changes_run=True, starts_compute=True)

ACTIONS: dict[str, Button] = {
    "alert_ack": Button("alert", _acknowledge, ANYONE),
    "alert_snooze": Button("alert", _snooze, ANYONE),
    "run_stop": Button("run", _stop, _OWNER),
    "run_resubmit": Button("run", _resubmit, _OWNER_STARTS),
    "run_resubmit_from": Button("run", _resubmit_from, _OWNER_STARTS),
    "launch_anyway": Button("run", _launch_anyway, _OWNER_STARTS),
    "run_stage": Button("run", _stage_data, _OWNER_STARTS),
    "profile_continue": Button("run", _continue_profiled, _OWNER_STARTS),
    "profile_stop": Button("run", _stop_profiled, _OWNER),
}


def register(app: App, ctx: ListenerContext) -> None:
    for action_id in ACTIONS:
        _register_one(app, ctx, action_id)


def _register_one(app: App, ctx: ListenerContext, action_id: str) -> None:
    def button(ack: Ack, body: dict[str, Any], client: WebClient) -> None:
        ack()
        ctx.later(handle_action, ctx, client, body, action_id)

    button.__name__ = f"{action_id}_button"
    app.action(action_id)(button)


def handle_action(
    ctx: ListenerContext, client: WebClient, body: Mapping[str, Any], action_id: str
) -> None:
    """One button press: once per trigger, allowed channel, permission, then the work."""
    action = next((a for a in body.get("actions") or () if a.get("action_id") == action_id), None)
    if action is None:
        return
    caller = caller_from_action(body)
    if not caller.user:
        return
    try:
        if not first_time(ctx.deps, action_key(body, action), action_id):
            log.info("ignored a repeated %s press", action_id)
            return
    except TrainbotError as exc:  # the database is unavailable: say so, change nothing
        reply(client, body, caller, escape(replies.error(str(exc))))
        return
    button = ACTIONS[action_id]
    value = _value(action)
    target = _target(ctx, button.kind, value)
    # A button in a message acts for that message's channel, so only its members may
    # press it; one in the App Home (no channel) acts in its run's or alert's channel,
    # which the presser must be in. Decided where every front end's requests are.
    ask = Ask(
        action=action_id,
        starts_compute=button.policy.starts_compute,
        target=target.id if target is not None else None,
        run=target.run if target is not None else None,
        owner=target.owner if target is not None and button.policy.changes_run else None,
        target_channel=target.channel if target is not None else None,
        in_message=caller.channel is not None,
    )
    denial = ctx.auth.authorize(caller, ask)
    if denial is not None:
        reply(client, body, caller, denial.text)
        return
    try:
        text = button.handler(ctx, caller, value)
    except TrainbotError as exc:
        reply(client, body, caller, escape(replies.error(str(exc))))
        return
    except CommandError as exc:  # escaped once, from its unescaped message
        reply(client, body, caller, escape(replies.error(exc.plain)))
        return
    except Exception:
        log.exception("the %s button failed", action_id)
        reply(client, body, caller, replies.unexpected())
        return
    if text:
        reply(client, body, caller, text)


def _value(action: Mapping[str, Any]) -> str:
    selected = action.get("selected_option")
    if isinstance(selected, dict) and selected.get("value"):
        return str(selected["value"])
    return str(action.get("value") or "")


def _run(kind: str, target: Target) -> str | None:
    return target.id if kind == "run" else None


def _target(ctx: ListenerContext, kind: str, value: str) -> Target | None:
    """The run or alert a button names, or None when there is none (the service will
    say so in its own words)."""
    with session_scope(ctx.deps.engine) as session:
        if kind == "run":
            # A Resubmit-from button's value is "<run id>|<step>".
            run = session.get(Run, value.partition("|")[0])
            if run is None:
                return None
            return Target(id=run.id, channel=run.channel, owner=run.requester, run=run.id)
        try:
            alert_id, _ = _snooze_choice(value)
        except CommandError:
            return None
        alert = session.get(Alert, alert_id)
        if alert is None:
            return None
        channel = alert.message_channel
        if channel is None and alert.run_id is not None:
            run = session.get(Run, alert.run_id)
            channel = run.channel if run is not None else None
        return Target(id=alert.id, channel=channel, owner=None, run=alert.run_id)
