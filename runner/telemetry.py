"""Telemetry from the runner to the control plane: sinks, the durable reporter, sampling.

A spot instance can lose the control plane for minutes (a deploy, a network blip) and can
itself be killed at any moment, yet the events it produces — above all a NaN loss and the
preemption notice — must arrive. So the :class:`Reporter` writes every event to a local
append-only spool *before* a sender thread ships it, numbers events per attempt so a
retried batch is deduplicated by the server, and deletes spool segments only once the
server has acknowledged them. A restarted Reporter on the same spool directory carries on
with the sequence and resends what was not acknowledged.

A training script running under the supervisor writes its events with a
:class:`FileSink`; the supervisor reads them with :func:`follow_file` and forwards them
to its Reporter. A file survives the child being killed and needs no socket.

The spool survives a crash of the process (each line is flushed to the OS as it is
written) but is fsynced only when a segment closes: a preempted instance loses its disk
anyway, and an fsync per event would cost the training loop a disk round trip.
"""

from __future__ import annotations

import contextlib
import ctypes
import email.utils
import functools
import http.client
import json
import logging
import os
import random
import shutil
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from time import monotonic
from time import time as unix_now
from types import TracebackType
from typing import IO, Any, NamedTuple, Protocol

from runner.errors import RunnerError, WireError
from runner.wire import Event, encode_batch, event_from_wire, event_to_wire, json_safe
from runner.wire import validate_payload as _validate

__all__ = [
    "EventSink",
    "FileFollower",
    "FileSink",
    "NullSink",
    "Reporter",
    "SinkRecord",
    "SpoolError",
    "SystemSampler",
    "follow_file",
    "sample_system",
]

log = logging.getLogger(__name__)

#: A spool segment is closed (fsynced) after this many events; acked segments are deleted.
SEGMENT_EVENTS = 1000
#: First retry delay; doubles per failure up to max_backoff_s.
_BASE_BACKOFF_S = 0.25
#: How much of an error response body goes into the log.
_BODY_LOG_CHARS = 500


class SpoolError(RunnerError):
    """The telemetry spool cannot be used (wrong attempt, unwritable, already closed)."""


class EventSink(Protocol):
    """Where the runner's events go. ``emit`` validates and raises WireError on bad data."""

    def emit(
        self, type: str, data: Mapping[str, Any], *, time: float | None = None
    ) -> Event | None: ...

    def close(self, timeout: float = 10.0) -> None: ...


class NullSink(EventSink):
    """Drops everything: for runs without a control plane (local scripts, tests)."""

    def emit(
        self, type: str, data: Mapping[str, Any], *, time: float | None = None
    ) -> Event | None:
        return None

    def close(self, timeout: float = 10.0) -> None:
        return None


