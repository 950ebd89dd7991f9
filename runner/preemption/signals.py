"""Signal handlers that only set the preemption flag, installed for a ``with`` block.

The originals are restored on exit (Lightning's signal connector).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from runner.preemption.flag import Notice, PreemptionFlag, SignalSetupError

_Handler = Callable[[int, FrameType | None], Any] | int | None


class SignalHandlers:
    """Install flag-setting handlers for the duration of a ``with`` block.

    Like Lightning's signal connector: the originals are saved on entry and restored on
    exit, so the runner composes with whatever the training script installed. A SIGINT
    that arrives after this block already received a signal is passed to the original
    SIGINT handler (by default Python's, which raises KeyboardInterrupt): Ctrl-C once
    asks for a clean stop at the next step, Ctrl-C twice still interrupts at once.
    Repeated SIGTERMs only re-set the flag; orchestrators follow up with SIGKILL anyway.
    """

    def __init__(
        self,
        flag: PreemptionFlag,
        *,
        window_s: float,
        signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
    ) -> None:
        self._flag = flag
        self._window_s = window_s
        self._signals = tuple(signals)
        self._originals: dict[int, _Handler] = {}
        self._received = False

    def __enter__(self) -> SignalHandlers:
        if threading.current_thread() is not threading.main_thread():
            raise SignalSetupError(
                "preemption signal handlers can only be installed from the main thread "
                f"(this is {threading.current_thread().name!r}); enter SignalHandlers "
                "where the training loop starts, before starting other threads"
            )
        if self._originals:
            raise SignalSetupError("these SignalHandlers are already installed; use a new one")
        self._received = False
        for signum in self._signals:
            self._originals[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        originals, self._originals = self._originals, {}
        for signum, original in originals.items():
            # None: the handler was not installed from Python; the default is the best guess.
            signal.signal(signum, signal.SIG_DFL if original is None else original)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Runs between bytecodes on the main thread: plain attribute writes only.
        if signum == signal.SIGINT and self._received:
            self._escalate(signum, frame)
            return
        self._received = True
        now = time.monotonic()
        self._flag.set(
            Notice(
                source="signal",
                reason=signal.Signals(signum).name,
                received_at=now,
                deadline=now + self._window_s,
            )
        )

    def _escalate(self, signum: int, frame: FrameType | None) -> None:
        original = self._originals.get(signum)
        if callable(original):
            original(signum, frame)
        elif original != signal.SIG_IGN:
            raise KeyboardInterrupt
