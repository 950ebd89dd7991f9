"""The training process's output, shipped to the run's store so that it outlives the
instance, and read back from there by the control plane.

Layout, beside the run's checkpoints (``{checkpoint_uri}/{checkpoint prefix}/``)::

    logs/{attempt id}/{node}/{seq:08d}.log.gz

Each object is one gzip member holding a segment of the process's stdout and stderr, in
the order the bytes arrived. The location comes from what the runner already has (the
checkpoint URI and prefix, the attempt id, the node's rank), so the control plane finds
it from the attempt row alone, after the instance has gone.

Bounds, all of them per attempt and node (:class:`LogLimits`):

- a segment closes at ``segment_bytes`` of output, or ``segment_s`` after its first byte,
  whichever comes first; a preemption notice or the process's exit closes it at once;
- at most ``total_bytes`` of compressed segments stay in the store. The first
  ``keep_first`` segments (the start: configuration, versions, the first warnings) and the
  newest ones (the end: the traceback) are kept; past the bound the oldest segment after
  the first ones is deleted. A reader sees the hole in the numbering and says so;
- memory: at most ``buffer_bytes`` of output wait for their segment. Output beyond that
  (the store is unreachable and the process prints faster than it uploads) is dropped,
  and a line in the log says how much, where it was lost.

Training never waits for the log: the pumps read the process's pipes and append to a
buffer under a lock held for the append only; compression, upload and deletion run in the
shipper's own thread, and nothing it does (a store error included) reaches the process.
"""

from __future__ import annotations

import bisect
import gzip
import logging
import os
import re
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from runner.store.base import Store

log = logging.getLogger(__name__)

MiB = 1 << 20
#: The folder, under a run's store, that holds its logs.
LOGS_DIR = "logs"
_ID = re.compile(r"[A-Za-z0-9._-]{1,200}")
_SEGMENT_NAME = re.compile(r"([0-9]{8,})\.log\.gz")
#: How far back from the size bound a segment looks for a line end to close on.
_LINE_SLACK = 64 << 10
#: Seconds between retries of an upload that failed, at most.
_RETRY_MAX_S = 30.0
#: The most output one segment is read as.
_GUNZIP_CAP = 64 * MiB


@dataclass(frozen=True)
class LogLimits:
    """How the output is cut and how much of it is kept (per attempt and node)."""

    #: Output bytes that close a segment.
    segment_bytes: int = 1 * MiB
    #: Seconds after a segment's first byte that close it.
    segment_s: float = 30.0
    #: Compressed bytes kept in the store; past it, the oldest after ``keep_first`` go.
    total_bytes: int = 64 * MiB
    #: Segments from the start that are always kept.
    keep_first: int = 1
    #: Output bytes held in memory, waiting for their segment or a failed upload's retry.
    buffer_bytes: int = 16 * MiB
    #: The exit event's tail: at most this many lines and this many bytes (UTF-8).
    tail_lines: int = 40
    tail_bytes: int = 4096

    def __post_init__(self) -> None:
        if self.segment_bytes < 1 or self.segment_s <= 0 or self.keep_first < 0:
            raise ValueError(f"{self}: segments need a positive size and time")
        if self.total_bytes < 1 or self.buffer_bytes < self.segment_bytes:
            raise ValueError(f"{self}: the bounds must hold at least one segment")


def log_prefix(attempt: str, node: int | None = None) -> str:
    """The keys of one attempt's logs (``logs/a-…/``), or of one node's (``logs/a-…/0/``)."""
    if not _ID.fullmatch(attempt) or attempt in (".", ".."):
        raise ValueError(f"{attempt[:80]!r} is not an attempt id")
    return f"{LOGS_DIR}/{attempt}/" + ("" if node is None else f"{int(node)}/")


def segment_key(attempt: str, node: int, seq: int) -> str:
    return f"{log_prefix(attempt, node)}{seq:08d}.log.gz"


def _dropped_note(count: int) -> bytes:
    return (
        f"\n[trainbot-runner: {count:,} bytes of output dropped here: the log upload fell "
        "behind]\n".encode()
    )


@dataclass(frozen=True)
class ShipStats:
    """What a shipper has done, for its caller's log line and for tests."""

    segments: int
    kept_bytes: int
    deleted: int
    dropped_bytes: int
    failed_uploads: int


