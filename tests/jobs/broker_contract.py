"""What both credential brokers' tests (AWS and GCP) share: the control plane's
``/v1/credentials`` over real HTTP, and which settings make the control plane tell a
runner to take its store's credentials from the broker."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine
from sqlmodel import Session

from bot.console import ConsoleNotifier
from jobs.database.models import Attempt, Run
from jobs.domain.lifecycle import AttemptState
from jobs.ingest import IngestService
from jobs.process.bootstrap import build_credential_broker
from jobs.process.deps import Deps
from jobs.process.settings import Settings
from jobs.providers.base import Provider
from jobs.runs import runner_env, spec_of
from jobs.web.server import CREDENTIALS_PATH, ControlPlaneApp, CredentialBroker, serve

#: The running attempt's token in both brokers' tests.
TOKEN = "tok-live"


class Plane:
    """The real WSGI app over real HTTP, with a broker (or none)."""

    def __init__(self, engine: Engine, broker: CredentialBroker | None) -> None:
        self.app = ControlPlaneApp(engine, IngestService(engine), credentials=broker)
        self.server = serve(self.app, "127.0.0.1", 0)
        self.url = self.server.url

    def credentials(self, token: str | None = TOKEN) -> tuple[int, dict[str, Any], Any]:
        """``POST /v1/credentials`` with ``token`` (None: no Authorization header): the
        status, the JSON body and the headers."""
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        request = urllib.request.Request(
            self.url + CREDENTIALS_PATH, data=b"", method="POST", headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, json.loads(reply.read()), reply.headers
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read()), exc.headers


def assert_store_credentials(
    engine: Engine, provider: Provider, cases: Sequence[tuple[Settings, str | None]]
) -> None:
    """For each (settings, expected): attempt a-1 of run r-1 on ``provider`` is launched
    with ``TRAINBOT_STORE_CREDENTIALS`` = expected (None: not set), with the deps wired as
    ControlPlane wires them (brokered only where a broker was built). ``provider`` is
    closed at the end."""
    try:
        with Session(engine) as session:
            run, attempt = session.get(Run, "r-1"), session.get(Attempt, "a-1")
            assert run is not None and attempt is not None
            for settings, expected in cases:
                deps = Deps(
                    settings=settings,
                    engine=engine,
                    provider=provider,
                    notifier=ConsoleNotifier(io.StringIO()),
                    store_credentials=build_credential_broker(settings) is not None,
                )
                env = runner_env(deps, run, attempt, spec_of(run))
                assert env.get("TRAINBOT_STORE_CREDENTIALS") == expected, settings
                deps.close()
    finally:
        provider.close()


def assert_tokens_refused(engine: Engine, plane: Plane) -> None:
    """With attempt a-1 live (its token TOKEN): an unknown token and none at all get 401;
    once the attempt ends its token is refused at once, though the look-up cache knew
    it, and no answer quotes it."""
    assert plane.credentials()[0] == 200  # the live one, so the cache knows its token
    for token in ("tok-unknown", None):
        status, body, _ = plane.credentials(token)
        assert status == 401 and "revoked" in body["error"]
    with Session(engine) as session:
        attempt = session.get(Attempt, "a-1")
        assert attempt is not None
        attempt.state, attempt.token_hash = AttemptState.PREEMPTED, None
        session.add(attempt)
        session.commit()
    status, body, _ = plane.credentials()
    assert status == 401 and "revoked" in body["error"]
    assert TOKEN not in json.dumps(body)
