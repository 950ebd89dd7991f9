"""What every alert rule shares: the observation, the window, the run's facts, the signal.

Rules are pure (no database, no clock) and read runner payloads defensively: a field of
the wrong type counts as missing. See docs/architecture.md, "Alert rules".
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain
from operator import attrgetter
from typing import Any, NamedTuple, Protocol, overload

from jobs.domain.severity import Severity
from jobs.spec import AlertThresholds

__all__ = [
    "TIME",
    "AlertThresholds",
    "Obs",
    "Rule",
    "RuleType",
    "RunContext",
    "Severity",
    "Signal",
    "Thresholded",
    "Trigger",
    "TypedWindow",
    "Verdict",
    "attempt_of",
    "by_node",
    "cleared",
    "integer",
    "number",
    "of_type",
    "on_node",
    "per_node",
    "slope",
]


@dataclass(frozen=True)
class Signal:
    """What a rule says about a run; the lifecycle dedups by (run, rule, key)."""

    #: The rule's name, e.g. "divergent_loss".
    rule: str
    #: Dedup key within the rule, e.g. "nan", "spike", "threshold-80".
    key: str
    #: How loudly to say it.
    severity: Severity
    #: One line for a tired on-call engineer: what happened, to which run.
    title: str
    #: The figures behind it.
    detail: str
    #: What to do about it.
    hint: str
    #: True when the condition has cleared, so the lifecycle can resolve the alert.
    resolved: bool = False
    #: Machine-readable figures; ``{"stop": True}`` asks the service to stop the run.
    data: Mapping[str, Any] = field(default_factory=dict)
    #: Signals of one run and rule with the same incident join one alert (a loss spike
    #: and a rising trend are one divergence); ``None`` keeps the key's own alert.
    incident: str | None = None
    #: Seconds an unacknowledged alert may stay open before trainbot stops the run
    #: (0: at once, even when acknowledged, as for a NaN loss); ``None`` never stops it.
    stop_after_s: float | None = None
    #: The step at which the problem began, for the stop message's "resubmit from".
    began_step: int | None = None


def cleared(
    rule: str,
    *,
    key: str,
    severity: Severity,
    title: str,
    detail: str,
    data: Mapping[str, Any],
    incident: str | None = None,
) -> Signal:
    """The signal a rule sends when its condition has cleared (lets the lifecycle resolve)."""
    return Signal(
        rule=rule,
        key=key,
        severity=severity,
        title=title,
        detail=detail,
        hint="Nothing to do.",
        resolved=True,
        data=data,
        incident=incident,
    )


@dataclass(frozen=True)
class Verdict:
    """One key of one rule about one run: its firing and its cleared signal share the rest."""

    #: The rule's name.
    rule: str
    #: Dedup key within the rule.
    key: str
    #: How loudly to say it (a firing signal may say it louder).
    severity: Severity
    #: The figures behind both signals, unless a call gives its own.
    data: Mapping[str, Any] = field(default_factory=dict)
    #: The incident both signals join; see :attr:`Signal.incident`.
    incident: str | None = None

    def cleared(self, title: str, detail: str) -> Signal:
        """The condition has cleared: lets the lifecycle resolve the alert."""
        return cleared(
            self.rule,
            key=self.key,
            severity=self.severity,
            title=title,
            detail=detail,
            data=self.data,
            incident=self.incident,
        )

    def firing(
        self,
        title: str,
        detail: str,
        *,
        hint: str,
        severity: Severity | None = None,
        data: Mapping[str, Any] | None = None,
        stop_after_s: float | None = None,
        began_step: int | None = None,
    ) -> Signal:
        """The condition holds: what happened, the figures, and what to do."""
        return Signal(
            rule=self.rule,
            key=self.key,
            severity=self.severity if severity is None else severity,
            title=title,
            detail=detail,
            hint=hint,
            data=self.data if data is None else data,
            incident=self.incident,
            stop_after_s=stop_after_s,
            began_step=began_step,
        )


class Obs(NamedTuple):
    """One observation: a runner event, or a synthetic one from the control plane.

    A named tuple rather than a frozen dataclass: the ingest API makes hundreds per
    batch for the rules' window, and a tuple is built four times faster.
    """

    #: When it happened, unix seconds.
    time: float
    #: Event type: "metrics", "system", "preemption_notice", "exit",
    #: "checkpoint_committed", or the synthetic "resubmitted".
    type: str
    #: The event's payload; may carry "attempt" (the attempt number that sent it).
    data: Mapping[str, Any]


@dataclass(frozen=True)
class RunContext:
    """Facts about the run that the events alone do not carry, read from the database."""

    #: The run the window belongs to; every title names it.
    run_id: str
    #: Last time the runner was heard from, unix seconds; None before it first reports.
    last_heartbeat: float | None
    #: When each preemption of this run happened, unix seconds.
    preemption_times: tuple[float, ...]
    #: The current attempt, counting from 1.
    attempt_number: int
    #: Step of the newest committed checkpoint; None when there is none yet.
    last_committed_step: int | None
    #: Latest step reported; None before the first metrics.
    current_step: int | None


class Trigger(str, enum.Enum):
    """When a rule is evaluated. Each place where one of these happens asks for the rules
    of its trigger (:func:`jobs.rules.rules_on`), so a registered rule is evaluated
    wherever its trigger happens, with no list of rule names anywhere else."""

    #: Each batch of a runner's events the ingest API stores, over the run's window.
    STREAM = "stream"
    #: An attempt ended preempted (``jobs.runs.end``): the window is its ``exit``.
    PREEMPTED = "preempted"
    #: The next attempt was launched after a preemption (``jobs.runs.recovery``): the
    #: window is its ``resubmitted`` observation.
    RESUBMITTED = "resubmitted"
    #: The reconcile job found an attempt silent past its heartbeat deadline
    #: (``jobs.runs.reconcile``): an empty window and the run's facts.
    SILENT = "silent"
    #: Each reconcile pass, for every attempt that runs and is heard from
    #: (``jobs.runs.watch``): its recent metrics and its newest ``stacks`` dump. For what
    #: no event announces, such as a step that stopped moving.
    PERIODIC = "periodic"
    #: The training script raised alerts itself (``session.alert``; the ingest API):
    #: the window is the batch's new ``alert`` events, each seen once.
    SCRIPT = "script"


class Rule(Protocol):
    """One alert rule: a pure function of the window, ``now`` and the run's facts."""

    name: str

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]: ...


