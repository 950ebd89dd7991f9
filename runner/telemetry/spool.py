"""The reporter's durable spool: every event is on local disk before it is sent.

Segments are deleted only once the server has acknowledged them, and the next seq is
always recoverable from disk, so a restarted Reporter carries on where the last one left.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from runner.errors import WireError
from runner.telemetry.sink import SpoolError, dump_line
from runner.wire import Event, event_from_wire, event_to_wire

log = logging.getLogger(__name__)

#: A spool segment is closed (fsynced) after this many events; acked segments are deleted.
SEGMENT_EVENTS = 1000


@dataclass
class _Segment:
    first_seq: int
    path: Path
    #: No more appends; fsynced.
    closed: bool


@dataclass
class Batch:
    events: list[Event]
    #: Lines consumed, including corrupt ones that were skipped.
    count: int
    #: Where the batch ends: index into the segment list and byte offset inside it.
    segment: int
    offset: int


class Spool:
    """Append-only JSONL segments ``seg-<first seq>.jsonl`` plus ``state.json``.

    ``state.json`` holds the attempt and the next seq; it is rewritten before the last
    segment is deleted, so the next seq is always recoverable from disk. The sender reads
    from the head segment at a byte offset and commits after an acknowledgement.
    """

    def __init__(self, directory: Path, *, attempt: str, run: str, first_seq: int = 0) -> None:
        """``first_seq``: where a new spool's seqs start (a gang's node k: k × NODE_SEQ_SPAN)."""
        self.directory = directory
        self.attempt = attempt
        self.run = run
        self._lock = threading.Lock()
        self._closed = False
        self._writer: IO[bytes] | None = None
        self._writer_lines = 0
        self._head_offset = 0
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._next_seq = self._load_state()
            self._segments, appended, last_seq = self._load_segments()
        except OSError as exc:
            raise SpoolError(
                f"cannot use telemetry spool {directory}: {exc}; give the runner a writable "
                "spool directory"
            ) from exc
        self._next_seq = max(self._next_seq, last_seq + 1, first_seq)
        self._appended = appended
        self._consumed = 0
        self._write_state()

    def _load_state(self) -> int:
        path = self.directory / "state.json"
        try:
            state = json.loads(path.read_text("utf-8"))
            owner, next_seq = state["attempt"], int(state["next_seq"])
        except FileNotFoundError:
            return 0
        except (ValueError, KeyError, TypeError) as exc:
            log.warning(
                "telemetry spool state %s is unreadable (%s); recovering from segments", path, exc
            )
            return 0
        if owner != self.attempt:
            raise SpoolError(
                f"telemetry spool {self.directory} belongs to attempt {owner!r}, not "
                f"{self.attempt!r}; give each attempt its own spool directory"
            )
        return next_seq

    def _load_segments(self) -> tuple[list[_Segment], int, int]:
        found = []
        for path in self.directory.glob("seg-*.jsonl"):
            try:
                found.append((int(path.stem.removeprefix("seg-")), path))
            except ValueError:
                continue
        segments: list[_Segment] = []
        appended, last_seq = 0, -1
        for first_seq, path in sorted(found):
            data = path.read_bytes()
            if data and not data.endswith(b"\n"):
                # A crash mid-append: that emit never returned, so the event was never
                # promised; drop the fragment so appends start on a clean line.
                data = data[: data.rfind(b"\n") + 1]
                with open(path, "r+b") as handle:
                    handle.truncate(len(data))
            lines = data.splitlines()
            if not lines:
                path.unlink()
                continue
            for line in lines:
                try:
                    last_seq = max(last_seq, int(json.loads(line)["seq"]))
                except (ValueError, KeyError, TypeError):
                    continue
            appended += len(lines)
            segments.append(_Segment(first_seq, path, closed=True))
        return segments, appended, last_seq

    def _write_state(self) -> None:
        path = self.directory / "state.json"
        tmp = path.with_suffix(".tmp")
        state = {"attempt": self.attempt, "run": self.run, "next_seq": self._next_seq}
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)

    @property
    def pending(self) -> int:
        return self._appended - self._consumed

    @property
    def appended(self) -> int:
        return self._appended

    @property
    def consumed(self) -> int:
        return self._consumed

    def append(self, type: str, time: float, data: dict[str, Any]) -> Event:
        with self._lock:
            if self._closed:
                raise SpoolError(
                    f"telemetry for attempt {self.attempt} is closed; emit before close()"
                )
            event = Event(self.attempt, self._next_seq, type, time, self.run, data)
            line = dump_line(event_to_wire(event))
            try:
                writer = self._writer or self._open_writer(event.seq)
                start = writer.tell()
                try:
                    writer.write(line)
                    writer.flush()
                except OSError:
                    with contextlib.suppress(OSError):
                        writer.truncate(start)
                    raise
            except OSError as exc:
                # Abandon the segment: the next append starts a fresh one, so a torn
                # fragment can at worst spoil itself, never the next line.
                if self._writer is not None:
                    with contextlib.suppress(OSError):
                        self._writer.close()
                    self._writer = None
                    self._segments[-1].closed = True
                raise SpoolError(
                    f"cannot write telemetry spool {self.directory}: {exc}; free disk space "
                    "there or move the spool"
                ) from exc
            self._next_seq += 1
            self._appended += 1
            self._writer_lines += 1
            if self._writer_lines >= SEGMENT_EVENTS:
                self._close_writer()
            return event

    def _open_writer(self, first_seq: int) -> IO[bytes]:
        path = self.directory / f"seg-{first_seq:012d}.jsonl"
        if self._segments and self._segments[-1].path == path:
            self._segments[-1].closed = False  # an abandoned segment that got no line
        else:
            self._segments.append(_Segment(first_seq, path, closed=False))
        self._writer = open(path, "ab")  # noqa: SIM115 - closed in _close_writer
        self._writer_lines = 0
        return self._writer

    def _close_writer(self) -> None:
        if self._writer is None:
            return
        writer, self._writer = self._writer, None
        try:
            writer.flush()
            os.fsync(writer.fileno())
        except OSError as exc:
            log.warning("could not sync telemetry spool segment: %s", exc)
        finally:
            writer.close()
        self._segments[-1].closed = True

    def read_batch(self, limit: int) -> Batch:
        """Up to ``limit`` events from the head, without consuming them."""
        with self._lock:
            events: list[Event] = []
            count, index, offset = 0, 0, self._head_offset
            while not self._closed and index < len(self._segments) and count < limit:
                segment = self._segments[index]
                lines, offset, at_end = _read_lines(segment.path, offset, limit - count)
                for line in lines:
                    count += 1
                    event = self._parse(line, segment.path)
                    if event is not None:
                        events.append(event)
                if not (at_end and segment.closed and index + 1 < len(self._segments)):
                    break
                index, offset = index + 1, 0
            return Batch(events, count, index, offset)

    def _parse(self, line: bytes, path: Path) -> Event | None:
        try:
            return event_from_wire(json.loads(line), attempt=self.attempt, run=self.run)
        except (ValueError, WireError) as exc:
            log.warning("skipping a corrupt line in telemetry spool %s: %s", path, exc)
            return None

    def commit(self, batch: Batch) -> None:
        """The batch is acknowledged (or dropped): advance and delete spent segments."""
        with self._lock:
            if self._closed:
                return  # a newer Reporter may own the directory now; it will resend
            spent, self._segments = self._segments[: batch.segment], self._segments[batch.segment :]
            self._head_offset = batch.offset
            self._consumed += batch.count
            if self._consumed == self._appended:
                # Caught up: drop everything, remembering the next seq first.
                self._close_writer()
                spent, self._segments = spent + self._segments, []
                self._head_offset = 0
                self._write_state()
            for segment in spent:
                try:
                    segment.path.unlink()
                except FileNotFoundError:
                    pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._close_writer()
            try:
                self._write_state()
            except OSError as exc:
                log.warning("could not save telemetry spool state in %s: %s", self.directory, exc)
            self._closed = True


def _read_lines(path: Path, offset: int, limit: int) -> tuple[list[bytes], int, bool]:
    """Complete lines from ``offset``: (lines, offset after them, no more complete lines)."""
    lines: list[bytes] = []
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        log.warning("telemetry spool segment %s vanished; its events are lost", path)
        return lines, 0, True
    with handle:
        handle.seek(offset)
        buffer = b""
        while len(lines) < limit:
            chunk = handle.read(1 << 16)
            if not chunk:
                return lines, offset, True
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            for line in complete:
                if len(lines) == limit:
                    return lines, offset, False
                lines.append(line)
                offset += len(line) + 1
    return lines, offset, False
