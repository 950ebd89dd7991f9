"""The AWS notice: IMDSv2 ``spot/instance-action``, polled with a session token that is
refreshed before it expires. No AWS SDK: plain HTTP to the instance metadata service.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from datetime import datetime, timezone

from runner.env import TERMINATION_WINDOWS_S as WINDOWS_S
from runner.preemption.flag import Notice, PreemptionFlag
from runner.preemption.metadata import (
    NETWORK_ERRORS,
    Endpoint,
    MetadataUnavailable,
    PollerThread,
    Reply,
    exchange,
)

log = logging.getLogger(__name__)

#: AWS's maximum token lifetime; the poller asks for it and refreshes before it ends.
AWS_TOKEN_TTL_S = 21600


def _parse_wallclock(text: str) -> float:
    """Seconds since the epoch of an ISO 8601 time; naive times are UTC (as AWS's are)."""
    stamp = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()


def aws_notice(body: bytes, *, received_at: float, wall_now: float, window_s: float) -> Notice:
    """The notice for an ``instance-action`` answer. The deadline comes from AWS's
    wall-clock ``time``, moved onto the monotonic clock; if that is unreadable, the
    usual window from ``received_at`` stands in."""
    action, when = "unknown", ""
    deadline = received_at + window_s
    try:
        doc = json.loads(body)
        action = str(doc.get("action", action))
        when = str(doc["time"])
        deadline = received_at + (_parse_wallclock(when) - wall_now)
    except (ValueError, TypeError, KeyError, AttributeError):
        log.debug("unreadable spot instance-action %r; assuming %.0f s", body[:200], window_s)
    reason = f"spot instance-action {action}" + (f" at {when}" if when else "")
    return Notice(source="aws", reason=reason, received_at=received_at, deadline=deadline)


class AwsSpotPoller(PollerThread):
    """Poll IMDSv2 ``spot/instance-action``, which appears about two minutes before AWS
    interrupts a spot instance (before the SIGTERM the shutdown sends, if any)."""

    name = "trainbot-aws-spot-poller"

    def __init__(
        self,
        flag: PreemptionFlag,
        *,
        base_url: str = "http://169.254.169.254",
        interval_s: float = 5.0,
        window_s: float = WINDOWS_S["aws"],
        timeout_s: float = 2.0,
        token_ttl_s: int = AWS_TOKEN_TTL_S,
    ) -> None:
        super().__init__()
        self._flag = flag
        self._endpoint = Endpoint(base_url, what="AWS")
        self._interval_s = interval_s
        self._window_s = window_s
        self._timeout_s = timeout_s
        self._token_ttl_s = token_ttl_s
        self._token: str | None = None
        self._token_renew_at = 0.0

    def __repr__(self) -> str:
        return f"AwsSpotPoller({self._endpoint.host}:{self._endpoint.port})"

    def _run(self) -> None:
        while not self._stopping.is_set():
            if self.poll_once():
                return
            self._stopping.wait(self._interval_s)

    def poll_once(self) -> bool:
        """Ask once; True when a notice was seen (and the flag set). Never raises for
        network trouble: the metadata server may be briefly unreachable."""
        try:
            reply = self._get_action()
            if reply.status == 401:  # token expired or revoked: one fresh try
                self._token = None
                reply = self._get_action()
        except NETWORK_ERRORS as exc:
            log.debug("AWS metadata not reachable (%s); polling again", exc)
            return False
        if reply.status == 404:
            return False
        if reply.status != 200:
            log.debug("AWS instance-action answered HTTP %s; polling again", reply.status)
            return False
        notice = aws_notice(
            reply.body,
            received_at=time.monotonic(),
            wall_now=time.time(),
            window_s=self._window_s,
        )
        self._flag.set(notice)
        log.warning("preemption notice from AWS: %s", notice.reason)
        return True

    def _get_action(self) -> Reply:
        token = self._ensure_token()
        path = self._endpoint.prefix + "/latest/meta-data/spot/instance-action"
        return self._request("GET", path, {"X-aws-ec2-metadata-token": token})

    def _ensure_token(self) -> str:
        if self._token is not None and time.monotonic() < self._token_renew_at:
            return self._token
        asked_at = time.monotonic()
        reply = self._request(
            "PUT",
            self._endpoint.prefix + "/latest/api/token",
            {"X-aws-ec2-metadata-token-ttl-seconds": str(self._token_ttl_s)},
        )
        if reply.status != 200 or not reply.body.strip():
            raise MetadataUnavailable(f"token request answered HTTP {reply.status}")
        self._token = reply.body.decode("ascii", "replace").strip()
        # Renew a quarter-TTL (at most a minute) early, counted from before the request.
        self._token_renew_at = asked_at + self._token_ttl_s - min(60.0, self._token_ttl_s / 4)
        return self._token

    def _request(self, method: str, path: str, headers: Mapping[str, str]) -> Reply:
        conn = self._endpoint.connect(timeout=self._timeout_s)
        try:
            return exchange(conn, method, path, headers)
        finally:
            conn.close()
