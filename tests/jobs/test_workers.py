"""The background pool: a task that waits gives its worker back, within a bound."""

from __future__ import annotations

import functools
import threading

import pytest

from jobs.background.workers import Workers, waiting

TIMEOUT = 30.0


def test_a_waiting_task_gives_its_worker_back_and_finishes_on_its_own_thread() -> None:
    pool = Workers(workers=1, max_waiting=2, name="t")
    inside, release = threading.Event(), threading.Event()

    def long_wait() -> str:
        with waiting() as released:
            assert released
            inside.set()
            assert release.wait(TIMEOUT)
        return threading.current_thread().name

    try:
        first = pool.submit(long_wait)
        assert inside.wait(TIMEOUT)
        # The only worker waits: queued work still runs, on another thread.
        assert pool.submit(lambda: 42).result(timeout=TIMEOUT) == 42
        assert pool.waiting_now == 1
        release.set()
        assert first.result(timeout=TIMEOUT).startswith("t-")
        assert pool.waiting_now == 0
    finally:
        release.set()
        pool.shutdown()


def test_waits_past_the_bound_keep_their_worker() -> None:
    pool = Workers(workers=1, max_waiting=0, name="t")
    release = threading.Event()
    answers: list[bool] = []

    def wait() -> None:
        with waiting() as released:
            answers.append(released)
            assert release.wait(TIMEOUT)

    try:
        held = pool.submit(wait)
        queued = pool.submit(lambda: 1)
        with pytest.raises(TimeoutError):
            queued.result(timeout=0.3)  # the one worker is held: the bound is zero
        release.set()
        held.result(timeout=TIMEOUT)
        assert queued.result(timeout=TIMEOUT) == 1
        assert answers == [False]
    finally:
        release.set()
        pool.shutdown()


def test_shutdown_runs_what_is_queued_and_refuses_more() -> None:
    pool = Workers(workers=2, max_waiting=1, name="t")
    done: list[int] = []
    futures = [pool.submit(functools.partial(done.append, n)) for n in range(20)]
    pool.shutdown(wait=True)
    assert all(f.done() for f in futures) and sorted(done) == list(range(20))
    with pytest.raises(RuntimeError):
        pool.submit(lambda: None)


def test_outside_a_pool_waiting_does_nothing_and_errors_reach_the_future() -> None:
    with waiting() as released:
        assert released is False
    pool = Workers(workers=1, max_waiting=1, name="t")
    try:
        failed = pool.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failed.result(timeout=TIMEOUT)
        assert pool.submit(lambda: "next").result(timeout=TIMEOUT) == "next"
    finally:
        pool.shutdown()
