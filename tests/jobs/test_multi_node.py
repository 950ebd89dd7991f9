"""Multi-node runs: a gang of local "nodes" (process groups on 127.0.0.1, gloo) launched,
preempted, lost and resumed through the control plane, and the gang's state combined
from its nodes'."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from bot.console import ConsoleNotifier
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.outbound.notify import CallbackJournal
from jobs.process.bootstrap import ControlPlane
from jobs.providers import gang
from jobs.providers.base import (
    TAG_NODE,
    InstanceState,
    InstanceStatus,
    LaunchRequest,
    ProviderError,
    ResourceRequest,
)
from jobs.providers.local import LocalProvider
from jobs.runs import reconcile
from jobs.usecases import service
from tests.jobs.test_control_plane import (
    ADA,
    FAST,
    attempts_of,
    run_state,
    settings_for,
    trainbot_processes,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[2]


def status(state: InstanceState, code: int | None = None, name: str = "n") -> InstanceStatus:
    return InstanceStatus(name, state, state.value, exit_code=code)


def test_a_gangs_state_is_its_nodes_combined() -> None:
    R, P, S = InstanceState.RUNNING, InstanceState.PREEMPTED, InstanceState.SUCCEEDED
    F, T = InstanceState.FAILED, InstanceState.TERMINATED

    def of(*nodes: InstanceStatus) -> InstanceStatus:
        return gang.combine("a+b", nodes)

    assert of(status(R), status(R)).state is R
    assert of(status(InstanceState.PENDING), status(R)).state is InstanceState.PENDING
    # One node finished before the other: the gang still runs until both have.
    assert of(status(S, 0), status(R)).state is R
    assert of(status(S, 0), status(S, 0)).state is S
    # One node preempted: the whole gang is, whatever the other says.
    got = of(status(R), status(P, 75, "b"))
    assert got.state is P and got.reason.startswith("node 1 (b)")
    assert of(status(F, 1), status(P, 75)).state is P
    # A node killed from outside (SIGKILL) or terminated under a running gang is lost,
    # and the gang resumes like a preempted one; the other node's failure is its effect.
    lost = of(status(F, 1, "a"), status(F, -9, "b"))
    assert lost.state is InstanceState.LOST and "node 1 (b)" in lost.reason
    assert lost.exit_code == 75
    assert of(status(R), status(T)).state is InstanceState.LOST
    # Every node terminated (the control plane ended it): terminated.
    assert of(status(T), status(T)).state is T
    # A node preempted that flushed its part (exit 75) leaves the others the window to
    # flush theirs and node 0 to commit the step; after the window the gang is preempted.
    now = datetime(2026, 12, 5, 12, 0, tzinfo=timezone.utc)
    flushed = InstanceStatus("b", P, "preempted", exit_code=75, preempted_at=now)
    soon = gang.combine("a+b", [status(R), flushed], window_s=5.0, now=now + timedelta(seconds=2))
    assert soon.state is R and "flushing" in soon.reason
    late = gang.combine("a+b", [status(R), flushed], window_s=5.0, now=now + timedelta(seconds=6))
    assert late.state is P
    assert gang.combine("a+b", [status(P, 75), flushed], window_s=5.0, now=now).state is P
    # A node's own failure fails the gang, with its exit code.
    failed = of(status(F, 2, "a"), status(R))
    assert failed.state is F and failed.exit_code == 2


@pytest.fixture
def local(tmp_path: Path) -> Iterator[LocalProvider]:
    provider = LocalProvider(tmp_path / "state", terminate_grace_s=2.0, cores=4)
    yield provider
    for inst in provider.list_instances():
        if not inst.state.is_terminal():
            provider.terminate(inst.instance_id)
    provider.close()


def _sleepers(nodes: int) -> LaunchRequest:
    return LaunchRequest(
        run_id="r-gang",
        attempt_id="a-gang",
        owner="ada",
        request=ResourceRequest(cloud="local", region="local", instances=nodes, spot=False),
        zone="",
        command=[
            sys.executable,
            "-c",
            "import os, time; print(os.environ['TRAINBOT_NODE_RANK'], "
            "os.environ['TRAINBOT_MASTER_ADDR'], os.environ['TRAINBOT_MASTER_PORT'], "
            "flush=True); time.sleep(120)",
        ],
        env={"PATH": os.environ["PATH"]},
        idempotency_key="a-gang",
        spot=False,
        nodes=nodes,
    )


def test_a_local_gang_launches_all_its_nodes_and_ends_them_together(
    local: LocalProvider,
) -> None:
    req = _sleepers(3)
    quota = local.quota(req.request)
    assert quota.needed == 3 and quota.unit == "cores"
    info = local.launch(req)
    nodes = gang.node_ids(info.instance_id)
    assert len(nodes) == 3 and info.attempt_id == "a-gang"
    # A retried launch (a control plane that died before recording it) adopts the gang.
    assert local.launch(req).instance_id == info.instance_id
    [listed] = [i for i in local.list_instances() if i.attempt_id == "a-gang"]
    assert listed.instance_id == info.instance_id and listed.tags[TAG_NODE] == "0"
    wait_until(lambda: "127.0.0.1" in local.instance_log(info.instance_id, lines=5), what="logs")

    def said(rank: int) -> list[str]:
        text = local.instance_log(nodes[rank], lines=5)  # each node's own line
        return text.split()

    wait_until(lambda: all(len(said(r)) == 3 for r in range(3)), what="every node's line")
    ports = {said(r)[2] for r in range(3)}
    assert [said(r)[0] for r in range(3)] == ["0", "1", "2"] and len(ports) == 1
    assert local.status(info.instance_id).state is InstanceState.RUNNING
    # One node preempted: the gang is, and says which node.
    local.preempt(nodes[2])
    wait_until(
        lambda: local.status(info.instance_id).state is not InstanceState.RUNNING,
        timeout=30,
        what="the gang to end",
    )
    got = local.status(info.instance_id)
    assert got.state is InstanceState.PREEMPTED and got.reason.startswith(f"node 2 ({nodes[2]})")
    local.terminate(info.instance_id)
    assert all(local.status(n).state.is_terminal() for n in nodes)


def test_a_gang_that_cannot_launch_every_node_launches_none(local: LocalProvider) -> None:
    req = _sleepers(2)
    # Node 1 cannot launch: the local provider refuses a command that is empty.
    broken = {"calls": 0}

    def one(node: LaunchRequest) -> object:
        broken["calls"] += 1
        # The provider's own launch of one node (what its launch hands gang.launch).
        if node.node_rank == 1:
            return local._launch_one(replace(node, command=[]))
        return local._launch_one(node)

    with pytest.raises(ProviderError, match="the launch command is empty"):
        gang.launch(one, req, terminate_one=local.terminate, loopback=True)  # type: ignore[arg-type]
    assert broken["calls"] == 2
    [node0] = [i for i in local.list_instances() if i.attempt_id == "a-gang"]
    assert node0.state is InstanceState.TERMINATED


# -- through the control plane ------------------------------------------------------------


def _node_pids(state: Path, attempt_id: str, node: int) -> list[int]:
    return [
        pid
        for pid, env in trainbot_processes(state).items()
        if env.get("TRAINBOT_ATTEMPT_ID") == attempt_id
        and env.get("TRAINBOT_NODE_RANK") == str(node)
    ]


def _result(cp: ControlPlane, instance_id: str) -> dict:
    """Rank 0's last line (the DDP example's result), from node 0's log."""
    text = cp.deps.provider.instance_log(gang.node_ids(instance_id)[0], lines=200)
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    assert lines, text[-3000:]
    return json.loads(lines[-1])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not Path("/proc/self/environ").exists(), reason="needs /proc to find a node's processes"
)
def test_a_two_node_run_is_preempted_and_lost_and_resumes_as_a_gang(tmp_path: Path) -> None:
    """Preempting one node stops both at the same step; the run is resubmitted as a gang
    and resumes; a node killed with SIGKILL ends the attempt the same way; nothing of any
    node is left running at the end."""
    state = tmp_path / "state"
    records: list[dict] = []
    journal = CallbackJournal(lambda t, run, data: records.append({"type": t, "run": run, **data}))
    cp = ControlPlane(
        settings_for(state, TRAINBOT_LOCAL_CORES="4"),  # type: ignore[arg-type]
        notifier=ConsoleNotifier(io.StringIO()),
        journal=journal,
        scheduler=False,
    )
    command = (
        "command=python -m runner.examples.tiny_ddp --steps 120 --dim 32 --checkpoint-every 5 "
        "--step-delay 0.05"
    )
    with cp:
        try:
            run = service.submit(
                cp.deps,
                spec_name="tiny",
                overrides=[*FAST, command, "resources.instances=2"],
                actor=ADA,
            )
            wait_until(
                lambda: run_state(cp, run.id) == RunState.AWAITING_CONFIRMATION,
                what="preflight",
            )
            service.confirm(cp.deps, run.id, ADA)

            def attempt(number: int) -> object:
                reconcile(cp.deps)
                found = [a for a in attempts_of(cp, run.id) if a.number == number]
                return found[0] if found and found[0].state == AttemptState.RUNNING else None

            def committed_in(number: int) -> bool:
                return any(
                    r["type"] == "checkpoint_committed" and r.get("attempt") == number
                    for r in records
                )

            # 1. Preempt node 1 once attempt 1 has committed a step.
            wait_until(lambda: attempt(1) is not None, timeout=120, what="attempt 1 running")
            first = attempts_of(cp, run.id)[0]
            assert first.instances == 2 and len(gang.node_ids(first.instance_id or "")) == 2
            wait_until(lambda: committed_in(1), timeout=120, what="attempt 1's first commit")
            cp.deps.provider.preempt(gang.node_ids(first.instance_id)[1])  # type: ignore[attr-defined]
            wait_until(lambda: attempt(2) is not None, timeout=180, what="attempt 2 running")
            first = attempts_of(cp, run.id)[0]
            assert first.state == AttemptState.PREEMPTED, first.end_reason
            stopped = _result(cp, first.instance_id or "")
            # Both ranks stopped at the same step, with a checkpoint, and exited 75.
            assert stopped["exit_code"] == 75, stopped
            assert {r["step"] for r in stopped["ranks"]} == {stopped["step"]}, stopped
            assert {r["stop_reason"] for r in stopped["ranks"]} == {"preempted"}, stopped
            resub = next(r for r in records if r["type"] == "resubmitted")
            assert resub["resume_from_step"] == stopped["step"]

            # 2. Attempt 2 resumes from that step; then its node 1 dies without notice.
            wait_until(lambda: committed_in(2), timeout=120, what="attempt 2's first commit")
            resumed = [r for r in records if r["type"] == "resumed"]
            assert resumed and resumed[0]["step"] == stopped["step"]
            second = attempts_of(cp, run.id)[1]
            victims = _node_pids(state, second.id, 1)
            assert victims, "node 1's processes"
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            wait_until(lambda: attempt(3) is not None, timeout=180, what="attempt 3 running")
            second = attempts_of(cp, run.id)[1]
            assert second.state in (AttemptState.LOST, AttemptState.PREEMPTED), second.end_reason
            assert "node 1" in (second.end_reason or ""), second.end_reason
            # Node 0 of the lost gang is gone too: no rank hangs on its dead peer.
            wait_until(
                lambda: not _node_pids(state, second.id, 0),
                timeout=60,
                what="node 0 of the lost gang to end",
            )

            # 3. The third gang runs to the end.
            wait_until(
                lambda: reconcile(cp.deps) is not None and run_state(cp, run.id).is_terminal(),
                timeout=300,
                what="the run to finish",
            )
            assert run_state(cp, run.id) == RunState.SUCCEEDED
            attempts = attempts_of(cp, run.id)
            done = _result(cp, attempts[-1].instance_id or "")
            assert done["step"] == 120 and done["exit_code"] == 0
            wait_until(
                lambda: not trainbot_processes(state), timeout=60, what="every process to end"
            )
            listed = cp.deps.provider.list_instances()
            assert all(i.state.is_terminal() for i in listed), [
                (i.instance_id, i.state) for i in listed
            ]
        finally:
            for inst in cp.deps.provider.list_instances():
                if not inst.state.is_terminal():
                    cp.deps.provider.terminate(inst.instance_id)
    cp.deps.provider.close()  # type: ignore[attr-defined]
