"""Launches that happen later on their own ask the launcher list again, when they happen.

Signed HTTP into the real Slack app over the real control plane, on the local provider.
Eve starts runs while she is on ``TRAINBOT_LAUNCHERS``; an admin takes her off and the
control plane is redeployed on the same state directory (as in
``tests/bot/test_launcher_authz.py``). Her instance keeps running through the redeploy,
as a cloud's would. What would start compute for her later without anyone asking (the
resubmit after a preemption, a preflight resumed after the restart) stops her run
instead, says why in its thread, and leaves no instance.
"""

from __future__ import annotations

import time

from sqlmodel import col, select

from bot.auth import Authorizer, Policy
from jobs.database.db import session_scope
from jobs.database.models import Attempt, Run
from jobs.domain.lifecycle import RunState
from jobs.outbound.notify import CallbackJournal
from jobs.runs import reconcile
from jobs.runs.launch import LAUNCHER_REMOVED
from tests.bot import test_launcher_authz
from tests.bot.test_launcher_authz import ADA, BOB, EVE, EVERYONE, TRAIN, Deployment
from tests.bot.test_security import press, waiting_run
from tests.bot.test_slack_app import TOKEN, Slack, wait_until
from tests.jobs.rows import all_detached, detached

deployment = test_launcher_authz.deployment

WITHOUT_EVE = f"{ADA},{BOB},@ml-leads"
#: Long enough that the run is still training when it is preempted.
LONG = '"command=python -m runner.examples.tiny --steps 100000 --step-delay 0.05"'
REFUSED = LAUNCHER_REMOVED.format(user=EVE)


def redeploy_keeping_instances(deployment: Deployment, launchers: str) -> Slack:
    """The control plane restarted with another launcher list; unlike
    :meth:`Deployment.restart`, the instances it launched keep running."""
    old = deployment.slack
    assert old is not None
    deployment.slack = None
    old.front.close()
    old.cp.close()
    old.notifier.close(timeout=5)
    return deployment.start(launchers)


def attempts_of(slack: Slack, run_id: str) -> list[Attempt]:
    return all_detached(slack.cp.deps.engine, select(Attempt).where(Attempt.run_id == run_id))


def run_row(slack: Slack, run_id: str) -> Run:
    return detached(slack.cp.deps.engine, Run, run_id)


def said(slack: Slack) -> str:
    """What the channel shows: a run's thread, or its top level for a run whose root was
    posted before the restart (without an outbox the handle's ts dies with the process)."""
    slack.notifier.flush(10)
    return " ".join(m.text for m in slack.fake.messages(TRAIN))


def live_instances(slack: Slack) -> list[str]:
    return [
        i.instance_id for i in slack.cp.deps.provider.list_instances() if not i.state.is_terminal()
    ]


def test_a_removed_launchers_preempted_run_is_not_resubmitted(deployment: Deployment) -> None:
    slack = deployment.start(launchers=EVERYONE)
    run_id = waiting_run(slack, LONG, user=EVE, channel=TRAIN)
    press(slack, "launch_anyway", run_id, user=EVE, channel=TRAIN)
    wait_until(lambda: slack.state(run_id) == RunState.RUNNING, 120, "Eve's runner")
    (first,) = attempts_of(slack, run_id)
    assert first.instance_id is not None

    slack = redeploy_keeping_instances(deployment, WITHOUT_EVE)
    assert live_instances(slack) == [first.instance_id]
    slack.cp.deps.provider.preempt(first.instance_id)  # the cloud takes it back
    deadline = time.monotonic() + 90
    while slack.state(run_id) != RunState.STOPPED:  # the scheduler is off: reconcile by hand
        assert time.monotonic() < deadline, f"{run_id} is still {slack.state(run_id)}"
        reconcile(slack.cp.deps)
        time.sleep(0.5)

    run = run_row(slack, run_id)
    assert run.reason == REFUSED
    assert [a.id for a in attempts_of(slack, run_id)] == [first.id]
    assert not slack.journal("resubmitted", run=run_id)
    assert slack.journal("run_finished", run=run_id, state="STOPPED", reason=REFUSED)
    assert REFUSED in said(slack)
    # The preempted instance ends within its window, and nothing replaced it.
    wait_until(lambda: live_instances(slack) == [], 30, "no live instance")


def test_a_removed_launchers_preflight_resumed_after_a_restart_does_not_launch(
    deployment: Deployment,
) -> None:
    slack = deployment.start(launchers=EVERYONE)
    eves = waiting_run(slack, user=EVE, channel=TRAIN)
    adas = waiting_run(slack, user=ADA, channel=TRAIN)
    # As a crash during their preflight checks leaves them (the card already posted).
    with session_scope(slack.cp.deps.engine) as session:
        for run in session.exec(select(Run).where(col(Run.id).in_([eves, adas]))).all():
            run.state, run.preflight, run.reason = RunState.PREFLIGHT, None, None
            session.add(run)

    slack = deployment.restart(launchers=WITHOUT_EVE)  # resumes the preflights it finds

    assert slack.state(eves) == RunState.STOPPED
    assert run_row(slack, eves).reason == REFUSED
    assert not slack.journal("preflight_resumed", run=eves)
    assert REFUSED in said(slack)
    # Ada, still a launcher, has her checks run again (the spec warns: she is asked).
    wait_until(lambda: slack.state(adas) == RunState.AWAITING_CONFIRMATION, 60, "Ada's checks")
    assert slack.journal("preflight_resumed", run=adas)
    assert attempts_of(slack, eves) == [] and live_instances(slack) == []


def test_the_front_ends_answer_is_fresh_and_unsure_while_slack_cannot_say(
    deployment: Deployment,
) -> None:
    """``Authorizer.may_start``, the hook the Slack app sets: a launcher group's members at
    most 15 s old, and no answer (None, not "no") while Slack cannot list the groups, so
    an outage holds a launch back instead of stopping the run."""
    fake = deployment.fake
    fake.add_usergroup("S0TRAIN", "trainers", [EVE])
    now = [0.0]
    auth = Authorizer(
        Policy(launchers=frozenset({"@trainers", ADA})),
        client=fake.client(TOKEN),
        journal=CallbackJournal(lambda *_: None),
        clock=lambda: now[0],
    )
    assert auth.may_start(EVE) is True and auth.may_start(ADA) is True
    fake.add_usergroup("S0TRAIN", "trainers", [BOB])  # an admin takes Eve out
    now[0] = 16.0
    assert auth.may_start(EVE) is False
    now[0] = 32.0
    fake.fail_next(method="usergroups.list", error="fatal_error")
    assert auth.may_start(EVE) is None
    assert auth.may_start(ADA) is True  # named on the list itself: no listing needed
    assert auth.may_start(BOB) is True  # the listing answers again
    only_ids = Authorizer(
        Policy(launchers=frozenset({ADA})),
        client=fake.client(TOKEN),
        journal=CallbackJournal(lambda *_: None),
    )
    assert only_ids.may_start(EVE) is False