class LogShipper:
    """Cuts a stream of output into segments and uploads them in a background thread.

    ``store`` opens the run's store; it is called in the shipper's thread at the first
    upload, so that opening it (importing boto3) never delays the training process.
    """

    def __init__(
        self,
        store: Callable[[], Store],
        *,
        attempt: str,
        node: int = 0,
        limits: LogLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        log_prefix(attempt, node)  # a bad id fails here, not in the thread
        self._open = store
        self._store: Store | None = None
        self.attempt = attempt
        self.node = node
        self.limits = limits or LogLimits()
        self._clock = clock
        self._cond = threading.Condition()
        self._pending = bytearray()
        self._first_at: float | None = None
        self._dropped = 0
        self._dropped_total = 0
        self._tail = bytearray()
        self._tail_cut = False
        self._flush = False
        self._closing = False
        self._seq = 0
        #: Uploaded segments still in the store: (seq, compressed size), by seq.
        self._kept: list[tuple[int, int]] = []
        self._kept_bytes = 0
        self._deleted = 0
        #: Segments whose upload failed, oldest first: (seq, blob), retried from _retry_at.
        self._unsent: list[tuple[int, bytes]] = []
        self._retry_at = 0.0
        self._retry_s = 1.0
        self._failed = 0
        self._thread: threading.Thread | None = None

    # -- the producer side: never blocks on the store -----------------------------------

    def start(self) -> LogShipper:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="log-shipper", daemon=True)
            self._thread.start()
        return self

    def feed(self, data: bytes) -> None:
        """Take some output. Cheap: an append under the lock, and a wake-up at the bound."""
        if not data:
            return
        limits = self.limits
        with self._cond:
            self._tail += data
            if len(self._tail) > 2 * limits.tail_bytes:
                del self._tail[: len(self._tail) - limits.tail_bytes]
                self._tail_cut = True
            if len(self._pending) + len(data) > limits.buffer_bytes:
                self._dropped += len(data)
                self._dropped_total += len(data)
                return
            if self._dropped:
                self._pending += _dropped_note(self._dropped)
                self._dropped = 0
            self._pending += data
            if self._first_at is None:  # the thread now waits for this segment's time
                self._first_at = self._clock()
                self._cond.notify()
            elif len(self._pending) >= limits.segment_bytes:
                self._cond.notify()

    def flush(self) -> None:
        """Close the current segment now and upload it (a notice: the instance is going)."""
        with self._cond:
            self._flush = True
            self._cond.notify()

    def close(self, timeout: float = 15.0) -> bool:
        """Upload what is left and stop, waiting at most ``timeout`` seconds; True when
        everything taken reached the store."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        thread = self._thread
        if thread is None:  # never started: ship what there is from here
            self._thread = thread = threading.Thread(target=self._run, daemon=True)
            thread.start()
        thread.join(max(timeout, 0.0))
        with self._cond:
            return not thread.is_alive() and not self._unsent and not self._pending

    def tail(self) -> str:
        """The last lines of the output, within ``tail_lines`` and ``tail_bytes``."""
        limits = self.limits
        with self._cond:
            raw, cut = bytes(self._tail), self._tail_cut
        if len(raw) > limits.tail_bytes:
            raw, cut = raw[-limits.tail_bytes :], True
        return clip_tail(raw, lines=limits.tail_lines, cut=cut)

    def stats(self) -> ShipStats:
        with self._cond:
            return ShipStats(
                segments=self._seq,
                kept_bytes=self._kept_bytes,
                deleted=self._deleted,
                dropped_bytes=self._dropped_total,
                failed_uploads=self._failed,
            )

    # -- the shipper's thread --------------------------------------------------------------

    def _due(self, now: float) -> bool:
        if self._closing or self._flush:
            return True
        if self._unsent and now >= self._retry_at:
            return True
        if not self._pending or self._first_at is None:
            return False
        return (
            len(self._pending) >= self.limits.segment_bytes
            or now - self._first_at >= self.limits.segment_s
        )

    def _wait_s(self, now: float) -> float | None:
        waits = []
        if self._first_at is not None:
            waits.append(self._first_at + self.limits.segment_s - now)
        if self._unsent:
            waits.append(self._retry_at - now)
        return max(min(waits), 0.01) if waits else None

    def _take(self) -> tuple[bytes, bool]:
        """The next segment's bytes (under the lock), and whether the thread is done."""
        limits = self.limits
        if self._dropped and (self._closing or self._flush):
            self._pending += _dropped_note(self._dropped)
            self._dropped = 0
        pending = self._pending
        size = len(pending)
        if size > limits.segment_bytes:
            end = pending.rfind(
                b"\n", max(limits.segment_bytes - _LINE_SLACK, 0), limits.segment_bytes
            )
            size = end + 1 if end >= 0 else limits.segment_bytes
        elif not (self._closing or self._flush):
            now = self._clock()
            timed_out = self._first_at is not None and now - self._first_at >= limits.segment_s
            if size < limits.segment_bytes and not timed_out:
                size = 0  # woken for a retry only
        chunk = bytes(pending[:size])
        del pending[:size]
        if not pending:
            self._first_at = None
            self._flush = False
        elif size:
            self._first_at = self._clock()
        done = self._closing and not pending
        return chunk, done

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due(self._clock()):
                    self._cond.wait(self._wait_s(self._clock()))
                chunk, done = self._take()
                seq = self._seq
                if chunk:
                    self._seq += 1
            if chunk:
                self._upload(seq, gzip.compress(chunk, compresslevel=6, mtime=0))
            if self._unsent and (done or self._clock() >= self._retry_at):
                self._retry()
            if done:
                return

    def _upload(self, seq: int, blob: bytes) -> bool:
        key = segment_key(self.attempt, self.node, seq)
        try:
            if self._store is None:
                self._store = self._open()
            self._store.put_bytes(key, blob)
        except Exception as exc:  # the log must never end the runner: keep it, retry it
            with self._cond:
                self._failed += 1
                if not self._unsent or self._unsent[-1][0] < seq:
                    self._unsent.append((seq, blob))
                else:
                    bisect.insort(self._unsent, (seq, blob))
                self._trim_unsent()
                self._retry_at = self._clock() + self._retry_s
                self._retry_s = min(self._retry_s * 2, _RETRY_MAX_S)
            log.warning("could not upload log segment %s: %s", key, exc)
            return False
        with self._cond:
            bisect.insort(self._kept, (seq, len(blob)))
            self._kept_bytes += len(blob)
            self._retry_s = 1.0
        self._prune()
        return True

    def _trim_unsent(self) -> None:
        """Keep failed segments within the memory bound: the oldest go first."""
        held = sum(len(b) for _, b in self._unsent)
        while len(self._unsent) > 1 and held > self.limits.buffer_bytes // 2:
            _, blob = self._unsent.pop(0)
            held -= len(blob)

    def _retry(self) -> None:
        with self._cond:
            unsent, self._unsent = self._unsent, []
        for index, (seq, blob) in enumerate(unsent):
            if not self._upload(seq, blob):
                with self._cond:  # the rest waits for the next retry, in order
                    for item in unsent[index + 1 :]:
                        bisect.insort(self._unsent, item)
                    self._trim_unsent()
                return

    def _prune(self) -> None:
        """Delete the oldest segments after the first ones while the total is over the
        bound (the newest is never deleted)."""
        limits = self.limits
        while True:
            with self._cond:
                if (
                    self._kept_bytes <= limits.total_bytes
                    or len(self._kept) <= limits.keep_first + 1
                ):
                    return
                seq, size = self._kept[limits.keep_first]
            key = segment_key(self.attempt, self.node, seq)
            try:
                assert self._store is not None
                self._store.delete([key])
            except Exception as exc:  # tried again after the next upload
                log.warning("could not delete log segment %s: %s", key, exc)
                return
            with self._cond:
                self._kept.remove((seq, size))
                self._kept_bytes -= size
                self._deleted += 1


