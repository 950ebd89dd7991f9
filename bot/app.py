"""The Slack app: a Bolt ``App`` with trainbot's listeners registered, nothing more.

Bolt runs each listener on the thread that received the request
(``process_before_response=True``) and answers Slack when the listener returns. Every
listener acknowledges first and hands its work to a pool of the app's own
(:class:`bot.workpool.WorkPool`, see :mod:`bot.listeners`), so it returns at once and
every command and button is answered well inside Slack's 3 s however slow the work.
This is cheaper than Bolt's other mode, which runs the listener on Bolt's executor and
has the request's thread poll for the acknowledgement every 10 ms. Signature
verification is on (and checked before Bolt, too, by :mod:`bot.slack_wsgi`). The Web
API client is passed in (``trainbot serve`` makes one from the bot token; tests point
one at a fake Slack), and the listeners get the control plane's dependencies and an
:class:`~bot.auth.Authorizer`.
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
from bot.listeners import spec_yaml as spec_yaml_listeners
from bot.workpool import WORK_THREADS, WorkPool
from jobs.process.deps import Deps
from jobs.process.settings import Settings

__all__ = ["LISTENER_THREADS", "WORK_THREADS", "SlackSetupError", "build_app", "work_pool"]

log = logging.getLogger(__name__)

#: Bolt's own executor, which runs only lazy listeners when listeners run on the
#: request's thread; trainbot has none, so its threads are never started.
LISTENER_THREADS = 2


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
        client = WebClient(
            token=settings.slack_bot_token.get_secret_value(), base_url=settings.slack_api_url
        )
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
        # The listener runs on the request's thread and only acknowledges and hands
        # its work over, so the answer goes as soon as it returns.
        process_before_response=True,
        listener_executor=ThreadPoolExecutor(
            max_workers=listener_threads, thread_name_prefix="slack"
        ),
        logger=logging.getLogger("bot.slack"),
    )
    auth = Authorizer(Policy.from_settings(settings), client=client, journal=deps.journal)
    # The launches that happen later on their own ask the same list, when they happen.
    deps.may_launch = auth.may_start
    if work is None:
        work = work_pool()
    ctx = ListenerContext(deps=deps, auth=auth, work=work)
    run_listeners.register(app, ctx)
    alert_listeners.register(app, ctx)
    home_listeners.register(app, ctx)
    spec_yaml_listeners.register(app, ctx)
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


def work_pool(threads: int = WORK_THREADS) -> WorkPool:
    """A pool for the work listeners do after acknowledging (acknowledgements first)."""
    return WorkPool(threads)
