"""A session across the ranks of a torch.distributed job (DDP under ``torchrun``).

``gang`` is the process group as the session sees it (rank, world size, the one small
collective a step); ``vote`` the stop/save flags every rank agrees on each step;
``parts`` the per-rank parts of a checkpoint and rank 0's commit of the whole step;
``sharded`` FSDP/DTensor state through ``torch.distributed.checkpoint``; ``session`` the
:class:`DistributedSession`. See docs/architecture.md, "Runner:
multi-rank runs".
"""

from __future__ import annotations

from runner.distributed.gang import Gang
from runner.distributed.parts import PART_MANIFEST, PartManifest, part_dir
from runner.distributed.session import DistributedSession, WorldSizeError
from runner.distributed.sharded import Sharded, ShardedStateError
from runner.distributed.vote import Vote

__all__ = [
    "PART_MANIFEST",
    "DistributedSession",
    "Gang",
    "PartManifest",
    "Sharded",
    "ShardedStateError",
    "Vote",
    "WorldSizeError",
    "part_dir",
]
