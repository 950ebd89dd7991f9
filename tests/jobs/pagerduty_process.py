"""One replica's PagerDuty bridge as its own process, for the test that kills it.

``python -m tests.jobs.pagerduty_process`` builds the bridge ``trainbot serve`` builds
(:class:`jobs.outbound.pagerduty.PagerDutyBridge` on the shared database), from the environment:

- ``PD_DATABASE_URL``: the database (the test's schema);
- ``PD_URL``, ``PD_ROUTING_KEY``: the Events API v2 to send to;
- ``PD_OWNER``: this replica's name on the rows it queues and claims;
- ``PD_HOLD_S``: how long its rows stay its own without a renewal;
- ``PD_ALERT``: when set, the id of an alert whose escalation this replica records at
  start, as the escalation job would.

It prints one JSON line, ``{"owner": …}``, once the bridge runs (and the escalation is
recorded), then waits to be killed.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading

from jobs.database.db import make_engine
from jobs.outbound.pagerduty import EventsClient, PagerDutyBridge


def main() -> int:
    owner = os.environ["PD_OWNER"]
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format=f"{owner} %(levelname)s %(message)s"
    )
    engine = make_engine(os.environ["PD_DATABASE_URL"])
    client = EventsClient(os.environ["PD_ROUTING_KEY"], url=os.environ["PD_URL"], timeout_s=2)
    bridge = PagerDutyBridge(
        client,
        engine=engine,
        owner=owner,
        hold_s=float(os.environ["PD_HOLD_S"]),
        poll_s=0.1,
        backoff_s=0.2,
        max_backoff_s=0.5,
        max_attempts=1000,
    )
    alert = os.environ.get("PD_ALERT")
    if alert:
        bridge.record("alert_escalated", None, alert_id=alert, group="@ml-oncall")
    print(json.dumps({"owner": owner}), flush=True)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
