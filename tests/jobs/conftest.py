"""Shared fixtures for the control plane's tests.

The database fixtures (``db_engine``, ``empty_engine``) are in ``tests.jobs.databases``,
for every test package. ``database_url`` is an empty database's URL; ``settings`` are
the embedded defaults with the state under ``tmp_path``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from sqlalchemy import Engine

from jobs.process.deps import Deps
from jobs.process.settings import Settings, load_settings
from jobs.providers.aws import AwsProvider
from tests.fakes import aws as fake_aws
from tests.fakes.gce_api import FakeComputeApi
from tests.jobs.local_plane import local_deps


@pytest.fixture
def database_url(empty_engine: Engine) -> str:
    """A URL of an empty database (SQLite file, or a fresh PostgreSQL schema), for
    control planes that each open their own engine as replicas do."""
    return empty_engine.url.render_as_string(hide_password=False)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """The embedded defaults, with the state directory under the test's tmp_path."""
    return load_settings({"TRAINBOT_STATE_DIR": str(tmp_path / "state")})


@pytest.fixture
def deps(db_engine: Engine, settings: Settings, tmp_path: Path) -> Iterator[Deps]:
    """The use-cases' dependencies on the local provider (``local_deps``); a module whose
    tests need a clock of their own, or background work done at once, defines its own."""
    with local_deps(settings, db_engine, tmp_path) as made:
        yield made


# -- AWS on moto's server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto(moto_server: str) -> dict[str, Any]:
    """What the AWS tests need from moto's server: its URL, an AMI, the runner's instance
    profile, the zones' ids and a checkpoint bucket of the module's own (us-east-1)."""
    return {
        "url": moto_server,
        "image": fake_aws.image_id(moto_server),
        "profile": fake_aws.instance_profile(moto_server),
        "zone_ids": fake_aws.zone_ids(moto_server),
        "bucket": fake_aws.unique_bucket(moto_server, region="us-east-1", prefix="ckpt"),
    }


@pytest.fixture(scope="module")
def session() -> boto3.session.Session:
    """One boto3 session for the module: each service's API model is parsed once."""
    return boto3.session.Session()


@pytest.fixture
def make_aws(
    moto: dict[str, Any], stubbers: list[Stubber], session: boto3.session.Session
) -> Callable[..., AwsProvider]:
    """AwsProviders on moto, with the runner's instance profile and a registered AMI; a
    test's ``options`` replace any of these."""

    def build(**options: Any) -> AwsProvider:
        options.setdefault("session", session)
        options.setdefault("region", "us-east-1")
        options.setdefault("endpoint_url", moto["url"])
        options.setdefault("image_id", moto["image"])
        options.setdefault("instance_profile", "trainbot-runner")
        return AwsProvider(**options)

    return build


@pytest.fixture
def stubbers() -> Iterator[list[Stubber]]:
    """Stubbers attached during a test (``tests.fakes.aws.stub``); deactivated at its end."""
    made: list[Stubber] = []
    yield made
    for stubber in made:
        stubber.deactivate()


# -- GCP on the fake Compute API -----------------------------------------------------------


@pytest.fixture
def gce() -> Iterator[FakeComputeApi]:
    """The fake Compute Engine API (its default project, regions and zones)."""
    with FakeComputeApi() as api:
        yield api
