"""The capped exponential backoff that PagerDuty's and Slack's senders share."""

from __future__ import annotations

from jobs.outbound.backoff import Backoff


def test_doubles_from_the_first_delay_up_to_the_cap() -> None:
    backoff = Backoff(0.5, 3.0)
    assert [backoff.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_longer_retry_after_wins_but_never_past_the_cap() -> None:
    backoff = Backoff(1.0, 10.0)
    assert backoff.delay(1, retry_after_s=4.0) == 4.0
    assert backoff.delay(3, retry_after_s=2.0) == 4.0  # shorter than the backoff: ignored
    assert backoff.delay(1, retry_after_s=60.0) == 10.0
