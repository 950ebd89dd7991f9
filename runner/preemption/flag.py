"""The preemption flag: set once by whoever sees the notice first, read between steps.

Setting it takes no lock, so a signal handler can set it safely. See docs/architecture.md,
"Runner: preemption".
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

from runner.errors import RunnerError

#: Where a notice can come from.
SOURCES = ("signal", "aws", "gcp", "stop")
#: How often a main-thread waiter re-reads the flag: a signal handler cannot wake it
#: through an Event (that takes a lock), so it notices within this long instead.
_WAIT_SLICE_S = 0.05


class PreemptionError(RunnerError):
    """Preemption handling could not be set up."""


class SignalSetupError(PreemptionError):
    """Signal handlers could not be installed."""


class PreemptionConfigError(PreemptionError):
    """A preemption source, metadata URL or termination window is not usable."""


@dataclass(frozen=True)
class Notice:
    """That the instance is going away, and by when."""

    #: "signal", "aws", "gcp" or "stop" (a stop request, e.g. from the control plane).
    source: str
    #: Human text: "SIGTERM", "spot instance-action terminate at 2026-11-29T17:05:00Z".
    reason: str
    #: time.monotonic() when the notice was seen.
    received_at: float
    #: time.monotonic() by which the instance will be killed.
    deadline: float

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"notice source {self.source!r} is not one of {', '.join(SOURCES)}")


class PreemptionFlag:
    """Set once by whoever sees preemption first; read by the loop between steps.

    Thread-safe without a lock on the setting path: notices are appended to a list (one
    atomic operation under the GIL) and merged when read. A signal handler runs on the
    main thread between bytecodes, possibly while that thread holds some lock; taking any
    lock there could deadlock, so :meth:`set` takes none and only wakes waiters through
    an Event when it runs on another thread (which can never be a signal handler).
    """

    def __init__(self) -> None:
        self._notices: list[Notice] = []
        self._wake = threading.Event()

    def set(self, notice: Notice) -> None:
        """Record a notice. The first one is kept; a later one may only bring the deadline
        forward, because the instance dies at the earliest deadline anyone announced."""
        current = self.notice
        if current is None or notice.deadline < current.deadline:
            self._notices.append(notice)
        if threading.current_thread() is not threading.main_thread():
            self._wake.set()

    @property
    def is_set(self) -> bool:
        return bool(self._notices)

    @property
    def notice(self) -> Notice | None:
        """The first notice, with the earliest deadline seen since."""
        notices = tuple(self._notices)
        if not notices:
            return None
        first = notices[0]
        deadline = min(n.deadline for n in notices)
        return first if deadline == first.deadline else replace(first, deadline=deadline)

    def time_left(self, now: float | None = None) -> float | None:
        """Seconds until the deadline (never below 0); None when no notice was seen."""
        notice = self.notice
        if notice is None:
            return None
        now = time.monotonic() if now is None else now
        return max(0.0, notice.deadline - now)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the flag is set or ``timeout`` passes; True when set.

        Waits in short slices so that a flag set by a signal handler (which does not
        touch the Event) is seen within ``_WAIT_SLICE_S``.
        """
        end = None if timeout is None else time.monotonic() + timeout
        while not self.is_set:
            slice_s = _WAIT_SLICE_S
            if end is not None:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return False
                slice_s = min(slice_s, remaining)
            self._wake.wait(slice_s)
        return True
