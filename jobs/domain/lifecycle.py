"""The run and attempt state machines, and nothing else.

Every state change goes through :func:`transition`, which checks the tables below and
fails loudly on an impossible move; terminal states are final. What moves runs and
attempts lives in :mod:`jobs.runs`, :mod:`jobs.usecases.service` and :mod:`jobs.background.tasks`;
docs/architecture.md ("Runs and attempts") draws both machines and gives the reasons.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any, overload

from jobs.domain.errors import IllegalTransition

__all__ = [
    "ATTEMPT_TRANSITIONS",
    "RUN_TRANSITIONS",
    "AttemptState",
    "RunState",
    "transition",
]


class _State(str, Enum):
    """A state of one of the two machines: its value is its name, its table says what follows."""

    def __str__(self) -> str:
        return self.value

    def is_terminal(self) -> bool:
        """Whether nothing moves it on: the run is over, or the attempt's instance is gone."""
        return not _TRANSITIONS[type(self)][self]


class RunState(_State):
    """Where a run is in its life."""

    PENDING = "PENDING"
    PREFLIGHT = "PREFLIGHT"
    PREFLIGHT_FAILED = "PREFLIGHT_FAILED"
    AWAITING_CONFIRMATION = "AWAITING_CONFIRMATION"
    LAUNCHING = "LAUNCHING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"
    BUDGET_EXCEEDED = "BUDGET_EXCEEDED"


class AttemptState(_State):
    """Where one instance working on a run is in its life."""

    REQUESTED = "REQUESTED"
    PROVISIONING = "PROVISIONING"
    RUNNING = "RUNNING"
    PREEMPTED = "PREEMPTED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    LOST = "LOST"
    TERMINATED = "TERMINATED"


_R = RunState
_ABANDON = frozenset({_R.STOPPED, _R.FAILED})
_SPENDING_END = frozenset({_R.STOPPED, _R.FAILED, _R.BUDGET_EXCEEDED})

#: Legal next states of a run. A state with no successors is terminal.
RUN_TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    _R.PENDING: frozenset({_R.PREFLIGHT}) | _ABANDON,
    _R.PREFLIGHT: frozenset({_R.PREFLIGHT_FAILED, _R.AWAITING_CONFIRMATION, _R.LAUNCHING})
    | _ABANDON,
    _R.AWAITING_CONFIRMATION: frozenset({_R.LAUNCHING}) | _ABANDON,
    _R.LAUNCHING: frozenset({_R.RUNNING, _R.RECOVERING}) | _SPENDING_END,
    _R.RUNNING: frozenset({_R.RECOVERING, _R.SUCCEEDED}) | _SPENDING_END,
    _R.RECOVERING: frozenset({_R.RUNNING}) | _SPENDING_END,
    _R.PREFLIGHT_FAILED: frozenset(),
    _R.SUCCEEDED: frozenset(),
    _R.FAILED: frozenset(),
    _R.STOPPED: frozenset(),
    _R.BUDGET_EXCEEDED: frozenset(),
}

_A = AttemptState
_ENDED = frozenset({_A.PREEMPTED, _A.FAILED, _A.LOST, _A.TERMINATED})

#: Legal next states of an attempt. A state with no successors is terminal.
ATTEMPT_TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    _A.REQUESTED: frozenset({_A.PROVISIONING}) | _ENDED,
    _A.PROVISIONING: frozenset({_A.RUNNING}) | _ENDED,
    _A.RUNNING: frozenset({_A.SUCCEEDED}) | _ENDED,
    _A.PREEMPTED: frozenset(),
    _A.SUCCEEDED: frozenset(),
    _A.FAILED: frozenset(),
    _A.LOST: frozenset(),
    _A.TERMINATED: frozenset(),
}

_TRANSITIONS: dict[type[_State], Mapping[Any, frozenset[Any]]] = {
    RunState: RUN_TRANSITIONS,
    AttemptState: ATTEMPT_TRANSITIONS,
}


def _names(states: frozenset[RunState] | frozenset[AttemptState]) -> str:
    return ", ".join(sorted(state.value for state in states))


@overload
def transition(
    current: RunState, target: RunState, *, subject_id: str | None = None
) -> RunState: ...


@overload
def transition(
    current: AttemptState, target: AttemptState, *, subject_id: str | None = None
) -> AttemptState: ...


def transition(
    current: RunState | AttemptState,
    target: RunState | AttemptState,
    *,
    subject_id: str | None = None,
) -> RunState | AttemptState:
    """Return ``target`` if ``current`` may move there; raise :class:`IllegalTransition`.

    The one gate for every state change of a run or an attempt. ``subject_id`` (the run
    or attempt id) is named in the error.
    """
    if isinstance(current, RunState) and isinstance(target, RunState):
        allowed: frozenset[RunState] | frozenset[AttemptState] = RUN_TRANSITIONS[current]
        kind, after_end = "run", "Launch a new run instead."
    elif isinstance(current, AttemptState) and isinstance(target, AttemptState):
        allowed = ATTEMPT_TRANSITIONS[current]
        kind = "attempt"
        after_end = "A late event from its instance can be ignored; a retry is a new attempt."
    else:
        raise TypeError(f"cannot move a {type(current).__name__} to a {type(target).__name__}")
    if target in allowed:
        return target
    subject = f"{kind} {subject_id}" if subject_id else f"the {kind}"
    if current.is_terminal():
        message = f"{subject} is {current}, which is final; it cannot become {target}. {after_end}"
    elif current is target:
        message = (
            f"{subject} is already {current}; the same change was applied twice, so "
            "check for a duplicated event or command."
        )
    else:
        message = (
            f"{subject} cannot go from {current} to {target}; from {current} it can only "
            f"become {_names(allowed)}. This is a bug in the caller: please report it."
        )
    raise IllegalTransition(message, current=current.value, target=target.value)
