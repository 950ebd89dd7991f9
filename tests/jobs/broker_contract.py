"""What both credential brokers' tests (AWS and GCP) check the same way: which settings
make the control plane tell a runner to take its store's credentials from the broker."""

from __future__ import annotations

import io
from collections.abc import Sequence

from sqlalchemy import Engine
from sqlmodel import Session

from bot.console import ConsoleNotifier
from jobs.bootstrap import build_credential_broker
from jobs.deps import Deps
from jobs.models import Attempt, Run
from jobs.providers.base import Provider
from jobs.runs import runner_env, spec_of
from jobs.settings import Settings


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
