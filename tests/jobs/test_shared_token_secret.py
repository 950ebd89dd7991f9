"""Runner tokens across replicas: every replica derives an attempt's token from one
shared secret (``TRAINBOT_RUNNER_TOKEN_SECRET``), so an attempt one replica recorded and
another launched is accepted by either's ingest API; a replica whose secret differs from
a live replica's refuses to start.

Each replica has a state directory of its own, as pods with an ``emptyDir`` do. Runs on
SQLite (a file both open) and on PostgreSQL when ``TRAINBOT_TEST_POSTGRES_URL`` is set.
"""

from __future__ import annotations

import io
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlmodel import select

from bot.console import ConsoleNotifier
from jobs.database.db import session_scope
from jobs.database.models import Attempt
from jobs.domain.errors import SettingsError
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings
from jobs.providers.base import InstanceInfo, LaunchRequest
from jobs.providers.local import LocalProvider
from jobs.runs import launch_attempt, provision
from runner.wire import Event, encode_batch
from tests.jobs.rows import sleeping_spec, tiny_run
from tests.waiting import wait_until

SHARED = "a" * 16 + "shared-runner-token-secret"
OTHER = "b" * 16 + "another-runner-token-secret"


class ReplicaKilled(Exception):
    """What a replica's launch raises when the test kills it between the attempt's row
    and the provider's call."""


class LocalCloud(LocalProvider):
    """The local provider, noting what each launch hands the instance; ``killed``: the
    replica dies before its launch reaches the provider."""

    def __init__(self, root: Path, *, killed: bool = False) -> None:
        super().__init__(root)
        self.killed = killed
        self.launched: list[LaunchRequest] = []

    def launch(self, req: LaunchRequest) -> InstanceInfo:
        if self.killed:
            raise ReplicaKilled(req.attempt_id)
        self.launched.append(req)
        return super().launch(req)


@pytest.fixture
def make_replica(database_url: str, tmp_path: Path) -> Iterator[Callable[..., ControlPlane]]:
    planes: list[ControlPlane] = []

    def make(
        name: str, *, secret: str | None, killed: bool = False, scheduler: bool = False
    ) -> ControlPlane:
        state = tmp_path / name  # a state directory of its own, like a pod's emptyDir
        env = {
            "TRAINBOT_STATE_DIR": str(state),
            "TRAINBOT_DATABASE_URL": database_url,
            "TRAINBOT_INGEST_PORT": "0",
        }
        if secret is not None:
            env["TRAINBOT_RUNNER_TOKEN_SECRET"] = secret
        cp = ControlPlane(
            load_settings(env),
            notifier=ConsoleNotifier(io.StringIO()),
            provider=LocalCloud(state / "local", killed=killed),
            scheduler=scheduler,
            lease_s=1.0,
            lease_holder=name,
        )
        planes.append(cp)
        return cp.start()

    yield make
    for cp in planes:
        for inst in cp.deps.provider.list_instances():
            if not inst.state.is_terminal():
                cp.deps.provider.terminate(inst.instance_id)
        cp.close()


def new_run(engine: Engine, run_id: str) -> None:
    with session_scope(engine) as session:
        session.add(tiny_run(run_id, spec=sleeping_spec(), state=RunState.LAUNCHING))


def attempt_of(engine: Engine, run_id: str) -> Attempt:
    with session_scope(engine) as session:
        (attempt,) = session.exec(select(Attempt).where(Attempt.run_id == run_id)).all()
        session.expunge(attempt)
        return attempt


