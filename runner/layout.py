"""Where checkpoints live in a store, and what makes one committed: no torch needed.

The control plane lists, verifies manifests of and prunes checkpoints with this module;
reading and writing tensors is ``runner.checkpoint``'s business.
"""

from __future__ import annotations

import builtins
import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from runner.errors import CheckpointError
from runner.store import ObjectInfo, Store

FORMAT = "trainbot-checkpoint/1"
MANIFEST = "manifest.json"
META = "meta.pt"
_STEP_RE = re.compile(r"^step-(\d{10})/")


def step_dir(step: int) -> str:
    return f"step-{step:010d}"


def finite_metrics(metrics: dict[str, Any] | None) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for k, v in (metrics or {}).items():
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        out[str(k)] = f if math.isfinite(f) else None
    return out


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint."""

    #: File name inside the step directory.
    name: str
    #: Size in bytes.
    size: int
    #: Hex sha256 of the whole file.
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a committed checkpoint holds. Its presence is the commit."""

    #: Training steps completed when the state was captured.
    step: int
    #: Unix time of the snapshot.
    time: float
    #: Every file, with size and checksum.
    files: tuple[FileEntry, ...]
    #: Total bytes of the files.
    bytes: int
    #: Seconds from the end of the snapshot to the manifest write.
    write_s: float
    #: User metrics at the step (non-finite values stored as null).
    metrics: dict[str, float | None] = field(default_factory=dict)
    #: Format tag.
    format: str = FORMAT
    #: "state" (written by the session API) or "files" (a directory synced by the supervisor).
    kind: str = "state"
    #: For "files" checkpoints, the name of the directory the script wrote.
    label: str | None = None

    def to_json(self) -> builtins.bytes:
        doc = asdict(self)
        doc["files"] = [asdict(f) for f in self.files]
        return json.dumps(doc, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: builtins.bytes, *, where: str) -> Manifest:
        try:
            doc = json.loads(raw)
            if doc.get("format") != FORMAT:
                raise ValueError(f"format is {doc.get('format')!r}, expected {FORMAT!r}")
            files = tuple(
                FileEntry(name=str(f["name"]), size=int(f["size"]), sha256=str(f["sha256"]))
                for f in doc["files"]
            )
            if not files:
                raise ValueError("it lists no files")
            for f in files:
                parts = f.name.split("/")
                if f.name.startswith("/") or ".." in parts or "" in parts or len(f.sha256) != 64:
                    raise ValueError(f"bad file entry {f.name!r}")
            kind = str(doc.get("kind", "state"))
            if kind not in ("state", "files"):
                raise ValueError(f"unknown kind {kind!r}")
            return cls(
                step=int(doc["step"]),
                time=float(doc["time"]),
                files=files,
                bytes=int(doc["bytes"]),
                write_s=float(doc["write_s"]),
                metrics={
                    str(k): (None if v is None else float(v)) for k, v in doc["metrics"].items()
                },
                kind=kind,
                label=None if doc.get("label") is None else str(doc["label"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"corrupt manifest {where}: {exc}") from exc


@dataclass(frozen=True)
class CommitInfo:
    """A checkpoint that has been committed."""

    #: Step of the checkpoint.
    step: int
    #: Bytes written.
    bytes: int
    #: Seconds the background write took (snapshot end to manifest).
    write_s: float
    #: Seconds the caller was blocked (waiting for a previous save plus the snapshot).
    stall_s: float
    #: URI of the step directory.
    uri: str


@dataclass(frozen=True)
class CheckpointEntry:
    """A committed checkpoint found by listing manifests."""

    step: int
    #: Modification time of the manifest object (commit time).
    committed_at: float


@dataclass(frozen=True)
class StepScan:
    """One listing of a run's step directories."""

    #: Committed checkpoints (a manifest exists), oldest first.
    committed: list[CheckpointEntry]
    #: Every object of every step directory, committed or torn, by step.
    objects: dict[int, list[ObjectInfo]]


def scan(store: Store) -> StepScan:
    """List the store once and sort what is there into steps."""
    committed: list[CheckpointEntry] = []
    objects: dict[int, list[ObjectInfo]] = {}
    for obj in store.list("step-"):
        m = _STEP_RE.match(obj.key)
        if not m:
            continue
        step = int(m.group(1))
        objects.setdefault(step, []).append(obj)
        if obj.key == f"{m.group(0)}{MANIFEST}":
            committed.append(CheckpointEntry(step=step, committed_at=obj.mtime))
    committed.sort(key=lambda e: e.step)
    return StepScan(committed=committed, objects=objects)


def list_committed(store: Store) -> list[CheckpointEntry]:
    """Committed checkpoints, oldest first: every step directory with a manifest."""
    return scan(store).committed


def read_manifest(store: Store, step: int) -> Manifest:
    key = f"{step_dir(step)}/{MANIFEST}"
    return Manifest.from_json(store.get_bytes(key), where=f"{store.uri}/{key}")


# ----------------------------------------------------------------------------- writing


def delete_steps(store: Store, found: StepScan, steps: set[int]) -> int:
    """Delete whole steps, manifests first, so a half-deleted step no longer exists."""
    keys = [obj.key for step in steps for obj in found.objects.get(step, [])]
    keys.sort(key=lambda k: (not k.endswith("/" + MANIFEST), k))
    return store.delete(keys)


def copy_step(src: Store, dst: Store, step: int, *, chunk: int = 8 << 20) -> Manifest:
    """Copy one committed checkpoint from ``src`` to the same step of ``dst``, the manifest
    last, so the copy exists only once it is whole. A step ``dst`` already holds committed
    is left as it is (a retried copy). Returns the manifest.

    A run resubmitted from an earlier step gets its own directory holding that step, so
    that "newest" there can never be a later step of the run it continues, whose own
    checkpoints stay where they were.
    """
    manifest = read_manifest(src, step)
    sd = step_dir(step)
    if dst.exists(f"{sd}/{MANIFEST}"):
        return manifest
    for entry in manifest.files:
        key = f"{sd}/{entry.name}"
        out = dst.open_write(key)
        size = 0
        try:
            with src.open_read(key) as f:
                while data := f.read(chunk):
                    size += len(data)
                    out.write(data)
            if size != entry.size:
                raise CheckpointError(
                    f"{src.uri}/{key} has {size} bytes, its manifest says {entry.size}"
                )
        except BaseException:
            out.abort()
            raise
        out.close()
    dst.put_bytes(f"{sd}/{MANIFEST}", manifest.to_json())
    return manifest
