"""Each node of a multi-node attempt holds a token of its own, good for events as that
node only: node 1 can neither report as node 0 (the run's progress) nor end the run
with a forged exit; only node 0's exit ends it.

Through the real ingest API on SQLite and, when ``TRAINBOT_TEST_POSTGRES_URL`` is set,
PostgreSQL; the tokens are the ones :func:`jobs.providers.gang.node_request` puts in
each node's environment.
"""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from sqlmodel import Session, select

from bot.console import ConsoleNotifier
from jobs.database.db import session_scope
from jobs.database.models import Attempt, EventRow, Run
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.ingest import IngestService
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings
from jobs.providers import gang
from jobs.providers.base import LaunchRequest, ResourceRequest
from jobs.providers.local import LocalProvider
from jobs.runs import launch_attempt
from runner.wire import NODE_SEQ_SPAN, Event, encode_batch
from tests.jobs.rows import add_running_attempt

ATTEMPT_TOKEN = "0" * 63 + "1"  # the attempt's own token: node 0's
OTHER_TOKEN = "0" * 63 + "2"  # another attempt's
TOKENS = {"a-1": ATTEMPT_TOKEN, "a-2": OTHER_TOKEN}


def add_attempt(engine: Engine, attempt_id: str = "a-1", run_id: str = "r-1") -> None:
    add_running_attempt(
        engine,
        provider="local",
        token=TOKENS[attempt_id],
        checkpoint_uri=None,
        run_id=run_id,
        attempt_id=attempt_id,
        instances=2,
        run_state=RunState.RUNNING,
    )


def node_envs() -> list[dict[str, str]]:
    """What each node of attempt a-1's two-node gang is launched with."""
    req = LaunchRequest(
        run_id="r-1",
        attempt_id="a-1",
        owner="U1",
        request=ResourceRequest(cloud="local", region="local", instance_type="cpu-2"),
        zone="",
        command=["trainbot-runner", "exec", "--", "python", "train.py"],
        env={"TRAINBOT_TOKEN": ATTEMPT_TOKEN, "TRAINBOT_RUN_ID": "r-1"},
        nodes=2,
    )
    return [
        dict(gang.node_request(req, rank, master_addr="10.0.0.1", master_port=29500).env)
        for rank in range(2)
    ]


def batch(node: int, items: list[tuple[str, dict[str, Any]]], *, first: int = 0) -> bytes:
    seq0 = node * NODE_SEQ_SPAN + first
    now = time.time()
    events = [
        Event("a-1", seq0 + i, kind, now + i, "r-1", data) for i, (kind, data) in enumerate(items)
    ]
    return encode_batch(events, node=node)


class Seen:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def __call__(self, attempt_id: str, kind: str, data: dict[str, Any]) -> None:
        self.events.append((attempt_id, kind))


def service(engine: Engine, seen: Seen | None = None) -> IngestService:
    return IngestService(engine, on_attempt_event=seen or Seen(), attempt_token=TOKENS.__getitem__)


def bearer(token: str) -> str:
    return f"Bearer {token}"


def test_each_node_is_launched_with_a_token_of_its_own() -> None:
    node0, node1 = node_envs()
    assert node0["TRAINBOT_TOKEN"] == ATTEMPT_TOKEN
    assert node1["TRAINBOT_TOKEN"] != ATTEMPT_TOKEN
    # Node 1's environment holds nothing of node 0's token.
    assert all(ATTEMPT_TOKEN not in value for value in node1.values())
    assert gang.parse_node_token(node1["TRAINBOT_TOKEN"]) == (1, "a-1")


def test_node_1s_token_is_refused_for_node_0s_events_and_exit(db_engine: Engine) -> None:
    add_attempt(db_engine)
    seen = Seen()
    svc = service(db_engine, seen)
    node1 = bearer(node_envs()[1]["TRAINBOT_TOKEN"])

    progress = svc.handle(node1, batch(0, [("heartbeat", {"step": 10**6})], first=1))
    forged = svc.handle(node1, batch(0, [("exit", {"code": 0, "reason": "succeeded"})], first=2))

    assert progress.status == forged.status == 403
    assert "node 1" in forged.body["error"]
    assert seen.events == []  # nothing reached the lifecycle
    with Session(db_engine) as session:
        attempt = session.get(Attempt, "a-1")
        run = session.get(Run, "r-1")
        assert attempt is not None and attempt.state == AttemptState.RUNNING
        assert attempt.last_step is None
        assert run is not None and run.state == RunState.RUNNING


