"""When to checkpoint: small save-decision policies given the time explicitly (orbax's
``SaveDecisionPolicy``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Protocol

from runner.preemption import MEASURED_SAVES_MIN, choose_interval


class SaveDecision(Protocol):
    """Whether to checkpoint after a step (orbax's SaveDecisionPolicy, with time passed in)."""

    def should_save(self, *, step: int, now: float, last_step: int, last_time: float) -> bool: ...


@dataclass(frozen=True)
class EverySteps:
    steps: int

    def should_save(self, *, step: int, now: float, last_step: int, last_time: float) -> bool:
        return step - last_step >= self.steps


@dataclass(frozen=True)
class EverySeconds:
    seconds: float

    def should_save(self, *, step: int, now: float, last_step: int, last_time: float) -> bool:
        return step > last_step and now - last_time >= self.seconds


@dataclass(frozen=True)
class AnyOf:
    policies: tuple[SaveDecision, ...]

    def should_save(self, *, step: int, now: float, last_step: int, last_time: float) -> bool:
        return any(
            p.should_save(step=step, now=now, last_step=last_step, last_time=last_time)
            for p in self.policies
        )


class MeasuredInterval:
    """Every T seconds, where T follows what this process's periodic saves cost: the
    ``"auto"`` interval. It starts at the control plane's choice (from a dry run on the
    control plane's CPU, or from the run's earlier attempts) and, once
    :data:`~runner.preemption.MEASURED_SAVES_MIN` periodic saves are measured, is the same
    rule (:func:`~runner.preemption.choose_interval`, with the M preflight chose) for the
    median stall and write of this process's saves, on the hardware it runs on.
    """

    def __init__(self, seconds: float, *, mtbp_s: float) -> None:
        self.seconds = seconds
        #: Daly's M: the mean time between the preemptions that lose work.
        self.mtbp_s = mtbp_s
        self._stalls: list[float] = []
        self._writes: list[float] = []

    def should_save(self, *, step: int, now: float, last_step: int, last_time: float) -> bool:
        return step > last_step and now - last_time >= self.seconds

    def observe(self, *, write_s: float, stall_s: float) -> float | None:
        """Take one periodic save's cost; the new interval when it moved by more than 2 %."""
        if not (write_s > 0 and stall_s > 0):
            return None
        self._writes.append(write_s)
        self._stalls.append(stall_s)
        if len(self._stalls) < MEASURED_SAVES_MIN:
            return None
        interval = choose_interval(
            write_s=statistics.median(self._writes),
            stall_s=statistics.median(self._stalls),
            mtbp_s=self.mtbp_s,
            flush_fits_window=False,  # M already counts only the preemptions losing work
        ).interval_s
        if abs(interval - self.seconds) <= 0.02 * self.seconds:
            return None
        self.seconds = interval
        return interval
