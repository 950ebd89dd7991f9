"""Issue 29 through moto's S3 (real boto3 over HTTP), its uploads throttled and slowed
down 4x at the notice: the trials of test_notice_slow_write.py on an object store.

moto serves from the test process; each trial runs in a process of its own (as each
attempt does), so the trials no longer share a GIL with moto's request handling or with
each other (sharing one, a trial's loop could wait behind them past its deadline on a
busy machine: 1 trial in 20, in about one module run of four, was retried for it).
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.fakes.moto_server import create_bucket
from tests.runner.test_notice_slow_write import (
    TRIALS,
    StoreAt,
    _judge,
    busy,
    trial_pool,
    trials,
)

# The module's CPU burners and the processes its trials run in, as fixtures here too.
__all__ = ["busy", "trial_pool"]

#: The trials' window: each upload also crosses the loopback and moto's handler, which
#: the burners slow down too.
S3_WINDOW_S = 4.0


@pytest.mark.parametrize("later", [False, True], ids=["first-attempt", "later-attempt"])
def test_s3_slowing_down_4x_at_the_notice_never_costs_the_notice_step(
    moto_server: str, busy: None, trial_pool: ProcessPoolExecutor, later: bool
) -> None:
    """Every attempt keeps the notice's step; the flush after it may be lost."""
    bucket = create_bucket(moto_server)  # one bucket, a run prefix per trial: cheaper
    stores = [StoreAt(f"ckpt/r{n}", bucket=bucket, endpoint_url=moto_server) for n in range(TRIALS)]
    outcomes = trials(trial_pool, stores, slowdown=4.0, later=later, window_s=S3_WINDOW_S)
    label = f"s3 4x {'later' if later else 'first'}"
    _judge(outcomes, slowdown=4.0, label=label, window_s=S3_WINDOW_S)
