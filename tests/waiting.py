"""Waiting in tests for something another thread or process does: one helper for all.

It polls rather than sleeping a fixed time, so a test waits as long as the machine needs
and no longer: the poll starts at 10 ms (a condition that is nearly there is seen at
once) and backs off to 100 ms (a predicate that reads a database or runs reconcile
costs little while the wait is long).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")

FIRST_POLL_S = 0.01
LAST_POLL_S = 0.1


def wait_until(
    pred: Callable[[], T],
    timeout: float = 60.0,
    what: str = "the condition",
    *,
    every: float = LAST_POLL_S,
) -> T:
    """``pred()``'s first truthy value; fails the test after ``timeout`` seconds.

    ``every`` caps the back-off, for a test that measures how long the wait took."""
    deadline = time.monotonic() + timeout
    pause = min(FIRST_POLL_S, every)
    while not (found := pred()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 1.5, every)
    return found
