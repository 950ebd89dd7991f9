"""Alert rules: small objects that read a window of a run's events and say what is wrong.

``base`` holds what they share; each other module is one family of rules. The rules'
thresholds are the job spec's ``alerts`` section (:class:`jobs.spec.AlertThresholds`).
Every rule is registered in :data:`RULES` and says when it is evaluated (its
:class:`Trigger`); each place where a trigger happens evaluates :func:`rules_on` it.
Budget alerts are not a rule: the spend job raises them (``jobs.background.tasks``). See
docs/architecture.md, "Alert rules".
"""

from __future__ import annotations

from collections.abc import Sequence

from jobs.domain.errors import TrainbotError
from jobs.rules.base import (
    AlertThresholds,
    Obs,
    Rule,
    RuleType,
    RunContext,
    Severity,
    Signal,
    Trigger,
    TypedWindow,
)
from jobs.rules.disk import Disk
from jobs.rules.heartbeat import LostHeartbeat
from jobs.rules.hung import Hung
from jobs.rules.loss import DivergentLoss
from jobs.rules.preemption import AutoResubmit, Preemption, RepeatedPreemptions
from jobs.rules.script import ScriptAlert
from jobs.rules.thresholds import MetricThresholds
from jobs.rules.utilisation import LowUtilisation

__all__ = [
    "RULES",
    "AlertThresholds",
    "AutoResubmit",
    "Disk",
    "DivergentLoss",
    "Hung",
    "LostHeartbeat",
    "LowUtilisation",
    "MetricThresholds",
    "Obs",
    "Preemption",
    "RepeatedPreemptions",
    "Rule",
    "RuleType",
    "RunContext",
    "ScriptAlert",
    "Severity",
    "Signal",
    "Trigger",
    "TypedWindow",
    "default_rules",
    "evaluate_all",
    "register",
    "rules_on",
]

#: Every rule by name, in the order their signals are raised.
RULES: dict[str, RuleType] = {}


def register(rule: RuleType) -> RuleType:
    """Add a rule to :data:`RULES` (a rule shipped outside this package, or one a test
    defines); it is then evaluated wherever its trigger happens. A name registered
    already, or a rule that does not say when it is evaluated, is refused, so a rule can
    neither replace another silently nor never fire; tests remove theirs with
    ``RULES.pop(name)``."""
    name = getattr(rule, "name", None)
    if not isinstance(name, str) or not name:
        raise TrainbotError(f"the rule {rule!r} has no name: give its class a `name`")
    if not isinstance(getattr(rule, "trigger", None), Trigger):
        triggers = ", ".join(f"Trigger.{t.name}" for t in Trigger)
        raise TrainbotError(
            f"the rule {name!r} does not say when it is evaluated: give its class a "
            f"`trigger` ({triggers})"
        )
    if name in RULES:
        raise TrainbotError(f"a rule named {name!r} is registered already")
    RULES[name] = rule
    return rule


for _rule in (
    DivergentLoss,
    LowUtilisation,
    Disk,
    Preemption,
    AutoResubmit,
    RepeatedPreemptions,
    LostHeartbeat,
    Hung,
    MetricThresholds,
    ScriptAlert,
):
    register(_rule)


def default_rules(cfg: AlertThresholds) -> list[Rule]:
    """Every registered rule, whatever its trigger, with the run's thresholds."""
    return [rule(cfg) for rule in RULES.values()]


def rules_on(trigger: Trigger, cfg: AlertThresholds) -> list[Rule]:
    """The registered rules evaluated when ``trigger`` happens, with the run's thresholds."""
    return [rule(cfg) for rule in RULES.values() if rule.trigger is trigger]


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
