"""A node of a multi-node attempt: the torchrun command it starts, and what its
supervisor reports (its own figures; the run's progress is node 0's)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from runner import EXIT_PREEMPTED
from runner.errors import RunnerError
from runner.nodes import Node
from runner.supervisor import Supervisor
from runner.telemetry import FileSink
from tests.runner.tinyproc import tiny_env

GANG = {
    "TRAINBOT_TORCHRUN": "1",
    "TRAINBOT_NNODES": "2",
    "TRAINBOT_NODE_RANK": "1",
    "TRAINBOT_NPROC_PER_NODE": "4",
    "TRAINBOT_MASTER_ADDR": "10.0.0.5",
    "TRAINBOT_MASTER_PORT": "29500",
}


def test_a_node_runs_the_spec_command_under_torchrun_as_its_rank() -> None:
    node = Node.from_env(GANG)
    assert node == Node(nnodes=2, rank=1, nproc=4, master_addr="10.0.0.5", master_port=29500)
    cmd = node.command(["python", "-m", "runner.examples.tiny_ddp", "--steps", "9"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    flags = " ".join(cmd[3:])
    assert (
        flags == "--nnodes 2 --node-rank 1 --nproc-per-node 4 --master-addr 10.0.0.5 --master-port "
        "29500 --max-restarts 0 -m runner.examples.tiny_ddp --steps 9"
    )
    assert node.command(["python3", "train.py", "--lr", "1"])[-3:] == ["train.py", "--lr", "1"]
    assert node.command(["./train.sh", "x"])[-3:] == ["--no-python", "./train.sh", "x"]
    # Nothing distributed asked: the command runs as it is.
    assert Node.from_env({}) is None
    # A distributed spec's dry run: one process under torchrun, on a free port.
    alone = Node.from_env({"TRAINBOT_TORCHRUN": "1"})
    assert alone is not None and (alone.nnodes, alone.nproc) == (1, 1)


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({**GANG, "TRAINBOT_NODE_RANK": "2"}, "a node's rank is 0 to 1"),
        ({**GANG, "TRAINBOT_NNODES": "two"}, "TRAINBOT_NNODES='two': expected a whole number"),
        ({**GANG, "TRAINBOT_NPROC_PER_NODE": "0"}, "expected 1 or more"),
        ({**GANG, "TRAINBOT_MASTER_ADDR": ""}, "needs node 0's address"),
    ],
)
def test_a_broken_node_environment_is_refused_with_what_to_fix(
    env: dict[str, str], words: str
) -> None:
    with pytest.raises(RunnerError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Node.from_env(env)


@pytest.mark.parametrize(
    ("command", "words"),
    [
        (["torchrun", "--nproc-per-node", "2", "train.py"], "starts torchrun itself"),
        (["python", "-m", "torch.distributed.run", "train.py"], "starts torchrun itself"),
        (["python", "-u", "train.py"], "without interpreter options"),
    ],
)
def test_a_command_torchrun_cannot_take_is_refused(command: list[str], words: str) -> None:
    node = Node.from_env(GANG)
    assert node is not None
    with pytest.raises(RunnerError, match=words):
        node.command(command)


# A first rank of node 1 under exec: reports metrics with its data wait, a checkpoint and
# a preempted exit, as a DistributedSession does when another node's notice stops it.
RANK = textwrap.dedent(
    """
    import json, os, sys, time
    with open(os.environ["TRAINBOT_EVENTS_FILE"], "a") as f:
        def emit(kind, data):
            f.write(json.dumps({"type": kind, "time": time.time(), "data": data}) + "\\n")
            f.flush()
        for step in range(1, 4):
            emit("metrics", {"step": step, "loss": 1.0, "step_time_s": 0.1,
                             "data_wait_fraction": 0.5 + step / 10, "metrics": {}})
        emit("restored", {"step": 0, "fallback_from": None, "restore_s": 0.0})
        time.sleep(0.6)
        emit("exit", {"code": 75, "reason": "preempted"})
    sys.exit(1)  # torchrun's exit when a worker exits 75
    """
)


def test_a_later_nodes_supervisor_reports_its_own_figures_and_the_ranks_exit(
    tmp_path: Path,
) -> None:
    events = tmp_path / "node-1.jsonl"
    supervisor = Supervisor(
        [sys.executable, "-c", RANK],
        sink=FileSink(events),
        env=tiny_env(tmp_path),
        install_signals=False,
        sample_s=0.25,
        under_torchrun=True,
        node=1,
    )
    assert supervisor.run() == EXIT_PREEMPTED
    seen = [json.loads(line) for line in events.read_text().splitlines()]
    kinds = [e["type"] for e in seen]
    # The run's progress is node 0's to report: no metrics, restores or commits from here.
    assert not {"metrics", "restored", "checkpoint_committed"} & set(kinds), kinds
    samples = [e["data"] for e in seen if e["type"] == "system"]
    assert samples and all(s["node"] == 1 for s in samples)
    waits = [s["data_wait_fraction"] for s in samples if s["data_wait_fraction"] is not None]
    assert waits and all(0.6 <= w <= 0.8 for w in waits), waits
    # torchrun exits 1 whatever its workers did: the rank's reported 75 is the node's exit.
    assert [e["data"]["code"] for e in seen if e["type"] == "exit"] == [EXIT_PREEMPTED]
