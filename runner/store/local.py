"""The local checkpoint store: a directory on a local (or mounted) file system."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from runner.errors import StoreError
from runner.store.base import DELETE_BATCH, ObjectInfo, WriteStream, check_key


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: Bytes written between two writeback starts of a local stream.
WRITEBACK_BYTES = 64 << 20


def _writeback(fd: int) -> None:
    # Only a head start for the fdatasync in close(), which reports errors.
    with contextlib.suppress(OSError):
        os.fdatasync(fd)


class _LocalWrite:
    """Writes to ``key.partial-<pid>``, fsyncs, then renames over the key.

    Every WRITEBACK_BYTES a helper thread fdatasyncs what is written so far, so the disk
    works while the writer goes on; otherwise the kernel keeps a whole shard dirty in
    memory and the final fdatasync writes all of it while everything waits.
    """

    def __init__(self, final: Path) -> None:
        self._final = final
        self._tmp = final.with_name(f".{final.name}.partial-{os.getpid()}-{time.monotonic_ns()}")
        self._file: BinaryIO | None = open(self._tmp, "wb", buffering=0)  # noqa: SIM115
        self._unsynced = 0
        self._sync: threading.Thread | None = None

    def write(self, data: bytes | memoryview, /) -> int:
        assert self._file is not None, "stream is closed"
        view = memoryview(data).cast("B")
        total = 0
        while total < len(view):
            written = self._file.write(view[total:])
            total += written or 0
        self._unsynced += total
        if self._unsynced >= WRITEBACK_BYTES and (self._sync is None or not self._sync.is_alive()):
            self._unsynced = 0
            self._sync = threading.Thread(
                target=_writeback, args=(self._file.fileno(),), name="store-writeback", daemon=True
            )
            self._sync.start()
        return total

    def _join_sync(self) -> None:
        if self._sync is not None:
            self._sync.join()
            self._sync = None

    def close(self) -> None:
        if self._file is None:
            return
        try:
            self._join_sync()
            os.fdatasync(self._file.fileno())
        finally:
            self._file.close()
            self._file = None
        os.replace(self._tmp, self._final)
        _fsync_dir(self._final.parent)

    def abort(self) -> None:
        self._join_sync()
        if self._file is not None:
            self._file.close()
            self._file = None
        with contextlib.suppress(FileNotFoundError):
            self._tmp.unlink()


class LocalStore:
    """A directory on a local (or mounted) file system."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self.uri = self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def _writable_parent(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(
                f"cannot create {path.parent} in checkpoint store {self.uri}: {exc.strerror}; "
                "check the path and its permissions"
            ) from exc

    def open_write(self, key: str) -> WriteStream:
        path = self._path(key)
        self._writable_parent(path)
        try:
            return _LocalWrite(path)
        except OSError as exc:
            raise StoreError(
                f"cannot write {key} to checkpoint store {self.uri}: {exc.strerror}; "
                "check that the directory is writable and the disk is not full"
            ) from exc

    def put_bytes(self, key: str, data: bytes) -> None:
        stream = self.open_write(key)
        try:
            stream.write(data)
            stream.close()
        except OSError as exc:
            stream.abort()
            raise StoreError(f"cannot write {key} to {self.uri}: {exc.strerror}") from exc

    def open_read(self, key: str) -> BinaryIO:
        try:
            return open(self._path(key), "rb")
        except FileNotFoundError as exc:
            raise StoreError(f"{key} is missing from checkpoint store {self.uri}") from exc
        except OSError as exc:
            raise StoreError(f"cannot read {key} from {self.uri}: {exc.strerror}") from exc

    def get_bytes(self, key: str) -> bytes:
        with self.open_read(key) as f:
            return f.read()

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        if not self.root.is_dir():
            return []
        out: list[ObjectInfo] = []
        # Walk only the directory that can hold the prefix, not the whole store.
        base_rel = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self.root.joinpath(*base_rel.split("/")) if base_rel else self.root
        if not base.is_dir():
            return []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if name.startswith(".") and ".partial-" in name:
                    continue
                key = name if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{name}"
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                out.append(ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime))
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, keys: Sequence[str]) -> int:
        deleted = 0
        parents: set[Path] = set()
        for start in range(0, len(keys), DELETE_BATCH):
            for key in keys[start : start + DELETE_BATCH]:
                path = self._path(key)
                try:
                    path.unlink()
                    deleted += 1
                    parents.add(path.parent)
                except (FileNotFoundError, NotADirectoryError):
                    pass
                except OSError as exc:
                    raise StoreError(
                        f"cannot delete {key} from {self.uri}: {exc.strerror}"
                    ) from exc
        # Remove directories left empty (a pruned step), deepest first.
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                leftovers = [p for p in parent.iterdir() if ".partial-" in p.name]
                for p in leftovers:
                    p.unlink()
                parent.rmdir()
        return deleted

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()
