"""The session API: what a torch training loop needs to survive spot capacity.

``core`` is the :class:`Session` (restore, log metrics, checkpoint, stop); ``config`` its
settings from the environment; ``policy`` when to checkpoint; ``phases`` the dry run's
hooks. See docs/architecture.md, "Runner: session", for the loop it expects.
"""

from __future__ import annotations

from runner.session.config import SessionConfig
from runner.session.core import Session, Stateful
from runner.session.phases import DRY_RUN_SAVES
from runner.session.policy import AnyOf, EverySeconds, EverySteps, MeasuredInterval, SaveDecision

__all__ = [
    "DRY_RUN_SAVES",
    "AnyOf",
    "EverySeconds",
    "EverySteps",
    "MeasuredInterval",
    "SaveDecision",
    "Session",
    "SessionConfig",
    "Stateful",
]
