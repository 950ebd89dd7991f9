"""The process group as the session sees it: who this rank is, and its collectives.

``torchrun`` (or the caller) initialises the default process group; the session only
uses it, from the main thread: background threads never run a collective (a collective
must be called in the same order on every rank, which a thread cannot promise).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from runner.distributed.vote import Vote
from runner.errors import RunnerError


@dataclass
class Gang:
    """This rank's place in the default process group."""

    rank: int
    world_size: int
    #: Where the vote tensor lives: NCCL reduces CUDA tensors only.
    device: torch.device

    @classmethod
    def current(cls) -> Gang:
        if not (dist.is_available() and dist.is_initialized()):
            raise RunnerError(
                "torch.distributed is not initialised: start the script with torchrun and "
                "call torch.distributed.init_process_group() before creating the session"
            )
        backend = str(dist.get_backend())
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)

    def agree(self, vote: Vote) -> Vote:
        """Every rank's vote combined (MAX): the one collective the session adds a step."""
        t = torch.tensor(vote.encode(), dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return Vote.decode(t.tolist())

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank says yes."""
        t = torch.tensor([int(ok)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def nonce(self) -> str:
        """A token rank 0 draws once per session: it marks this attempt's parts, so that a
        part an earlier attempt left at the same step is never taken for this one's."""
        return str(self.broadcast(secrets.token_hex(8) if self.rank == 0 else None))

    def barrier(self) -> None:
        dist.barrier()
