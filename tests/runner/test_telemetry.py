"""Telemetry: the spooled Reporter against a real local ingest server, sinks, sampling."""

from __future__ import annotations

import ctypes
import logging
import math
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runner.errors import WireError
from runner.telemetry import (
    FileSink,
    Reporter,
    SpoolError,
    SystemSampler,
    follow_file,
    sample_system,
)
from runner.wire import validate_payload
from tests.fakes.ingest import FakeIngest
from tests.waiting import wait_until

TOKEN = "s3cr3t-attempt-token"


@pytest.fixture
def server() -> Iterator[FakeIngest]:
    with FakeIngest(TOKEN) as fake:
        yield fake


def reporter(server: FakeIngest, spool: Path, **options: Any) -> Reporter:
    settings: dict[str, Any] = {
        "flush_interval_s": 0.02,
        "max_backoff_s": 0.05,
        "timeout_s": 2.0,
        "batch_max": 100,
    }
    settings.update(options)
    token = settings.pop("token", TOKEN)
    return Reporter(server.url, token, attempt="att-1", run="run-1", spool_dir=spool, **settings)


def metric(step: int, loss: float | None = None) -> dict[str, Any]:
    return {
        "step": step,
        "loss": 1.0 / (step + 1) if loss is None else loss,
        "step_time_s": 0.1,
        "data_wait_fraction": 0.05,
        "metrics": {"lr": 1e-3},
    }


def segments(spool: Path) -> list[Path]:
    return sorted(spool.glob("seg-*.jsonl"))


def test_no_event_is_lost_through_an_outage_and_503s(
    server: FakeIngest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="runner.telemetry")
    total = 2000
    r = reporter(server, tmp_path)
    for step in range(500):
        r.emit("metrics", metric(step))
    assert server.wait_for(lambda: len(server.accepted) >= 100, timeout=5)

    server.go_down()
    for step in range(500, 1500):
        r.emit("metrics", metric(step, loss=math.nan if step == 1234 else None))
    # It really hit a refused connection.
    wait_until(lambda: "failed" in caplog.text, 5, "the refused connection in the log")
    assert r.pending > 0

    server.fail_next(503, times=5)
    server.come_up()
    for step in range(1500, total):
        r.emit("metrics", metric(step))
    assert r.flush(timeout=20)

    assert server.injected_left == 0  # every 503 was answered and retried past
    seqs = server.accepted_seqs()
    assert sorted(seqs) == list(range(total))
    assert len(seqs) == len(set(seqs)) == total
    assert set(server.received_seqs) == set(range(total))
    by_seq = {event.seq: event for event in server.accepted}
    assert all(by_seq[seq].data["step"] == seq for seq in range(total))
    assert math.isnan(by_seq[1234].data["loss"])
    assert r.pending == 0
    assert segments(tmp_path) == []  # acknowledged segments are deleted
    assert TOKEN not in caplog.text
    r.close()


def test_restarted_reporter_resumes_the_sequence(server: FakeIngest, tmp_path: Path) -> None:
    server.go_down()
    first = reporter(server, tmp_path)
    for step in range(300):
        assert first.emit("metrics", metric(step)).seq == step
    first.close(timeout=0.2)
    assert first.pending == 300
    with pytest.raises(SpoolError, match="closed"):
        first.emit("heartbeat", {"step": 1})
    # The process died in the middle of appending the next event.
    with open(segments(tmp_path)[-1], "ab") as handle:
        handle.write(b'{"seq":300,"type":"metr')

    second = reporter(server, tmp_path)
    assert second.pending == 300
    assert second.emit("metrics", metric(300)).seq == 300
    server.come_up()
    assert second.flush(timeout=10)
    assert sorted(server.accepted_seqs()) == list(range(301))
    second.close()

    # Everything was acknowledged and the spool emptied; the counter still carries on.
    assert segments(tmp_path) == []
    third = reporter(server, tmp_path)
    assert third.emit("heartbeat", {"step": 301}).seq == 301
    assert third.flush(timeout=5)
    third.close()
    assert server.accepted_seqs()[-1] == 301


