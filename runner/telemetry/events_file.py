"""The events file: how a script under the supervisor hands its events to the runner.

The script appends with a :class:`FileSink`; the supervisor reads with :func:`follow_file`
and forwards to its Reporter. A file survives the child being killed and needs no socket.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from time import time as unix_now
from typing import IO, Any, NamedTuple

from runner.errors import WireError
from runner.telemetry.sink import EventSink, SpoolError, dump_line
from runner.wire import Event
from runner.wire import validate_payload as _validate

log = logging.getLogger(__name__)


class FileSink(EventSink):
    """Appends one JSON object per line, ``{"type", "time", "data"}``, flushed per line.

    Used by a training script under the supervisor, which follows the file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] | None = open(self.path, "ab")  # noqa: SIM115 - closed in close()
        # A child killed mid-line leaves a torn tail; start on a fresh line so the next
        # event is not glued to it (the follower skips the torn fragment).
        if self._file.tell() > 0:
            with open(self.path, "rb") as existing:
                existing.seek(-1, os.SEEK_END)
                if existing.read(1) != b"\n":
                    self._file.write(b"\n")
                    self._file.flush()

    def emit(
        self, type: str, data: Mapping[str, Any], *, time: float | None = None
    ) -> Event | None:
        payload = _validate(type, data)
        line = dump_line(
            {"type": type, "time": unix_now() if time is None else time, "data": payload}
        )
        with self._lock:
            if self._file is None:
                raise SpoolError(f"event file {self.path} is closed; emit before close()")
            self._file.write(line)
            self._file.flush()
        return None

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class SinkRecord(NamedTuple):
    """One event read back from a FileSink file."""

    type: str
    time: float
    data: dict[str, Any]


class FileFollower:
    """Reads the complete new lines of a FileSink file; iterate again to get more.

    A torn last line (the child is mid-write, or was killed) is left until completed.
    Lines that are not valid events are skipped with a warning, so one bad line cannot
    stop the forwarding.
    """

    def __init__(self, path: str | Path, *, start_offset: int = 0) -> None:
        self.path = Path(path)
        #: Byte offset after the last complete line read; persist it to resume.
        self.offset = start_offset

    def __iter__(self) -> Iterator[SinkRecord]:
        try:
            handle = open(self.path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            return
        with handle:
            size = os.fstat(handle.fileno()).st_size
            if size < self.offset:
                log.warning(
                    "event file %s shrank below offset %d; reading it from the start",
                    self.path,
                    self.offset,
                )
                self.offset = 0
            handle.seek(self.offset)
            buffer = b""
            while chunk := handle.read(1 << 16):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    self.offset += len(line) + 1
                    record = self._parse(line)
                    if record is not None:
                        yield record

    def _parse(self, line: bytes) -> SinkRecord | None:
        if not line.strip():
            return None
        try:
            obj = json.loads(line)
            type = obj["type"]
            when = float(obj["time"])
            return SinkRecord(type, when, _validate(type, obj["data"]))
        except (ValueError, TypeError, KeyError, WireError) as exc:
            log.warning("skipping a bad line in event file %s: %s", self.path, exc)
            return None


def follow_file(path: str | Path, *, start_offset: int = 0) -> FileFollower:
    """A follower of a FileSink file: ``for type, time, data in follower: ...``."""
    return FileFollower(path, start_offset=start_offset)
