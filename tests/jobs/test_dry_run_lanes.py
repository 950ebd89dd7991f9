"""Issue 23.3, 23.4 and 23.8: cloud dry runs hold no worker, end with a stop, and stay
inside what the admin allows and the run's budget.

A real control plane (database, service layer, HTTP server with the report route and
the credential broker) on AWS through moto's server, as in ``test_cloud_dry_run``. The
dry runs' instances are never played: they stay silent, as a slow boot would, with a
timeout of hours, so each preflight waits on its instance.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from bot import messages
from jobs import spend
from jobs.database.db import session_scope
from jobs.domain.lifecycle import RunState
from jobs.outbound.notify import CallbackJournal
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings
from jobs.usecases import service
from jobs.web.server import CREDENTIALS_PATH
from tests.fakes import aws as fake
from tests.jobs import test_aws_control_plane as on_aws
from tests.jobs.test_cloud_dry_run import (
    aws_env,
    aws_spec,
    dry_check,
    dry_rows,
    dry_run_instances,
    moto,
    state_of,
    wait_for,
)

__all__ = ["moto"]  # the module's moto fixture, shared with test_cloud_dry_run

ADA = service.Actor(user="ada", channel="#ml")
BOB = service.Actor(user="bob", channel="#cv")
CAROL = service.Actor(user="carol", channel="#nlp")
#: The dry run's instance never reports: its preflight waits the whole six hours.
SILENT = "python -c 'print(42)'"
#: How quickly a stop must end what it stops (the issue's figure).
STOP_WITHIN_S = 10.0


class Clock:
    """The control plane's clock (``Deps.clock``): real time from a fixed morning, plus
    what the test adds, so an hour of dry run costs an hour without waiting one."""

    def __init__(self) -> None:
        self.base = datetime(2026, 3, 10, 8, 0, tzinfo=timezone.utc)
        self.began = time.monotonic()
        self.extra = timedelta()

    def __call__(self) -> datetime:
        return self.base + timedelta(seconds=time.monotonic() - self.began) + self.extra


@contextmanager
def plane(
    tmp_path: Path, moto: dict[str, Any], **settings: str
) -> Iterator[tuple[ControlPlane, on_aws.Recorder]]:
    """The control plane on moto with two specs: ``gpu`` (a cloud dry run of up to 6 h)
    and ``quick`` (no dry run); ``settings``: more ``TRAINBOT_*`` variables."""
    url, bucket = moto["url"], moto["bucket"]
    env = aws_env(tmp_path, moto, aws_spec(bucket, url, command=SILENT, timeout="6h"))
    quick = aws_spec(bucket, url, command=SILENT).replace(
        "dry_run:\n", "dry_run:\n  enabled: false\n"
    )
    (tmp_path / "specs" / "quick.yaml").write_text(quick)
    env.update(settings)
    aws = on_aws.make_aws(moto, boto3.session.Session())
    quotas = Stubber(aws.client("service-quotas"))
    for _ in range(16):  # each preflight asks for both quotas, in either order
        quotas.add_response("get_service_quota", fake.quota(on_aws.G_SPOT, 64), None)
    quotas.activate()
    try:
        with ControlPlane(
            load_settings(env),
            notifier=(notes := on_aws.Recorder()),
            journal=CallbackJournal(lambda *_: None),
            provider=aws,
            scheduler=False,
        ) as cp:
            yield cp, notes
    finally:
        quotas.deactivate()


def state(cp: ControlPlane, run_id: str) -> RunState:
    return on_aws.run_row(cp, run_id).state


def credentials_status(cp: ControlPlane, token: str) -> int:
    """What ``POST /v1/credentials`` answers the token (the instance's store asks it)."""
    base = cp.deps.ingest_url.rsplit("/v1/", 1)[0]
    request = urllib.request.Request(
        base + CREDENTIALS_PATH,
        data=b"",
        method="POST",
        headers={"Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def start_dry_run(
    cp: ControlPlane, actor: service.Actor, url: str, *overrides: str
) -> tuple[str, str]:
    """``/train preflight gpu``: the run and its dry run's instance, once launched."""
    run_id = service.submit(
        cp.deps, spec_name="gpu", overrides=list(overrides), actor=actor, launch=False
    ).id
    [inst] = wait_for(lambda: dry_run_instances(url, run_id), what=f"{run_id}'s dry run")
    return run_id, str(inst["InstanceId"])


def gone(url: str, instance_id: str) -> bool:
    return state_of(url, instance_id) in ("shutting-down", "terminated")


def test_a_dry_run_type_outside_the_admin_list_or_over_the_ceiling_is_refused(
    tmp_path: Path, moto: dict[str, Any]
) -> None:
    url = moto["url"]
    listed = {"TRAINBOT_DRY_RUN_INSTANCE_TYPES": "g4dn.xlarge,p5.48xlarge"}
    with plane(tmp_path, moto, **listed) as (cp, notes):
        # Not on the admin's list: refused at preflight, naming what may be set.
        off_list = service.submit(
            cp.deps,
            spec_name="gpu",
            overrides=["dry_run.instance_type=p4d.24xlarge"],
            actor=ADA,
            launch=False,
        )
        wait_for(lambda: state(cp, off_list.id) != RunState.PREFLIGHT, what="its preflight")
        check = dry_check(notes, off_list.id)
        assert check.status == "fail"
        assert "dry_run.instance_type=p4d.24xlarge is not a dry-run type" in check.detail
        assert "TRAINBOT_DRY_RUN_INSTANCE_TYPES" in check.detail
        assert "set dry_run.instance_type to one of g4dn.xlarge, p5.48xlarge" in check.remedy
        assert state(cp, off_list.id) == RunState.PREFLIGHT_FAILED

        # On the list, but on demand at $98/h: over the price ceiling.
        costly = service.submit(
            cp.deps,
            spec_name="gpu",
            overrides=["dry_run.instance_type=p5.48xlarge", "resources.spot=false"],
            actor=ADA,
            launch=False,
        )
        wait_for(lambda: state(cp, costly.id) != RunState.PREFLIGHT, what="its preflight")
        check = dry_check(notes, costly.id)
        assert check.status == "fail"
        assert "p5.48xlarge costs" in check.detail and "on demand" in check.detail
        assert "TRAINBOT_DRY_RUN_MAX_USD_PER_HOUR" in check.detail
        assert "resources.spot=true" in check.remedy
        for run_id in (off_list.id, costly.id):
            assert not dry_run_instances(url, run_id), "nothing was launched"
            assert not dry_rows(cp, run_id)


def test_the_default_list_refuses_a_type_the_spec_picks(
    tmp_path: Path, moto: dict[str, Any]
) -> None:
    with plane(tmp_path, moto) as (cp, notes):
        run = service.submit(
            cp.deps,
            spec_name="gpu",
            overrides=["dry_run.instance_type=p5.48xlarge"],
            actor=ADA,
            launch=False,
        )
        wait_for(lambda: state(cp, run.id) != RunState.PREFLIGHT, what="its preflight")
        check = dry_check(notes, run.id)
        assert check.status == "fail" and "the aws defaults" in check.detail
        assert "g4dn.xlarge" in check.remedy and "dry_run.instance_type=cpu" in check.remedy
        assert not dry_run_instances(moto["url"], run.id)


def test_dry_run_spend_counts_against_the_run_and_shows_in_the_digest(
    tmp_path: Path, moto: dict[str, Any]
) -> None:
    url = moto["url"]
    clock = Clock()
    with plane(tmp_path, moto) as (cp, _):
        cp.deps.clock = clock  # the dependency every use-case takes its time from
        # On demand: the shipped table's price (moto's spot prices are fractions of a cent).
        run_id, instance_id = start_dry_run(cp, ADA, url, "resources.spot=false")
        clock.extra += timedelta(hours=2)  # two hours of the instance, paid
        service.stop(cp.deps, run_id, ADA)
        wait_for(lambda: dry_rows(cp, run_id)[0].cost_usd is not None, what="its price")
        [row] = dry_rows(cp, run_id)
        assert row.price_per_hour is not None and row.price_per_hour > 0
        assert row.cost_usd is not None
        assert row.cost_usd == pytest.approx(row.price_per_hour * 2, rel=0.01)
        with session_scope(cp.deps.engine) as session:
            assert spend.run_spent(session, run_id) == pytest.approx(row.cost_usd)
            figures = spend.digest_figures(
                session,
                channel="#ml",
                now=clock(),
                tz=timezone.utc,
                day=clock().date(),
            )
        [mine] = [r for r in figures["per_run"] if r["run_id"] == run_id]
        assert mine["usd"] == round(row.cost_usd, 2) == mine["dry_run_usd"]
        assert figures["dry_run_usd"] == round(row.cost_usd, 2)
        # The digest's line for the run says what of it was the dry run.
        assert f"(dry run ${row.cost_usd:,.2f})" in messages.digest_run_line(mine)
        assert figures["day_usd"] == pytest.approx(row.cost_usd, abs=0.01)
        assert gone(url, instance_id)


# -- the local provider: a stop ends the dry run's process too --------------------------------


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_a_stop_kills_a_local_dry_run_within_seconds(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    settings = load_settings({"TRAINBOT_STATE_DIR": str(state_dir), "TRAINBOT_INGEST_PORT": "0"})
    with ControlPlane(
        settings,
        notifier=on_aws.Recorder(),
        journal=CallbackJournal(lambda *_: None),
        scheduler=False,
    ) as cp:
        # A script that never reaches a step: its dry run waits out its whole timeout.
        run = service.submit(
            cp.deps, spec_name="tiny", overrides=["command=sleep 300"], actor=ADA, launch=False
        )

        def mine() -> list[int]:
            """Live processes whose environment names the run (the dry run's)."""
            marker = f"TRAINBOT_RUN_ID={run.id}".encode()
            found = []
            for entry in Path("/proc").iterdir():
                try:
                    if entry.name.isdigit() and marker in (entry / "environ").read_bytes():
                        found.append(int(entry.name))
                except OSError:
                    continue
            return found

        wait_for(mine, what="the dry run's process", timeout=60)
        service.stop(cp.deps, run.id, ADA)
        wait_for(lambda: not mine(), what="its end", timeout=STOP_WITHIN_S)
        assert state(cp, run.id) == RunState.STOPPED
