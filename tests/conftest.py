"""Fixtures shared by every test package."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.moto_server import MotoServer

# db_engine and empty_engine (SQLite, and PostgreSQL where TRAINBOT_TEST_POSTGRES_URL is set).
pytest_plugins = ("tests.jobs.databases",)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """moto's server for the whole session; yields its endpoint URL.

    Fake credentials and a region are set (unless already set) so that boto3 never looks
    for real ones, and never asks an instance metadata service that is not there.
    """
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    server = MotoServer()
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No AWS credentials anywhere boto3 looks (moto's own clients carry theirs)."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A retry is for a test that says why it needs one: ``flaky`` (pytest-rerunfailures)
    without a ``reason`` is a collection error, so no test is retried blindly.

    The modules that hold a ``slow`` test run first (each module whole and in its order,
    so a module-scoped fixture is still set up once): under ``-n 2 --dist worksteal`` the
    suite then ends on short tests, instead of one worker idling while the other finishes
    a minute-long one it picked up last."""
    with_slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in with_slow)  # stable: order kept within
    unexplained = [
        item.nodeid
        for item in items
        for mark in item.iter_markers("flaky")
        if not str(mark.kwargs.get("reason", "")).strip()
    ]
    if unexplained:
        raise pytest.UsageError(
            "these tests are marked flaky with no reason; say why a retry is honest "
            "(flaky(reruns=1, reason=…)) or fix the test: " + ", ".join(unexplained)
        )