def post_events(cp: ControlPlane, token: str, attempt: Attempt, *, seq: int) -> int:
    """A runner's heartbeat batch to ``cp``'s ingest API; the HTTP status."""
    body = encode_batch(
        [Event(attempt.id, seq, "heartbeat", time.time(), attempt.run_id, {"step": None})]
    )
    assert cp.server is not None
    request = urllib.request.Request(
        cp.server.url.rstrip("/") + "/v1/events",
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            status: int = answer.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code


def relaunched(make_replica: Callable[..., ControlPlane], **secrets: Any) -> tuple[Any, ...]:
    """Replica a records an attempt and dies before its launch; replica b launches it
    (as its reconcile adopts a REQUESTED attempt). Returns a, b and the attempt."""
    a = make_replica("replica-a", secret=secrets["a"], killed=True)
    b = make_replica("replica-b", secret=secrets["b"])
    new_run(a.deps.engine, "r-shared")
    with pytest.raises(ReplicaKilled):
        launch_attempt(a.deps, "r-shared")
    attempt = attempt_of(a.deps.engine, "r-shared")
    assert attempt.state == AttemptState.REQUESTED  # recorded by a, with a's token hash
    assert provision(b.deps, attempt.id) is not None
    return a, b, attempt


def test_an_attempt_recorded_by_one_replica_and_launched_by_the_other_is_accepted(
    make_replica: Callable[..., ControlPlane],
) -> None:
    a, b, attempt = relaunched(make_replica, a=SHARED, b=SHARED)
    provider = b.deps.provider
    assert isinstance(provider, LocalCloud)
    (request,) = provider.launched
    token = request.env["TRAINBOT_TOKEN"]
    # The runner b started reports to b's ingest API: its start moves the attempt on.
    wait_until(
        lambda: attempt_of(b.deps.engine, "r-shared").state == AttemptState.RUNNING,
        30,
        "the runner's start to be accepted",
    )
    # Either replica takes its batches (a load balancer sends them to either).
    assert post_events(a, token, attempt, seq=10_000) == 200
    assert post_events(b, token, attempt, seq=10_001) == 200


def test_without_a_shared_secret_the_relaunched_attempts_token_is_refused(
    make_replica: Callable[..., ControlPlane], caplog: pytest.LogCaptureFixture
) -> None:
    """What the shared secret fixes: each replica's own secret (its state directory's).
    The replica that launches says why in its log."""
    a, b, attempt = relaunched(make_replica, a=None, b=None)
    assert any(
        "TRAINBOT_RUNNER_TOKEN_SECRET" in r.getMessage() and r.levelname == "ERROR"
        for r in caplog.records
    )
    provider = b.deps.provider
    assert isinstance(provider, LocalCloud)
    token = provider.launched[0].env["TRAINBOT_TOKEN"]
    assert post_events(a, token, attempt, seq=10_000) == 401
    assert post_events(b, token, attempt, seq=10_001) == 401


def test_a_replica_with_another_secret_refuses_to_start_beside_a_live_one(
    make_replica: Callable[..., ControlPlane],
) -> None:
    a = make_replica("replica-a", secret=SHARED, scheduler=True)
    wait_until(lambda: a.elector is not None and a.elector.leading, 10, "replica-a to lead")
    new_run(a.deps.engine, "r-live")
    assert launch_attempt(a.deps, "r-live") is not None  # a live attempt with a's token
    with pytest.raises(SettingsError, match="TRAINBOT_RUNNER_TOKEN_SECRET") as refused:
        make_replica("replica-b", secret=OTHER)
    assert "replica-a" in str(refused.value)
    assert SHARED not in str(refused.value) and OTHER not in str(refused.value)
    with pytest.raises(SettingsError, match="TRAINBOT_RUNNER_TOKEN_SECRET"):
        make_replica("replica-c", secret=None)  # its state directory's own secret
    # The same secret starts.
    assert make_replica("replica-d", secret=SHARED).server is not None


def test_the_secret_is_long_and_never_shown() -> None:
    short = "s3cr3t-but-short"
    with pytest.raises(SettingsError, match="TRAINBOT_RUNNER_TOKEN_SECRET") as bad:
        load_settings({"TRAINBOT_RUNNER_TOKEN_SECRET": short})
    assert short not in str(bad.value)
    settings = load_settings({"TRAINBOT_RUNNER_TOKEN_SECRET": SHARED})
    assert SHARED not in repr(settings)
