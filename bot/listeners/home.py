"""The App Home tab: the runs that are going and the alerts still open in the channels
of whoever opens it. Published fresh on every ``app_home_opened``, so it is never stale for long
and needs no bookkeeping of who looked at it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from slack_bolt import Ack, App
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackRequestError

from bot import views
from bot.auth import Caller
from bot.listeners import ListenerContext, caller_from_event
from jobs import alerts
from jobs.database.db import session_scope
from jobs.database.models import Run
from jobs.outbound.notify import AlertMessage, RunCard
from jobs.usecases import service

__all__ = ["home_content", "publish_home", "register"]

log = logging.getLogger(__name__)

#: The tab shows at most this many runs and alerts; the rest are counted, and a
#: command away.
MAX_ITEMS = 20


def home_content(ctx: ListenerContext, caller: Caller) -> tuple[list[RunCard], list[AlertMessage]]:
    """Active runs and the alerts still open, newest first: those of the allowed channels
    the person is a member of (every channel's, for an admin), and nothing for a person
    from another organisation."""
    if ctx.auth.is_external(caller):
        return [], []
    actor = ctx.auth.actor(caller)
    cards = service.list_runs(ctx.deps, "active", actor)
    cards = [c for c in cards if ctx.auth.channel_allowed_id(c.channel)]
    with session_scope(ctx.deps.engine) as session:
        rows = list(reversed(alerts.open_alerts(session)))
        found = []
        for alert in rows:
            run = session.get(Run, alert.run_id) if alert.run_id else None
            channel = alert.message_channel or (run.channel if run else None)
            if not actor.sees(channel) or not ctx.auth.channel_allowed_id(channel):
                continue
            found.append(
                alerts.alert_message(
                    alert, channel=channel or "", thread_ts=run.thread_ts if run else None
                )
            )
    return cards, found  # all of them: the tab shows MAX_ITEMS and counts the rest


def register(app: App, ctx: ListenerContext) -> None:
    def home_opened(ack: Ack, body: dict[str, Any], client: WebClient) -> None:
        ack()
        ctx.later(publish_home, ctx, client, body)

    app.event("app_home_opened")(home_opened)


def publish_home(ctx: ListenerContext, client: WebClient, body: Mapping[str, Any]) -> None:
    event = body.get("event") or {}
    if event.get("tab", "home") != "home":
        return
    caller = caller_from_event(body)
    if not caller.user:
        return
    runs, open_alerts = home_content(ctx, caller)
    try:
        view = views.home_tab(runs, open_alerts, max_items=MAX_ITEMS)
        client.views_publish(user_id=caller.user, view=view)
    except (SlackApiError, SlackRequestError, OSError) as exc:
        log.warning("could not publish the App Home for %s: %s", caller.user, exc)
