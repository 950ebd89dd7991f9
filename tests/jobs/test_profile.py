"""Profile the start of a run before committing to all of it, over signed HTTP to the
real Slack app with the tiny model trained by real runner processes.

The run asks for 100,000 steps. Its first 5 (``profile.steps``) are measured on its
instance; the projection (hours, cost, finish, preemptions) goes in its thread. Past its
budget, it stops at a checkpoint (the runner flushes) and asks: Continue, Continue with
a budget that covers it, or Stop; Continue resumes from that checkpoint. Within its
budget, it goes on without asking (there the runner's side is played by batches to
the real ingest service).
"""

from __future__ import annotations

import dataclasses
import io
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlmodel import select

from bot.console import ConsoleNotifier
from jobs.database.db import session_scope
from jobs.database.models import Attempt, Run, hash_token
from jobs.domain.errors import ConflictError
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.outbound.notify import CallbackJournal
from jobs.process.bootstrap import build_ingest
from jobs.process.deps import Deps
from jobs.process.settings import Settings
from jobs.providers.local import LocalProvider
from jobs.runs.profile import epochs, projection_reasons, window
from jobs.spec import JobSpec
from jobs.usecases import service
from jobs.usecases.service import Actor
from runner.wire import Event as WireEvent
from runner.wire import encode_batch
from tests.bot import test_slack_app
from tests.bot.test_slack_app import ADA, BOB, CAROL, CHANNEL, FAST, Slack, wait_until
from tests.jobs.rows import all_detached

slack = test_slack_app.slack

LONG = 'command="python -m runner.examples.tiny --steps 100000 --step-delay 0.01" profile.steps=5'


def _launch(slack: Slack, budget: float) -> str:
    """Launch the long tiny run with ``budget`` and press "Launch anyway"."""
    before = set(_run_ids(slack))
    _, path = slack.command(f"launch tiny {FAST} {LONG} budget.usd={budget}")
    slack.hooks.wait(path)
    wait_until(lambda: len(set(_run_ids(slack)) - before) == 1, 15, "the run")
    (run_id,) = set(_run_ids(slack)) - before
    wait_until(lambda: slack.state(run_id) == RunState.AWAITING_CONFIRMATION, what="preflight")
    slack.action("launch_anyway", run_id)
    return run_id


def _run_ids(slack: Slack) -> list[str]:
    with session_scope(slack.cp.deps.engine) as session:
        return list(session.exec(select(Run.id)).all())


def _buttons(slack: Slack, run_id: str) -> list[tuple[str, str, str]]:
    slack.notifier.flush(10)
    found = []
    for message in slack.thread(run_id):
        for block in message.blocks or []:
            if block.get("type") == "actions" and block.get("block_id", "").startswith("profile:"):
                found += [
                    (e["action_id"], e["text"]["text"], e["value"]) for e in block["elements"]
                ]
    return found


def test_a_run_projected_past_its_budget_stops_at_a_checkpoint_and_asks(slack: Slack) -> None:
    deps = slack.cp.deps
    old = _launch(slack, budget=0.1)
    record = slack.wait_journal("projection", run=old, timeout=120)
    assert record["asked"] is True and record["cost_usd"] > 0.1
    assert record["step"] >= 5 and record["hours_left"] > 0 and record["step_time_s"] > 0
    assert "past its budget of $0.10" in record["reasons"][0]
    # Stopped the way the hard cap stops a run: the runner flushed a checkpoint.
    wait_until(lambda: slack.state(old) == RunState.STOPPED, 30, "the stop")
    with session_scope(deps.engine) as session:
        run = session.get(Run, old)
        assert run is not None and (run.reason or "").startswith("profile: ")
    wait_until(lambda: _attempt(slack, old).state == AttemptState.TERMINATED, 60, "the flush")
    with session_scope(deps.engine) as session:
        run = session.get(Run, old)
        assert run is not None and run.last_committed_step is not None
        flushed = run.last_committed_step
    suggested = record["suggested_budget_usd"]
    assert suggested is not None and suggested >= record["cost_usd"]
    assert _buttons(slack, old) == [
        ("profile_continue", "Continue", old),
        ("profile_continue", f"Continue with budget ${suggested:,.0f}", f"{old}|{suggested:.0f}"),
        ("profile_stop", "Stop", old),
    ]
    thread = " ".join(m.text for m in slack.thread(old))
    assert "Projection:" in thread and "Continue or stop?" in thread

    # Bob may not answer for Ada's run; Ada continues with the budget that covers it.
    _, path = slack.action("profile_stop", old, user=BOB)
    assert "belongs to" in slack.hooks.wait(path)["text"]
    _, path = slack.action("profile_continue", f"{old}|{suggested:.0f}", user=ADA)
    reply = slack.hooks.wait(path)["text"]
    (new,) = set(_run_ids(slack)) - {old}
    assert f"as {new}" in reply
    wait_until(lambda: bool(slack.journal("resumed", run=new)), 120, "the resumed runner")
    attempt = _attempt(slack, new)
    assert attempt.resumed_from_step == flushed
    assert attempt.profile_until_step is None and attempt.profile_until_s is None
    with session_scope(deps.engine) as session:
        run = session.get(Run, new)
        assert run is not None and run.budget_usd == suggested and run.budget_raised_by == ADA
    # Answered once: a later Stop is refused.
    _, path = slack.action("profile_stop", old, user=CAROL)
    assert "already chose continue" in slack.hooks.wait(path)["text"]


