"""The asynchronous writer: snapshot into staging buffers, write and commit in the background.

The loop blocks only while tensors are copied into reusable staging buffers; hashing and
writing the shards and then the manifest (last) run on a background thread, with at most
one save in flight.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Any

import torch

from runner.checkpoint.hashing import Hasher
from runner.layout import MANIFEST, META, CommitInfo, FileEntry, Manifest, finite_metrics, step_dir
from runner.state import TensorSpec, as_bytes, flatten
from runner.store import Store, WriteStream

log = logging.getLogger(__name__)

ALIGN = 64


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


def write_object(
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


def _write_shard(
    store: Store,
    key: str,
    pieces: list[memoryview],
    chunk: int,
    on_chunk: Callable[[memoryview], object] | None = None,
) -> FileEntry:
    """Write one shard of staged tensors while a thread of its own hashes the same bytes.

    The staged bytes do not change until the save is over, so the hash need not follow the
    writes chunk by chunk: it runs beside them (a whole tensor per update, so it takes the
    GIL back once a tensor, not once a chunk), and the shard is written in about the time
    of the slower of the two instead of their sum.
    """
    hasher = Hasher("ckpt-write-hash")
    for view in pieces:
        hasher.update(view)
    try:
        size = write_object(store, key, pieces, chunk, on_chunk)
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


class SaveCancelled(Exception):
    """A save given up for a newer one (:meth:`CheckpointWriter.cancel`): nothing of it
    is committed, and it is not a failure."""


@dataclass(frozen=True)
class WriteProgress:
    """The save in flight, so far."""

    #: The step being saved.
    step: int
    #: Bytes of its shards and metadata, all told.
    total: int
    #: Bytes of shards handed to the store so far.
    done: int
    #: Seconds since its write began (0 while it waits to begin).
    elapsed_s: float


class CheckpointWriter:
    """Saves states of a run asynchronously into a store, at most one save in flight.

    A subclass may write its files under :attr:`prefix` inside the step directory and
    commit differently (:meth:`_uncommit`, :meth:`_commit`): one rank's part of a
    multi-rank checkpoint (:mod:`runner.distributed`).
    """

    #: Where the files go inside the step directory ("" or "name/").
    prefix: str = ""

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
        #: The save in flight as it goes: its step, bytes to write, bytes written, and
        #: when its write began (perf_counter; None until it has).
        self._progress: tuple[int, int] = (-1, 0)
        self._written = 0
        self._write_began: float | None = None
        self._cancel = threading.Event()

    def progress(self) -> WriteProgress | None:
        """How far the save in flight has got: what a notice window's plan follows, since
        the write during the window is the one most likely to be slow. None when no save
        is in flight."""
        if not self.in_flight:
            return None
        step, total = self._progress
        began = self._write_began
        elapsed = 0.0 if began is None else time.perf_counter() - began
        done = min(self._written, total)
        return WriteProgress(step=step, total=total, done=done, elapsed_s=elapsed)

    def _count(self, piece: memoryview) -> None:
        if self._cancel.is_set():
            raise SaveCancelled("given up for a newer save")
        with self._lock:
            self._written += len(piece)

    def cancel(self) -> bool:
        """Give up the save in flight before its manifest, for a newer state that matters
        more (the one at a preemption notice, which must not queue behind an older save
        slowed down with the rest of the window). Returns at once; the write stops at its
        next chunk and nothing of it is committed. False when no save was in flight."""
        if not self.in_flight:
            return False
        self._cancel.set()
        return True

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
        self._cancel.clear()
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
            self._progress = (step, sum(s.nbytes for s in specs) + len(meta.getbuffer()))
            self._written = 0
            self._write_began = None
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

    def _uncommit(self, step: int) -> None:
        """Before writing a step: re-saving one (after a fallback past a corrupt one)
        first uncommits it."""
        self.store.delete([f"{step_dir(step)}/{MANIFEST}"])

    def _commit(self, manifest: Manifest) -> Manifest:
        """After every file is written: the manifest, last; returns what was committed."""
        self.store.put_bytes(f"{step_dir(manifest.step)}/{MANIFEST}", manifest.to_json())
        return manifest

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
        self._write_began = t0
        sd = step_dir(step)
        files: list[FileEntry] = []
        stream: WriteStream | None = None
        try:
            self._uncommit(step)
            by_shard: dict[str, list[tuple[TensorSpec, torch.Tensor]]] = {}
            for spec, t in zip(specs, staged, strict=True):
                by_shard.setdefault(spec.shard, []).append((spec, t))
            pending = [
                self._shards.submit(
                    _write_shard,
                    self.store,
                    f"{sd}/{self.prefix}{shard}",
                    list(_shard_pieces(items)),
                    self.chunk_bytes,
                    self._count,
                )
                for shard, items in by_shard.items()
            ]
            # Wait for every shard before raising, so no thread still writes into the step.
            wait(pending)
            files.extend(f.result() for f in pending)
            stream = self.store.open_write(f"{sd}/{self.prefix}{META}")
            stream.write(meta)
            stream.close()
            stream = None
            files.append(
                FileEntry(
                    name=f"{self.prefix}{META}",
                    size=len(meta),
                    sha256=hashlib.sha256(meta).hexdigest(),
                )
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
            total = self._commit(manifest).bytes
            write_s = time.perf_counter() - t0
        except Exception as exc:
            if stream is not None:
                try:
                    stream.abort()
                except Exception:  # the original error matters more
                    log.debug("abort after a failed write also failed", exc_info=True)
            if isinstance(exc, SaveCancelled):
                log.info("checkpoint at step %d was given up for a newer one", step)
                raise
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
