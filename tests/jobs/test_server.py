"""The control plane's HTTP server, over real sockets, with the real runner Reporter.

The end-to-end tests run on SQLite and PostgreSQL (``db_engine``); the HTTP-robustness
tests need no second database and use SQLite only.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, func, select
from sqlmodel import Session

from jobs.database.db import make_engine, migrate
from jobs.database.models import Attempt, Checkpoint, EventRow, MetricBlock, Run, hash_token
from jobs.domain.lifecycle import AttemptState
from jobs.ingest import IngestService
from jobs.rules import Signal
from jobs.web.server import (
    CHANNEL_TIMEOUT_S,
    CONNECTION_LIMIT,
    DRAIN_FACTOR,
    EVENTS_PATH,
    MAX_CONNECTIONS_PER_CLIENT,
    ControlPlaneApp,
    ServerHandle,
    serve,
)
from runner.telemetry import Reporter
from runner.wire import Event as WireEvent
from runner.wire import encode_batch

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

TOKEN = "tok-a1"
FLUSH_S = 10.0


class Recorder:
    """The service layer's side: records the callbacks; can hold a request in one."""

    def __init__(self) -> None:
        self.signals: list[tuple[str, list[Signal]]] = []
        self.attempt_events: list[tuple[str, str]] = []
        #: When set, on_attempt_event signals ``entered`` and waits for ``release``.
        self.hold = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def on_signals(self, run_id: str, signals: list[Signal], now: datetime) -> None:
        self.signals.append((run_id, signals))

    def on_attempt_event(self, attempt_id: str, type_: str, data: dict[str, Any]) -> None:
        self.attempt_events.append((attempt_id, type_))
        if self.hold:
            self.entered.set()
            self.release.wait(FLUSH_S)