def test_a_run_within_its_budget_goes_on_without_asking(
    db_engine: Engine, settings: Settings, tmp_path: Path
) -> None:
    """The runner's side played by signed batches to the real ingest service."""
    journal: list[dict[str, Any]] = []
    out = io.StringIO()
    deps = Deps(
        settings=settings,
        engine=db_engine,
        provider=LocalProvider(tmp_path / "local"),
        notifier=ConsoleNotifier(out),
        journal=CallbackJournal(
            lambda t, run, data: journal.append({"type": t, "run": run, **data})
        ),
    )
    spec = JobSpec.model_validate(
        {"name": "tiny", "command": ["python", "t.py", "--steps", "1000"], "profile": {"steps": 10}}
    )
    now = deps.clock()
    with session_scope(db_engine) as session:
        run = Run(
            spec_name="tiny", spec=spec.model_dump(mode="json"), state=RunState.RUNNING,
            requester=ADA, channel=CHANNEL, budget_usd=500.0, target_steps=1000,
            checkpoint_interval_s=60.0, created_at=now, updated_at=now,
        )  # fmt: skip
        session.add(run)
        session.flush()
        attempt = Attempt(
            run_id=run.id, number=1, provider="local", zone="local-a", state=AttemptState.RUNNING,
            started_at=now, price_per_hour=2.0, token_hash=hash_token("tok"),
        )  # fmt: skip
        attempt.profile_until_step, attempt.profile_until_s = window(spec, run, start_step=0)
        session.add(attempt)
        session.flush()
        run_id, attempt_id = run.id, attempt.id
    ingest = build_ingest(deps)
    t0 = now.timestamp()
    batch = [
        WireEvent(attempt_id, step, "metrics", t0 + step, run_id, {
            "step": step, "loss": 1.0, "step_time_s": 0.5, "data_wait_fraction": 0.1,
            "metrics": {},
        })
        for step in range(12)
    ]  # fmt: skip
    try:
        assert ingest.handle("Bearer tok", encode_batch(batch)).status == 200
        wait_until(lambda: any(r["type"] == "projection" for r in journal), 15, "the projection")
    finally:
        deps.close()
    (record,) = [r for r in journal if r["type"] == "projection"]
    # 989 steps left at 0.5 s is 494.5 s; spot preempts every 6 h on average (the default),
    # so 494.5 / 21600 preemptions, each losing half the 60 s interval; at $2/h.
    preemptions = 494.5 / 21600
    hours = (494.5 + preemptions * 30.0) / 3600
    assert record["asked"] is False and record["reasons"] == []
    assert (
        record["step"] == 11
        and record["step_time_s"] == 0.5
        and record["data_wait"] == pytest.approx(0.1)
    )
    assert record["preemptions"] == pytest.approx(preemptions)
    assert record["lost_s"] == pytest.approx(preemptions * 30.0)
    assert record["hours_left"] == pytest.approx(hours)
    assert record["cost_usd"] == pytest.approx(hours * 2.0)
    with session_scope(db_engine) as session:
        stored = session.get(Run, run_id)
        assert stored is not None and stored.state == RunState.RUNNING
        assert (stored.projection or {})["asked"] is False
    assert "it goes on" in out.getvalue() and "Continue" not in out.getvalue()


def _attempt(slack: Slack, run_id: str) -> Attempt:
    (attempt,) = all_detached(slack.cp.deps.engine, select(Attempt).where(Attempt.run_id == run_id))
    return attempt


def asked_run(
    engine: Engine,
    *,
    requester: str,
    channel: str,
    command: list[str],
    committed: int = 0,
    cost_usd: float = 1.0,
) -> str:
    """A run its projection stopped to ask Continue or Stop, ``committed`` steps in and
    projected at ``cost_usd``: the row the projection leaves, without a profiled attempt's
    minutes; its id."""
    now = datetime.now(timezone.utc)
    spec = JobSpec.model_validate({"name": "tiny", "command": command})
    with session_scope(engine) as session:
        run = Run(
            spec_name="tiny", spec=spec.model_dump(mode="json"), state=RunState.STOPPED,
            requester=requester, channel=channel, last_committed_step=committed,
            projection={"asked": True, "cost_usd": cost_usd}, created_at=now, updated_at=now,
        )  # fmt: skip
        session.add(run)
        session.flush()
        return run.id


