"""The last resort of a preempted attempt's report: a thread that sends the exit, if the
session has not, just before the deadline.

The session reports a preempted exit from its main thread, when the loop (or the
restore) hands control back to it. A training step that runs on past the deadline (a
long step of the script's, a collective that hangs) never does, and the kill then leaves
the control plane with no exit and no word of what was kept (issue 29). The guard waits
for a notice, then for ``deadline - GUARD_S``, and sends a preempted exit with what the
session knows at that moment, unless one has been sent: whichever sends first marks it
sent under the session's lock, so the exit goes out once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from runner.preemption import PreemptionFlag
from runner.session.notice import REPORT_S

#: How long before the deadline the guard sends the exit the session has not: later
#: than the session's own (:data:`~runner.session.notice.REPORT_S` before it), so that
#: it stands in only for a main thread that is stuck; early enough that the supervisor,
#: which reads the session's events every 0.2 s, still passes it on.
GUARD_S = 0.6 * REPORT_S
#: How often the guard looks for a notice (seconds): it acts only near the deadline, so
#: seeing the notice this late costs nothing.
LOOK_S = 0.2


class ExitGuard:
    """Calls ``send`` once, ``GUARD_S`` before the deadline of a notice, unless stopped
    first; ``refresh`` is called before each look at the deadline (to read the
    supervisor's notice, which can only bring it forward)."""

    def __init__(
        self,
        flag: PreemptionFlag,
        *,
        send: Callable[[], None],
        refresh: Callable[[], None],
    ) -> None:
        self._flag = flag
        self._send = send
        self._refresh = refresh
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="exit-guard", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching; waits for a ``send`` under way (the sink must not close under it)."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._flag.is_set:
            if self._done.wait(LOOK_S):
                return
        while True:
            self._refresh()
            left = self._flag.time_left()
            if left is None:
                return
            due = left - GUARD_S
            if due <= 0:
                self._send()
                return
            if self._done.wait(min(due, LOOK_S)):
                return