class Plane:
    """A served control plane and what it recorded."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.recorder = Recorder()
        self.ingest = IngestService(
            engine,
            on_signals=self.recorder.on_signals,
            on_attempt_event=self.recorder.on_attempt_event,
            max_body_bytes=1 << 20,
        )
        self.app = ControlPlaneApp(engine, self.ingest)
        self.server: ServerHandle = serve(self.app, "127.0.0.1", 0)
        self.events_url = self.server.url + EVENTS_PATH
        assert self.server.admin_url is not None
        #: The admin port's URL (health, readiness, metrics).
        self.admin_url: str = self.server.admin_url

    def close(self) -> None:
        self.server.shutdown()


def add_attempt(
    engine: Engine,
    *,
    attempt_id: str = "a-1",
    token: str | None = TOKEN,
    number: int = 1,
) -> None:
    with Session(engine) as session:
        if session.get(Run, "r-1") is None:
            session.add(Run(id="r-1", spec_name="tiny", requester="U1"))
            session.flush()
        session.add(
            Attempt(
                id=attempt_id,
                run_id="r-1",
                number=number,
                state=AttemptState.PROVISIONING,
                provider="local",
                token_hash=hash_token(token) if token else None,
            )
        )
        session.commit()


def count_events(engine: Engine) -> int:
    """Stored events: rows of ``events`` and the points of the metrics blocks."""
    with engine.connect() as connection:
        rows = connection.execute(select(func.count()).select_from(EventRow)).scalar_one()
        points = connection.execute(select(func.sum(MetricBlock.count))).scalar_one()
        return int(rows) + int(points or 0)


def post(url: str, body: bytes, token: str | None = TOKEN) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        assert exc.headers["Content-Type"] == "application/json"
        return exc.code, json.loads(exc.read())


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def raw_exchange(port: int, data: bytes, *, read: bool = True) -> bytes:
    """Send raw bytes on a fresh connection; the whole answer, until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(data)
        if not read:
            return b""
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def scrape(base_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of ``/metrics``, parsed by prometheus_client's own parser."""
    status, content_type, text = get(base_url + "/metrics")
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(
    found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return found[(name, frozenset(labels.items()))]


def metrics(step: int, loss: float = 1.0) -> dict[str, Any]:
    return {
        "step": step,
        "loss": loss,
        "step_time_s": 0.1,
        "data_wait_fraction": 0.1,
        "metrics": {},
    }


def wire_body(attempt: str = "a-1", run: str = "r-1", first_seq: int = 0, n: int = 3) -> bytes:
    return encode_batch(
        [WireEvent(attempt, first_seq + i, "metrics", 1.7e9 + i, run, metrics(i)) for i in range(n)]
    )


@pytest.fixture
def plane(db_engine: Engine) -> Iterator[Plane]:
    add_attempt(db_engine)
    served = Plane(db_engine)
    yield served
    served.close()


@pytest.fixture
def sqlite_plane(tmp_path: Path) -> Iterator[Plane]:
    engine = make_engine(f"sqlite:///{tmp_path / 'plane.db'}")
    migrate(engine)
    add_attempt(engine)
    served = Plane(engine)
    yield served
    served.close()
    engine.dispose()


# --- end to end with the runner's Reporter ------------------------------------------------


def test_the_reporter_delivers_and_the_events_take_effect(plane: Plane, tmp_path: Path) -> None:
    with Reporter(
        plane.events_url, TOKEN, attempt="a-1", run="r-1", spool_dir=tmp_path / "spool"
    ) as reporter:
        reporter.emit("started", {"pid": 42, "host": "worker-1"})
        for step in range(1, 31):
            reporter.emit("metrics", metrics(step))
        reporter.emit(
            "checkpoint_committed",
            {"step": 30, "bytes": 4096, "write_s": 0.5, "uri": "file:///ckpt/r-1/step-30"},
        )
        assert reporter.flush(FLUSH_S)

    assert count_events(plane.engine) == 32
    with Session(plane.engine) as session:
        attempt = session.get(Attempt, "a-1")
        run = session.get(Run, "r-1")
        checkpoints = session.exec(select(Checkpoint)).scalars().all()  # type: ignore[call-overload]
    assert attempt is not None and run is not None
    assert attempt.state == AttemptState.RUNNING
    assert attempt.last_heartbeat is not None
    assert (attempt.last_step, attempt.last_seq) == (30, 31)
    assert (run.last_step, run.last_committed_step) == (30, 30)
    assert [(c.step, c.uri) for c in checkpoints] == [(30, "file:///ckpt/r-1/step-30")]
    assert ("a-1", "started") in plane.recorder.attempt_events
    assert ("a-1", "checkpoint_committed") in plane.recorder.attempt_events


def test_a_restarted_reporter_resends_and_nothing_doubles(plane: Plane, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    first = Reporter(
        plane.events_url, TOKEN, attempt="a-1", run="r-1", spool_dir=spool, flush_interval_s=0.05
    )
    for step in range(20):
        first.emit("metrics", metrics(step))
    assert first.flush(FLUSH_S)
    # The next batch is stored, but the runner dies before it hears the answer.
    plane.recorder.hold = True
    first.emit("started", {"pid": 1, "host": "h"})
    for step in range(20, 25):
        first.emit("metrics", metrics(step))
    assert plane.recorder.entered.wait(FLUSH_S)
    first.close(timeout=0.1)
    plane.recorder.hold = False
    plane.recorder.release.set()
    assert count_events(plane.engine) == 26

    with Reporter(plane.events_url, TOKEN, attempt="a-1", run="r-1", spool_dir=spool) as second:
        assert second.pending == 6  # never acknowledged, so sent again
        second.emit("metrics", metrics(25))
        assert second.flush(FLUSH_S)

    assert count_events(plane.engine) == 27
    exposition = scrape(plane.admin_url)
    assert sample(exposition, "trainbot_ingest_events_total", result="duplicate") == 6
    assert sample(exposition, "trainbot_ingest_events_total", result="accepted") == 27
    assert plane.recorder.attempt_events.count(("a-1", "started")) == 1


def test_a_nan_loss_is_an_alert_before_the_post_returns(plane: Plane, tmp_path: Path) -> None:
    with Reporter(
        plane.events_url, TOKEN, attempt="a-1", run="r-1", spool_dir=tmp_path / "spool"
    ) as reporter:
        reporter.emit("metrics", metrics(1, 2.5))
        reporter.emit("metrics", metrics(2, math.nan))
        assert reporter.flush(FLUSH_S)
        # flush returns once the 200 is in, and the server answers after on_signals.
        fired = [
            s
            for _, batch in plane.recorder.signals
            for s in batch
            if s.rule == "divergent_loss" and s.key == "nan" and not s.resolved
        ]

    assert fired and fired[0].data["step"] == 2


def test_a_revoked_token_stops_the_reporter(plane: Plane, tmp_path: Path) -> None:
    with Session(plane.engine) as session:
        attempt = session.get(Attempt, "a-1")
        assert attempt is not None
        attempt.token_hash = None
        session.add(attempt)
        session.commit()
    reporter = Reporter(
        plane.events_url, TOKEN, attempt="a-1", run="r-1", spool_dir=tmp_path / "spool"
    )
    try:
        reporter.emit("metrics", metrics(1))
        assert not reporter.flush(FLUSH_S)
        assert reporter.revoked
    finally:
        reporter.close(timeout=2)
    assert count_events(plane.engine) == 0


# --- token scoping and malformed bodies over HTTP ----------------------------------------


def test_tokens_are_checked_over_http(plane: Plane) -> None:
    add_attempt(plane.engine, attempt_id="a-2", token="tok-a2", number=2)

    assert post(plane.events_url, wire_body(), token=None)[0] == 401
    assert post(plane.events_url, wire_body(), token="made-up")[0] == 401
    status, answer = post(plane.events_url, wire_body(attempt="a-2"), token=TOKEN)
    assert status == 403 and "scoped to its attempt" in answer["error"]
    assert post(plane.events_url, wire_body(attempt="a-2"), token="tok-a2") == (
        200,
        {"accepted": 3, "duplicates": 0},
    )


def test_a_malformed_batch_gets_400_and_the_server_keeps_serving(sqlite_plane: Plane) -> None:
    status, answer = post(sqlite_plane.events_url, b'{"v": 1, "attempt": "a-1"')
    assert status == 400 and "not valid JSON" in answer["error"]

    assert post(sqlite_plane.events_url, wire_body()) == (200, {"accepted": 3, "duplicates": 0})
    assert get(sqlite_plane.admin_url + "/healthz")[0] == 200


# --- HTTP robustness -----------------------------------------------------------------------


def test_unknown_paths_and_wrong_methods(sqlite_plane: Plane) -> None:
    url = sqlite_plane.server.url
    status, content_type, text = get(url + "/nope")
    assert (status, content_type) == (404, "application/json")
    assert "/nope" in json.loads(text)["error"]

    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(url + EVENTS_PATH, timeout=10)
    assert caught.value.code == 405
    assert caught.value.headers["Allow"] == "POST"
    assert "POST" in json.loads(caught.value.read())["error"]


def test_a_huge_content_length_is_refused_without_reading(sqlite_plane: Plane) -> None:
    head = (
        f"POST {EVENTS_PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100000000000\r\n\r\n"
    ).encode()

    answer = raw_exchange(sqlite_plane.server.port, head + b'{"v": 1')

    assert answer.startswith(b"HTTP/1.0 413") or answer.startswith(b"HTTP/1.1 413")
    assert b"limit" in answer
    assert count_events(sqlite_plane.engine) == 0


def test_a_body_over_the_limit_is_answered_413_not_reset(sqlite_plane: Plane) -> None:
    big = b"x" * (2 << 20)  # twice the plane's 1 MiB limit, really sent

    status, answer = post(sqlite_plane.events_url, big)

    assert status == 413 and "limit" in answer["error"]


def test_a_missing_content_length_gets_411(sqlite_plane: Plane) -> None:
    head = (
        f"POST {EVENTS_PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()

    answer = raw_exchange(sqlite_plane.server.port, head)

    assert b" 411 " in answer.split(b"\r\n", 1)[0]
    assert b"Content-Length" in answer.split(b"\r\n\r\n", 1)[1]


def chunked(body: bytes, size: int = 1000) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def test_a_chunked_batch_is_taken_within_the_limits(sqlite_plane: Plane) -> None:
    """Chunked uploads are de-chunked by the server (a proxy may re-chunk a batch)."""
    head = (
        f"POST {EVENTS_PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    ).encode()
    port = sqlite_plane.server.port

    answer = raw_exchange(port, head + chunked(wire_body()))
    over_route_limit = raw_exchange(port, head + chunked(b"x" * (1 << 20) + b"x", 1 << 16))

    assert b" 200 " in answer.split(b"\r\n", 1)[0]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {"accepted": 3, "duplicates": 0}
    assert b" 413 " in over_route_limit.split(b"\r\n", 1)[0]
    assert b"limit" in over_route_limit
    assert count_events(sqlite_plane.engine) == 3


def test_a_chunked_body_over_the_cap_is_cut_off_while_it_arrives(sqlite_plane: Plane) -> None:
    cap = DRAIN_FACTOR * sqlite_plane.ingest.max_body_bytes
    with socket.create_connection(("127.0.0.1", sqlite_plane.server.port), timeout=10) as conn:
        conn.sendall(
            (
                f"POST {EVENTS_PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                "Transfer-Encoding: chunked\r\n\r\n"
            ).encode()
        )
        chunk = b"%x\r\n%s\r\n" % (1 << 16, b"x" * (1 << 16))
        sent = 0
        try:
            while sent <= cap + (1 << 20):  # the client would go on; the server stops it
                conn.sendall(chunk)
                sent += 1 << 16
        except OSError:
            pass
        answer = conn.recv(65536)

    assert b" 413 " in answer.split(b"\r\n", 1)[0]
    assert count_events(sqlite_plane.engine) == 0


def test_broken_http_and_vanishing_clients_do_not_stop_the_server(
    sqlite_plane: Plane, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    port = sqlite_plane.server.port
    garbage = raw_exchange(port, b"\x16\x03\x01 this is not http\r\n\r\n")
    assert b"400" in garbage.split(b"\r\n", 1)[0]
    # A client that promises a body and hangs up halfway.
    head = (
        f"POST {EVENTS_PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Content-Length: 5000\r\n\r\n"
    ).encode()
    raw_exchange(port, head + b'{"v": 1, "att', read=False)
    # A client that hangs up without reading its answer.
    raw_exchange(port, b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\n\r\n", read=False)

    assert post(sqlite_plane.events_url, wire_body()) == (200, {"accepted": 3, "duplicates": 0})
    assert count_events(sqlite_plane.engine) == 3
    assert capsys.readouterr().err == ""  # the log, not stderr
    # At most one line per broken client, and no traceback.
    assert len(caplog.records) <= 3, [r.getMessage() for r in caplog.records]
    assert not any(r.exc_info for r in caplog.records)


def test_clients_that_trickle_their_headers_keep_nobody_waiting(sqlite_plane: Plane) -> None:
    """Slowloris: 120 connections sending their headers a byte at a time (within the
    per-client cap and the deadline; tests/jobs/test_server_exhaustion.py goes past both)."""
    port = sqlite_plane.server.port
    assert CONNECTION_LIMIT > 120 and MAX_CONNECTIONS_PER_CLIENT > 120 + 1  # + the poster
    slow = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(120)]
    try:
        for conn in slow:
            conn.sendall(b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        waited: list[float] = []
        for index in range(5):
            for conn in slow:
                conn.sendall(b"a")  # each stays active, under any idle timeout
            started = time.monotonic()
            assert post(sqlite_plane.events_url, wire_body(first_seq=10 * index))[0] == 200
            waited.append(time.monotonic() - started)
    finally:
        for conn in slow:
            conn.close()

    assert max(waited) < 2.0, waited


def test_a_silent_connection_is_closed_after_the_channel_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert 5.0 <= CHANNEL_TIMEOUT_S <= 60.0  # the real setting; shortened here
    monkeypatch.setattr("jobs.web.server.CHANNEL_TIMEOUT_S", 1.0)
    monkeypatch.setattr("jobs.web.server._CLEANUP_INTERVAL_S", 0.2)
    monkeypatch.setattr("jobs.web.server.REQUEST_DEADLINE_S", 60.0)  # silence, not the deadline
    engine = make_engine(f"sqlite:///{tmp_path / 'x.db'}")
    migrate(engine)
    server = serve(ControlPlaneApp(engine, IngestService(engine)), "127.0.0.1", 0)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            conn.sendall(b"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            started = time.monotonic()
            assert conn.recv(65536) == b""  # closed, nothing answered
            closed_after = time.monotonic() - started
    finally:
        server.shutdown()
        engine.dispose()

    assert 0.5 < closed_after < 5.0, closed_after


def test_many_clients_at_once(sqlite_plane: Plane) -> None:
    results: list[int] = []
    lock = threading.Lock()

    def send(index: int) -> None:
        status, _ = post(sqlite_plane.events_url, wire_body(first_seq=index * 10, n=10))
        with lock:
            results.append(status)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert results == [200] * 8
    assert count_events(sqlite_plane.engine) == 80


# --- health, metrics, mounts ----------------------------------------------------------------


def test_healthz_is_the_process_and_readyz_the_database(
    sqlite_plane: Plane, tmp_path: Path
) -> None:
    """Liveness never asks the database, so a database blip restarts no replica;
    readiness does, and takes the replica out of the load balancer (issue 28)."""
    status, content_type, text = get(sqlite_plane.admin_url + "/healthz")
    assert (status, content_type) == (200, "application/json")
    assert json.loads(text) == {"ok": True}

    broken_dir = tmp_path / "not-a-database"
    broken_dir.mkdir()
    broken = make_engine(f"sqlite:///{broken_dir}")
    server = serve(ControlPlaneApp(broken, IngestService(broken)), "127.0.0.1", 0)
    try:
        assert server.admin_url is not None
        status, _, text = get(server.admin_url + "/healthz")
        ready_status, _, ready_text = get(server.admin_url + "/readyz")
    finally:
        server.shutdown()
        broken.dispose()
    assert status == 200
    assert json.loads(text)["ok"] is True
    assert ready_status == 503
    assert json.loads(ready_text)["ready"] is False
    assert json.loads(ready_text)["db"].startswith("unavailable")


def test_metrics_in_prometheus_text(plane: Plane) -> None:
    post(plane.events_url, wire_body())
    post(plane.events_url, wire_body())
    post(plane.events_url, b"nonsense")

    found = scrape(plane.admin_url)

    assert sample(found, "trainbot_ingest_events_total", result="accepted") == 3
    assert sample(found, "trainbot_ingest_events_total", result="duplicate") == 3
    assert sample(found, "trainbot_ingest_batches_total", status="200") == 2
    assert sample(found, "trainbot_ingest_batches_total", status="400") == 1
    assert sample(found, "trainbot_ingest_latency_seconds_bucket", le="+Inf") == 3
    assert sample(found, "trainbot_ingest_latency_seconds_count") == 3
    assert sample(found, "trainbot_alerts_open", severity="critical") == 0
    assert (
        "# TYPE trainbot_ingest_latency_seconds histogram" in get(plane.admin_url + "/metrics")[2]
    )


def test_a_mounted_app_gets_its_prefix(sqlite_plane: Plane) -> None:
    seen: list[tuple[str, str]] = []

    def slack(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        seen.append((environ["SCRIPT_NAME"], environ["PATH_INFO"]))
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"slack here"]

    sqlite_plane.app.mount("/slack/", slack)

    assert get(sqlite_plane.server.url + "/slack/events")[::2] == (200, "slack here")
    assert get(sqlite_plane.server.url + "/slackers")[0] == 404
    assert seen == [("/slack", "/events")]


def test_shutdown_closes_the_port(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'x.db'}")
    migrate(engine)
    server = serve(ControlPlaneApp(engine, IngestService(engine)), "127.0.0.1", 0)
    assert server.admin_url is not None
    assert get(server.admin_url + "/healthz")[0] == 200
    assert get(server.url + "/v1/nothing")[0] == 404

    server.shutdown()

    for port in (server.port, server.admin_port):
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    engine.dispose()


def test_bursts_reuse_the_answering_threads_and_a_stalled_client_blocks_nobody(
    sqlite_plane: Plane,
) -> None:
    names: list[str] = []
    release = threading.Event()

    def probe(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        names.append(threading.current_thread().name)
        release.wait(10)  # every request of a burst is in flight at once
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    sqlite_plane.app.mount("/probe", probe)
    # A client that sends half its headers and stalls holds one thread, no more.
    stalled = socket.create_connection(("127.0.0.1", sqlite_plane.server.port), timeout=10)
    stalled.sendall(b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\n")
    try:
        statuses: list[int] = []

        def ask() -> None:
            statuses.append(get(sqlite_plane.server.url + "/probe/x")[0])

        for burst in range(1, 4):
            statuses.clear()
            threads = [threading.Thread(target=ask) for _ in range(8)]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 10
            while len(names) < 8 * burst and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(names) == 8 * burst, "the burst was not answered all at once"
            release.set()
            for thread in threads:
                thread.join(15)
            release.clear()
            assert statuses == [200] * 8
    finally:
        stalled.close()
    assert len(names) == 24
    # A thread per connection would be 24 threads; the server answers on a fixed pool.
    assert len(set(names)) < 16, sorted(set(names))
