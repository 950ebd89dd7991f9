"""Asynchronous, atomic checkpoints in a store.

Layout under a run's store root::

    step-0000000120/shard-00000.bin   raw tensor bytes, 64-byte aligned
    step-0000000120/meta.pt           skeleton + tensor index (torch.save, loaded weights_only)
    step-0000000120/manifest.json     files, sizes, sha256, step, metrics, time: written LAST

A step without a manifest does not exist. "Latest" is found by listing manifests, never
from a mutable pointer. The training loop blocks only while tensors are copied into
reusable staging buffers; hashing, writing and uploading run on a background thread, with
at most one save in flight.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from runner.errors import CheckpointError, NoCheckpointError, RunnerError, StoreError
from runner.layout import (
    MANIFEST,
    META,
    CheckpointEntry,
    CommitInfo,
    FileEntry,
    Manifest,
    delete_steps,
    finite_metrics,
    list_committed,
    read_manifest,
    scan,
    step_dir,
)
from runner.state import TensorSpec, as_bytes, dtype_from_name, flatten, unflatten
from runner.store import Store, WriteStream

log = logging.getLogger(__name__)

ALIGN = 64
_OWN_BELOW = 1 << 20


class _Staging:
    """Reusable CPU buffers for one layout of tensors (allocating per save page-faults)."""

    def __init__(self) -> None:
        self._layout: list[tuple[torch.dtype, tuple[int, ...]]] = []
        self._buffers: list[torch.Tensor] = []

    def copy(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        layout = [(t.dtype, tuple(t.shape)) for t in tensors]
        pin = torch.cuda.is_available() and any(t.is_cuda for t in tensors)
        if layout != self._layout:
            self._buffers = [
                torch.empty(shape, dtype=dtype, pin_memory=pin) for dtype, shape in layout
            ]
            self._layout = layout
        for buf, src in zip(self._buffers, tensors, strict=True):
            buf.copy_(src.detach(), non_blocking=src.is_cuda)
        if pin:
            torch.cuda.synchronize()
        return self._buffers


def _plan(tensors: list[torch.Tensor], shard_bytes: int) -> list[TensorSpec]:
    specs: list[TensorSpec] = []
    shard, offset = 0, 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if offset and offset + nbytes > shard_bytes:
            shard, offset = shard + 1, 0
        specs.append(
            TensorSpec(
                shard=f"shard-{shard:05d}.bin",
                offset=offset,
                nbytes=nbytes,
                dtype=str(t.dtype).removeprefix("torch."),
                shape=tuple(t.shape),
            )
        )
        offset += -(-nbytes // ALIGN) * ALIGN
    return specs


def _io_workers() -> int:
    """Threads that write shards at once: hashing a GiB takes about a CPU-second, so one
    thread cannot keep up with a fast disk; more than four rarely helps."""
    return max(2, min(4, os.cpu_count() or 1))


class _Hasher:
    """The sha256 of a file being read or written, computed on a thread of its own: hashing
    overlaps the reads (a piece behind them) or the writes (of the same staged bytes), since
    both release the GIL, so the transfer and its hash take about as long as the slower of
    the two, not their sum.

    ``update`` takes views of memory that nothing writes to any more.
    """

    def __init__(self, name: str) -> None:
        self._sha = hashlib.sha256()
        self._pieces: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._abandoned = False
        self._done = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def update(self, data: memoryview) -> None:
        self._pieces.put(data)

    def _run(self) -> None:
        while (data := self._pieces.get()) is not None:
            if not self._abandoned:
                self._sha.update(data)

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._pieces.put(None)
            self._thread.join()

    def hexdigest(self) -> str:
        """Wait for the pieces given so far to be hashed; their digest."""
        self._finish()
        return self._sha.hexdigest()

    def abandon(self) -> None:
        """Stop hashing (the read failed): skip what is queued and end the thread."""
        self._abandoned = True
        self._finish()


def _write_object(
    store: Store,
    key: str,
    pieces: Iterable[memoryview],
    chunk: int,
    on_chunk: Callable[[memoryview], object] | None,
) -> int:
    """Write one object in chunks (aborted on any error); its size."""
    stream = store.open_write(key)
    size = 0
    try:
        for view in pieces:
            for start in range(0, len(view), chunk):
                piece = view[start : start + chunk]
                stream.write(piece)
                if on_chunk is not None:
                    on_chunk(piece)
                size += len(piece)
        stream.close()
    except BaseException:
        try:
            stream.abort()
        except Exception:  # the original error matters more
            log.debug("abort after a failed write also failed", exc_info=True)
        raise
    return size


def _write_hashed(store: Store, key: str, pieces: Iterable[memoryview], chunk: int) -> FileEntry:
    """Write one object, hashing each chunk right after writing it, while it is in cache."""
    sha = hashlib.sha256()
    size = _write_object(store, key, pieces, chunk, sha.update)
    return FileEntry(name=key.split("/", 1)[1], size=size, sha256=sha.hexdigest())


def _write_shard(store: Store, key: str, pieces: list[memoryview], chunk: int) -> FileEntry:
    """Write one shard of staged tensors while a thread of its own hashes the same bytes.

    The staged bytes do not change until the save is over, so the hash need not follow the
    writes chunk by chunk: it runs beside them (a whole tensor per update, so it takes the
    GIL back once a tensor, not once a chunk), and the shard is written in about the time
    of the slower of the two instead of their sum.
    """
    hasher = _Hasher("ckpt-write-hash")
    for view in pieces:
        hasher.update(view)
    try:
        size = _write_object(store, key, pieces, chunk, None)
    except BaseException:
        hasher.abandon()
        raise
    return FileEntry(name=key.split("/", 1)[1], size=size, sha256=hasher.hexdigest())


def _shard_pieces(items: list[tuple[TensorSpec, torch.Tensor]]) -> Iterator[memoryview]:
    """A shard's bytes: each tensor at its aligned offset, zeros between."""
    size = 0
    for spec, t in items:
        if size < spec.offset:
            yield memoryview(bytes(spec.offset - size))
        if spec.nbytes:
            yield as_bytes(t).numpy().data
        size = spec.offset + spec.nbytes