def clip_tail(raw: bytes, *, lines: int, cut: bool = False) -> str:
    """The last ``lines`` lines of ``raw`` as text; ``cut``: ``raw`` starts somewhere in
    the output, so its first, partial line is left out (unless it is the only one)."""
    text = raw.decode("utf-8", errors="replace")
    if cut and "\n" in text.rstrip("\n"):
        text = text.split("\n", 1)[1]
    kept = text.rstrip("\n").split("\n")
    return "\n".join(kept[-lines:]) if lines > 0 else ""


def pump(source: IO[bytes], *, echo: int | None, shipper: LogShipper) -> threading.Thread:
    """A thread that reads ``source`` (a pipe from the process) to its end, writes what
    it reads to ``echo`` (the runner's own stdout or stderr, as before: the console, a
    local instance's log file) and hands it to ``shipper``."""

    def run() -> None:
        fd = source.fileno()
        out = echo
        try:
            while True:
                try:
                    data = os.read(fd, 1 << 16)
                except OSError:
                    return
                if not data:
                    return
                if out is not None:
                    try:
                        view = memoryview(data)
                        while view:
                            view = view[os.write(out, view) :]
                    except OSError:
                        out = None  # the console went away: keep shipping
                shipper.feed(data)
        finally:
            source.close()

    thread = threading.Thread(target=run, name="log-pump", daemon=True)
    thread.start()
    return thread


