"""``Deps.may_launch`` is asked when a launch happens on its own, not only when a person
asks: after preflight passes, when the price job finds a price met, when a preempted run
is resubmitted. The hook is the front end's (``bot.auth.Authorizer.may_start``); here it
is the launcher list itself, which the test changes as an admin would. The local
provider starts the real processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlmodel import select

from jobs.background import tasks
from jobs.database.db import session_scope
from jobs.database.models import Attempt, Run
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.process.deps import Deps
from jobs.process.settings import Settings
from jobs.providers.local import LocalProvider
from jobs.runs import resubmit_if_due
from jobs.runs.launch import LAUNCHER_REMOVED
from jobs.runs.start import preflight_then_launch
from jobs.spec import JobSpec
from tests.jobs.local_plane import local_deps
from tests.jobs.rows import all_detached, detached

CHANNEL = "C0TRAIN"


class LauncherList:
    """``Deps.may_launch`` as a front end answers it: who is on the list, and for whom it
    cannot be told now (Slack could not list a launcher group)."""

    def __init__(self, *names: str) -> None:
        self.names = set(names)
        self.unknown: set[str] = set()

    def __call__(self, requester: str) -> bool | None:
        return None if requester in self.unknown else requester in self.names


@pytest.fixture
def launchers() -> LauncherList:
    return LauncherList("ada", "eve")


@pytest.fixture
def deps(
    db_engine: Engine, settings: Settings, tmp_path: Path, launchers: LauncherList
) -> Iterator[Deps]:
    """The use-cases with background work run at once, and ``launchers`` as the list."""
    with local_deps(
        settings, db_engine, tmp_path, gpu_names=[], at_once=True, may_launch=launchers
    ) as made:
        yield made


def new_run(deps: Deps, *, requester: str, state: RunState, **spec: Any) -> str:
    full = JobSpec.model_validate(
        {
            "name": "tiny",
            "command": ["python", "-c", "import time; time.sleep(30)"],
            "dry_run": {"enabled": False},
            **spec,
        }
    )
    now = deps.clock()
    with session_scope(deps.engine) as session:
        run = Run(
            spec_name="tiny", spec=full.model_dump(mode="json"), state=state,
            requester=requester, channel=CHANNEL, last_committed_step=40,
            created_at=now, updated_at=now,
        )  # fmt: skip
        session.add(run)
        session.flush()
        return run.id


def attempts(deps: Deps, run_id: str) -> list[Attempt]:
    return all_detached(deps.engine, select(Attempt).where(Attempt.run_id == run_id))


def run_row(deps: Deps, run_id: str) -> Run:
    return detached(deps.engine, Run, run_id)


def live(deps: Deps) -> list[str]:
    return [i.instance_id for i in deps.provider.list_instances() if not i.state.is_terminal()]


def preempted_run(deps: Deps, *, requester: str, **spec: Any) -> tuple[str, str]:
    """A run in RECOVERING after its first attempt was preempted: (run id, attempt id)."""
    run_id = new_run(deps, requester=requester, state=RunState.RECOVERING, **spec)
    with session_scope(deps.engine) as session:
        prev = Attempt(
            run_id=run_id, number=1, provider="local", zone="local-a",
            state=AttemptState.PREEMPTED, started_at=deps.clock(), ended_at=deps.clock(),
        )  # fmt: skip
        session.add(prev)
        session.flush()
        return run_id, prev.id


def test_a_preflight_that_passes_after_the_removal_does_not_launch(
    deps: Deps, launchers: LauncherList
) -> None:
    eves = new_run(deps, requester="eve", state=RunState.PREFLIGHT)
    adas = new_run(deps, requester="ada", state=RunState.PREFLIGHT)
    launchers.names.discard("eve")  # an admin takes Eve off while her checks run

    for run_id in (eves, adas):
        preflight_then_launch(deps, run_id, checks=["quota", "capacity"])

    records: list[dict[str, Any]] = deps.records  # type: ignore[attr-defined]
    checked = {r["run"] for r in records if r["type"] == "preflight_check"}
    assert checked == {eves, adas}  # both passed their checks
    refused = LAUNCHER_REMOVED.format(user="eve")
    run = run_row(deps, eves)
    assert run.state == RunState.STOPPED and run.reason == refused
    assert attempts(deps, eves) == []
    # Ada, still on the list, launched: the one live instance is hers.
    (adas_attempt,) = attempts(deps, adas)
    assert live(deps) == [adas_attempt.instance_id]


def test_a_run_waiting_for_its_price_is_not_launched_for_a_removed_launcher(
    deps: Deps, launchers: LauncherList
) -> None:
    provider = deps.provider
    assert isinstance(provider, LocalProvider)
    provider.set_prices(spot_usd_per_hour=2.0)
    run_id, prev_id = preempted_run(deps, requester="eve", resubmit={"max_price": 1.5})
    assert resubmit_if_due(deps, prev_id) is False  # it waits for its price
    assert run_row(deps, run_id).price_wait is not None

    launchers.names.discard("eve")
    provider.set_prices(spot_usd_per_hour=1.0)  # the price is met, and nobody asks again

    assert tasks.price_job(deps) == []
    run = run_row(deps, run_id)
    assert run.state == RunState.STOPPED
    assert run.reason == LAUNCHER_REMOVED.format(user="eve")
    assert not run.price_wait
    assert [a.id for a in attempts(deps, run_id)] == [prev_id]
    assert live(deps) == []
    # The next price job has nothing left to launch for her.
    assert tasks.price_job(deps) == []


def test_a_preempted_run_of_a_removed_launcher_is_stopped_not_resubmitted(
    deps: Deps, launchers: LauncherList
) -> None:
    run_id, prev_id = preempted_run(deps, requester="eve")
    launchers.names.discard("eve")

    assert resubmit_if_due(deps, prev_id) is False
    run = run_row(deps, run_id)
    assert run.state == RunState.STOPPED and run.reason == LAUNCHER_REMOVED.format(user="eve")
    assert [a.id for a in attempts(deps, run_id)] == [prev_id] and live(deps) == []
    records: list[dict[str, Any]] = deps.records  # type: ignore[attr-defined]
    assert not [r for r in records if r["type"] == "resubmitted"]


def test_while_the_list_cannot_be_read_the_resubmit_waits_and_the_run_goes_on(
    deps: Deps, launchers: LauncherList
) -> None:
    """A Slack outage is no removal: the run is not stopped, its launch waits for the
    next try (reconcile's backstop), and goes ahead once the list answers."""
    run_id, prev_id = preempted_run(deps, requester="ada")
    launchers.unknown.add("ada")

    assert resubmit_if_due(deps, prev_id) is False
    assert run_row(deps, run_id).state == RunState.RECOVERING
    assert [a.id for a in attempts(deps, run_id)] == [prev_id]

    launchers.unknown.clear()
    assert resubmit_if_due(deps, prev_id) is True
    assert sorted(a.number for a in attempts(deps, run_id)) == [1, 2]
