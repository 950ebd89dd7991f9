"""The command's output shipped to the run's store (issue 27, point 1): bounded gzip
segments per attempt and node, uploaded in the background, the last one on exit and on a
notice, read back after the instance is gone; its tail with the exit event."""

from __future__ import annotations

import gzip
import shutil
import sys
import textwrap
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from runner import EXIT_PREEMPTED
from runner.logship import LogLimits, LogShipper, log_prefix, nodes, read_tail, segments
from runner.preemption import Notice, PreemptionFlag
from runner.store import LocalStore, Store
from runner.store.s3 import S3Store
from runner.supervisor import Supervisor
from runner.wire import validate_payload
from tests.fakes import gcs_emulator as gcs
from tests.fakes.gcs_emulator import gcs_emulator
from tests.fakes.moto_server import closed_port, create_bucket

__all__ = ["gcs_emulator"]  # the session's emulator, a fixture

ATTEMPT = "a-logs1"


class Recorder:
    """An event sink that checks each payload against the wire schema and keeps it."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def emit(self, type: str, data: Mapping[str, Any], *, time: float | None = None) -> None:
        validate_payload(type, dict(data))
        self.events.append((type, dict(data)))

    def close(self, timeout: float = 10.0) -> None:
        return None

    def exit(self) -> dict[str, Any]:
        [found] = [d for t, d in self.events if t == "exit"]
        return found


#: Prints ``lines`` lines of 100 hard-to-compress characters, then fails with a
#: traceback whose message holds Slack's control characters.
NOISY_THEN_FAIL = textwrap.dedent(
    """
    import os, sys
    print("config: lr=3e-4 <first line>", flush=True)
    for i in range(int(sys.argv[1])):
        print(f"{i:06d} " + os.urandom(46).hex(), flush=(i % 50 == 0))
    raise RuntimeError("loss is <nan> & rising > 1e9")
    """
)


def supervise(
    tmp_path: Path, store: Store, script: str, *args: str, limits: LogLimits, **kw: Any
) -> tuple[int, Recorder, float]:
    """The script under the supervisor, its output shipped to ``store`` (from a scratch
    folder that stands for the instance); returns the exit code, the events, seconds."""
    instance = tmp_path / "instance"
    instance.mkdir()
    (instance / "train.py").write_text(script)
    shipper = LogShipper(lambda: store, attempt=ATTEMPT, node=0, limits=limits)
    sink = Recorder()
    sup = Supervisor(
        [sys.executable, str(instance / "train.py"), *args],
        sink=sink,
        install_signals=False,
        scratch_dir=instance,
        sample_s=3600,
        logs=shipper,
        **kw,
    )
    started = time.monotonic()
    code = sup.run()
    return code, sink, time.monotonic() - started


def check_bounds(store: Store, limits: LogLimits) -> None:
    found = segments(store, ATTEMPT, 0)
    assert found[0].seq == 0, "the first segment (the start of the output) is kept"
    total = sum(s.size for s in found)
    newest = found[-1].size
    assert total <= limits.total_bytes + newest, (total, limits.total_bytes)
    for seg in found:
        raw = gzip.decompress(store.get_bytes(seg.key))
        assert len(raw) <= limits.segment_bytes + 200  # + a dropped-output note at most


@pytest.mark.parametrize("where", ["local", "s3", "gcs"])
def test_a_failed_commands_output_is_in_the_store_after_the_instance_is_gone(
    tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    if where == "s3":
        url = request.getfixturevalue("moto_server")
        store: Store = S3Store(create_bucket(url), "ckpt/r-logs", endpoint_url=url)
    elif where == "gcs":
        from runner.store.gcs import GCSStore

        host = request.getfixturevalue("gcs_emulator")
        store = GCSStore(gcs.create_bucket(host), "ckpt/r-logs", emulator_host=host)
    else:
        store = LocalStore(tmp_path / "store" / "r-logs")
    limits = LogLimits(segment_bytes=32 << 10, total_bytes=96 << 10, tail_bytes=2048)
    # About 300 KB of output: ten segments and more, three times the total bound.
    code, sink, _ = supervise(tmp_path, store, NOISY_THEN_FAIL, "3000", limits=limits)
    assert code == 1
    shutil.rmtree(tmp_path / "instance")  # the instance deletes itself on exit

    check_bounds(store, limits)
    found = segments(store, ATTEMPT, 0)
    assert found[-1].seq >= 9 and len(found) < found[-1].seq + 1, "the middle was deleted"
    assert nodes(store, ATTEMPT) == [0]
    assert all(
        s.key.startswith(log_prefix(ATTEMPT, 0)) and s.key.endswith(".log.gz") for s in found
    )
    first = gzip.decompress(store.get_bytes(found[0].key)).decode()
    assert first.startswith("config: lr=3e-4 <first line>")

    tail = read_tail(store, ATTEMPT, 0, max_bytes=4000, max_lines=20)
    assert tail is not None and tail.cut and tail.missing > 0
    assert tail.text.splitlines()[-1] == "RuntimeError: loss is <nan> & rising > 1e9"
    assert "Traceback (most recent call last):" in tail.text
    assert len(tail.text.splitlines()) <= 20
    # Everything, as far back as it goes: the start, a note where the middle was, the end.
    whole = read_tail(store, ATTEMPT, 0, max_bytes=10 << 20)
    assert whole is not None and whole.text.startswith("config: lr=3e-4")
    assert "segment(s) of output deleted here" in whole.text
    assert whole.text.endswith("rising > 1e9")

    # The exit event carries the last lines, bounded.
    exit_data = sink.exit()
    assert exit_data["reason"] == "failed"
    assert exit_data["log_tail"].endswith("RuntimeError: loss is <nan> & rising > 1e9")
    assert len(exit_data["log_tail"].encode()) <= limits.tail_bytes
    assert len(exit_data["log_tail"].splitlines()) <= limits.tail_lines


#: Prints a line, then waits for SIGTERM, says so and exits 1 (as a script does that
#: does not know about preemption).
WAITS_FOR_SIGTERM = textwrap.dedent(
    """
    import signal, sys, time
    def bye(signum, frame):
        print("got SIGTERM at step 7", flush=True)
        sys.exit(1)
    signal.signal(signal.SIGTERM, bye)
    print("training", flush=True)
    time.sleep(60)
    """
)


def test_a_segment_closes_on_time_and_the_last_one_on_a_notice(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    limits = LogLimits(segment_s=0.3)
    flag = PreemptionFlag()

    def notice_once_a_segment_is_up() -> None:
        deadline = time.monotonic() + 20
        while not segments(store, ATTEMPT, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        now = time.monotonic()
        flag.set(Notice(source="aws", reason="test", received_at=now, deadline=now + 30))

    threading.Thread(target=notice_once_a_segment_is_up, daemon=True).start()
    code, sink, took = supervise(
        tmp_path, store, WAITS_FOR_SIGTERM, limits=limits, flag=flag, window_s=30
    )
    assert code == EXIT_PREEMPTED and took < 20
    texts = [gzip.decompress(store.get_bytes(s.key)).decode() for s in segments(store, ATTEMPT, 0)]
    assert texts[0] == "training\n", "the time bound closed the first segment mid-run"
    assert "".join(texts) == "training\ngot SIGTERM at step 7\n", "the last output is flushed"
    assert sink.exit()["log_tail"] == "training\ngot SIGTERM at step 7"


def test_an_unreachable_store_never_slows_the_command(tmp_path: Path) -> None:
    """Every upload is refused at once: the command runs as fast as without a store."""
    store = S3Store("nowhere", "r", endpoint_url=f"http://127.0.0.1:{closed_port()}")
    limits = LogLimits(segment_bytes=16 << 10, buffer_bytes=64 << 10)
    shipper = LogShipper(lambda: store, attempt=ATTEMPT, limits=limits).start()
    started = time.monotonic()
    for i in range(20_000):  # 2 MB in 64 KB writes' worth of lines, far past the buffer
        shipper.feed(f"{i:08d} {'x' * 91}\n".encode())
    fed = time.monotonic() - started
    assert fed < 1.0, f"feeding took {fed:.2f} s"
    assert shipper.close(timeout=0.5) is False
    stats = shipper.stats()
    assert stats.dropped_bytes > 0 and stats.kept_bytes == 0
    assert shipper.tail().endswith("00019999 " + "x" * 91)
