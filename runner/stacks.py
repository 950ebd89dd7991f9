"""A stalled step: the supervisor dumps the training processes' Python stacks.

A hung run keeps its heartbeat (the runner is fine) while its step stands still: a
collective waiting for a rank that died, a deadlock, a read that never returns. The
control plane's ``hung`` rule alerts when the step has not moved for
:func:`stall_limit_s`; a little before that (:data:`DUMP_AT` of it) the supervisor asks
every Python process of the command for its stacks, so the alert can show where it is
stuck. The stacks go into the attempt's shipped logs (:mod:`runner.logship`) and, clipped,
to the control plane as a ``stacks`` event.

How a process is asked: :mod:`runner._site.sitecustomize`, first on the command's
``PYTHONPATH``, registers :mod:`faulthandler` on SIGUSR2 in every Python process the
command starts (a plain script, torchrun's workers, spawned data loaders), and the
session registers too (a script run with ``python -I``, which skips ``PYTHONPATH``). What
gets no stacks: a process that is not Python, a plain script run with ``-I`` or ``-S``,
a command whose image replaces ``PYTHONPATH``, and a script that takes SIGUSR2 for itself
after start-up. Standard library only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from runner import env as contract
from runner._site import sitecustomize as site_hook
from runner.telemetry import EventSink
from runner.wire.schema import STACKS_TEXT_MAX

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_FACTOR",
    "DEFAULT_FLOOR_S",
    "DUMP_AT",
    "SITE_DIR",
    "StackDumper",
    "StallWatch",
    "dump_stacks",
    "stall_limit_s",
]

#: A step standing still for this many times the run's median step time...
DEFAULT_FACTOR: float = contract.HANG_FACTOR.default
#: ...and at least this long (seconds) is a hung run (the spec's ``alerts.hung``).
DEFAULT_FLOOR_S: float = contract.HANG_FLOOR_S.default
#: The supervisor dumps the stacks at this fraction of the limit, so that they have
#: reached the control plane when its rule alerts.
DUMP_AT = 0.75
#: The directory the supervisor puts first on the command's PYTHONPATH.
SITE_DIR = Path(site_hook.__file__).parent
#: Recent step times the median is taken over.
RECENT_STEPS = 50
#: Steps that arrive in bursts (a framework's files, read at each save: runner.frameworks)
#: may stand still this many times the usual gap between bursts.
BURST_GAPS = 1.5
#: Seconds a dump may take to be written by every process asked.
DUMP_WAIT_S = 3.0


def stall_limit_s(step_times: Iterable[float], *, factor: float, floor_s: float) -> float:
    """How long the step may stand still before the run counts as hung: ``factor`` times
    the median of the recent step times, and never less than ``floor_s`` (a run with a
    long evaluation or checkpoint between steps sets a longer floor)."""
    finite = [t for t in step_times if isinstance(t, float | int) and math.isfinite(t) and t > 0]
    typical = statistics.median(finite) if finite else 0.0
    return max(factor * typical, floor_s)


class StallWatch:
    """The step's progress as the supervisor sees it, and when its stacks are due."""

    def __init__(self, *, factor: float = DEFAULT_FACTOR, floor_s: float = DEFAULT_FLOOR_S) -> None:
        self.factor = factor
        self.floor_s = floor_s
        self.step: int | None = None
        #: Monotonic time the step last moved.
        self.moved_at: float | None = None
        self._times: deque[float] = deque(maxlen=RECENT_STEPS)
        #: Seconds between the recent moves of the step, as they arrived.
        self._gaps: deque[float] = deque(maxlen=10)
        self._dumped = False

    def saw(self, step: int, step_time_s: float, *, now: float) -> None:
        """A metrics event: the step it reached and how long it took."""
        if step != self.step:
            # A gap shorter than half a step is inside a burst: the steps of one read.
            if self.moved_at is not None and now - self.moved_at >= 0.5 * step_time_s:
                self._gaps.append(now - self.moved_at)
            self.step, self.moved_at, self._dumped = step, now, False
        self._times.append(step_time_s)

    def limit_s(self) -> float:
        """The run's own limit; for steps that arrive in bursts, at least
        :data:`BURST_GAPS` of the usual gap between them (a session reports every step,
        so there the gap is the step time and changes nothing)."""
        limit = stall_limit_s(self._times, factor=self.factor, floor_s=self.floor_s)
        if self._gaps:
            limit = max(limit, BURST_GAPS * statistics.median(self._gaps))
        return limit

    def due(self, *, now: float) -> float | None:
        """Seconds the step has stood still when its stacks are due now (once per stall),
        else None."""
        if self.moved_at is None or self._dumped:
            return None
        stalled = now - self.moved_at
        if stalled < DUMP_AT * self.limit_s():
            return None
        self._dumped = True
        return stalled