def test_stop_keeps_a_profiled_run_stopped_and_answers_once(slack: Slack) -> None:
    deps = slack.cp.deps
    run_id = asked_run(
        deps.engine, requester=ADA, channel=CHANNEL, command=["python", "train.py"],
        committed=40, cost_usd=12.0,
    )  # fmt: skip
    _, path = slack.action("profile_stop", run_id, user=ADA)
    slack.wait_journal("profile_answered", run=run_id, timeout=15)
    with session_scope(deps.engine) as session:
        stored = session.get(Run, run_id)
        assert stored is not None and stored.state == RunState.STOPPED
        assert (stored.projection or {})["answer"]["choice"] == "stop"
    _, path = slack.action("profile_continue", run_id, user=ADA)
    assert "already chose stop" in slack.hooks.wait(path)["text"]
    assert _run_ids(slack) == [run_id]
    # A run that asked nothing has no question to answer.
    now = datetime.now(timezone.utc)
    spec = JobSpec.model_validate({"name": "tiny", "command": ["python", "train.py"]})
    with session_scope(deps.engine) as session:
        plain = Run(
            spec_name="tiny", spec=spec.model_dump(mode="json"), state=RunState.STOPPED,
            requester=ADA, channel=CHANNEL, created_at=now, updated_at=now,
        )  # fmt: skip
        session.add(plain)
        session.flush()
        plain_id = plain.id
    with pytest.raises(ConflictError, match="not waiting for Continue or Stop"):
        service.continue_profiled(deps, plain_id, Actor(user=ADA, channel=CHANNEL))


# ----------------------------------------------------------------------------- the figures


def _spec(**fields: Any) -> JobSpec:
    return JobSpec.model_validate({"name": "x", "command": ["python", "train.py"], **fields})


def test_the_window_is_an_epoch_unless_the_spec_says_otherwise() -> None:
    run = Run(spec_name="x", requester=ADA, target_steps=5000)
    assert epochs(["python", "t.py", "--epochs", "50"]) == 50
    assert epochs(["python", "t.py", "--epochs=8", "--epochs=5"]) == 5
    epoch = _spec(command=["python", "t.py", "--steps", "5000", "--epochs", "50"])
    assert window(epoch, run, start_step=200) == (300, None)  # one epoch: 100 steps
    assert window(_spec(), run, start_step=0) == (500, None)  # a tenth of the steps
    assert window(_spec(profile={"steps": 30, "minutes": 2}), run, start_step=10) == (40, 120.0)
    assert window(_spec(), Run(spec_name="x", requester=ADA), start_step=0) == (None, 600.0)
    assert window(_spec(profile={"enabled": False}), run, start_step=0) == (None, None)
    profiled = Run(spec_name="x", requester=ADA, target_steps=5000, projection={"asked": False})
    assert window(_spec(), profiled, start_step=0) == (None, None)


def test_the_reasons_to_ask() -> None:
    spec = _spec(max_hours=10)
    ok = {"cost_usd": 80.0, "budget_usd": 100.0, "hours_in_all": 9.0}
    assert projection_reasons(spec, **ok, gpu_util=90.0, data_wait=0.4) == []
    over = projection_reasons(spec, **{**ok, "cost_usd": 120.0}, gpu_util=None, data_wait=0.1)
    assert over == ["it would cost $120.00, past its budget of $100.00"]
    long = projection_reasons(spec, **{**ok, "hours_in_all": 12.5}, gpu_util=None, data_wait=None)
    assert long == ["it would run 12.5 h, past its max_hours of 10"]
    starved = projection_reasons(spec, **ok, gpu_util=20.0, data_wait=0.6)
    assert "input pipeline" in starved[0] and "20% busy" in starved[0]
    # Low utilisation with little data-wait is not the input's fault: no reason to ask.
    assert projection_reasons(spec, **ok, gpu_util=20.0, data_wait=0.05) == []
    assert "input pipeline" in projection_reasons(spec, **ok, gpu_util=None, data_wait=0.7)[0]


def test_the_projection_message_renders_its_buttons_only_when_it_asks() -> None:
    from bot import messages, views
    from jobs.outbound.notify import ProjectionMessage

    msg = ProjectionMessage(
        channel=CHANNEL, run_id="r-1", step=100, target_steps=5000, zone="us-east-1b",
        step_time_s=0.5, data_wait=0.1, gpu_util=88.0, hours_left=0.7, cost_usd=14.2,
        spent_usd=0.3, budget_usd=10.0, max_hours=None, finish_at=datetime(2026, 1, 2, 9, 14,
        tzinfo=timezone.utc), preemptions=0.4, lost_s=36.0, interval_s=180.0,
        price_per_hour=20.0, reasons=("it would cost $14.20, past its budget of $10.00",),
        suggested_budget_usd=16.0, stopped=True,
    )  # fmt: skip
    text = messages.render(msg)
    assert "0.70 h more to step 5000, $14.20 in all (budget $10.00)" in text
    assert "Fri 02 Jan 09:14 UTC" in text and "/train resubmit r-1 budget.usd=16" in text
    actions = [b for b in views.render(msg) if b["type"] == "actions"]
    values = [e["value"] for e in actions[0]["elements"]]
    assert values == ["r-1", "r-1|16", "r-1"]
    assert views.parse_continue_value("r-1|16") == ("r-1", 16.0)
    quiet = json.dumps(views.render(dataclasses.replace(msg, stopped=False)))
    assert "profile_continue" not in quiet
