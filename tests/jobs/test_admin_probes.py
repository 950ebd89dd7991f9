"""The admin listener as a platform uses it (issue 28, point 1): liveness is the
process, readiness the database, and ``/metrics`` says which release runs and what the
process costs (build info, resident memory, open fds, CPU seconds, start time)."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine

from jobs.database.db import make_engine, migrate
from jobs.ingest import IngestService
from jobs.web.prometheus import ControlPlaneMetrics
from jobs.web.server import ControlPlaneApp, ServerHandle, serve


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'admin.db'}")
    migrate(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def server(engine: Engine) -> Iterator[ServerHandle]:
    app = ControlPlaneApp(engine, IngestService(engine), metrics=ControlPlaneMetrics(engine))
    handle = serve(app, "127.0.0.1", 0)
    yield handle
    handle.shutdown()


def test_metrics_say_the_build_and_what_the_process_costs(server: ServerHandle) -> None:
    status, text = get(f"{server.admin_url}/metrics")
    assert status == 200
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    try:
        version = importlib.metadata.version("trainbot")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    build = frozenset({"version": version, "python": platform.python_version()}.items())
    assert samples[("trainbot_build_info", build)] == 1
    if not Path("/proc/self/stat").exists():
        pytest.skip("the process collector reads /proc (Linux only)")
    rss = samples[("process_resident_memory_bytes", frozenset())]
    assert 10e6 < rss < 10e9
    assert samples[("process_open_fds", frozenset())] >= 3
    assert samples[("process_cpu_seconds_total", frozenset())] > 0
    started = samples[("process_start_time_seconds", frozenset())]
    assert time.time() - 24 * 3600 < started <= time.time()
    assert any(name == "python_info" for name, _ in samples)


def test_liveness_stays_green_while_readiness_follows_the_database(
    server: ServerHandle, engine: Engine, tmp_path: Path
) -> None:
    assert get(f"{server.admin_url}/readyz")[0] == 200
    database = Path(str(engine.url.database))
    aside = tmp_path / "aside.db"
    engine.dispose()
    database.rename(aside)
    database.mkdir()  # where the file was, a directory: SQLite cannot open it
    try:
        ready, body = get(f"{server.admin_url}/readyz")
        live, live_body = get(f"{server.admin_url}/healthz")
        assert (ready, json.loads(body)["ready"]) == (503, False)
        assert (live, json.loads(live_body)) == (200, {"ok": True})
    finally:
        database.rmdir()
        aside.rename(database)
    engine.dispose()
    assert get(f"{server.admin_url}/readyz")[0] == 200
