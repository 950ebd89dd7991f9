"""Verified parallel reads of a checkpoint's files: nothing is used before its sha256 matches.

Local files are read with O_DIRECT where the file system takes it; every file is hashed
as it is read, and the first failure stops the other reads.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import torch

from runner.checkpoint.hashing import Hasher
from runner.errors import CheckpointError, RunnerError, StoreError
from runner.layout import FileEntry
from runner.store import Store

#: Most bytes read (and then hashed) at a time. Large, because a reader thread takes the
#: GIL back after every read and every hash, and while the caller's thread runs Python
#: (say, building its model) each of those waits up to the interpreter's switch interval
#: (5 ms): 64 MiB chunks keep that under 2 % of the time a chunk takes to read and hash.
READ_CHUNK = 64 << 20
#: A checkpoint with fewer large files than this is read in smaller pieces (of at least
#: :data:`_MIN_PIECE`), so that every file's hash, computed one piece behind its reads,
#: overlaps the reading instead of following it. With this many files or more, the
#: threads reading other files already overlap each file's hash.
_PIECES = 8
_MIN_PIECE = 4 << 20
#: Alignment of buffers, offsets and lengths for O_DIRECT reads (the largest logical block
#: size of common disks).
_IO_ALIGN = 4096


def piece_bytes(sizes: Iterable[int], chunk: int) -> int:
    """Bytes one read asks for, for files of these sizes read at once (see :data:`_PIECES`)."""
    large = sum(1 for size in sizes if size > _MIN_PIECE)
    if large == 0:
        return chunk
    per_file = -(-_PIECES // large)
    biggest = max(sizes)
    return min(chunk, max(_MIN_PIECE, -(-biggest // per_file)))


class PrefetchCancelled(RunnerError):
    """Reading a checkpoint was cancelled (the session closed before restoring)."""


class _Stopped(Exception):
    """A read gave up because another one failed or the prefetch was cancelled."""


class _NoDirect(Exception):
    """The file system refused an O_DIRECT read; read through the page cache instead."""


def _read_workers() -> int:
    """Threads that read a checkpoint at once. Reads straight from the disk (O_DIRECT) get
    no read-ahead, so a few more threads than cores keep the disk busy while others hash."""
    return max(4, min(8, os.cpu_count() or 1))


def _aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 buffer of at least ``nbytes`` (rounded up to the alignment)
    that starts on an O_DIRECT boundary."""
    size = -(-nbytes // _IO_ALIGN) * _IO_ALIGN
    raw = torch.empty(size + _IO_ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % _IO_ALIGN
    return raw[start : start + size]


def _set_direct(fd: int, on: bool) -> None:
    """Switch O_DIRECT on or off for an open file (Linux lets fcntl change it)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)


def _direct_fd(f: Any) -> int | None:
    """The descriptor of a local file, switched to O_DIRECT; None for a stream (S3) or
    where the platform or file system does not take it."""
    if not getattr(os, "O_DIRECT", 0) or not hasattr(os, "preadv"):
        return None
    try:
        fd = f.fileno()
        _set_direct(fd, True)
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None
    return fd if isinstance(fd, int) else None


def _fill_direct(
    fd: int, view: memoryview, chunk: int, stop: Callable[[], bool] | None, key: str, sha: Any
) -> int:
    """Read a file with O_DIRECT into ``view`` (aligned), hashing as it goes; bytes read.

    Every request starts and ends on an alignment boundary. A short read is normally the
    end of the file; one that is not (some network file systems) leaves the offset
    unaligned, so the rest is read through the page cache.
    """
    step = max(_IO_ALIGN, chunk - chunk % _IO_ALIGN)
    got = 0
    while got < len(view):
        if stop is not None and stop():
            raise _Stopped(key)
        want = min(step, len(view) - got)
        try:
            n = os.preadv(fd, [view[got : got + want]], got)
        except OSError as exc:
            if exc.errno != errno.EINVAL or got:
                raise
            _set_direct(fd, False)
            raise _NoDirect(key) from exc
        sha.update(view[got : got + n])
        got += n
        if n < want:
            if n == 0 or got >= os.fstat(fd).st_size:
                break
            if got % _IO_ALIGN:
                _set_direct(fd, False)
    return got


def _fill_stream(
    f: Any, view: memoryview, chunk: int, stop: Callable[[], bool] | None, key: str, sha: Any
) -> int:
    """Read a stream into ``view`` until it ends or ``view`` is full, hashing as it goes."""
    got = 0
    while got < len(view):
        if stop is not None and stop():
            raise _Stopped(key)
        n = f.readinto(view[got : min(len(view), got + chunk)])
        if not n:
            break
        sha.update(view[got : got + n])
        got += n
    return got


def read_verified(
    store: Store,
    key: str,
    entry: FileEntry,
    chunk: int,
    stop: Callable[[], bool] | None = None,
) -> torch.Tensor:
    """Read one file into a new buffer, hashing each chunk after reading it.

    A local file is read with O_DIRECT where the file system takes it: from the disk
    straight into the buffer, without a copy through the page cache. That takes about a
    third of the CPU of a buffered read and leaves no second copy of the checkpoint in
    memory. The buffer has room for one byte more than the manifest's size, so a longer
    file shows as one. A file of more than one ``chunk`` is hashed on a thread of its own,
    a piece behind the reads (:class:`Hasher`).
    """
    buf = _aligned_empty(entry.size + 1)
    view = buf.numpy().data
    sha: Any = Hasher("ckpt-read-hash") if entry.size > chunk else hashlib.sha256()
    try:
        with store.open_read(key) as f:
            fd = _direct_fd(f)
            try:
                if fd is None:
                    raise _NoDirect(key)
                got = _fill_direct(fd, view, chunk, stop, key, sha)
            except _NoDirect:
                got = _fill_stream(f, view, chunk, stop, key, sha)
    except BaseException as exc:
        if isinstance(sha, Hasher):
            sha.abandon()
        if isinstance(exc, OSError):
            raise StoreError(f"cannot read {key} from {store.uri}: {exc.strerror or exc}") from exc
        raise
    digest = sha.hexdigest()
    if got != entry.size:
        raise CheckpointError(
            f"{store.uri}/{key} is {'longer' if got > entry.size else got} bytes, "
            f"manifest says {entry.size}"
        )
    if digest != entry.sha256:
        raise CheckpointError(f"checksum mismatch in {store.uri}/{key}")
    return buf[: entry.size]


def read_all(
    store: Store,
    sd: str,
    entries: dict[str, FileEntry],
    chunk: int,
    cancel: threading.Event | None,
) -> dict[str, torch.Tensor]:
    """Read and verify every file in parallel; the first failure stops the other reads."""
    failed = threading.Event()

    def stop() -> bool:
        return failed.is_set() or (cancel is not None and cancel.is_set())

    piece = piece_bytes([e.size for e in entries.values()], chunk)
    with ThreadPoolExecutor(max_workers=_read_workers(), thread_name_prefix="ckpt-read") as pool:
        reads = {
            name: pool.submit(read_verified, store, f"{sd}/{name}", entry, piece, stop)
            for name, entry in entries.items()
        }
        done, _ = wait(reads.values(), return_when=FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            failed.set()
    # Leaving the pool waited for every read: no thread still fills a buffer.
    if cancel is not None and cancel.is_set():
        raise PrefetchCancelled(f"reading {store.uri}/{sd} was cancelled")
    errors = [
        exc
        for f in reads.values()
        if (exc := f.exception()) is not None and not isinstance(exc, _Stopped)
    ]
    if errors:
        if isinstance(errors[0], StoreError):
            raise CheckpointError(f"shard missing or unreadable: {errors[0]}") from errors[0]
        raise errors[0]
    return {name: f.result() for name, f in reads.items()}
