"""Capped exponential backoff, shared by the senders that retry a service's transient
failures (PagerDuty's Events API, Slack's Web API)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Backoff"]


@dataclass(frozen=True)
class Backoff:
    """The first retry waits ``first_s``, each next one twice as long, never more than
    ``max_s``."""

    first_s: float
    max_s: float

    def delay(self, failures: int, *, retry_after_s: float | None = None) -> float:
        """Seconds to wait after the ``failures``-th failure in a row (1 for the first).
        A server's own ``Retry-After`` is honoured when it asks for longer, up to the cap."""
        delay = min(self.max_s, self.first_s * 2 ** (failures - 1))
        if retry_after_s is not None:
            delay = min(self.max_s, max(delay, retry_after_s))
        return delay
