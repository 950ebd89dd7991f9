"""The pool the Slack listeners' work runs on, which yields to acknowledgements.

Python runs one thread at a time (the GIL), so work that is busy on the CPU — a status
query, a reply, a launch — slows every acknowledgement being answered at the same
moment: each answer waits its turn for the interpreter. Slack's deadline is on the
acknowledgement (3 s, then the user sees an error); the reply that follows has no
deadline. So this pool puts acknowledgements first: the HTTP endpoint marks each Slack
request it is answering (:meth:`WorkPool.enter` / :meth:`WorkPool.leave`, the leave once
the response has been written), and a piece of work starts only once no request has
been in flight for ``quiet_s`` — or once it has waited ``max_defer_s``, so a steady
stream of requests delays work but never starves it. A lone command's reply is late by
``quiet_s``; under a burst of commands, the replies start when the burst has been answered.

Waiting workers sleep on a timer, not on every request's end, so a burst of requests
does not wake them fifty times. The pool is bounded (a few threads): fifty commands at
once queue fifty pieces of work, not fifty threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

__all__ = ["MAX_DEFER_S", "QUIET_S", "WORK_THREADS", "WorkPool"]

#: Threads that run the work: few, so the work does not crowd the acknowledgements out.
WORK_THREADS = 4
#: Work starts once no Slack request has been in flight for this long.
QUIET_S = 0.05
#: ...or once it has waited this long, however busy the endpoint is.
MAX_DEFER_S = 1.0

P = ParamSpec("P")
T = TypeVar("T")


class WorkPool(Executor):
    """A bounded thread pool whose tasks wait for the Slack endpoint to be quiet."""

    def __init__(
        self,
        threads: int = WORK_THREADS,
        *,
        quiet_s: float = QUIET_S,
        max_defer_s: float = MAX_DEFER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threads < 1:
            raise ValueError(f"a work pool needs at least one thread, not {threads}")
        if quiet_s < 0 or max_defer_s < 0:
            raise ValueError("quiet_s and max_defer_s must be 0 or more")
        self.quiet_s = quiet_s
        self.max_defer_s = max_defer_s
        self._clock = clock
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="slack-work")
        self._cond = threading.Condition()
        self._in_flight = 0
        self._last_left = float("-inf")
        self._stopping = False

    # --- the endpoint's side -------------------------------------------------------------

    def enter(self) -> None:
        """A Slack request is being answered: work waits until it has been."""
        with self._cond:
            self._in_flight += 1

    def leave(self) -> None:
        """The request's answer has been written. Waiting work is not woken here: it
        looks again when its timer runs out, so a burst costs it no wake-ups."""
        with self._cond:
            self._in_flight = max(0, self._in_flight - 1)
            self._last_left = self._clock()

    @property
    def in_flight(self) -> int:
        """Slack requests being answered now."""
        with self._cond:
            return self._in_flight

    # --- Executor ------------------------------------------------------------------------

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        deadline = self._clock() + self.max_defer_s

        def after_acknowledgements() -> T:
            self._wait_until_quiet(deadline)
            return fn(*args, **kwargs)

        return self._pool.submit(after_acknowledgements)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work; what is queued runs at once (the app is stopping, nothing
        is left to put first), and with ``wait`` this returns when it has run."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)

    # --- internals -----------------------------------------------------------------------

    def _wait_until_quiet(self, deadline: float) -> None:
        with self._cond:
            while not self._stopping:
                now = self._clock()
                if now >= deadline:
                    return
                if self._in_flight == 0:
                    quiet_left = self._last_left + self.quiet_s - now
                    if quiet_left <= 0:
                        return
                    self._cond.wait(min(quiet_left, deadline - now))
                else:
                    self._cond.wait(min(self.quiet_s, deadline - now))

    def __repr__(self) -> str:
        return f"WorkPool(quiet_s={self.quiet_s}, max_defer_s={self.max_defer_s})"
