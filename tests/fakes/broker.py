"""The control plane's credential broker as the runner sees it: ``POST /v1/credentials``
with the attempt's bearer token, on 127.0.0.1 (the control plane's own broker is tested in
``tests/jobs/test_credentials_broker.py`` and ``test_gcp_credentials_broker.py``).

Each answer is fresh and expires after the next of ``lifetimes`` (the last one repeats);
what it holds is the subclass's (STS keys from moto, a Google access token). The runner's
events, sent to the same host, are acknowledged and not recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from runner.errors import StoreError
from tests.fakes.loopback import ClosedOnExit, LoopbackServer, QuietHandler, read_body, reply_json

TOKEN = "tok-runner"


class FakeBroker(ClosedOnExit):
    def __init__(self, *, lifetimes: list[timedelta] | None = None) -> None:
        self.lifetimes = list(lifetimes or [timedelta(hours=1)])
        self.issued: list[dict[str, Any]] = []
        #: (path, Authorization) of every request but the events'.
        self.requests: list[tuple[str, str | None]] = []
        broker = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                read_body(self)
                if self.path == "/v1/events":  # the runner's telemetry: acknowledged
                    return reply_json(self, 200, {})
                broker.requests.append((self.path, self.headers.get("Authorization")))
                if self.path != "/v1/credentials":
                    return reply_json(self, 404, {"error": f"no such endpoint {self.path!r}"})
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return reply_json(self, 401, {"error": "unknown or revoked runner token"})
                return reply_json(self, 200, broker.issue())

        self._server = LoopbackServer(Handler)
        self.url = self._server.url

    def issue(self) -> dict[str, Any]:
        lifetime = self.lifetimes.pop(0) if len(self.lifetimes) > 1 else self.lifetimes[0]
        answer = self.credentials(datetime.now(timezone.utc) + lifetime)
        self.issued.append(answer)
        return answer

    def credentials(self, expires: datetime) -> dict[str, Any]:
        """One answer's body, expiring at ``expires``."""
        raise NotImplementedError

    def close(self) -> None:
        self._server.close()

    def runner_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """What the control plane puts in the environment of a runner whose store takes
        its credentials from the broker."""
        monkeypatch.setenv("TRAINBOT_INGEST_URL", self.url + "/v1/events")
        monkeypatch.setenv("TRAINBOT_TOKEN", TOKEN)
        monkeypatch.setenv("TRAINBOT_STORE_CREDENTIALS", "broker")


def assert_refused_token_said(
    open_store: Callable[[], object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What every store that takes its credentials from the broker says when it cannot:
    a refused (revoked) token is a StoreError naming the 401 and never the token, and a
    TRAINBOT_STORE_CREDENTIALS other than broker one that says to write 'broker'. The
    runner's environment is the broker's (``FakeBroker.runner_env``) and is left with
    TRAINBOT_STORE_CREDENTIALS=profile."""
    monkeypatch.setenv("TRAINBOT_TOKEN", "tok-revoked")
    with pytest.raises(StoreError, match=r"refused checkpoint credentials \(401") as caught:
        open_store()
    assert "tok-revoked" not in str(caught.value)
    monkeypatch.setenv("TRAINBOT_TOKEN", TOKEN)
    monkeypatch.setenv("TRAINBOT_STORE_CREDENTIALS", "profile")
    with pytest.raises(StoreError, match="write 'broker'"):
        open_store()
