"""Sharded state (FSDP, any DTensor) through ``torch.distributed.checkpoint``.

DCP writes each rank's shards and, on rank 0, the global metadata; it plans a load from
that metadata whatever world size saved it, so a run resumes on fewer or more ranks.
The session stages DCP's files on each rank's own disk (no shared file system is
assumed: on several nodes each writes where it runs) and carries them as bytes in that
rank's part of the step, so the step's manifest, its sha256s, retention and ``verify``
cover them like everything else; rank 0 commits the step only once every part is in.
A restore fetches every saved rank's files (DCP reads the pieces each rank needs) and
lets DCP reshard them.

Both the save and the load are collectives: every rank calls them at the same point,
which the session's agreed saves, stops and restores guarantee.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from runner.errors import RunnerError

#: The key of a rank's DCP files in its part of a step (file name → bytes, uint8).
DCP_KEY = "dcp"


class ShardedStateError(RunnerError):
    """A checkpoint's sharded state cannot be loaded into this run's."""


class Sharded:
    """A model (FSDP or plain) and its optimizer as one tracked object, in the form
    ``torch.distributed.checkpoint`` saves and reshards: parameters and optimizer state
    by fully qualified name, each a DTensor where it is sharded. Track it with
    :meth:`DistributedSession.track_sharded`."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model = model
        self.optimizer = optimizer

    def _optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        return () if self.optimizer is None else (self.optimizer,)

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self._optimizers())
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: Mapping[str, Any], /) -> None:
        set_state_dict(
            self.model,
            self._optimizers(),
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )


def stage(state: dict[str, Any], directory: Path) -> dict[str, torch.Tensor]:
    """Save ``state`` with DCP into ``directory`` (a collective); the files this rank
    wrote, by name, as uint8 tensors for its part of the step."""
    _empty(directory)
    dcp.save(state, storage_writer=FileSystemWriter(str(directory), single_file_per_rank=True))
    files = {
        path.name: torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        for path in sorted(directory.iterdir())
        if path.is_file()
    }
    shutil.rmtree(directory, ignore_errors=True)
    return files


def load(
    state: dict[str, Any],
    files: Mapping[str, torch.Tensor],
    directory: Path,
    *,
    step: int,
    saved_world: int,
    world: int,
) -> None:
    """Load the saved ranks' DCP ``files`` into ``state`` in place (a collective), resharded
    from ``saved_world`` ranks to ``world`` where DCP can; a clear error where it cannot."""
    if ".metadata" not in files:
        raise ShardedStateError(
            f"checkpoint step {step} has no sharded-state metadata (rank 0's .metadata): "
            "it was not saved with track_sharded, so it cannot be loaded as sharded state"
        )
    _empty(directory)
    try:
        for name, blob in files.items():
            (directory / name).write_bytes(blob.numpy().tobytes())
        try:
            dcp.load(state, storage_reader=FileSystemReader(str(directory)))
        except (Exception, CheckpointException) as exc:  # DCP's, on every rank alike
            raise ShardedStateError(
                f"checkpoint step {step} (sharded over {saved_world} ranks) could not be "
                f"loaded into this run's sharded state on {world} ranks: {_first_line(exc)}. "
                "torch.distributed.checkpoint reshards state whose names and global shapes "
                "match (FSDP from any number of ranks to any other); build the same model "
                "and optimizer as the run that saved it"
            ) from exc
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _empty(directory: Path) -> None:
    """``directory``, created empty (what an interrupted save or load left there goes)."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException) and exc.failures:  # the ranks' own errors
        exc = next(iter(exc.failures.values()))[0]
    text = str(exc).strip()
    return text.splitlines()[0][:500] if text else type(exc).__name__
