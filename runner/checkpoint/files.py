"""Checkpoints of a script's files: a directory uploaded as one step, and restored whole.

The supervisor uses these for scripts that write their own checkpoints into a directory;
the files are hashed as they are written and verified as they are read back.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from runner.checkpoint.read import READ_CHUNK, piece_bytes, read_verified
from runner.checkpoint.write import write_object
from runner.errors import CheckpointError
from runner.layout import MANIFEST, CommitInfo, FileEntry, Manifest, finite_metrics, step_dir
from runner.store import Store


def _file_pieces(path: Path, chunk: int) -> Iterator[memoryview]:
    with open(path, "rb") as f:
        while data := f.read(chunk):
            yield memoryview(data)


def _write_hashed(store: Store, key: str, pieces: Iterable[memoryview], chunk: int) -> FileEntry:
    """Write one object, hashing each chunk right after writing it, while it is in cache."""
    sha = hashlib.sha256()
    size = write_object(store, key, pieces, chunk, sha.update)
    return FileEntry(name=key.split("/", 1)[1], size=size, sha256=sha.hexdigest())


def commit_files(
    store: Store,
    step: int,
    root: Path,
    *,
    metrics: dict[str, Any] | None = None,
    chunk_bytes: int = 8 << 20,
) -> CommitInfo:
    """Upload a directory a script wrote as one checkpoint (files first, manifest last)."""
    t0 = time.perf_counter()
    sd = step_dir(step)
    files: list[FileEntry] = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        name = path.relative_to(root).as_posix()
        files.append(
            _write_hashed(store, f"{sd}/{name}", _file_pieces(path, chunk_bytes), chunk_bytes)
        )
    if not files:
        raise CheckpointError(f"{root} is empty: nothing to checkpoint")
    total = sum(f.size for f in files)
    manifest = Manifest(
        step=step,
        time=time.time(),
        files=tuple(files),
        bytes=total,
        write_s=time.perf_counter() - t0,
        metrics=finite_metrics(metrics),
        kind="files",
        label=root.name,
    )
    store.put_bytes(f"{sd}/{MANIFEST}", manifest.to_json())
    write_s = time.perf_counter() - t0
    return CommitInfo(step=step, bytes=total, write_s=write_s, stall_s=0.0, uri=f"{store.uri}/{sd}")


def download_files(store: Store, manifest: Manifest, dest: Path) -> Path:
    """Restore a "files" checkpoint into ``dest/<label>``, verifying every checksum."""
    target = dest / (manifest.label or step_dir(manifest.step))
    sd = step_dir(manifest.step)
    for entry in manifest.files:
        piece = piece_bytes([entry.size], READ_CHUNK)
        data = read_verified(store, f"{sd}/{entry.name}", entry, piece)
        out = target.joinpath(*entry.name.split("/"))
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "wb") as f:
            f.write(data.numpy().data)
    return target