class RuleType(Protocol):
    """What the registry holds (:data:`jobs.rules.RULES`): a rule class, which says its
    name and when it is evaluated, and is built from a run's thresholds."""

    @property
    def name(self) -> str: ...

    @property
    def trigger(self) -> Trigger: ...

    def __call__(self, cfg: AlertThresholds, /) -> Rule: ...


class Thresholded:
    """What a rule is built from: the run's alert thresholds (the spec's ``alerts``)."""

    def __init__(self, cfg: AlertThresholds = AlertThresholds()) -> None:
        self.cfg = cfg


def by_node(observations: Iterable[Obs]) -> dict[int, list[Obs]]:
    """Observations per node of a multi-node run (their ``node`` field; none: node 0),
    node 0 first, each in the given order."""
    nodes: dict[int, list[Obs]] = {0: []}
    for obs in observations:
        node = obs.data.get("node", 0)
        nodes.setdefault(node if type(node) is int and node >= 0 else 0, []).append(obs)
    return dict(sorted(nodes.items()))


def per_node(
    observations: Iterable[Obs], judge: Callable[[int, list[Obs]], list[Signal]]
) -> list[Signal]:
    """A rule's signals judged node by node (``judge(node, its observations)``). A run on
    one node gets them as they are; each node of a multi-node run is judged on its own
    figures, and its signals say which node (:func:`on_node`)."""
    nodes = by_node(observations)
    if len(nodes) == 1:
        return judge(0, nodes[0])
    return [on_node(signal, node) for node, obs in nodes.items() for signal in judge(node, obs)]


def on_node(signal: Signal, node: int) -> Signal:
    """A rule's signal about one node of a multi-node run: the title says which, and a
    node after the first has alerts of its own (node 0 keeps the run's keys, so a run's
    alerts stay the same when it grows a second node)."""
    return replace(
        signal,
        key=signal.key if node == 0 else f"{signal.key}:node-{node}",
        title=f"{signal.title} (node {node})",
        data={**signal.data, "node": node},
    )


def number(data: Mapping[str, Any], key: str) -> float | None:
    """A numeric payload field as float, or None when it is missing or of the wrong type."""
    value = data.get(key)
    if type(value) is float:  # nearly always: the rules read every observation per batch
        return value
    if type(value) is int:
        return float(value)
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):  # JSON has no NaN: the wire sends "NaN", "Infinity".
        try:
            return float(value)
        except ValueError:
            return None
    return None


def integer(data: Mapping[str, Any], key: str) -> int | None:
    """A whole-number payload field, or None when it is missing, wrong or not finite."""
    exact = data.get(key)
    if type(exact) is int:
        return exact
    value = number(data, key)
    return int(value) if value is not None and math.isfinite(value) else None


def attempt_of(obs: Obs, ctx: RunContext) -> int:
    """The attempt that sent an observation; the current one when it does not say."""
    attempt = integer(obs.data, "attempt")
    return attempt if attempt is not None else ctx.attempt_number


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs; 0 when xs do not vary."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


TIME = attrgetter("time")


class TypedWindow(Sequence[Obs]):
    """A window that also holds its observations by type, each type oldest first.

    Every batch evaluates every rule over the whole window, so the grouping is done once
    here rather than once per rule. Immutable, so the groups never go stale.
    """

    __slots__ = ("_groups", "_items")

    def __init__(self, window: Iterable[Obs] = ()) -> None:
        self._items = tuple(window)
        self._groups: dict[str, list[Obs]] | None = None

    @classmethod
    def from_groups(cls, groups: Mapping[str, Iterable[Obs]]) -> TypedWindow:
        """A window of observations already grouped: each group holds only its key's type."""
        lists = {kind: list(group) for kind, group in groups.items()}
        window = cls(chain.from_iterable(lists.values()))
        for group in lists.values():
            group.sort(key=TIME)
        window._groups = lists
        return window

    def of_type(self, kind: str) -> list[Obs]:
        """The observations of one type, oldest first. Shared between the rules: read only."""
        groups = self._groups
        if groups is None:
            groups = {}
            for obs in self._items:
                group = groups.get(obs.type)
                if group is None:
                    group = groups[obs.type] = []
                group.append(obs)
            for group in groups.values():
                group.sort(key=TIME)
            self._groups = groups
        return groups.get(kind, [])

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Obs]:
        return iter(self._items)

    @overload
    def __getitem__(self, index: int) -> Obs: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Obs]: ...

    def __getitem__(self, index: int | slice) -> Obs | Sequence[Obs]:
        return self._items[index]


def of_type(window: Sequence[Obs], kind: str) -> list[Obs]:
    """One type's observations, oldest first; read only (it may be shared)."""
    if isinstance(window, TypedWindow):
        return window.of_type(kind)
    return sorted([o for o in window if o.type == kind], key=TIME)
