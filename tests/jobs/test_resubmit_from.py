"""Resubmit from step N, after trainbot stopped a diverging run: the alert's button and
``/train resubmit r-… from=N``, over signed HTTP to the real Slack app.

A stopped run has checkpoints at steps 10, 20 and 30, and its divergence began at step 25.
The stop's alert offers "Resubmit from step 20"; pressing it (or the command) starts a new
run whose runner, a real process under the local provider, restores step 20, not 30,
from a copy of step 20 in its own directory. The diverged run's steps stay where they
were. Only the owner or an admin may; a step with no checkpoint at or before it is refused.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlmodel import col, select

from bot import views
from jobs import alerts
from jobs.background import tasks
from jobs.database.db import session_scope
from jobs.database.models import Attempt, Checkpoint, Run
from jobs.domain.lifecycle import RunState
from jobs.outbound.notify import AlertMessage
from jobs.rules import Severity, Signal
from jobs.runs import alert_target, spec_of
from jobs.runs.launch import runner_env
from jobs.spec import JobSpec
from runner.layout import list_committed
from runner.session import EverySteps, Session, SessionConfig
from runner.store import run_store
from tests.bot import test_slack_app
from tests.bot.test_slack_app import ADA, BOB, CAROL, CHANNEL, Slack, wait_until
from tests.runner.stand_ins import Counter

#: The control plane with the Slack app over real HTTP, as the Slack app's tests have it.
slack = test_slack_app.slack

#: The script the new run runs: restore through the session API, write down the step.
SCRIPT = """
import sys
from runner.session import Session

class Counter:
    def __init__(self):
        self.step = -1
    def state_dict(self):
        import torch
        return {"step": self.step, "w": torch.full((4,), float(self.step))}
    def load_state_dict(self, state):
        self.step = int(state["step"])

with Session.from_env() as s:
    counter = Counter()
    s.track(counter=counter)
    step = s.restore()
    with open(sys.argv[1], "w") as f:
        f.write(f"{step} {counter.step}")
    for _ in s.steps(step):
        pass
"""


def write_checkpoints(run_id: str, root: str, *, last: int) -> None:
    """Commit the run's checkpoints every 10 steps up to ``last``, as its runner would."""
    config = SessionConfig(run_id=run_id, checkpoint_uri=root)
    with Session(config, install_signals=False, decision=EverySteps(10), prefetch=False) as s:
        counter = Counter()
        s.track(counter=counter)
        for step in s.steps(last):
            counter.step = step + 1


def _diverged_run(slack: Slack, tmp_path: Path) -> tuple[str, str, str]:
    """A stopped run (Ada's) with checkpoints 10, 20, 30, whose divergence began at step 25,
    and its stop alert offering step 20. Returns (run id, checkpoint root, alert id)."""
    deps = slack.cp.deps
    root = deps.settings.checkpoint_uri
    script = tmp_path / "resume.py"
    script.write_text(SCRIPT)
    spec = JobSpec.model_validate(
        {
            "name": "diverge",
            "command": ["python", str(script), str(tmp_path / "restored.txt")],
            "resources": {"cloud": "local", "spot": True, "disk_gb": 1},
            "dry_run": {"enabled": False},
            "resubmit": {"backoff_s": 0},
        }
    )
    now = deps.clock()
    with session_scope(deps.engine) as session:
        run = Run(
            spec_name="diverge",
            spec=spec.model_dump(mode="json"),
            state=RunState.STOPPED,
            requester=ADA,
            channel=CHANNEL,
            checkpoint_uri=root,
            last_step=31,
            last_committed_step=30,
            created_at=now,
            updated_at=now,
        )
        session.add(run)
        session.flush()
        run_id = run.id
    write_checkpoints(run_id, root, last=30)
    signal = Signal(
        rule="loss_spike", key="loss", severity=Severity.CRITICAL, title="Loss spiked",
        detail="loss 1.4e6 at step 31", hint="Acknowledge, or trainbot stops the run",
    )  # fmt: skip
    with session_scope(deps.engine) as session:
        for step in (10, 20, 30):
            session.add(
                Checkpoint(run_id=run_id, step=step, uri=f"{root}/{run_id}", committed_at=now)
            )
        run = session.get(Run, run_id)
        assert run is not None
        (alert,) = alerts.process_signals(
            session, run=run, signals=[signal], now=now, target=alert_target(run),
            notifier=deps.notifier, journal=deps.journal,
        )  # fmt: skip
        alert.began_step = 25
        resume = tasks._resume_step(session, run_id, alert.began_step)
        assert resume == 20
        alerts.mark_stopped(
            session, alert, now=now, resume_step=resume, notifier=deps.notifier,
            hint=f"trainbot stopped the run after a flush. Resubmit from step {resume}.",
        )  # fmt: skip
        alert_id = alert.id
    return run_id, root, alert_id


def _restored(slack: Slack, new: str, out: Path) -> None:
    """The new run's runner restored step 20 from its own copy; the old steps are kept."""
    deps = slack.cp.deps
    wait_until(lambda: out.exists() and out.read_text().strip() != "", 120, "the runner")
    assert out.read_text() == "20 20"
    with session_scope(deps.engine) as session:
        run = session.get(Run, new)
        assert run is not None and run.checkpoint_prefix is None
        attempt = session.exec(select(Attempt).where(Attempt.run_id == new)).one()
        assert attempt.resumed_from_step == 20
        env = runner_env(deps, run, attempt, spec_of(run))
    assert env["TRAINBOT_RESUME_MAX_STEP"] == "20"
    assert env["TRAINBOT_CHECKPOINT_PREFIX"] == new


