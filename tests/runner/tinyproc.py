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
