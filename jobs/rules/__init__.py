"""Alert rules: small objects that read a window of a run's events and say what is wrong.

``base`` holds what they share; each other module is one family of rules. The rules'
thresholds are the job spec's ``alerts`` section (:class:`jobs.spec.AlertThresholds`).
Budget alerts are not a rule: the spend job raises them (``jobs.tasks``). See
docs/architecture.md, "Alert rules".
"""

from __future__ import annotations

from collections.abc import Sequence

from jobs.rules.base import (
    AlertThresholds,
    Obs,
    Rule,
    RunContext,
    Severity,
    Signal,
    TypedWindow,
)
from jobs.rules.disk import Disk
from jobs.rules.heartbeat import LostHeartbeat
from jobs.rules.loss import DivergentLoss
from jobs.rules.preemption import AutoResubmit, Preemption, RepeatedPreemptions
from jobs.rules.utilisation import LowUtilisation

__all__ = [
    "AlertThresholds",
    "AutoResubmit",
    "Disk",
    "DivergentLoss",
    "LostHeartbeat",
    "LowUtilisation",
    "Obs",
    "Preemption",
    "RepeatedPreemptions",
    "Rule",
    "RunContext",
    "Severity",
    "Signal",
    "TypedWindow",
    "default_rules",
    "evaluate_all",
]


def default_rules(cfg: AlertThresholds) -> list[Rule]:
    """Every rule, with the run's thresholds."""
    return [
        DivergentLoss(cfg),
        LowUtilisation(cfg),
        Disk(cfg),
        Preemption(cfg),
        AutoResubmit(cfg),
        RepeatedPreemptions(cfg),
        LostHeartbeat(cfg),
    ]


def evaluate_all(
    rules: Sequence[Rule], window: Sequence[Obs], *, now: float, ctx: RunContext
) -> list[Signal]:
    """Every rule's signals, in rule order."""
    if not isinstance(window, TypedWindow):
        window = TypedWindow(window)
    signals: list[Signal] = []
    for rule in rules:
        signals.extend(rule.evaluate(window, now=now, ctx=ctx))
    return signals