def test_node_1s_own_exit_is_stored_and_ends_nothing_node_0s_does(db_engine: Engine) -> None:
    add_attempt(db_engine)
    seen = Seen()
    svc = service(db_engine, seen)
    node0, node1 = (bearer(env["TRAINBOT_TOKEN"]) for env in node_envs())
    done = ("exit", {"code": 0, "reason": "succeeded"})

    assert svc.handle(node1, batch(1, [done])).status == 200
    assert seen.events == []  # a node's exit is not the attempt's
    assert svc.handle(node0, batch(0, [done])).status == 200
    assert seen.events == [("a-1", "exit")]


def test_node_0s_token_is_node_0s_alone(db_engine: Engine) -> None:
    add_attempt(db_engine)
    svc = service(db_engine)
    got = svc.handle(bearer(ATTEMPT_TOKEN), batch(1, [("heartbeat", {"step": None})]))
    assert got.status == 403


def test_forged_and_foreign_node_tokens_are_refused(db_engine: Engine) -> None:
    add_attempt(db_engine)
    add_attempt(db_engine, "a-2", "r-2")
    svc = service(db_engine)
    node1 = node_envs()[1]["TRAINBOT_TOKEN"]
    heartbeat = batch(1, [("heartbeat", {"step": None})])
    # Node 1 of a-1 cannot make node 2's token, nor another attempt's node's.
    rank, attempt_id = gang.parse_node_token(node1) or (0, "")
    mac = node1.rsplit(".", 1)[1]
    for forged in (f"n2.{attempt_id}.{mac}", f"n{rank}.a-2.{mac}", node1[:-1] + "0"):
        assert svc.handle(bearer(forged), heartbeat).status == 401, forged
    # Another attempt's genuine node token is refused for this attempt's batch.
    theirs = gang.node_token(OTHER_TOKEN, "a-2", 1)
    assert svc.handle(bearer(theirs), heartbeat).status == 403
    # The credentials route takes a node's token as its attempt's, and a forged one not.
    assert svc.runner_of(bearer(node1)) == ("r-1", "a-1")
    assert svc.runner_of(bearer(f"n2.{attempt_id}.{mac}")) is None


def test_revoking_the_attempts_token_revokes_every_nodes(db_engine: Engine) -> None:
    add_attempt(db_engine)
    svc = service(db_engine)
    node1 = bearer(node_envs()[1]["TRAINBOT_TOKEN"])
    assert svc.handle(node1, batch(1, [("heartbeat", {"step": None})])).status == 200
    with Session(db_engine) as session:
        attempt = session.get(Attempt, "a-1")
        assert attempt is not None
        attempt.token_hash = None  # the attempt ended
        session.add(attempt)
        session.commit()
    got = svc.handle(node1, batch(1, [("heartbeat", {"step": None})], first=1))
    assert got.status == 401
    assert svc.runner_of(node1) is None


def test_a_local_gangs_second_node_reports_with_its_own_token(tmp_path: Path) -> None:
    """End to end: the control plane launches a two-node attempt on the local provider;
    node 1's runner sends with the token its launch gave it, and ingest stores its events
    as node 1's (in its own seq range)."""
    settings = load_settings(
        {"TRAINBOT_STATE_DIR": str(tmp_path / "state"), "TRAINBOT_INGEST_PORT": "0"}
    )
    provider = LocalProvider(tmp_path / "local")
    script = tmp_path / "sleep.py"
    script.write_text("import time\n\ntime.sleep(60)\n")
    spec = {
        "name": "tiny",
        "command": ["python", str(script)],  # under torchrun: a script, not -c
        "dry_run": {"enabled": False},
        "resubmit": {"backoff_s": 3600},
        "resources": {"instances": 2},
    }
    with ControlPlane(
        settings, notifier=ConsoleNotifier(io.StringIO()), provider=provider, scheduler=False
    ) as cp:
        with session_scope(cp.deps.engine) as session:
            session.add(
                Run(
                    id="r-gang",
                    spec_name="tiny",
                    spec=spec,
                    requester="U1",
                    state=RunState.LAUNCHING,
                )
            )
        attempt = launch_attempt(cp.deps, "r-gang")
        assert attempt is not None and attempt.instance_id
        try:

            def node_1_seqs() -> list[int]:
                with session_scope(cp.deps.engine) as session:
                    rows = session.exec(
                        select(EventRow.seq).where(EventRow.attempt_id == attempt.id)
                    ).all()
                return [seq for seq in rows if seq >= NODE_SEQ_SPAN]

            deadline = time.monotonic() + 60
            while not node_1_seqs() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert node_1_seqs(), "node 1's events never arrived"
            assert all(NODE_SEQ_SPAN <= seq < 2 * NODE_SEQ_SPAN for seq in node_1_seqs())
        finally:
            provider.terminate(attempt.instance_id)