def _steps(root: str, prefix: str) -> list[int]:
    return [e.step for e in list_committed(run_store(root, prefix))]


def _new_runs(slack: Slack, old: str) -> list[str]:
    with session_scope(slack.cp.deps.engine) as session:
        rows = session.exec(select(Run).where(Run.id != old).order_by(col(Run.created_at)))
        return [r.id for r in rows]


def test_the_stop_alert_button_resubmits_from_the_step_before_the_divergence(
    slack: Slack, tmp_path: Path
) -> None:
    old, root, alert_id = _diverged_run(slack, tmp_path)
    slack.notifier.flush(10)
    message = next(m for m in slack.fake.messages(CHANNEL) if alert_id in json.dumps(m.blocks))
    buttons = [
        e
        for b in message.blocks
        if b.get("type") == "actions"
        for e in b["elements"]
        if e.get("action_id") == "run_resubmit_from"
    ]
    assert [(b["text"]["text"], b["value"]) for b in buttons] == [
        ("Resubmit from step 20", f"{old}|20")
    ]

    # Bob neither owns the run nor is an admin: refused, privately, and nothing starts.
    _, path = slack.action("run_resubmit_from", f"{old}|20", user=BOB)
    assert "belongs to" in slack.hooks.wait(path)["text"]
    assert _new_runs(slack, old) == []

    # Ada owns it.
    _, path = slack.action("run_resubmit_from", f"{old}|20", user=ADA, message_ts=message.ts)
    reply = slack.hooks.wait(path)["text"]
    (new,) = _new_runs(slack, old)
    assert f"as {new}" in reply and "step 20" in reply
    record = slack.wait_journal("resubmitted_from", timeout=15)
    assert record["run"] == new and record["from_run"] == old
    assert record["from_step"] == 20 and record["later_steps_kept"] == [30]
    _restored(slack, new, tmp_path / "restored.txt")
    # Its own directory starts at the copy of step 20; the diverged run's are all kept.
    assert _steps(root, new)[0] == 20 and 30 not in _steps(root, new)
    assert _steps(root, old) == [10, 20, 30]
    thread = " ".join(m.text for m in slack.thread(new))
    assert f"resubmitted {old} from step 20" in thread and "steps 30" in thread


def test_the_command_resubmits_from_a_step_and_refuses_what_it_cannot(
    slack: Slack, tmp_path: Path
) -> None:
    old, root, _ = _diverged_run(slack, tmp_path)

    # No checkpoint at or before step 5; step 40 is past the last one; Bob may not.
    _, path = slack.command(f"resubmit {old} from=5", user=ADA)
    assert "no committed checkpoint at or before step 5" in slack.hooks.wait(path)["text"]
    _, path = slack.command(f"resubmit {old} from=40", user=ADA)
    assert "past" in slack.hooks.wait(path)["text"]
    _, path = slack.command(f"resubmit {old} from=25", user=BOB)
    assert old in slack.hooks.wait(path)["text"]
    response, _ = slack.command(f"resubmit {old} from=ten", user=ADA)
    assert "not a step number" in response.text  # a parse error comes back at once
    assert _new_runs(slack, old) == []

    # Carol is an admin: from=25 resumes from step 20, the newest at or before it.
    _, path = slack.command(f"resubmit {old} from=25", user=CAROL)
    reply = slack.hooks.wait(path)["text"]
    (new,) = _new_runs(slack, old)
    assert f"as {new}" in reply and "step 20" in reply
    record = slack.wait_journal("resubmitted_from", timeout=15)
    assert record["asked_step"] == 25 and record["from_step"] == 20 and record["by"] == CAROL
    _restored(slack, new, tmp_path / "restored.txt")
    assert _steps(root, old) == [10, 20, 30]


def _actions(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for b in blocks if b.get("type") == "actions" for e in b["elements"]]


def test_an_alert_without_the_offer_has_no_resubmit_from_button() -> None:
    when = datetime(2024, 1, 1, tzinfo=timezone.utc)
    msg = AlertMessage(
        channel=CHANNEL, thread_ts=None, alert_id="al-1", run_id="r-1", rule="loss_spike",
        severity="critical", state="OPEN", title="Loss spiked", detail="", hint="",
    )  # fmt: skip
    ids = {e.get("action_id") for e in _actions(views.alert(msg))}
    assert "run_resubmit_from" not in ids and "run_resubmit" in ids
    acked = AlertMessage(
        channel=CHANNEL, thread_ts=None, alert_id="al-1", run_id="r-1", rule="loss_spike",
        severity="critical", state="ACKED", title="Loss spiked", detail="", hint="",
        acked_by=ADA, acked_at=when, resume_step=20,
    )  # fmt: skip
    values = [e["value"] for e in _actions(views.alert(acked))]
    assert values == ["r-1|20"]  # the offer stands while the alert is open, acknowledged too