# -- the reading side (the control plane) ------------------------------------------------


@dataclass(frozen=True)
class Segment:
    key: str
    seq: int
    size: int


def segments(store: Store, attempt: str, node: int) -> list[Segment]:
    """One node's segments in the store, oldest first."""
    prefix = log_prefix(attempt, node)
    found = []
    for obj in store.list(prefix):
        match = _SEGMENT_NAME.fullmatch(obj.key[len(prefix) :])
        if match:
            found.append(Segment(obj.key, int(match.group(1)), obj.size))
    return sorted(found, key=lambda s: s.seq)


def nodes(store: Store, attempt: str) -> list[int]:
    """The nodes of an attempt that shipped any output."""
    prefix = log_prefix(attempt)
    found = set()
    for obj in store.list(prefix):
        node, _, rest = obj.key[len(prefix) :].partition("/")
        if node.isdigit() and _SEGMENT_NAME.fullmatch(rest):
            found.add(int(node))
    return sorted(found)


@dataclass(frozen=True)
class LogTail:
    """The end of one node's log, as read from the store."""

    text: str
    #: Whether there is earlier output than ``text`` shows.
    cut: bool
    #: Segments in the store, and segments the bound deleted (holes in the numbering).
    segments: int
    missing: int


def read_tail(
    store: Store, attempt: str, node: int, *, max_bytes: int, max_lines: int = 10_000
) -> LogTail | None:
    """The last ``max_bytes`` (about) and ``max_lines`` of a node's log; None when it
    shipped nothing. Reads the newest segments only, as many as the bound needs."""
    found = segments(store, attempt, node)
    if not found:
        return None
    parts: list[bytes] = []
    got = 0
    newer: int | None = None
    for seg in reversed(found):
        if newer is not None and seg.seq != newer - 1:
            gap = newer - seg.seq - 1
            parts.append(f"[… {gap} segment(s) of output deleted here: the log keeps the "
                         "start and the newest …]\n".encode())  # fmt: skip
        newer = seg.seq
        data = _gunzip(store.get_bytes(seg.key))
        parts.append(data)
        got += len(data)
        if got > max_bytes:
            break
    raw = b"".join(reversed(parts))
    whole = got <= max_bytes and newer == found[0].seq
    cut = not whole or found[0].seq != 0
    if len(raw) > max_bytes:
        raw = raw[-max_bytes:]
    lines_all = raw.decode("utf-8", errors="replace").rstrip("\n").split("\n")
    text = clip_tail(raw, lines=max_lines, cut=not whole)
    cut = cut or len(lines_all) > max_lines
    missing = found[-1].seq + 1 - len(found)
    return LogTail(text=text, cut=cut, segments=len(found), missing=missing)


def _gunzip(blob: bytes) -> bytes:
    """A segment's output. Segments are small (a megabyte by default); the cap only
    guards against an object under ``logs/`` that is not one of ours."""
    try:
        return zlib.decompressobj(wbits=31).decompress(blob, _GUNZIP_CAP)
    except zlib.error:
        return b"[a log segment that is not gzip: skipped]\n"