def _dump_line(obj: Mapping[str, Any]) -> bytes:
    try:
        text = json.dumps(json_safe(obj), allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise WireError(f"data: not JSON-able ({exc}); pass only JSON types") from exc
    return text.encode("utf-8") + b"\n"


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
        line = _dump_line(
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


# --- the durable spool ----------------------------------------------------------------


@dataclass
class _Segment:
    first_seq: int
    path: Path
    #: No more appends; fsynced.
    closed: bool


@dataclass
class _Batch:
    events: list[Event]
    #: Lines consumed, including corrupt ones that were skipped.
    count: int
    #: Where the batch ends: index into the segment list and byte offset inside it.
    segment: int
    offset: int


class _Spool:
    """Append-only JSONL segments ``seg-<first seq>.jsonl`` plus ``state.json``.

    ``state.json`` holds the attempt and the next seq; it is rewritten before the last
    segment is deleted, so the next seq is always recoverable from disk. The sender reads
    from the head segment at a byte offset and commits after an acknowledgement.
    """

    def __init__(self, directory: Path, *, attempt: str, run: str) -> None:
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
        self._next_seq = max(self._next_seq, last_seq + 1)
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
            line = _dump_line(event_to_wire(event))
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

    def read_batch(self, limit: int) -> _Batch:
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
            return _Batch(events, count, index, offset)

    def _parse(self, line: bytes, path: Path) -> Event | None:
        try:
            return event_from_wire(json.loads(line), attempt=self.attempt, run=self.run)
        except (ValueError, WireError) as exc:
            log.warning("skipping a corrupt line in telemetry spool %s: %s", path, exc)
            return None

    def commit(self, batch: _Batch) -> None:
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


# --- the reporter ---------------------------------------------------------------------


@dataclass
class _Response:
    #: HTTP status, or None when no response came (refused, reset, timeout).
    status: int | None
    detail: str = ""
    retry_after: float | None = None


def _parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - unix_now())
    except (TypeError, ValueError, IndexError):
        return None


@dataclass
class _SendState:
    failures: int = 0
    limit: int = 0


class Reporter(EventSink):
    """Ships events to the ingest API from a durable spool; see the module docstring.

    Responses: 2xx acknowledges; network errors, 5xx, 408, 429 and unexpected statuses
    are retried with capped exponential backoff (honouring Retry-After); 401/403 mean
    the attempt's token was revoked, so sending stops and the spool is kept; 413 halves
    the batch; 400/422 (and 413 on one event) drop the batch with an error naming the
    response, so one bad event cannot block the stream.
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        attempt: str,
        run: str,
        spool_dir: Path,
        batch_max: int = 500,
        flush_interval_s: float = 1.0,
        timeout_s: float = 5.0,
        max_backoff_s: float = 30.0,
    ) -> None:
        if batch_max < 1 or flush_interval_s <= 0 or timeout_s <= 0 or max_backoff_s <= 0:
            raise ValueError("batch_max, flush_interval_s, timeout_s, max_backoff_s must be > 0")
        self.url = url
        self._token = token
        self._batch_max = batch_max
        self._flush_interval_s = flush_interval_s
        self._timeout_s = timeout_s
        self._max_backoff_s = max_backoff_s
        self._spool = _Spool(Path(spool_dir), attempt=attempt, run=run)
        self._opener = urllib.request.build_opener()
        self._cond = threading.Condition()
        self._flush_wanted = False
        self._stopping = False
        self._revoked = False
        self._thread = threading.Thread(target=self._run, name=f"telemetry-{attempt}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:  # never the token
        return f"Reporter(url={self.url!r}, attempt={self._spool.attempt!r})"

    @property
    def pending(self) -> int:
        """Events spooled and not yet acknowledged (nor dropped)."""
        return self._spool.pending

    @property
    def revoked(self) -> bool:
        """The server refused the token; nothing more will be sent by this Reporter."""
        return self._revoked

    def emit(self, type: str, data: Mapping[str, Any], *, time: float | None = None) -> Event:
        """Validate, number and spool one event; the sender thread ships it later."""
        payload = _validate(type, data)
        event = self._spool.append(type, unix_now() if time is None else time, payload)
        if self._spool.pending >= self._batch_max:
            with self._cond:
                self._cond.notify_all()
        return event

    def flush(self, timeout: float) -> bool:
        """Send now; True once everything emitted so far is acknowledged (or dropped)."""
        deadline = monotonic() + timeout
        with self._cond:
            target = self._spool.appended
            self._flush_wanted = True
            self._cond.notify_all()
            while self._spool.consumed < target:
                remaining = deadline - monotonic()
                if remaining <= 0 or self._revoked or not self._thread.is_alive():
                    return False
                self._cond.wait(remaining)
            return True

    def close(self, timeout: float = 10.0) -> None:
        """Flush best-effort, stop the sender; whatever is unsent stays in the spool."""
        deadline = monotonic() + timeout
        if self._thread.is_alive() and not self._revoked:
            self.flush(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - monotonic()))
        self._spool.close()
        if self.pending:
            log.info(
                "telemetry closed with %d events unsent, kept in %s",
                self.pending,
                self._spool.directory,
            )

    # The sender thread.

    def _run(self) -> None:
        state = _SendState(limit=self._batch_max)
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._stopping
                        or self._flush_wanted
                        or self._spool.pending >= self._batch_max
                    ),
                    timeout=self._flush_interval_s,
                )
                self._flush_wanted = False
                if self._stopping:
                    return
            try:
                self._drain(state)
            except Exception:  # never let the sender die silently; the spool keeps the events
                log.exception("telemetry sender failed; retrying after %.0f s", self._max_backoff_s)
                self._sleep(self._max_backoff_s)

    def _drain(self, state: _SendState) -> None:
        """Send until the spool is empty, the token is revoked or we are stopping."""
        while not self._stopping and not self._revoked:
            batch = self._spool.read_batch(state.limit)
            if batch.count == 0:
                return
            if not batch.events:  # only corrupt lines
                self._commit(batch)
                continue
            try:
                body = encode_batch(batch.events)
            except WireError as exc:  # cannot happen for events that passed emit; never block
                log.error(
                    "dropped unencodable telemetry events of attempt %s: %s",
                    self._spool.attempt,
                    exc,
                )
                self._commit(batch)
                continue
            response = self._post(body)
            status = response.status
            if status is not None and 200 <= status < 300:
                if state.failures:
                    log.info("telemetry delivered again after %d failed tries", state.failures)
                state.failures, state.limit = 0, self._batch_max
                self._commit(batch)
            elif status in (401, 403):
                log.warning(
                    "telemetry token for attempt %s was refused (HTTP %d): the attempt has "
                    "ended or its token was revoked; stopped sending, %d events kept in %s",
                    self._spool.attempt,
                    status,
                    self._spool.pending,
                    self._spool.directory,
                )
                with self._cond:
                    self._revoked = True
                    self._cond.notify_all()
            elif status == 413 and len(batch.events) > 1:
                state.limit = max(1, len(batch.events) // 2)
            elif status in (400, 413, 422):
                first, last = batch.events[0].seq, batch.events[-1].seq
                log.error(
                    "telemetry batch seq %d..%d of attempt %s was rejected (HTTP %d: %s); "
                    "dropped it so later events still flow",
                    first,
                    last,
                    self._spool.attempt,
                    status,
                    response.detail,
                )
                state.failures, state.limit = 0, self._batch_max
                self._commit(batch)
            else:
                state.failures += 1
                self._back_off(state, response)

    def _commit(self, batch: _Batch) -> None:
        self._spool.commit(batch)
        with self._cond:
            self._cond.notify_all()

    def _back_off(self, state: _SendState, response: _Response) -> None:
        problem = f"HTTP {response.status}" if response.status else "no response"
        if response.detail:
            problem += f": {response.detail}"
        if response.retry_after is not None:
            delay = min(response.retry_after, self._max_backoff_s)
        else:
            ceiling = min(self._max_backoff_s, _BASE_BACKOFF_S * 2 ** min(state.failures - 1, 30))
            delay = random.uniform(ceiling / 2, ceiling)
        if state.failures == 1:
            log.warning(
                "telemetry to %s failed (%s); %d events spooled in %s, retrying with backoff",
                self.url,
                problem,
                self._spool.pending,
                self._spool.directory,
            )
        else:
            log.debug(
                "telemetry retry %d failed (%s); next in %.2f s", state.failures, problem, delay
            )
        self._sleep(delay)

    def _sleep(self, seconds: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._stopping, timeout=seconds)

    def _post(self, body: bytes) -> _Response:
        request = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={
                "Authorization": f"Bearer {self._token}",
                "Content-Type": "application/json",
            },
        )
        try:
            with self._opener.open(request, timeout=self._timeout_s) as reply:
                reply.read()
                return _Response(reply.status)
        except urllib.error.HTTPError as exc:
            try:
                detail = exc.read(_BODY_LOG_CHARS * 4).decode("utf-8", "replace")
            except (OSError, http.client.HTTPException):
                detail = ""
            return _Response(
                exc.code,
                detail.strip()[:_BODY_LOG_CHARS],
                _parse_retry_after(exc.headers.get("Retry-After") if exc.headers else None),
            )
        except (OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", None) or exc
            return _Response(None, str(reason))

    def __enter__(self) -> Reporter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# --- system sampling ------------------------------------------------------------------


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Nvml:
    """NVML through ctypes: no pynvml dependency, and nothing at all without a GPU."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lib: Any = None
        self._handles: list[ctypes.c_void_p] = []
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != 0:
                return
            count = ctypes.c_uint(0)
            if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
                return
            lib.nvmlDeviceGetUtilizationRates.argtypes = [
                ctypes.c_void_p,
                ctypes.POINTER(_Utilization),
            ]
            for index in range(count.value):
                handle = ctypes.c_void_p()
                if (
                    lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle))
                    == 0
                ):
                    self._handles.append(handle)
            self._lib = lib
        except (OSError, AttributeError) as exc:
            log.debug("NVML unavailable, reporting no GPU: %s", exc)

    def utilization(self) -> tuple[float | None, int]:
        """(mean GPU utilisation in percent over the devices, device count)."""
        if self._lib is None or not self._handles:
            return None, 0
        values = []
        with self._lock:
            for handle in self._handles:
                rates = _Utilization()
                if self._lib.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(rates)) == 0:
                    values.append(float(rates.gpu))
        return (sum(values) / len(values) if values else None), len(self._handles)


