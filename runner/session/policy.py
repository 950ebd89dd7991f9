"""When to checkpoint: small save-decision policies given the time explicitly (orbax's
``SaveDecisionPolicy``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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
