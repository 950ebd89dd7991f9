"""Stop deliberately, change something, go on: ``/train resubmit r-… key.path=value`` and
``--max-price``, over signed HTTP to the real Slack app (and the console for the checks).

A stopped run (Ada's) has checkpoints at steps 10 and 20 and ran with ``LR=0.001``.
``/train resubmit r-… env.LR=3e-4`` starts a new run whose runner, a real process under
the local provider, restores step 20 and sees the new LR; both threads say what changed
(old → new) and who changed it, and an env change runs no preflight check again. What a
launch may not set (reserved ``TRAINBOT_*`` env, another checkpoint location, another
channel) a resubmit may not set either. ``--max-price 1.20`` waits while the local
provider's price is $1.45/h, the card says so, and the price job launches the run once
the price drops.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlmodel import col, select

from bot.dispatch import handle_text
from jobs.background import tasks
from jobs.database.db import session_scope
from jobs.database.models import Attempt, Run
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.process.deps import Deps
from jobs.process.settings import Settings
from jobs.providers.local import LocalProvider
from jobs.runs import resubmit_if_due
from jobs.spec import JobSpec
from jobs.usecases.service import Actor
from tests.bot import test_slack_app
from tests.bot.test_slack_app import ADA, BOB, CHANNEL, Slack, wait_until
from tests.jobs import test_resubmit_from
from tests.jobs.local_plane import local_deps
from tests.jobs.rows import all_detached
from tests.jobs.test_resubmit_from import write_checkpoints

slack = test_slack_app.slack

#: test_resubmit_from's script (restore through the session API, write down the step),
#: writing down the LR the run sees instead of the restored counter.
SCRIPT = test_resubmit_from.SCRIPT.replace("import sys", "import os, sys").replace(
    'f.write(f"{step} {counter.step}")', "f.write(f\"{step} {os.environ.get('LR')}\")"
)
assert "os.environ.get('LR')" in SCRIPT


def stopped_run(deps: Deps, tmp_path: Path, *, requester: str = ADA, **spec: Any) -> str:
    """A stopped run with committed checkpoints at steps 10 and 20, run with LR=0.001."""
    script = tmp_path / "resume.py"
    script.write_text(SCRIPT)
    full = JobSpec.model_validate(
        {
            "name": "tiny",
            "command": ["python", str(script), str(tmp_path / "restored.txt")],
            "env": {"LR": "0.001"},
            "resources": {"cloud": "local", "spot": True, "disk_gb": 1},
            "dry_run": {"enabled": False},
            "resubmit": {"backoff_s": 0},
            **spec,
        }
    )
    root = deps.settings.checkpoint_uri
    now = deps.clock()
    with session_scope(deps.engine) as session:
        run = Run(
            spec_name="tiny", spec=full.model_dump(mode="json"), state=RunState.STOPPED,
            requester=requester, channel=CHANNEL, checkpoint_uri=root, last_step=21,
            last_committed_step=20, created_at=now, updated_at=now,
        )  # fmt: skip
        session.add(run)
        session.flush()
        run_id = run.id
    write_checkpoints(run_id, root, last=20)
    return run_id


def new_runs(deps: Deps, old: str) -> list[Run]:
    return all_detached(deps.engine, select(Run).where(Run.id != old).order_by(col(Run.created_at)))


def test_a_resubmit_with_a_new_env_resumes_the_checkpoint_with_the_change(
    slack: Slack, tmp_path: Path
) -> None:
    deps = slack.cp.deps
    old = stopped_run(deps, tmp_path)

    # What a launch may not set, a resubmit may not either; Bob may not change Ada's run.
    refused = {
        f"resubmit {old} env.TRAINBOT_CHECKPOINT_PREFIX=r-someoneelse": "reserved",
        f"resubmit {old} checkpoint.uri=/tmp/elsewhere": "checkpoints where they are",
        f"resubmit {old} notify.channel=C0RANDOM": "reporting where it was launched",
        f"resubmit {old} budget.hard_cap=false": "budget.usd= is the budget setting",
        f"resubmit {old} resources.disk_gb=-1": "resources.disk_gb",
    }
    for text, said in refused.items():
        _, path = slack.command(text, user=ADA)
        assert said in slack.hooks.wait(path)["text"], text
    _, path = slack.command(f"resubmit {old} env.LR=3e-4", user=BOB)
    assert "belongs to" in slack.hooks.wait(path)["text"]
    assert new_runs(deps, old) == []

    _, path = slack.command(f"resubmit {old} env.LR=3e-4", user=ADA)
    reply = slack.hooks.wait(path)["text"]
    (new,) = new_runs(deps, old)
    assert f"as {new.id}" in reply
    out = tmp_path / "restored.txt"
    wait_until(lambda: out.exists() and out.read_text() != "", 120, "the runner")
    step, lr = out.read_text().split()
    assert step == "20" and float(lr) == 3e-4
    assert new.spec["env"]["LR"] == lr and new.checkpoint_prefix == old
    record = slack.wait_journal("resubmit_changed", timeout=15)
    assert record["by"] == ADA and record["from_run"] == old and record["checks"] == []
    # An env value may be a credential: the journal and the threads say only that it changed.
    assert record["changes"] == [{"key": "env.LR", "change": "changed"}]
    # An env change needs no check again: none ran for the new run.
    assert not slack.journal("preflight_check", run=new.id)
    with session_scope(deps.engine) as session:
        attempt = session.exec(select(Attempt).where(Attempt.run_id == new.id)).one()
        assert attempt.resumed_from_step == 20
    said = f"{ADA} resubmitted {old} as {new.id}"
    thread = " ".join(m.text for m in slack.thread(new.id))
    assert said in thread and "env.LR changed" in thread
    # The old run (made here without a card) says it where its messages go.
    channel = " ".join(m.text for m in slack.fake.messages(CHANNEL))
    assert f"{said} with changes env.LR changed." in channel


def test_max_price_waits_until_the_price_drops_then_launches(slack: Slack, tmp_path: Path) -> None:
    deps = slack.cp.deps
    provider = deps.provider
    assert isinstance(provider, LocalProvider)
    provider.set_prices(spot_usd_per_hour=1.45)
    old = stopped_run(deps, tmp_path)

    _, path = slack.command(f"resubmit {old} --max-price 1.20", user=ADA)
    assert "$1.20 or less" in slack.hooks.wait(path)["text"]
    (new,) = new_runs(deps, old)
    slack.wait_journal("price_wait", run=new.id, timeout=15)
    waiting = "waiting for ≤ $1.20/h, now $1.45/h in local-a"
    wait_until(lambda: waiting in json.dumps(slack.root(new.id).blocks, ensure_ascii=False), 15)
    assert new.spec["resubmit"]["max_price"] == 1.2
    # The price job finds it still too dear: nothing launches.
    assert tasks.price_job(deps) == []
    with session_scope(deps.engine) as session:
        assert session.exec(select(Attempt).where(Attempt.run_id == new.id)).all() == []
        run = session.get(Run, new.id)
        assert run is not None and run.state == RunState.LAUNCHING

    provider.set_prices(spot_usd_per_hour=1.10)
    assert tasks.price_job(deps) == [new.id]
    out = tmp_path / "restored.txt"
    wait_until(lambda: out.exists() and out.read_text() != "", 120, "the runner")
    assert out.read_text().split()[0] == "20"
    with session_scope(deps.engine) as session:
        attempt = session.exec(select(Attempt).where(Attempt.run_id == new.id)).one()
        assert attempt.price_per_hour == 1.10
        run = session.get(Run, new.id)
        assert run is not None and not run.price_wait and run.reason is None
    assert slack.journal("price_met", run=new.id)
    assert "at or below $1.20/h" in " ".join(m.text for m in slack.thread(new.id))


# ----------------------------------------------------------------------------- the checks


@pytest.fixture
def deps(db_engine: Engine, settings: Settings, tmp_path: Path) -> Iterator[Deps]:
    """The control plane's use-cases through the console's dispatcher; background work
    runs at once (the checks), and the local provider has no GPU."""
    with local_deps(settings, db_engine, tmp_path, gpu_names=[], at_once=True) as made:
        yield made


def test_a_resources_change_runs_quota_capacity_and_locality_again(
    deps: Deps, tmp_path: Path
) -> None:
    old = stopped_run(deps, tmp_path, requester="ada")
    ada = Actor(user="ada", channel=CHANNEL)
    reply = handle_text(deps, f"/train resubmit {old} resources.accelerator=A100:8", ada)
    assert "resumes from" in reply.text, reply.text
    (new,) = new_runs(deps, old)
    records: list[dict[str, Any]] = deps.records  # type: ignore[attr-defined]
    checks = [r["check"] for r in records if r["type"] == "preflight_check" and r["run"] == new.id]
    assert checks == ["quota", "capacity", "data"]
    with session_scope(deps.engine) as session:
        run = session.get(Run, new.id)
        assert run is not None
        # This machine has no A100: the quota check fails, and nothing launches.
        assert run.state == RunState.PREFLIGHT_FAILED and "quota" in (run.reason or "")
        assert session.exec(select(Attempt).where(Attempt.run_id == new.id)).all() == []
    (changed,) = [r for r in records if r["type"] == "resubmit_changed"]
    assert changed["checks"] == ["quota", "capacity", "data"]
    assert changed["changes"] == [
        {"key": "resources.accelerator", "old": None, "new": {"type": "A100", "count": 8}}
    ]


def test_a_preempted_run_with_a_price_limit_waits_the_same_way(deps: Deps, tmp_path: Path) -> None:
    provider = deps.provider
    assert isinstance(provider, LocalProvider)
    provider.set_prices(spot_usd_per_hour=2.0)
    spec = JobSpec.model_validate(
        {"name": "tiny", "command": ["python", "-c", "pass"], "resubmit": {"max_price": 1.5}}
    )
    now = deps.clock()
    with session_scope(deps.engine) as session:
        run = Run(
            spec_name="tiny", spec=spec.model_dump(mode="json"), state=RunState.RECOVERING,
            requester="ada", channel=CHANNEL, last_committed_step=40, preemptions=1,
            created_at=now, updated_at=now,
        )  # fmt: skip
        session.add(run)
        session.flush()
        prev = Attempt(
            run_id=run.id, number=1, provider="local", zone="local-a", state=AttemptState.PREEMPTED,
            started_at=now, ended_at=now,
        )  # fmt: skip
        session.add(prev)
        session.flush()
        run_id, prev_id = run.id, prev.id
    assert resubmit_if_due(deps, prev_id) is False
    with session_scope(deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None and run.state == RunState.RECOVERING
        assert run.reason == "waiting for ≤ $1.50/h, now $2.00/h in local-a"
        assert run.price_wait is not None and run.price_wait["price"] == 2.0
        assert [a.id for a in session.exec(select(Attempt).where(Attempt.run_id == run_id))] == [
            prev_id
        ]
    provider.set_prices(spot_usd_per_hour=1.5)  # at the limit is enough
    try:
        assert tasks.price_job(deps) == [run_id]
        with session_scope(deps.engine) as session:
            second = session.exec(
                select(Attempt).where(Attempt.run_id == run_id, Attempt.number == 2)
            ).one()
            assert second.price_per_hour == 1.5 and second.resumed_from_step == 40
    finally:
        for instance in provider.list_instances():
            provider.terminate(instance.instance_id)
