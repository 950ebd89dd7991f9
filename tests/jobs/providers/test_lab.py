"""A fourth provider, "lab", defined in the tests alone (:mod:`tests.jobs.providers.lab`)
and added through the registry: it passes the provider contract, and a control plane
configured with it (``TRAINBOT_PROVIDERS=local,lab``) runs a ``cloud: lab`` spec on it to
the end. Nothing in ``jobs/`` names it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bot import messages
from jobs.domain.errors import SettingsError
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.outbound.notify import CallbackJournal, RunCard
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings
from jobs.providers import PROVIDERS, Registration, make_provider, register
from jobs.providers.base import ResourceRequest
from jobs.runs import reconcile
from jobs.usecases import service
from tests.jobs.providers.contract import ProviderContract
from tests.jobs.providers.lab import REGION, ZONES, LabProvider
from tests.jobs.test_aws_control_plane import (
    ADA,
    Recorder,
    attempt_launched,
    attempts_of,
    run_row,
    wait_until,
)

RUNNER_LIKE = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))\n"
    "time.sleep(120)\n"
)


@pytest.fixture
def registered() -> Iterator[None]:
    """The "lab" provider in the registry for the test's length, as a provider shipped elsewhere
    adds itself."""
    register(
        "lab",
        Registration(
            "tests.jobs.providers.lab", on_this_machine=True, settings_prefix="TRAINBOT_LAB_"
        ),
    )
    try:
        yield
    finally:
        PROVIDERS.pop("lab")


@pytest.fixture
def provider(registered: None) -> Iterator[LabProvider]:
    lab = make_provider("lab", cores=4)
    assert isinstance(lab, LabProvider)
    yield lab
    lab.terminate_all()


@pytest.fixture
def resource_request() -> ResourceRequest:
    return ResourceRequest(cloud="lab", region=REGION, zones=ZONES, cpus=1)


@pytest.fixture
def workload() -> list[str]:
    return [sys.executable, "-c", RUNNER_LIKE]


class TestLabProviderContract(ProviderContract):
    @pytest.fixture
    def unknown_instance_id(self) -> str:
        return "lab-0000000000"


def test_lab_is_no_provider_until_it_is_registered() -> None:
    with pytest.raises(SettingsError, match="expected one of 'local', 'aws' or 'gcp'"):
        load_settings({"TRAINBOT_PROVIDERS": "local,lab"})


def test_a_cloud_lab_spec_runs_on_the_lab_to_the_end(tmp_path: Path, registered: None) -> None:
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "bench.yaml").write_text(
        f"command: ['{sys.executable}', '-c', 'print(42)']\n"
        "resources:\n  cloud: lab\n  disk_gb: 1\n"  # no region: the lab's own
        "dry_run:\n  enabled: false\n"
    )
    settings = load_settings(
        {
            "TRAINBOT_STATE_DIR": str(tmp_path / "state"),
            "TRAINBOT_SPECS_DIR": str(specs),
            "TRAINBOT_PROVIDERS": "local,lab",  # built from the settings, by the registry
            "TRAINBOT_INGEST_PORT": "0",
        }
    )
    notes = Recorder()
    cp = ControlPlane(
        settings, notifier=notes, journal=CallbackJournal(lambda *_: None), scheduler=False
    )
    with cp:
        lab = cp.deps.providers["lab"]
        assert isinstance(lab, LabProvider)
        run = service.submit(cp.deps, spec_name="bench", overrides=[], actor=ADA)
        wait_until(lambda: run_row(cp, run.id).state != RunState.PREFLIGHT, what="preflight")
        assert run_row(cp, run.id).state == RunState.AWAITING_CONFIRMATION
        checks = {c.name: c for c in notes.preflight(run.id).checks}
        assert "lab cores" in checks["quota"].detail
        service.confirm(cp.deps, run.id, ADA)
        wait_until(lambda: attempt_launched(cp, run.id, 1), what="attempt 1")
        [attempt] = attempts_of(cp, run.id)
        assert (attempt.provider, attempt.region, attempt.zone) == ("lab", REGION, ZONES[0])
        assert attempt.instance_id is not None and attempt.instance_id.startswith("lab-")
        assert [i.instance_id for i in lab.list_instances()] == [attempt.instance_id]
        assert cp.deps.providers["local"].list_instances() == []
        # The runner reports over the ingest API; the run ends when the command does.
        wait_until(
            lambda: run_row(cp, run.id).state.is_terminal(), what="the run's end", timeout=60
        )
        assert run_row(cp, run.id).state == RunState.SUCCEEDED, run_row(cp, run.id).reason
        assert attempts_of(cp, run.id)[0].state == AttemptState.SUCCEEDED
        cards = [m for _, m in notes.updated if isinstance(m, RunCard) and m.run_id == run.id]
        assert f"in {REGION} on lab" in messages.run_card(cards[-1])
        assert reconcile(cp.deps)["orphans"] == 0
        lab.terminate_all()