@functools.cache
def _nvml() -> _Nvml:
    """NVML is initialised once per process; the device handles stay valid."""
    return _Nvml()


def _bytes_under(directory: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue  # deleted while we walked
    return total


def sample_system(disk_path: str | Path, *, declared_total: int | None = None) -> dict[str, Any]:
    """The "system" payload now; never raises (a failed reading is reported as 0/None).

    Disk total is used + available, not the raw size, so used/total is the fullness
    that ends a run (as ``df`` shows it; root's reserved blocks are not available).
    With ``declared_total`` (a scratch directory of a declared size, as the local
    provider gives), used is the bytes under the directory.
    """
    path = str(disk_path)
    used = total = 0
    try:
        if declared_total is None:
            usage = shutil.disk_usage(path)
            used, total = usage.used, usage.used + usage.free
        else:
            used, total = _bytes_under(Path(path)), max(0, int(declared_total))
    except (OSError, ValueError) as exc:
        log.debug("disk usage of %s unavailable: %s", path, exc)
    try:
        gpu_util, gpu_count = _nvml().utilization()
    except Exception as exc:  # sampling must never take the runner down
        log.debug("GPU sampling failed: %s", exc)
        gpu_util, gpu_count = None, 0
    return {
        "gpu_util": gpu_util,
        "gpu_count": gpu_count,
        "disk_used": used,
        "disk_total": total,
        "disk_path": path,
    }


class SystemSampler:
    """A thread that emits "system" and "heartbeat" to a sink every ``interval_s``."""

    def __init__(
        self,
        sink: EventSink,
        disk_path: str | Path,
        *,
        interval_s: float = 15.0,
        declared_total: int | None = None,
        current_step: Callable[[], int | None] | None = None,
    ) -> None:
        self._sink = sink
        self._disk_path = disk_path
        self._interval_s = interval_s
        self._declared_total = declared_total
        self._current_step = current_step or (lambda: None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="system-sampler", daemon=True)

    def start(self) -> SystemSampler:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            try:
                self._sink.emit(
                    "system", sample_system(self._disk_path, declared_total=self._declared_total)
                )
                self._sink.emit("heartbeat", {"step": self._current_step()})
            except Exception as exc:  # a sampler must not kill the run
                log.warning("system sampling could not emit: %s", exc)
            if self._stop.wait(self._interval_s):
                return

    def __enter__(self) -> SystemSampler:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
