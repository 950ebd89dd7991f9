"""What fits in a termination window: the providers' windows, whether an emergency
checkpoint fits the time left, and the periodic checkpoint interval (Daly) around it.

Pure arithmetic, shared by the runner and the control plane's preflight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runner.errors import RunnerError

#: Write bandwidth assumed before any save has been measured: a cautious figure for an
#: object store over the network (25 MB/s), so a first emergency flush of a small state
#: still happens and one of many gigabytes is not started in a 30 s window.
ASSUMED_BANDWIDTH_BPS = 25e6
#: When the emergency checkpoint fits the termination window, the share of preemptions
#: still assumed to come without a usable notice (a lost host, a notice that never
#: arrives, a kill before the flush ends). Only those need periodic checkpoints.
UNANNOUNCED_SHARE = 0.1
#: Periodic saves a run must have measured before its ``"auto"`` interval follows their
#: cost (the session within an attempt, the control plane before a resubmit).
MEASURED_SAVES_MIN = 3


def flush_fits(
    *,
    nbytes: int,
    bandwidth_bps: float | None,
    time_left_s: float | None,
    stall_s: float = 0.0,
    overhead_s: float = 1.0,
    safety: float = 1.5,
) -> bool:
    """Whether an emergency checkpoint of ``nbytes`` can finish before the deadline.

    A flush that cannot finish is worse than none: it spends the window and leaves a torn
    step. The estimate is :func:`flush_seconds`. With no deadline known (``time_left_s``
    None) it always fits.
    """
    if nbytes < 0:
        raise ValueError(f"checkpoint size must be >= 0 bytes, got {nbytes}")
    if time_left_s is None:
        return True
    return (
        flush_seconds(nbytes, bandwidth_bps, stall_s=stall_s, overhead_s=overhead_s, safety=safety)
        <= time_left_s
    )


def flush_seconds(
    nbytes: int,
    bandwidth_bps: float | None,
    *,
    stall_s: float = 0.0,
    overhead_s: float = 1.0,
    safety: float = 1.5,
) -> float:
    """The time to keep back for an emergency checkpoint of ``nbytes``.

    With a measured bandwidth (bytes ÷ the whole write of an earlier save, first request
    to manifest) the store's fixed costs per checkpoint are in the measurement already:
    ``stall_s + safety * nbytes / bandwidth_bps``, where ``stall_s`` is the measured
    snapshot before the write (a device-to-host copy on a GPU) and ``safety`` covers a
    write slower than those measured. Nothing here is a wall-clock constant, so the margin
    scales with the checkpoint (a 10 s write keeps 15 s; a 0.3 s one, 0.45 s). With no
    measurement yet, the cautious guess ``overhead_s + safety * nbytes /``
    :data:`ASSUMED_BANDWIDTH_BPS`.
    """
    if bandwidth_bps is None or bandwidth_bps <= 0:
        return overhead_s + safety * write_seconds(nbytes, None)
    return max(0.0, stall_s) + safety * write_seconds(nbytes, bandwidth_bps)


def write_seconds(nbytes: int, bandwidth_bps: float | None) -> float:
    """How long writing ``nbytes`` takes at the measured bandwidth, or at
    :data:`ASSUMED_BANDWIDTH_BPS` with no measurement yet."""
    if bandwidth_bps is None or bandwidth_bps <= 0:
        bandwidth_bps = ASSUMED_BANDWIDTH_BPS
    return nbytes / bandwidth_bps


def daly_interval(checkpoint_s: float, mtbp_s: float) -> float:
    """Daly's first-order optimum √(2CM) − C, never shorter than one checkpoint."""
    if not (checkpoint_s > 0 and mtbp_s > 0 and math.isfinite(checkpoint_s * mtbp_s)):
        raise RunnerError("Daly's interval needs a positive checkpoint time and MTBP")
    return max(checkpoint_s, math.sqrt(2 * checkpoint_s * mtbp_s) - checkpoint_s)


@dataclass(frozen=True)
class IntervalChoice:
    """A checkpoint interval and the figures it came from (all seconds)."""

    #: Seconds between checkpoints: max(``floor_s``, Daly(``cost_s``, ``mtbp_s``)).
    interval_s: float
    #: Daly's C: how long one save blocks the loop (the stall; the write if unmeasured).
    cost_s: float
    #: Daly's M: mean time between the preemptions that lose the work since the last
    #: checkpoint, i.e. those whose emergency checkpoint does not fit.
    mtbp_s: float
    #: The write time: one save in flight at a time, so no interval is shorter.
    floor_s: float


def choose_interval(
    *,
    write_s: float,
    stall_s: float | None,
    mtbp_s: float,
    flush_fits_window: bool,
    unannounced_share: float = UNANNOUNCED_SHARE,
) -> IntervalChoice:
    """The checkpoint interval for an asynchronous writer.

    C is the stall, because the write runs beside the next steps; the write time is the
    floor. M counts only preemptions that lose work: all of them when the emergency
    checkpoint does not fit the termination window, else the ``unannounced_share`` that
    comes without a usable notice (the others cost a flush, whatever the interval).
    """
    if not (write_s > 0 and math.isfinite(write_s)):
        raise RunnerError(f"the checkpoint write time must be positive (got {write_s})")
    if not 0 < unannounced_share <= 1:
        raise RunnerError(f"unannounced_share must be in (0, 1] (got {unannounced_share})")
    cost = stall_s if stall_s is not None and stall_s > 0 else write_s
    effective = mtbp_s / unannounced_share if flush_fits_window else mtbp_s
    interval = max(write_s, daly_interval(cost, effective))
    return IntervalChoice(interval_s=interval, cost_s=cost, mtbp_s=effective, floor_s=write_s)