def test_a_spool_belongs_to_one_attempt(server: FakeIngest, tmp_path: Path) -> None:
    reporter(server, tmp_path).close()
    with pytest.raises(SpoolError, match="belongs to attempt 'att-1'"):
        Reporter(server.url, TOKEN, attempt="att-2", run="run-1", spool_dir=tmp_path)


def test_revoked_token_stops_sending_and_keeps_the_spool(
    server: FakeIngest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="runner.telemetry")
    secret = "wrong-token-value"
    r = reporter(server, tmp_path, token=secret)
    for step in range(10):
        r.emit("metrics", metric(step))
    assert not r.flush(timeout=5)
    assert r.revoked and r.pending == 10
    for step in range(10, 15):
        r.emit("metrics", metric(step))
    assert not r.flush(timeout=0.2)
    time.sleep(0.1)  # several flush intervals: nothing more may be sent
    assert [req.status for req in server.requests] == [401]
    r.close(timeout=0.5)
    assert segments(tmp_path)
    refusals = [rec for rec in caplog.records if "refused" in rec.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelno == logging.WARNING
    assert secret not in caplog.text

    # A fresh token for the same attempt delivers everything that was kept.
    again = reporter(server, tmp_path)
    assert again.flush(timeout=5)
    assert server.accepted_seqs() == list(range(15))
    again.close()


@pytest.mark.parametrize("kind", ["preemption_notice", "exit"])
def test_a_notice_and_an_exit_go_out_at_once(server: FakeIngest, tmp_path: Path, kind: str) -> None:
    """Metrics wait for the flush interval; a notice (a window of seconds) and the exit
    (the attempt's report) are sent as soon as they are emitted, with what came before."""
    r = reporter(server, tmp_path, flush_interval_s=60)
    r.emit("metrics", metric(0))
    time.sleep(0.3)
    assert server.accepted_seqs() == [], "metrics wait for the interval"
    data = (
        {"source": "signal", "time_left_s": 30.0}
        if kind == "preemption_notice"
        else {"code": 75, "reason": "preempted"}
    )
    r.emit(kind, data)
    wait_until(lambda: server.accepted_seqs() == [0, 1], 5, f"the {kind} sent")
    r.close()


def test_a_rejected_batch_is_dropped_alone(
    server: FakeIngest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server.reject_if = lambda event: bool(event.data.get("poison"))
    r = reporter(server, tmp_path, flush_interval_s=60)  # batches only on flush()
    for step in range(3):
        r.emit("metrics", metric(step))
    assert r.flush(timeout=5)
    r.emit("log", {"level": "info", "message": "bad", "poison": True})
    r.emit("metrics", metric(4))
    r.emit("metrics", metric(5))
    assert r.flush(timeout=5)
    for step in range(6, 9):
        r.emit("metrics", metric(step))
    assert r.flush(timeout=5)
    r.close()
    assert server.accepted_seqs() == [0, 1, 2, 6, 7, 8]
    errors = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "seq 3..5" in errors[0] and "HTTP 400" in errors[0]
    assert "rejected by the test server" in errors[0]


def test_too_large_batches_are_split(server: FakeIngest, tmp_path: Path) -> None:
    server.max_body_bytes = 3000
    r = reporter(server, tmp_path, batch_max=100, flush_interval_s=60)
    for step in range(100):
        r.emit("metrics", metric(step))
    assert r.flush(timeout=10)
    r.close()
    assert sorted(server.accepted_seqs()) == list(range(100))
    assert 413 in {req.status for req in server.requests}


def test_retry_after_is_honoured(server: FakeIngest, tmp_path: Path) -> None:
    server.fail_next(429, retry_after="1")
    r = reporter(server, tmp_path, max_backoff_s=5.0, flush_interval_s=60)
    r.emit("heartbeat", {"step": 1})
    assert r.flush(timeout=5)
    r.close()
    first, second = server.requests
    assert (first.status, second.status) == (429, 200)
    assert second.at - first.at >= 0.9


def test_retry_after_is_capped_by_max_backoff(server: FakeIngest, tmp_path: Path) -> None:
    server.fail_next(429, retry_after="3600")
    r = reporter(server, tmp_path, max_backoff_s=0.1)
    r.emit("heartbeat", {"step": 1})
    assert r.flush(timeout=3)
    r.close()
    assert server.accepted_seqs() == [0]


def test_emit_validates_before_spooling(server: FakeIngest, tmp_path: Path) -> None:
    r = reporter(server, tmp_path)
    with pytest.raises(WireError, match=r"^data\.step: expected an integer"):
        r.emit("metrics", {**metric(1), "step": "one"})
    with pytest.raises(WireError, match="unknown event type"):
        r.emit("gossip", {})
    assert r.pending == 0
    event = r.emit("heartbeat", {"step": 1}, time=123.0)
    assert (event.seq, event.time, event.attempt, event.run) == (0, 123.0, "att-1", "run-1")
    assert r.flush(timeout=5)
    r.close()
    assert server.accepted[0].time == 123.0


def test_file_sink_and_follower_round_trip(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "events.jsonl"
    follower = follow_file(path)
    assert list(follower) == []  # no file yet
    sink = FileSink(path)
    sink.emit("metrics", metric(1, loss=math.nan), time=100.0)
    sink.emit("log", {"level": "info", "message": "NaN"}, time=101.0)
    first, second = list(follower)
    assert first.type == "metrics" and first.time == 100.0 and math.isnan(first.data["loss"])
    assert tuple(second) == ("log", 101.0, {"level": "info", "message": "NaN"})
    with pytest.raises(WireError):
        sink.emit("metrics", {"step": 1})
    sink.close()

    # The child is in the middle of writing a line: nothing until it is complete.
    with open(path, "ab") as handle:
        handle.write(b'{"type":"heartbeat","time":102.0,"da')
    assert list(follower) == []
    resume_at = follower.offset
    with open(path, "ab") as handle:
        handle.write(b'ta":{"step":5}}\n')
    assert list(follower) == [("heartbeat", 102.0, {"step": 5})]

    # The child was killed mid-line; its restart appends after the fragment.
    with open(path, "ab") as handle:
        handle.write(b'{"type":"hea')
    restarted = FileSink(path)
    restarted.emit("heartbeat", {"step": 6}, time=103.0)
    restarted.close()
    assert list(follower) == [("heartbeat", 103.0, {"step": 6})]
    assert "skipping a bad line" in caplog.text

    resumed = follow_file(path, start_offset=resume_at)
    assert [record.data["step"] for record in resumed] == [5, 6]


def _has_nvml() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_sample_system(tmp_path: Path) -> None:
    sample = validate_payload("system", sample_system(tmp_path))
    usage = shutil.disk_usage(tmp_path)
    assert 0 < sample["disk_used"] <= sample["disk_total"] <= usage.total
    assert sample["disk_path"] == str(tmp_path)
    if _has_nvml():
        assert sample["gpu_count"] >= 1 and 0 <= sample["gpu_util"] <= 100
    else:
        assert sample["gpu_util"] is None and sample["gpu_count"] == 0

    (tmp_path / "a").write_bytes(b"x" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"y" * 2500)
    declared = sample_system(tmp_path, declared_total=10_000)
    assert (declared["disk_used"], declared["disk_total"]) == (3500, 10_000)

    missing = sample_system(tmp_path / "nope")
    assert (missing["disk_used"], missing["disk_total"]) == (0, 0)


def test_system_sampler_emits_and_stops_promptly(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    sink = FileSink(path)
    follower = follow_file(path)
    records: list[Any] = []
    sampler = SystemSampler(sink, tmp_path, interval_s=0.02, current_step=lambda: 7).start()

    def four_records() -> bool:
        records.extend(follower)
        return len(records) >= 4

    wait_until(four_records, 5, "four system records")
    sampler.stop()
    slow = SystemSampler(sink, tmp_path, interval_s=60).start()
    started = time.monotonic()
    slow.stop()
    assert time.monotonic() - started < 1.0
    sink.close()
    types = [record.type for record in records]
    assert types[:4] == ["system", "heartbeat", "system", "heartbeat"]
    assert records[1].data == {"step": 7}
    assert records[0].data["disk_path"] == str(tmp_path)
