"""One control-plane replica as its own process, for the tests that kill replicas.

``python -m tests.jobs.replica_process`` builds what ``trainbot serve`` builds with Slack
(the control plane, the Slack app at /slack/events, the Slack notifier, which on
PostgreSQL writes to the shared outbox), with three things a test sets that the CLI
keeps fixed: the Web API's URL (the fake Slack), the scheduler lease's length (short, so
a takeover happens within the test) and the digest time to the second. The settings
come from the environment as ``trainbot serve`` reads them; the test's own knobs are:

- ``REPLICA_NAME``: this replica's name on the lease and on what it claims;
- ``REPLICA_SLACK_API``: the fake Slack's ``api_url``;
- ``REPLICA_LEASE_S``: the lease's length in seconds;
- ``REPLICA_POST_INTERVAL_S``: the notifier's pace per channel;
- ``REPLICA_DIGEST_AT``: the digest time, ``HH:MM:SS`` in ``TRAINBOT_TIMEZONE``;
- ``REPLICA_INTERVALS``: JSON of the interval jobs' periods (``{"reconcile": 1}``).

It prints one JSON line, ``{"url": …}``, once it serves, and stops cleanly on SIGTERM.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from datetime import time

from slack_sdk import WebClient

from bot.slack_notifier import SlackNotifier
from bot.slack_wsgi import attach
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings


def main() -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s {os.environ['REPLICA_NAME']} %(levelname)s %(name)s: %(message)s",
    )
    settings = load_settings()
    at = os.environ.get("REPLICA_DIGEST_AT")
    if at:
        settings = settings.model_copy(update={"digest_time": time.fromisoformat(at)})
    assert settings.slack_bot_token is not None
    client = WebClient(
        base_url=os.environ["REPLICA_SLACK_API"], token=settings.slack_bot_token.get_secret_value()
    )
    notifier = SlackNotifier(
        client, min_interval_s=float(os.environ.get("REPLICA_POST_INTERVAL_S", "1")), backoff_s=0.05
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    cp = ControlPlane(
        settings,
        notifier=notifier,
        lease_s=float(os.environ["REPLICA_LEASE_S"]),
        lease_holder=os.environ["REPLICA_NAME"],
        scheduler_intervals=json.loads(os.environ.get("REPLICA_INTERVALS") or "{}"),
    )
    front = attach(cp, client=client, notifier=notifier)
    try:
        with cp:
            front.start()
            assert cp.server is not None
            print(json.dumps({"url": cp.server.url}), flush=True)
            stop.wait()
            front.close()
    finally:
        notifier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
