"""Every alert rule says when it is evaluated, and is evaluated there.

A rule registered in :data:`jobs.rules.RULES` with a trigger fires where that trigger
happens, with no list of rule names to edit elsewhere: shown here with rules defined only
in this file, through the real ingest path (signed batches to the service that
``jobs.process.bootstrap.build_ingest`` wires, the attempt lifecycle behind it, the alert tables).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from jobs import alerts
from jobs.database.db import session_scope
from jobs.database.models import Attempt, Run, hash_token
from jobs.domain.errors import TrainbotError
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.ingest import IngestService
from jobs.process.bootstrap import build_ingest
from jobs.process.deps import Deps
from jobs.rules import (
    RULES,
    AlertThresholds,
    Obs,
    RunContext,
    Severity,
    Signal,
    Trigger,
    default_rules,
    register,
    rules_on,
)
from jobs.rules.base import Thresholded, Verdict, of_type
from runner.wire import Event as WireEvent
from runner.wire import encode_batch

TOKEN = "tok-trigger"


class Answer42(Thresholded):
    """Fires when the loss is exactly 42: a rule only this file knows."""

    name = "test_answer_42"
    trigger = Trigger.STREAM

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        if not any(o.data.get("loss") == 42.0 for o in of_type(window, "metrics")):
            return []
        verdict = Verdict(self.name, "answer", Severity.WARNING)
        return [verdict.firing(f"Run {ctx.run_id} reached the answer", "loss 42", hint="Rejoice.")]


class EveryPreemption(Thresholded):
    """Fires on every preempted end of an attempt."""

    name = "test_every_preemption"
    trigger = Trigger.PREEMPTED

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        verdict = Verdict(self.name, f"attempt-{ctx.attempt_number}", Severity.INFO)
        return [verdict.firing(f"Run {ctx.run_id} lost attempt {ctx.attempt_number}", "", hint="-")]


class Untriggered(Thresholded):
    name = "test_untriggered"

    def evaluate(self, window: Sequence[Obs], *, now: float, ctx: RunContext) -> list[Signal]:
        return []


@pytest.fixture
def registered() -> Iterator[Callable[[Any], None]]:
    """Registers rules the normal way, and takes them out again after the test."""
    names: list[str] = []

    def add(rule: Any) -> None:
        register(rule)
        names.append(rule.name)

    yield add
    for name in names:
        RULES.pop(name, None)


def running_attempt(deps: Deps) -> tuple[str, str]:
    now = deps.clock()
    with session_scope(deps.engine) as session:
        run = Run(
            spec_name="tiny", spec={"name": "tiny", "command": ["python", "t.py"]},
            state=RunState.RUNNING, requester="U1", channel="C1", budget_usd=50.0,
            created_at=now, updated_at=now,
        )  # fmt: skip
        session.add(run)
        session.flush()
        attempt = Attempt(
            run_id=run.id, number=1, provider="local", zone="local-a",
            state=AttemptState.RUNNING, started_at=now, token_hash=hash_token(TOKEN),
        )  # fmt: skip
        session.add(attempt)
        session.flush()
        return run.id, attempt.id


def send(
    ingest: IngestService,
    run_id: str,
    attempt_id: str,
    events: list[tuple[str, dict[str, Any]]],
    *,
    first_seq: int = 0,
) -> None:
    """One batch from the attempt's runner, as the wire carries it."""
    t0 = 1_800_000_000.0
    batch = [
        WireEvent(attempt_id, seq, kind, t0 + seq, run_id, data)
        for seq, (kind, data) in enumerate(events, start=first_seq)
    ]
    assert ingest.handle(f"Bearer {TOKEN}", encode_batch(batch)).status == 200


def open_rules(deps: Deps, run_id: str) -> set[str]:
    with session_scope(deps.engine) as session:
        return {a.rule for a in alerts.open_alerts(session, run_id=run_id)}


def metrics(step: int, loss: float) -> tuple[str, dict[str, Any]]:
    return "metrics", {
        "step": step,
        "loss": loss,
        "step_time_s": 0.1,
        "data_wait_fraction": 0.05,
        "metrics": {},
    }


def test_every_registered_rule_says_when_it_is_evaluated() -> None:
    assert RULES, "the rules register themselves"
    for name, rule in RULES.items():
        assert rule.name == name and isinstance(rule.trigger, Trigger), name
    # Every trigger a rule declares is one the control plane has a place for, and the
    # built-in rules are evaluated where they always were.
    by_trigger = {t: {r.name for r in rules_on(t, AlertThresholds())} for t in Trigger}
    assert by_trigger == {
        Trigger.STREAM: {"divergent_loss", "low_utilisation", "disk", "metric_threshold"},
        Trigger.PREEMPTED: {"preemption", "repeated_preemptions"},
        Trigger.RESUBMITTED: {"auto_resubmit"},
        Trigger.SILENT: {"lost_heartbeat"},
        Trigger.PERIODIC: {"hung"},
        Trigger.SCRIPT: {"script_alert"},
    }
    assert [r.name for r in default_rules(AlertThresholds())] == list(RULES)


def test_a_rule_without_a_trigger_or_with_a_taken_name_is_refused() -> None:
    with pytest.raises(TrainbotError, match="does not say when it is evaluated"):
        register(Untriggered)
    with pytest.raises(TrainbotError, match="registered already"):
        register(RULES["disk"])
    assert "test_untriggered" not in RULES


def test_a_new_stream_rule_fires_through_the_ingest_path(
    deps: Deps, registered: Callable[[Any], None]
) -> None:
    registered(Answer42)
    run_id, attempt_id = running_attempt(deps)
    ingest = build_ingest(deps)  # wired by declaration: nothing here names the rule
    send(ingest, run_id, attempt_id, [metrics(1, 3.0), metrics(2, 2.5)])
    assert "test_answer_42" not in open_rules(deps, run_id)
    send(ingest, run_id, attempt_id, [metrics(3, 42.0)], first_seq=2)
    assert "test_answer_42" in open_rules(deps, run_id)


def test_a_new_rule_on_a_preempted_end_fires_when_the_runner_says_so(
    deps: Deps, registered: Callable[[Any], None]
) -> None:
    registered(Answer42)
    registered(EveryPreemption)
    run_id, attempt_id = running_attempt(deps)
    ingest = build_ingest(deps)
    # Not on the stream: a metrics batch does not evaluate it.
    send(ingest, run_id, attempt_id, [metrics(1, 1.0)])
    assert open_rules(deps, run_id) == set()
    send(ingest, run_id, attempt_id, [("exit", {"code": 75, "reason": "preempted"})], first_seq=1)
    assert {"test_every_preemption", "preemption"} <= open_rules(deps, run_id)
    assert "test_answer_42" not in open_rules(deps, run_id)
