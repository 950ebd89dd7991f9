"""Spot behaviour: a preemption is SIGTERM to the instance's group, the termination
window, then SIGKILL; preemptions can be scheduled, or drawn at random for spot launches.

The schedule and the kill timers live in this object only: a restarted control plane keeps
the instances but not their schedule, and ``status`` sends a SIGKILL whose timer died.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from datetime import datetime

from jobs.providers.base import ProviderError
from jobs.providers.local.processes import kill_instance, read_process
from jobs.providers.local.records import PREEMPTED, Instances, utc

__all__ = ["Preemptions"]

log = logging.getLogger(__name__)


class Preemptions:
    """The preemptions of one provider object: notices, kill timers, and a thread that
    preempts scheduled instances when their time comes.

    ``lock`` is the provider's, so a preemption never interleaves with a launch or a
    termination of the same instance.
    """

    def __init__(
        self,
        instances: Instances,
        *,
        lock: threading.RLock,
        window_s: float,
        mean_time_between_s: float | None,
        seed: int | None,
    ) -> None:
        self._instances = instances
        self._lock = lock
        self._window_s = window_s
        self._mean_time_between_s = mean_time_between_s
        self._rng = random.Random(seed)
        self._kill_timers: dict[str, threading.Timer] = {}
        self._schedule: dict[str, float] = {}
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def preempt(self, instance_id: str, *, now: datetime | None = None) -> None:
        """SIGTERM now, SIGKILL after the window (from a timer); nothing if not running."""
        self._instances.load(instance_id)
        with self._lock:
            process = read_process(self._instances, instance_id)
            if (
                self._instances.has(instance_id, PREEMPTED)
                or process is None
                or not process.alive()
            ):
                return
            signalled = time.time()
            at = now.timestamp() if now is not None else signalled
            window = self._window_s
            self._instances.write(
                instance_id,
                PREEMPTED,
                {"at": at, "signalled_at": signalled, "kill_at": signalled + window},
            )
            process.signal_group(signal.SIGTERM)
            timer = threading.Timer(window, self._kill_after_window, args=(instance_id,))
            timer.daemon = True
            self._kill_timers[instance_id] = timer
            timer.start()
        log.info("preempted local instance %s; SIGKILL in %g s if alive", instance_id, window)

    def random_delay_s(self) -> float | None:
        """Seconds until a new spot instance's random preemption (exponential, seeded);
        None without a mean time between preemptions."""
        if self._mean_time_between_s is None:
            return None
        with self._lock:
            return self._rng.expovariate(1.0 / self._mean_time_between_s)

    def schedule(self, instance_id: str, when: float) -> None:
        """Preempt the instance at epoch ``when``, replacing any earlier schedule."""
        with self._wake:
            if self._closed:
                raise ProviderError("the local provider is closed; make a new one")
            self._schedule[instance_id] = when
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="local-preemptions", daemon=True
                )
                self._thread.start()
            self._wake.notify()

    def scheduled(self) -> dict[str, datetime]:
        with self._wake:
            return {i: utc(t) for i, t in self._schedule.items()}

    def cancel(self, instance_id: str) -> None:
        """Forget the instance's pending SIGKILL and its scheduled preemption."""
        with self._lock:
            timer = self._kill_timers.pop(instance_id, None)
        if timer is not None:
            timer.cancel()
        with self._wake:
            self._schedule.pop(instance_id, None)

    def close(self) -> None:
        """Stop the thread and the timers; the instances are left as they are."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)
        with self._lock:
            timers = list(self._kill_timers.values())
            self._kill_timers.clear()
        for timer in timers:
            timer.cancel()

    def _kill_after_window(self, instance_id: str) -> None:
        with self._lock:
            self._kill_timers.pop(instance_id, None)
        process = read_process(self._instances, instance_id)
        if process is not None and process.alive():
            log.info("local instance %s outlived its termination window: SIGKILL", instance_id)
            kill_instance(self._instances, instance_id, process)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed:
                    now = time.time()
                    due = [i for i, t in self._schedule.items() if t <= now]
                    if due:
                        break
                    wait = min(self._schedule.values(), default=now + 3600.0) - now
                    self._wake.wait(timeout=wait)
                if self._closed:
                    return
                for instance_id in due:
                    del self._schedule[instance_id]
            for instance_id in due:
                try:
                    self.preempt(instance_id)
                except ProviderError as e:
                    log.warning("scheduled preemption of %s skipped: %s", instance_id, e)
