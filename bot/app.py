"""The Slack app: a Bolt ``App`` with trainbot's listeners registered, nothing more.

Bolt runs in its ordinary mode (``process_before_response=False``): each listener
acknowledges at once and hands its work to a pool of the app's own (see
:mod:`bot.listeners`), so every command and button is answered well inside Slack's 3 s
however slow the work. Signature verification is on. The Web API client is passed in
(``trainbot serve`` makes one from the bot token; tests point one at a fake Slack), and
the listeners get the control plane's dependencies and an :class:`~bot.auth.Authorizer`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

from slack_bolt import App
from slack_bolt.authorization import AuthorizeResult
from slack_sdk import WebClient

from bot.auth import Authorizer, Policy
from bot.commands import BotError
from bot.listeners import ListenerContext
from bot.listeners import alerts as alert_listeners
from bot.listeners import home as home_listeners
from bot.listeners import runs as run_listeners
from jobs.deps import Deps
from jobs.settings import Settings

__all__ = ["LISTENER_THREADS", "WORK_THREADS", "SlackSetupError", "build_app", "work_pool"]

log = logging.getLogger(__name__)

#: Bolt's threads, which run the listeners up to their acknowledgement: each takes a
#: moment, and a burst of commands is acknowledged in parallel.
LISTENER_THREADS = 32
#: Threads that run the work after an acknowledgement (service calls, replies): apart
#: from Bolt's, so slow work never queues in front of an acknowledgement, and few, so
#: it does not crowd the acknowledgements out of the CPU.
WORK_THREADS = 4


class SlackSetupError(BotError):
    """The Slack app cannot be built from these settings; the message says which to set."""


def build_app(
    deps: Deps,
    *,
    settings: Settings,
    client: WebClient | None = None,
    work: Executor | None = None,
    listener_threads: int = LISTENER_THREADS,
) -> App:
    """The Bolt app over ``deps``; ``client`` defaults to one made from the bot token.

    ``work`` runs what listeners do after acknowledging; the caller owns it and shuts it
    down after the app's own executor (see :class:`bot.slack_wsgi.SlackFrontEnd`). By
    default a pool of ``WORK_THREADS`` is made, which lives as long as the process.
    """
    if settings.slack_signing_secret is None:
        raise SlackSetupError(
            "TRAINBOT_SLACK_SIGNING_SECRET is not set: without it no request from Slack can "
            "be verified; copy it from the app's Basic Information page"
        )
    if client is None:
        if settings.slack_bot_token is None:
            raise SlackSetupError(
                "TRAINBOT_SLACK_BOT_TOKEN is not set: the app cannot post or reply; copy the "
                "xoxb- token from the app's OAuth & Permissions page"
            )
        client = WebClient(token=settings.slack_bot_token.get_secret_value())
    if not client.token:
        raise SlackSetupError(
            "the Slack Web API client has no token: set TRAINBOT_SLACK_BOT_TOKEN to the "
            "app's xoxb- token"
        )
    app = App(
        signing_secret=settings.slack_signing_secret.get_secret_value(),
        # A client without the token (Bolt makes one per request from it), and the token
        # from ``authorize``: Bolt's default would call auth.test on the first request,
        # and while Slack's API cannot be reached every command would fail with a 500.
        client=_tokenless(client),
        authorize=_static_authorize(client.token),
        request_verification_enabled=True,
        process_before_response=False,
        listener_executor=ThreadPoolExecutor(
            max_workers=listener_threads, thread_name_prefix="slack"
        ),
        logger=logging.getLogger("bot.slack"),
    )
    auth = Authorizer(Policy.from_settings(settings), client=client, journal=deps.journal)
    if work is None:
        work = work_pool()
    ctx = ListenerContext(deps=deps, auth=auth, work=work)
    run_listeners.register(app, ctx)
    alert_listeners.register(app, ctx)
    home_listeners.register(app, ctx)
    return app


def _tokenless(client: WebClient) -> WebClient:
    return WebClient(
        base_url=client.base_url,
        timeout=client.timeout,
        ssl=client.ssl,
        proxy=client.proxy,
        headers=client.headers,
        logger=client.logger,
        retry_handlers=list(client.retry_handlers),
    )


def _static_authorize(token: str) -> Callable[..., AuthorizeResult]:
    """One workspace, one bot token: nothing to look up, so no API call per request.

    The bot's own user id stays unknown, which only matters for ignoring the bot's own
    message events, and the app subscribes to none.
    """

    def authorize(
        enterprise_id: str | None, team_id: str | None, user_id: str | None
    ) -> AuthorizeResult:
        return AuthorizeResult(
            enterprise_id=enterprise_id, team_id=team_id, user_id=user_id, bot_token=token
        )

    return authorize


def work_pool(threads: int = WORK_THREADS) -> ThreadPoolExecutor:
    """A pool for the work listeners do after acknowledging."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="slack-work")
