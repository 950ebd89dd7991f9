"""The flags every rank agrees on after each step: stop (and why) and save.

Each rank votes; one ``all_reduce(MAX)`` of a two-element tensor combines the votes, so a
notice seen by one rank stops every rank before its next step, and a save one rank's
policy asks for (a time-based policy reads each rank's own clock) is made by all.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Stop codes, ordered so that MAX keeps the most urgent: a preemption beats a stop request.
GO = 0
STOP = 1
PREEMPT = 2


@dataclass(frozen=True)
class Vote:
    """One rank's vote, or (after the reduction) the gang's decision."""

    #: GO, STOP (a stop request) or PREEMPT (a preemption notice).
    stop: int = GO
    #: Whether a periodic save is due.
    save: bool = False

    def encode(self) -> list[int]:
        return [self.stop, int(self.save)]

    @classmethod
    def decode(cls, values: list[int]) -> Vote:
        stop, save = (int(v) for v in values)
        if stop not in (GO, STOP, PREEMPT):
            raise ValueError(f"stop code {stop} is not one of {GO}, {STOP}, {PREEMPT}")
        return cls(stop=stop, save=bool(save))

    @property
    def reason(self) -> str | None:
        """The session's stop reason for this decision; None to go on."""
        return {GO: None, STOP: "stopped", PREEMPT: "preempted"}[self.stop]