def _file_pieces(path: Path, chunk: int) -> Iterator[memoryview]:
    with open(path, "rb") as f:
        while data := f.read(chunk):
            yield memoryview(data)


class CheckpointWriter:
    """Saves states of a run asynchronously into a store, at most one save in flight."""

    def __init__(
        self,
        store: Store,
        *,
        shard_bytes: int = 128 << 20,
        chunk_bytes: int = 1 << 20,
        on_commit: Callable[[CommitInfo], None] | None = None,
        on_error: Callable[[int, Exception], None] | None = None,
    ) -> None:
        self.store = store
        self.shard_bytes = shard_bytes
        self.chunk_bytes = chunk_bytes
        self._on_commit = on_commit
        self._on_error = on_error
        self._staging = _Staging()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-write")
        self._shards = ThreadPoolExecutor(
            max_workers=_io_workers(), thread_name_prefix="ckpt-shard"
        )
        self._inflight: Future[CommitInfo] | None = None
        self._lock = threading.Lock()
        #: Last committed checkpoint.
        self.last_commit: CommitInfo | None = None
        #: Bytes per second measured on the last write; None before the first.
        self.bandwidth_bps: float | None = None
        #: Size of the last state saved, for estimating the next write.
        self.last_bytes: int | None = None

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None and not self._inflight.done()

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: dict[str, Any] | None = None,
        copy: bool = True,
    ) -> Future[CommitInfo]:
        """Snapshot ``state`` now and write it in the background.

        Blocks while a previous save finishes (at most one in flight) and while tensors are
        copied into staging buffers; returns a future that resolves when the manifest is written.
        ``copy=False`` writes CPU tensors from where they are, for a caller that will not
        change them before the future resolves (the last save of a loop that has ended):
        no staging buffers to allocate, nothing to copy.
        """
        start = time.perf_counter()
        self.wait()
        skeleton, tensors = flatten(state)
        if copy or any(t.device.type != "cpu" for t in tensors):
            staged = self._staging.copy([t.contiguous() for t in tensors])
        else:
            staged = [t.detach().contiguous() for t in tensors]
        specs = _plan(staged, self.shard_bytes)
        meta = io.BytesIO()
        torch.save({"skeleton": skeleton, "tensors": [asdict(s) for s in specs]}, meta)
        snap_time = time.time()
        stall = time.perf_counter() - start
        with self._lock:
            self._inflight = self._worker.submit(
                self._write,
                step,
                staged,
                specs,
                meta.getvalue(),
                snap_time,
                finite_metrics(metrics),
                stall,
            )
        return self._inflight

    def wait(self, timeout: float | None = None) -> CommitInfo | None:
        """Wait for the save in flight; None if there was none or it failed."""
        fut = self._inflight
        if fut is None:
            return None
        try:
            return fut.result(timeout=timeout)
        except TimeoutError:
            raise
        except Exception:
            return None  # reported through on_error when it happened

    def close(self) -> None:
        self.wait()
        self._worker.shutdown(wait=True)
        self._shards.shutdown(wait=True)

    def _write(
        self,
        step: int,
        staged: list[torch.Tensor],
        specs: list[TensorSpec],
        meta: bytes,
        snap_time: float,
        metrics: dict[str, float | None],
        stall: float,
    ) -> CommitInfo:
        t0 = time.perf_counter()
        sd = step_dir(step)
        files: list[FileEntry] = []
        stream: WriteStream | None = None
        try:
            # Re-saving a step (after a fallback past a corrupt one) first uncommits it.
            self.store.delete([f"{sd}/{MANIFEST}"])
            by_shard: dict[str, list[tuple[TensorSpec, torch.Tensor]]] = {}
            for spec, t in zip(specs, staged, strict=True):
                by_shard.setdefault(spec.shard, []).append((spec, t))
            pending = [
                self._shards.submit(
                    _write_shard,
                    self.store,
                    f"{sd}/{shard}",
                    list(_shard_pieces(items)),
                    self.chunk_bytes,
                )
                for shard, items in by_shard.items()
            ]
            # Wait for every shard before raising, so no thread still writes into the step.
            wait(pending)
            files.extend(f.result() for f in pending)
            stream = self.store.open_write(f"{sd}/{META}")
            stream.write(meta)
            stream.close()
            stream = None
            files.append(
                FileEntry(name=META, size=len(meta), sha256=hashlib.sha256(meta).hexdigest())
            )
            total = sum(f.size for f in files)
            write_s = time.perf_counter() - t0
            manifest = Manifest(
                step=step,
                time=snap_time,
                files=tuple(files),
                bytes=total,
                write_s=write_s,
                metrics=metrics,
            )
            self.store.put_bytes(f"{sd}/{MANIFEST}", manifest.to_json())
            write_s = time.perf_counter() - t0
        except Exception as exc:
            if stream is not None:
                try:
                    stream.abort()
                except Exception:  # the original error matters more
                    log.debug("abort after a failed write also failed", exc_info=True)
            log.error("checkpoint at step %d was not committed: %s", step, exc)
            if self._on_error is not None:
                self._on_error(step, exc)
            raise
        info = CommitInfo(
            step=step, bytes=total, write_s=write_s, stall_s=stall, uri=f"{self.store.uri}/{sd}"
        )
        self.last_commit = info
        self.last_bytes = total
        self.bandwidth_bps = total / write_s if write_s > 0 else None
        if self._on_commit is not None:
            self._on_commit(info)
        return info


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
        piece = _piece_bytes([entry.size], READ_CHUNK)
        data = _read_verified(store, f"{sd}/{entry.name}", entry, piece)
        out = target.joinpath(*entry.name.split("/"))
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "wb") as f:
            f.write(data.numpy().data)
    return target


