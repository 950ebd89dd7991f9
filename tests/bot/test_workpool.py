"""The Slack work pool: acknowledgements first, work never starved, few threads."""

from __future__ import annotations

import threading

import pytest

from bot.workpool import WorkPool


def started_event(pool: WorkPool) -> tuple[threading.Event, threading.Event]:
    """Submit a task; (its start, a gate it waits on before it ends)."""
    started, gate = threading.Event(), threading.Event()

    def task() -> None:
        started.set()
        gate.wait(10)

    pool.submit(task)
    return started, gate


def test_work_waits_while_a_request_is_answered_and_runs_after() -> None:
    pool = WorkPool(2, quiet_s=0.01, max_defer_s=600)
    try:
        pool.enter()
        started, gate = started_event(pool)
        assert not started.wait(0.3), "work started while an answer was being written"
        pool.leave()
        assert started.wait(10), "work did not start once the endpoint was quiet"
        gate.set()
        assert pool.in_flight == 0
    finally:
        pool.shutdown()


def test_work_with_nothing_in_flight_starts_at_once() -> None:
    pool = WorkPool(1, quiet_s=600, max_defer_s=600)
    try:
        started, gate = started_event(pool)
        assert started.wait(10), "nothing was in flight, yet the work waited"
        gate.set()
    finally:
        pool.shutdown()


def test_a_steady_stream_of_requests_delays_work_but_never_starves_it() -> None:
    pool = WorkPool(1, quiet_s=600, max_defer_s=0.2)
    pool.enter()  # a request that never ends
    try:
        started, gate = started_event(pool)
        assert started.wait(10), "work starved behind requests"
        gate.set()
    finally:
        pool.leave()
        pool.shutdown()


def test_shutdown_runs_what_is_queued_now_and_waits_for_it() -> None:
    pool = WorkPool(2, quiet_s=600, max_defer_s=600)
    pool.enter()
    done: list[int] = []
    for i in range(5):
        pool.submit(done.append, i)
    pool.shutdown(wait=True)
    assert sorted(done) == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError):
        pool.submit(done.append, 5)


def test_a_burst_of_work_runs_on_the_pool_s_few_threads() -> None:
    pool = WorkPool(3)
    names: set[str] = set()
    lock = threading.Lock()

    def note() -> None:
        with lock:
            names.add(threading.current_thread().name)

    futures = [pool.submit(note) for _ in range(50)]
    for future in futures:
        future.result(10)
    pool.shutdown()
    assert 1 <= len(names) <= 3 and all(n.startswith("slack-work") for n in names)


def test_results_and_errors_come_back_through_the_future() -> None:
    pool = WorkPool(1)
    try:
        assert pool.submit(lambda a, b: a + b, 2, b=3).result(10) == 5
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 // 0).result(10)
    finally:
        pool.shutdown()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one thread"):
        WorkPool(0)
    with pytest.raises(ValueError, match="0 or more"):
        WorkPool(1, quiet_s=-1)
