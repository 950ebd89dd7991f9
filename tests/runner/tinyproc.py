"""Running the tiny example as a real process, the way an instance runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from runner.telemetry import follow_file
from tests.paths import ROOT

#: A small, fast configuration of the example.
TINY = ["--dim", "32", "--batch", "8"]


@dataclass
class Finished:
    code: int
    result: dict | None
    events: list[tuple[str, float, dict]]
    stderr: str


def tiny_env(tmp: Path, run_id: str = "r-test", **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINBOT_")}
    env.update(
        PYTHONPATH=str(ROOT),
        TRAINBOT_RUN_ID=run_id,
        TRAINBOT_CHECKPOINT_URI=str(tmp / "ck"),
        TRAINBOT_EVENTS_FILE=str(tmp / f"events-{time.monotonic_ns()}.jsonl"),
        OMP_NUM_THREADS="1",
    )
    env.update(extra)
    return env


def run_tiny(
    args: list[str],
    env: Mapping[str, str],
    *,
    signal_when: Callable[[list[tuple[str, float, dict]]], bool] | None = None,
    timeout: float = 120,
) -> Finished:
    """Run the example; send SIGTERM once ``signal_when(events)`` says so."""
    events_path = Path(env["TRAINBOT_EVENTS_FILE"])
    events_path.parent.mkdir(parents=True, exist_ok=True)
    events_path.touch()
    follower = follow_file(events_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner.examples.tiny", *TINY, *args],
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    events: list[tuple[str, float, dict]] = []
    deadline = time.monotonic() + timeout
    signalled = False
    while proc.poll() is None and time.monotonic() < deadline:
        events.extend(follower)
        if signal_when is not None and not signalled and signal_when(events):
            proc.send_signal(signal.SIGTERM)
            signalled = True
        time.sleep(0.005)
    if proc.poll() is None:
        proc.kill()
        pytest.fail("the example did not finish in time")
    out, err = proc.communicate()
    events.extend(follower)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    return Finished(proc.returncode, json.loads(lines[-1]) if lines else None, events, err)


def metric_steps(events: list[tuple[str, float, dict]]) -> list[int]:
    return [d["step"] for t, _, d in events if t == "metrics"]


def exec_synced(
    env: Mapping[str, str], sync: Path, *command: str
) -> subprocess.CompletedProcess[str]:
    """``trainbot-runner exec`` of ``command`` with ``sync`` as its synced checkpoint
    directory (settling 0.1 s), as an instance runs it; it must exit 0."""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "runner.cli", "exec", "--sync-dir", str(sync)),
            *("--settle", "0.1", "--", *command),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done


def preempt_once_synced(
    proc: subprocess.Popen[str], sync: Path, *, settle_s: float = 0.8, timeout_s: float = 60
) -> str:
    """SIGTERM ``proc`` (``trainbot-runner exec --sync-dir sync`` over a script writing
    ``epoch-N`` folders) once three folders are there (slow machines start slowly) and
    ``settle_s`` later, past the settle time, so the early ones are synced; its stderr once
    it exited."""
    deadline = time.monotonic() + 60
    while len(list(sync.glob("epoch-*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(settle_s)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=timeout_s)
    return err


def first_line_then_stop(proc: subprocess.Popen[str], *, timeout_s: float = 60) -> str:
    """The first line ``proc`` prints (its script's first word once the runner restored
    what it needs); then ``proc`` is sent SIGTERM and waited for."""
    assert proc.stdout is not None
    first_line = proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=timeout_s)
    return first_line


def preempt_when(
    proc: subprocess.Popen[str],
    ready: Callable[[], bool],
    *,
    what: str = "the moment",
    timeout: float = 60,
    poll_s: float = 0.001,
) -> tuple[int, str, str]:
    """SIGTERM the attempt's process group (``proc`` started a session) once ``ready()``;
    its exit code and output. The test fails, saying ``what`` never came, when ``proc``
    ends first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"{what} never came (exit {proc.returncode}): {err[-3000:]}")
        time.sleep(poll_s)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err
