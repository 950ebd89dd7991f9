"""Per-rank parts of a checkpoint, and rank 0's commit of the whole step.

Under DDP the model and optimizer are the same on every rank, so rank 0 writes them at
the step directory's top, as a single process would; every rank (rank 0 too) writes what
is its own (its RNG state, its data position) under ``rank-NNNNN/``, and ends its part
with a part manifest. Rank 0's background writer then waits for every rank's part
manifest of this attempt, checks each listed file is there at its size, and only then
writes the step's ``manifest.json``, listing every file of every part with its sha256:
the step directory with its manifest stays the unit that listing, retention, ``verify``
and restore know. No collective runs here: the parts meet in the store.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from runner.checkpoint import CheckpointWriter, CommitInfo
from runner.errors import CheckpointError, StoreError
from runner.layout import FileEntry, Manifest, step_dir
from runner.store import Store

PART_MANIFEST = "part.json"
PART_FORMAT = "trainbot-part/1"
#: How often rank 0 looks for the parts it waits for.
POLL_S = 0.02


def part_dir(rank: int) -> str:
    """A rank's part inside a step directory, with its trailing slash."""
    return f"rank-{rank:05d}/"


@dataclass(frozen=True)
class PartManifest:
    """One rank's part of a step: written last by that rank, read by rank 0."""

    step: int
    rank: int
    world_size: int
    #: The attempt's token (:meth:`Gang.nonce`).
    nonce: str
    #: The part's files (names inside the step directory, "rank-NNNNN/…").
    files: tuple[FileEntry, ...]
    format: str = PART_FORMAT

    def to_json(self) -> bytes:
        doc = asdict(self)
        doc["files"] = [asdict(f) for f in self.files]
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, *, where: str) -> PartManifest:
        try:
            doc = json.loads(raw)
            if doc.get("format") != PART_FORMAT:
                raise ValueError(f"format is {doc.get('format')!r}, expected {PART_FORMAT!r}")
            return cls(
                step=int(doc["step"]),
                rank=int(doc["rank"]),
                world_size=int(doc["world_size"]),
                nonce=str(doc["nonce"]),
                files=tuple(
                    FileEntry(name=str(f["name"]), size=int(f["size"]), sha256=str(f["sha256"]))
                    for f in doc["files"]
                ),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"corrupt part manifest {where}: {exc}") from exc


def part_key(step: int, rank: int) -> str:
    return f"{step_dir(step)}/{part_dir(rank)}{PART_MANIFEST}"


class PartWriter(CheckpointWriter):
    """Writes one rank's part; its commit is the part manifest."""

    def __init__(self, store: Store, *, rank: int, world_size: int, nonce: str, **kw: Any):
        super().__init__(store, **kw)
        self.prefix = part_dir(rank)
        self.rank = rank
        self.world_size = world_size
        self.nonce = nonce

    def _uncommit(self, step: int) -> None:
        self.store.delete([part_key(step, self.rank)])

    def _commit(self, manifest: Manifest) -> Manifest:
        part = PartManifest(manifest.step, self.rank, self.world_size, self.nonce, manifest.files)
        self.store.put_bytes(part_key(manifest.step, self.rank), part.to_json())
        return manifest


class GangWriter(CheckpointWriter):
    """Rank 0's writer of the replicated state; commits the step once every part is in."""

    def __init__(
        self,
        store: Store,
        *,
        world_size: int,
        nonce: str,
        part_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        **kw: Any,
    ):
        super().__init__(store, **kw)
        self.world_size = world_size
        self.nonce = nonce
        self.part_timeout_s = part_timeout_s
        self._clock = clock

    def _commit(self, manifest: Manifest) -> Manifest:
        parts = wait_for_parts(
            self.store,
            manifest.step,
            world_size=self.world_size,
            nonce=self.nonce,
            timeout_s=self.part_timeout_s,
            clock=self._clock,
        )
        files = list(manifest.files)
        for part in parts:
            raw = self.store.get_bytes(part_key(manifest.step, part.rank))
            files.extend(part.files)
            files.append(_entry(f"{part_dir(part.rank)}{PART_MANIFEST}", raw))
        whole = replace(manifest, files=tuple(files), bytes=sum(f.size for f in files))
        return super()._commit(whole)


def _entry(name: str, raw: bytes) -> FileEntry:
    return FileEntry(name=name, size=len(raw), sha256=hashlib.sha256(raw).hexdigest())


