from __future__ import annotations

import itertools

import pytest

from jobs.domain.errors import IllegalTransition
from jobs.domain.lifecycle import (
    ATTEMPT_TRANSITIONS,
    RUN_TRANSITIONS,
    AttemptState,
    RunState,
    transition,
)

R = RunState
A = AttemptState

RUN_TERMINAL = {R.PREFLIGHT_FAILED, R.SUCCEEDED, R.FAILED, R.STOPPED, R.BUDGET_EXCEEDED}
ATTEMPT_TERMINAL = {A.PREEMPTED, A.SUCCEEDED, A.FAILED, A.LOST, A.TERMINATED}

# Targets in the enums' order, not the frozensets' (which follows string hashes and so
# changes from one process to the next): every pytest-xdist worker must collect the same
# tests in the same order.
LEGAL_RUN = [(a, b) for a, targets in RUN_TRANSITIONS.items() for b in RunState if b in targets]
ILLEGAL_RUN = [
    (a, b) for a, b in itertools.product(RunState, RunState) if b not in RUN_TRANSITIONS[a]
]
LEGAL_ATTEMPT = [
    (a, b) for a, targets in ATTEMPT_TRANSITIONS.items() for b in AttemptState if b in targets
]
ILLEGAL_ATTEMPT = [
    (a, b)
    for a, b in itertools.product(AttemptState, AttemptState)
    if b not in ATTEMPT_TRANSITIONS[a]
]


def test_tables_cover_every_state() -> None:
    assert set(RUN_TRANSITIONS) == set(RunState)
    assert set(ATTEMPT_TRANSITIONS) == set(AttemptState)


def test_terminal_states_are_exactly_the_designed_ones() -> None:
    assert {s for s in RunState if s.is_terminal()} == RUN_TERMINAL
    assert {s for s in AttemptState if s.is_terminal()} == ATTEMPT_TERMINAL


@pytest.mark.parametrize(("current", "target"), LEGAL_RUN)
def test_every_legal_run_transition_is_accepted(current: RunState, target: RunState) -> None:
    assert transition(current, target, subject_id="r-1") is target


@pytest.mark.parametrize(("current", "target"), LEGAL_ATTEMPT)
def test_every_legal_attempt_transition_is_accepted(
    current: AttemptState, target: AttemptState
) -> None:
    assert transition(current, target) is target


@pytest.mark.parametrize(("current", "target"), ILLEGAL_RUN)
def test_every_illegal_run_transition_is_rejected(current: RunState, target: RunState) -> None:
    with pytest.raises(IllegalTransition) as caught:
        transition(current, target, subject_id="r-12")
    assert caught.value.current == current.value
    assert caught.value.target == target.value
    assert "run r-12" in str(caught.value)


@pytest.mark.parametrize(("current", "target"), ILLEGAL_ATTEMPT)
def test_every_illegal_attempt_transition_is_rejected(
    current: AttemptState, target: AttemptState
) -> None:
    with pytest.raises(IllegalTransition, match="attempt a-3"):
        transition(current, target, subject_id="a-3")


def test_the_designed_happy_path_is_legal() -> None:
    path = [R.PENDING, R.PREFLIGHT, R.AWAITING_CONFIRMATION, R.LAUNCHING, R.RUNNING]
    path += [R.RECOVERING, R.RUNNING, R.RECOVERING, R.RUNNING, R.SUCCEEDED]
    state = path[0]
    for target in path[1:]:
        state = transition(state, target)
    assert state is R.SUCCEEDED
    attempt = A.REQUESTED
    for target_attempt in (A.PROVISIONING, A.RUNNING, A.PREEMPTED):
        attempt = transition(attempt, target_attempt)
    assert attempt.is_terminal()


def test_decisions_left_open_by_the_design() -> None:
    assert transition(R.PREFLIGHT, R.LAUNCHING) is R.LAUNCHING
    assert transition(R.AWAITING_CONFIRMATION, R.STOPPED) is R.STOPPED
    assert transition(R.LAUNCHING, R.RECOVERING) is R.RECOVERING
    with pytest.raises(IllegalTransition):
        transition(R.RECOVERING, R.LAUNCHING)
    with pytest.raises(IllegalTransition):
        transition(R.PREFLIGHT, R.BUDGET_EXCEEDED)


@pytest.mark.parametrize("state", [s for s in RunState if not s.is_terminal()])
def test_any_live_run_can_be_stopped_or_failed(state: RunState) -> None:
    assert transition(state, R.STOPPED) is R.STOPPED
    assert transition(state, R.FAILED) is R.FAILED


@pytest.mark.parametrize("state", [s for s in AttemptState if not s.is_terminal()])
def test_any_live_attempt_can_be_terminated_or_lost(state: AttemptState) -> None:
    assert transition(state, A.TERMINATED) is A.TERMINATED
    assert transition(state, A.LOST) is A.LOST


def test_every_live_state_can_still_end() -> None:
    for table in (RUN_TRANSITIONS, ATTEMPT_TRANSITIONS):
        for start in table:
            seen, frontier = {start}, [start]
            while frontier:
                for nxt in table[frontier.pop()]:  # type: ignore[index]
                    if nxt not in seen:
                        seen.add(nxt)
                        frontier.append(nxt)
            assert any(state.is_terminal() for state in seen), start


def test_terminal_message_says_it_is_final_and_what_to_do() -> None:
    with pytest.raises(IllegalTransition) as caught:
        transition(R.SUCCEEDED, R.RUNNING, subject_id="r-12")
    message = str(caught.value)
    assert message.startswith("run r-12 is SUCCEEDED, which is final;")
    assert "Launch a new run instead" in message


def test_repeating_a_transition_is_flagged_as_a_duplicate() -> None:
    with pytest.raises(IllegalTransition, match="already RUNNING"):
        transition(R.RUNNING, R.RUNNING, subject_id="r-1")


def test_illegal_move_lists_what_is_allowed() -> None:
    with pytest.raises(IllegalTransition) as caught:
        transition(R.PENDING, R.RUNNING)
    assert "from PENDING it can only become FAILED, PREFLIGHT, STOPPED" in str(caught.value)


def test_states_of_different_machines_do_not_mix() -> None:
    with pytest.raises(TypeError):
        transition(R.RUNNING, A.RUNNING)  # type: ignore[call-overload]


def test_states_are_stored_by_name() -> None:
    assert all(state.value == state.name for state in RunState)
    assert all(state.value == state.name for state in AttemptState)
    assert str(R.RECOVERING) == "RECOVERING"
    assert R("RUNNING") is R.RUNNING
