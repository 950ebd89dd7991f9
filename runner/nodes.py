"""This runner's node of a multi-node attempt, and the ``torchrun`` command that joins it.

The control plane launches a gang's nodes with ``TRAINBOT_NNODES``, ``TRAINBOT_NODE_RANK``,
``TRAINBOT_MASTER_ADDR`` and ``TRAINBOT_MASTER_PORT`` (:mod:`jobs.providers.gang`), and
a distributed spec's attempts with ``TRAINBOT_TORCHRUN=1`` and ``TRAINBOT_NPROC_PER_NODE``
(declared in :mod:`runner.env`).
Then ``trainbot-runner exec`` runs the spec's command under ``torchrun`` with static
rendezvous on node 0: the ranks are the same at every launch, and no rendezvous service
is needed beyond the TCP store torchrun itself starts on node 0.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from runner import env as contract
from runner.errors import RunnerError

__all__ = ["Node", "free_port"]


def free_port() -> int:
    """A TCP port of the loopback that is free now, for a rendezvous on this machine."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Node:
    """Where this runner sits: ``rank`` of ``nnodes`` nodes, ``nproc`` processes each."""

    nnodes: int
    rank: int
    nproc: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Node | None:
        """The node the environment describes; None for one process on one node."""
        nnodes = contract.NNODES.get(env)
        nproc = contract.NPROC_PER_NODE.get(env)
        if nnodes == 1 and nproc == 1 and not contract.TORCHRUN.get(env):
            return None
        rank = contract.NODE_RANK.get(env)
        if rank >= nnodes:
            raise RunnerError(
                f"TRAINBOT_NODE_RANK={rank} with TRAINBOT_NNODES={nnodes}: a node's rank is "
                f"0 to {nnodes - 1}"
            )
        given = (contract.MASTER_ADDR.get(env) or "").strip()
        if rank > 0 and not given:
            raise RunnerError(
                "TRAINBOT_MASTER_ADDR is not set: node "
                f"{rank} of {nnodes} needs node 0's address to join its rendezvous"
            )
        port = contract.MASTER_PORT.get(env)
        addr = given or "127.0.0.1"
        return cls(nnodes=nnodes, rank=rank, nproc=nproc, master_addr=addr, master_port=port)

    @classmethod
    def alone(cls) -> Node:
        """One process on one node, on a port free now: a distributed script's dry run."""
        return cls(nnodes=1, rank=0, nproc=1, master_addr="127.0.0.1", master_port=free_port())

    def command(self, command: Sequence[str]) -> list[str]:
        """``command`` (``python train.py …``, ``python -m pkg …`` or a program) under
        torchrun, as this node."""
        cmd = list(command)
        if not cmd:
            raise RunnerError("no command to run under torchrun")
        program = os.path.basename(cmd[0])
        if program == "torchrun" or "torch.distributed.run" in cmd[:3]:
            raise RunnerError(
                "the command starts torchrun itself; on a run with more than one process "
                "trainbot starts torchrun on each node with the right --nnodes, --node-rank "
                "and --nproc-per-node: write the command as `python train.py …` or "
                "`python -m your.module …`"
            )
        if program.startswith("python"):
            rest = cmd[1:]
            if rest[:1] == ["-m"] and len(rest) > 1:
                script = ["-m", *rest[1:]]
            elif rest and not rest[0].startswith("-"):
                script = rest
            else:
                raise RunnerError(
                    f"cannot run {' '.join(cmd[:3])!r} under torchrun: write the command as "
                    "`python train.py …` or `python -m your.module …`, without interpreter "
                    "options"
                )
        else:
            script = ["--no-python", *cmd]
        return [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(self.nnodes),
            "--node-rank", str(self.rank),
            "--nproc-per-node", str(self.nproc),
            "--master-addr", self.master_addr,
            "--master-port", str(self.master_port),
            "--max-restarts", "0",
            *script,
        ]  # fmt: skip