def wait_for_parts(
    store: Store,
    step: int,
    *,
    world_size: int,
    nonce: str,
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> list[PartManifest]:
    """Every rank's part of ``step`` from this attempt, each checked against the store.

    Raises CheckpointError (the step is not committed) when a part is still missing or
    does not match its manifest after ``timeout_s``: a rank died or could not write.
    """
    deadline = clock() + timeout_s
    found: dict[int, PartManifest] = {}
    problem = ""
    while True:
        for rank in range(world_size):
            if rank in found:
                continue
            try:
                part = _read_part(store, step, rank)
            except StoreError:
                problem = f"rank {rank}'s part is missing"
                continue
            if part.nonce != nonce or part.step != step or part.rank != rank:
                problem = f"rank {rank}'s part belongs to another attempt or step"
                continue
            problem = _check_files(store, step, part)
            if not problem:
                found[rank] = part
        if len(found) == world_size:
            return [found[r] for r in range(world_size)]
        if clock() >= deadline:
            raise CheckpointError(
                f"step {step} was not committed: {problem} after {timeout_s:.0f}s "
                f"({len(found)} of {world_size} parts in); the run resumes from the step before"
            )
        time.sleep(POLL_S)


def _read_part(store: Store, step: int, rank: int) -> PartManifest:
    key = part_key(step, rank)
    return PartManifest.from_json(store.get_bytes(key), where=f"{store.uri}/{key}")


def _check_files(store: Store, step: int, part: PartManifest) -> str:
    """What is wrong with a part's files in the store ("" when each is there, at its size).

    The sha256 of each was computed by the rank that wrote it; restore and ``verify``
    check the bytes against it."""
    sd = step_dir(step)
    sizes = {o.key: o.size for o in store.list(f"{sd}/{part_dir(part.rank)}")}
    for f in part.files:
        if not f.name.startswith(part_dir(part.rank)):
            return f"rank {part.rank}'s part lists {f.name}, outside its directory"
        size = sizes.get(f"{sd}/{f.name}")
        if size != f.size:
            return f"rank {part.rank}'s {f.name} has {size} bytes, its part says {f.size}"
    return ""


class RankWriter:
    """What the session sees as its writer on one rank: the part, and on rank 0 the
    replicated state and the step's commit. Same surface as CheckpointWriter."""

    def __init__(
        self,
        store: Store,
        *,
        rank: int,
        world_size: int,
        nonce: str,
        part_timeout_s: float,
        on_commit: Callable[[CommitInfo], None] | None = None,
        on_error: Callable[[int, Exception], None] | None = None,
    ) -> None:
        self.rank = rank
        # A part's commit on rank 0 is not the step's: rank 0 reports the gang's commit.
        own = None if rank == 0 else on_commit
        self.part = PartWriter(
            store, rank=rank, world_size=world_size, nonce=nonce, on_commit=own, on_error=on_error
        )
        self.gang: GangWriter | None = None
        if rank == 0:
            self.gang = GangWriter(
                store,
                world_size=world_size,
                nonce=nonce,
                part_timeout_s=part_timeout_s,
                on_commit=on_commit,
                on_error=on_error,
            )

    @property
    def _main(self) -> CheckpointWriter:
        return self.gang if self.gang is not None else self.part

    @property
    def in_flight(self) -> bool:
        return self.part.in_flight or (self.gang is not None and self.gang.in_flight)

    @property
    def last_commit(self) -> CommitInfo | None:
        return self._main.last_commit

    @property
    def bandwidth_bps(self) -> float | None:
        return self._main.bandwidth_bps

    @property
    def last_bytes(self) -> int | None:
        return self._main.last_bytes

    def save(
        self, step: int, state: Any, *, metrics: dict[str, Any] | None = None, copy: bool = True
    ) -> Any:
        """Split the session's state: ``local`` into this rank's part, the rest (rank 0)
        at the top of the step."""
        own = {"step": step, "rank": self.rank, **state["local"]}
        fut = self.part.save(step, own, metrics=metrics, copy=copy)
        if self.gang is None:
            return fut
        shared = {k: v for k, v in state.items() if k != "local"}
        return self.gang.save(step, shared, metrics=metrics, copy=copy)

    def wait(self, timeout: float | None = None) -> CommitInfo | None:
        """Wait for this rank's part, then (rank 0) the step's commit: ``timeout`` for
        both together, not each (a notice window's wait must end by its deadline)."""
        until = None if timeout is None else time.monotonic() + timeout
        part = self.part.wait(timeout=timeout)
        if self.gang is None:
            return part
        left = None if until is None else max(0.0, until - time.monotonic())
        return self.gang.wait(timeout=left)

    def close(self) -> None:
        self.part.close()
        if self.gang is not None:
            self.gang.close()