# ----------------------------------------------------------------------------- reading


@dataclass
class Restored:
    """A checkpoint loaded from the store."""

    #: Step of the checkpoint loaded.
    step: int
    #: The nested state, as it was saved.
    state: Any
    manifest: Manifest
    #: Newer checkpoints that were skipped, with why.
    skipped: list[tuple[int, str]]
    #: Seconds spent reading and verifying.
    restore_s: float


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


def _piece_bytes(sizes: Iterable[int], chunk: int) -> int:
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


def _read_verified(
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
    a piece behind the reads (:class:`_Hasher`).
    """
    buf = _aligned_empty(entry.size + 1)
    view = buf.numpy().data
    sha: Any = _Hasher("ckpt-read-hash") if entry.size > chunk else hashlib.sha256()
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
        if isinstance(sha, _Hasher):
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


def _read_all(
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

    piece = _piece_bytes([e.size for e in entries.values()], chunk)
    with ThreadPoolExecutor(max_workers=_read_workers(), thread_name_prefix="ckpt-read") as pool:
        reads = {
            name: pool.submit(_read_verified, store, f"{sd}/{name}", entry, piece, stop)
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


def load_checkpoint(
    store: Store,
    manifest: Manifest,
    *,
    chunk_bytes: int = READ_CHUNK,
    cancel: threading.Event | None = None,
) -> Any:
    """Read and verify every file of a checkpoint, and rebuild its state.

    Nothing is used before every file's sha256 matches the manifest. Large tensors are
    views into the buffers the files were read into (no copy); setting ``cancel`` makes
    the reads stop at their next chunk and raises :class:`PrefetchCancelled`.
    """
    sd = step_dir(manifest.step)
    if manifest.kind != "state":
        raise CheckpointError(
            f"{store.uri}/{sd} holds a script's files, not a session state: "
            "restore it with `trainbot-runner exec --sync-dir`"
        )
    entries = {f.name: f for f in manifest.files}
    if META not in entries:
        raise CheckpointError(f"{store.uri}/{sd} has no {META} in its manifest")
    data = _read_all(store, sd, entries, chunk_bytes, cancel)
    try:
        meta = torch.load(io.BytesIO(data.pop(META).numpy().tobytes()), weights_only=True)
        tensors = []
        for raw in meta["tensors"]:
            spec = TensorSpec(**{**raw, "shape": tuple(raw["shape"])})
            shard = data[spec.shard]
            flat = shard[spec.offset : spec.offset + spec.nbytes]
            t = flat.view(dtype_from_name(spec.dtype)).reshape(spec.shape)
            # Small tensors get their own storage: some consumers (Generator.set_state)
            # assume a tensor starts at its storage's first byte. Large ones stay views.
            tensors.append(t.clone() if spec.nbytes < _OWN_BELOW else t)
        return unflatten(meta["skeleton"], tensors)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{store.uri}/{sd}/{META} does not describe the shards: {exc}"
        ) from exc


def restore_latest(
    store: Store, *, below: int | None = None, cancel: threading.Event | None = None
) -> Restored:
    """Load the newest committed checkpoint that verifies; fall back past corrupt ones."""
    t0 = time.perf_counter()
    return _restore_from(store, list_committed(store), below=below, cancel=cancel, t0=t0)


def _restore_from(
    store: Store,
    entries: list[CheckpointEntry],
    *,
    below: int | None,
    cancel: threading.Event | None,
    t0: float,
) -> Restored:
    skipped: list[tuple[int, str]] = []
    for entry in reversed(entries):
        if below is not None and entry.step >= below:
            continue
        try:
            manifest = read_manifest(store, entry.step)
            state = load_checkpoint(store, manifest, cancel=cancel)
        except (CheckpointError, StoreError) as exc:
            log.warning(
                "checkpoint step %d is unusable (%s); trying the previous one", entry.step, exc
            )
            skipped.append((entry.step, str(exc)))
            continue
        return Restored(
            step=entry.step,
            state=state,
            manifest=manifest,
            skipped=skipped,
            restore_s=time.perf_counter() - t0,
        )
    if skipped:
        raise CheckpointError(
            f"no usable checkpoint in {store.uri}: "
            + "; ".join(f"step {s}: {why}" for s, why in skipped)
        )
    raise NoCheckpointError(f"no committed checkpoint in {store.uri}")


class Prefetch:
    """The newest usable checkpoint, read and verified on a background thread.

    A :class:`~runner.session.Session` starts one when it is created, so that reading the
    shards and hashing them (both release the GIL) overlap with the caller building its
    model and optimizer. Fallback past a corrupt checkpoint happens here too. The memory
    it holds is the state the restore needs anyway, and :meth:`take` hands it over once.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._cancel = threading.Event()
        #: Newest committed step when the prefetch listed the store; unset if listing failed.
        self._newest: int | None = None
        self._listed = False
        self._result: Restored | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ckpt-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            entries = list_committed(self.store)
            self._newest = entries[-1].step if entries else None
            self._listed = True
            self._result = _restore_from(
                self.store, entries, below=None, cancel=self._cancel, t0=t0
            )
        except BaseException as exc:  # handed to the caller by take()
            self._error = exc

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the reading is over (done, failed or cancelled); False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def take(self) -> Restored | None:
        """Wait for the prefetch and hand over its checkpoint.

        Returns None when the caller must restore by itself: the prefetch was cancelled,
        could not list the store, or a newer checkpoint has been committed since it
        started. Raises what restoring raised otherwise (no checkpoint, none usable).
        """
        self._thread.join()
        result, error = self._result, self._error
        self._result = self._error = None
        if not self._listed or self._cancel.is_set():
            return None
        entries = list_committed(self.store)
        newest = entries[-1].step if entries else None
        if newest != self._newest:
            log.info(
                "checkpoint step %s was committed after the prefetch started; reading it",
                newest,
            )
            return None
        if error is not None:
            raise error
        return result

    def close(self) -> None:
        """Stop reading (at the next chunk), wait for the threads and drop what was read."""
        self._cancel.set()
        self._thread.join()
        self._result = self._error = None


def verify(store: Store, step: int) -> list[str]:
    """Problems with one committed checkpoint; an empty list means it verifies."""
    try:
        load_checkpoint(store, read_manifest(store, step))
    except (CheckpointError, StoreError) as exc:
        return [str(exc)]
    return []


__all__ = [
    "CheckpointEntry",
    "CheckpointError",
    "CheckpointWriter",
    "CommitInfo",
    "Manifest",
    "NoCheckpointError",
    "Prefetch",
    "PrefetchCancelled",
    "Restored",
    "RunnerError",
    "commit_files",
    "delete_steps",
    "download_files",
    "list_committed",
    "load_checkpoint",
    "read_manifest",
    "restore_latest",
    "scan",
    "step_dir",
    "verify",
]