def _registered(directory: Path) -> list[int]:
    """Pids of the live processes whose site hook registered in ``directory``."""
    pids = []
    for pid_file in sorted(directory.glob("*.pid")):
        try:
            pid, started = int(pid_file.stem), pid_file.read_text(encoding="ascii").strip()
        except (OSError, ValueError):
            continue
        if started and site_hook.start_time(pid) == started:
            pids.append(pid)
    return pids


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)[:200]


def dump_stacks(directory: Path, *, wait_s: float = DUMP_WAIT_S) -> tuple[str, int]:
    """Ask every registered live process for its stacks; the text (one section per
    process) and how many answered. A process that does not answer within ``wait_s``
    (stopped, or not running any Python at all) is left out."""
    before = {pid: _size(directory / f"{pid}.stacks") for pid in _registered(directory)}
    asked = []
    for pid in before:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, getattr(signal, site_hook.SIGNAL_NAME))
            asked.append(pid)
    deadline = time.monotonic() + wait_s
    sizes = dict.fromkeys(asked, -1)
    while asked and time.monotonic() < deadline:
        time.sleep(0.1)
        now_sizes = {pid: _size(directory / f"{pid}.stacks") for pid in asked}
        settled = all(now_sizes[p] > before[p] and now_sizes[p] == sizes[p] for p in asked)
        sizes = now_sizes
        if settled:
            break
    sections = []
    for pid in asked:
        path = directory / f"{pid}.stacks"
        try:
            with path.open("rb") as f:
                f.seek(before[pid])
                text = f.read().decode(errors="replace").strip()
        except OSError:
            continue
        if text:
            sections.append(f"--- process {pid}: {_command_line(pid)}\n{_current_first(text)}")
    return "\n\n".join(sections), len(sections)


def _current_first(text: str) -> str:
    """faulthandler lists the other threads first; the thread the signal interrupted
    (the main thread, where a training loop hangs) goes first here, as the one to read."""
    threads = text.split("\n\n")
    current = [t for t in threads if t.startswith("Current thread")]
    return "\n\n".join(current + [t for t in threads if not t.startswith("Current thread")])


def clip_stacks(text: str, limit: int = STACKS_TEXT_MAX) -> str:
    """At most ``limit`` characters, cut in the middle: each process's innermost frames
    (its first lines) and the last process's come through."""
    if len(text) <= limit:
        return text
    marker = "\n[… clipped …]\n"
    keep = (limit - len(marker)) // 2
    return text[:keep] + marker + text[len(text) - keep :]


class StackDumper:
    """The supervisor's part: it watches the child's metrics and, when the step has stood
    still long enough, dumps the stacks into the logs and reports them."""

    def __init__(
        self,
        directory: Path,
        *,
        sink: EventSink,
        feed: Callable[[bytes], None] | None,
        watch: StallWatch,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self.sink = sink
        self.feed = feed
        self.watch = watch
        self.clock = clock
        directory.mkdir(parents=True, exist_ok=True)

    def env(self, env: Mapping[str, str]) -> dict[str, str]:
        """The command's variables that make its Python processes ready to dump."""
        path = os.pathsep.join(p for p in (str(SITE_DIR), env.get("PYTHONPATH", "")) if p)
        return {site_hook.STACKS_DIR: str(self.directory), "PYTHONPATH": path}

    def saw(self, kind: str, data: Mapping[str, Any]) -> None:
        """One event from the child; its metrics move the step."""
        if kind != "metrics":
            return
        step, step_time = data.get("step"), data.get("step_time_s")
        if isinstance(step, int) and isinstance(step_time, int | float):
            self.watch.saw(step, float(step_time), now=self.clock())

    def poll(self) -> bool:
        """Dump when due; whether it did."""
        stalled = self.watch.due(now=self.clock())
        if stalled is None:
            return False
        text, answered = dump_stacks(self.directory)
        step = self.watch.step
        head = (
            f"trainbot-runner: step {step} has not moved for {stalled:.0f} s; "
            f"Python stacks of {answered} process(es) follow\n"
        )
        body = text if text else "(no process answered: none is a Python process it can ask)"
        block = f"{head}{body}\n".encode(errors="replace")
        with contextlib.suppress(OSError):
            os.write(1, block)
        if self.feed is not None:
            self.feed(block)
        log.warning("step %s stalled for %.0f s: stacks dumped (%d)", step, stalled, answered)
        self.sink.emit(
            "stacks",
            {"step": step, "stalled_s": stalled, "processes": answered, "text": clip_stacks(body)},
        )
        return True
