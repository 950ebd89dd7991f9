"""The control plane's background threads: a few workers, and waits that give theirs back.

Background work (a preflight, a launch, a digest) runs on a small pool, so a burst of
commands cannot start hundreds of threads. Some of that work spends most of its time
waiting on something outside: a cloud dry run waits up to ``dry_run.timeout`` (hours)
for its instance to report. Holding a worker for that wait is how four long dry runs
once stalled every other launch and stop (issue 23.3).

So a task that waits wraps the wait in :func:`waiting`: for its duration the task's
thread no longer counts as a worker, and a new thread takes the queued work. Waits are
bounded separately (``max_waiting``; the dry runs themselves are bounded per channel),
so the threads are never unbounded: at most ``workers + max_waiting``. A wait past that
bound keeps its worker, as before. When the wait ends the task finishes on its own
thread, which then leaves if the pool has more workers than it should.

Stops and terminations use a pool of their own (``Deps.urgent``), so they never queue
behind other work.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

__all__ = ["Workers", "waiting"]

log = logging.getLogger(__name__)

#: The pool whose worker the current thread is (``None`` outside any pool).
_here = threading.local()


class Workers:
    """A thread pool whose tasks may give their worker back while they wait."""

    def __init__(self, *, workers: int, max_waiting: int, name: str) -> None:
        if workers < 1:
            raise ValueError("a pool needs at least one worker")
        self.workers = workers
        self.max_waiting = max_waiting
        self.name = name
        self._queue: deque[tuple[Future[Any], Callable[[], Any]]] = deque()
        self._lock = threading.Condition()
        #: Threads that count as workers: idle ones and those running a task not in a wait.
        self._counted = 0
        self._idle = 0
        self._waiting = 0
        self._threads: set[threading.Thread] = set()
        self._serial = 0
        self._shutdown = False

    # -- what callers use ----------------------------------------------------------------

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Queue ``fn``; its future has its result or exception."""
        future: Future[Any] = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError(f"the {self.name} pool is shut down")
            self._queue.append((future, fn))
            self._wake_or_grow()
        return future

    @property
    def waiting_now(self) -> int:
        """Tasks in a :func:`waiting` block that gave their worker back."""
        with self._lock:
            return self._waiting

    def shutdown(self, *, wait: bool = True) -> None:
        """Take no more work; the queued work still runs. ``wait``: until it has."""
        with self._lock:
            self._shutdown = True
            self._lock.notify_all()
        while wait:
            with self._lock:
                alive = [t for t in self._threads if t is not threading.current_thread()]
            if not alive:
                return
            for thread in alive:
                thread.join()

    # -- inside ----------------------------------------------------------------------------

    def _wake_or_grow(self) -> None:
        """Called with the lock held and work queued: an idle worker takes it, or a new
        one starts if the pool has room."""
        if self._idle > 0:
            self._lock.notify()
        elif self._counted < self.workers:
            self._counted += 1
            self._serial += 1
            thread = threading.Thread(
                target=self._work, name=f"{self.name}-{self._serial}", daemon=True
            )
            self._threads.add(thread)
            thread.start()

    def _work(self) -> None:
        _here.pool = self
        try:
            while True:
                with self._lock:
                    while not self._queue and not self._shutdown:
                        if self._counted > self.workers:
                            self._counted -= 1  # one too many since a wait ended
                            return
                        self._idle += 1
                        self._lock.wait()
                        self._idle -= 1
                    if not self._queue:  # shut down and drained
                        self._counted -= 1
                        return
                    future, fn = self._queue.popleft()
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn()
                except BaseException as exc:  # handed to whoever holds the future
                    future.set_exception(exc)
                else:
                    future.set_result(result)
                with self._lock:
                    if self._counted > self.workers:
                        self._counted -= 1
                        return
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())
            _here.pool = None

    def _begin_wait(self) -> bool:
        """This thread stops counting as a worker; False when waits are at their bound."""
        with self._lock:
            if self._waiting >= self.max_waiting:
                return False
            self._waiting += 1
            self._counted -= 1
            if self._queue:  # shutting down or not: the queued work still runs
                self._wake_or_grow()
            return True

    def _end_wait(self) -> None:
        with self._lock:
            self._waiting -= 1
            self._counted += 1


@contextmanager
def waiting() -> Iterator[bool]:
    """A block that waits on something outside: the current worker is given back to its
    pool meanwhile (see the module's docstring). Yields whether it was; outside a pool
    it does nothing."""
    pool: Workers | None = getattr(_here, "pool", None)
    released = pool._begin_wait() if pool is not None else False
    if pool is not None and not released:
        log.warning(
            "%d tasks of the %s pool are waiting already; this wait keeps its worker",
            pool.max_waiting,
            pool.name,
        )
    try:
        yield released
    finally:
        if pool is not None and released:
            pool._end_wait()
