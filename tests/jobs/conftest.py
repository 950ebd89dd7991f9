"""Shared fixtures for the control plane's tests.

``db_engine`` is a migrated database, once on SQLite (a file in the test's temporary
directory) and once on PostgreSQL when ``TRAINBOT_TEST_POSTGRES_URL`` is set. Tests
that take it run against both, so nothing works on one database by accident. Each test
gets the database in the migrated state with no rows from another test, without paying
for a migration (``tests.jobs.databases``). ``empty_engine`` is a database before
migration (a fresh PostgreSQL schema, dropped afterwards). ``settings`` are the
embedded defaults with the state under ``tmp_path``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from sqlalchemy import Engine, text

from jobs.database.db import make_engine, migrate
from jobs.process.deps import Deps
from jobs.process.settings import Settings, load_settings
from jobs.providers.aws import AwsProvider
from tests.fakes import aws as fake_aws
from tests.fakes.gce_api import FakeComputeApi
from tests.jobs.databases import PostgresSchemas, SqliteTemplate, with_search_path
from tests.jobs.local_plane import local_deps

POSTGRES_URL_ENV = "TRAINBOT_TEST_POSTGRES_URL"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_kind(request: pytest.FixtureRequest) -> str:
    """Which database a test's ``db_engine`` or ``empty_engine`` is: each test runs on both."""
    return str(request.param)


@pytest.fixture
def empty_engine(database_kind: str, tmp_path: Path) -> Iterator[Engine]:
    """An engine on an empty database: SQLite, or a fresh PostgreSQL schema."""
    if database_kind == "sqlite":
        engine = make_engine(f"sqlite:///{tmp_path / 'trainbot.db'}")
        yield engine
        engine.dispose()
        return
    url = postgres_or_skip("to run the PostgreSQL variant")
    with fresh_schema(url, "trainbot_test") as schema_url:
        engine = make_engine(schema_url)
        try:
            yield engine
        finally:
            engine.dispose()


def postgres_or_skip(why: str) -> str:
    """The test PostgreSQL's URL, or the test skipped saying how to set it and ``why``."""
    url = os.environ.get(POSTGRES_URL_ENV)
    if not url:
        pytest.skip(
            f"{POSTGRES_URL_ENV} is not set: set it to a PostgreSQL URL such as "
            f"postgresql://postgres@127.0.0.1:5432/test {why}"
        )
    return url


@contextmanager
def fresh_schema(url: str, prefix: str) -> Iterator[str]:
    """A URL whose connections use a new PostgreSQL schema (``prefix`` and a random
    suffix) of the database at ``url``; the schema is dropped at the end."""
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = make_engine(url)
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield with_search_path(url, schema)
    finally:
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> SqliteTemplate:
    """The worker's migrated SQLite file, copied for each test."""
    return SqliteTemplate(tmp_path_factory.mktemp("migrated"))


@pytest.fixture(scope="session")
def postgres_schemas() -> Iterator[PostgresSchemas]:
    """The worker's migrated PostgreSQL schema, emptied between tests."""
    schemas = PostgresSchemas(postgres_or_skip("to run the PostgreSQL variant"))
    yield schemas
    schemas.close()


@pytest.fixture
def db_engine(
    database_kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Engine]:
    """An engine on a database migrated to the newest revision, with no rows."""
    if "empty_engine" in request.fixturenames:
        # The same database as the test's empty_engine, as a test that takes both expects.
        engine = request.getfixturevalue("empty_engine")
        migrate(engine)
        yield engine
        return
    if database_kind == "sqlite":
        path = tmp_path / "trainbot.db"
        request.getfixturevalue("sqlite_template").copy_to(path)
        engine = make_engine(f"sqlite:///{path}")
    else:
        engine = make_engine(request.getfixturevalue("postgres_schemas").acquire())
    try:
        yield engine
    finally:
        engine.dispose()


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
