"""``trainbot shell`` is the one-person local mode, and it cleans up after itself.

Real ``trainbot shell`` processes: two on one machine do not collide (a port that is
taken is one line, not a traceback), a shared PostgreSQL database is refused, and
quitting (SIGTERM here; Ctrl-D and Ctrl-C take the same way out) stops the training
processes the shell started and gives the scheduler lease back.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

import pytest
from sqlmodel import select

from bot.cli import shell_problem
from jobs.database.db import make_engine, session_scope
from jobs.database.models import Run
from jobs.database.replica_tables import SchedulerLease
from jobs.domain.lifecycle import RunState
from jobs.process.settings import load_settings
from tests.bot.test_slack_app import wait_until


def shell_env(state: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINBOT_")}
    return {**env, "TRAINBOT_STATE_DIR": str(state), **extra}


def start_shell(env: dict[str, str], *, quiet: bool = False) -> subprocess.Popen[str]:
    """`trainbot shell` reading commands from a pipe; its output piped, or dropped when
    ``quiet``."""
    out = subprocess.DEVNULL if quiet else subprocess.PIPE
    return subprocess.Popen(
        [sys.executable, "-m", "bot.cli", "shell"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=out,
        stderr=out,
        text=True,
    )


def wait_for_line(stream: IO[str], text: str) -> str:
    """Read until a line holding ``text`` (the shell's greeting); what was read."""
    seen = ""
    while text not in seen:
        line = stream.readline()
        if not line:
            pytest.fail(f"the shell ended before saying {text!r}: {seen}")
        seen += line
    return seen


@pytest.fixture
def shells() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_two_shells_on_one_machine(tmp_path: Path, shells: list[subprocess.Popen[str]]) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    state = tmp_path / "state"
    first = start_shell(shell_env(state, TRAINBOT_INGEST_PORT=str(port)))
    shells.append(first)
    assert first.stdout is not None
    wait_for_line(first.stdout, "trainbot shell:")
    # A second shell told to use the same port: one line saying what to do.
    second = subprocess.run(
        [sys.executable, "-m", "bot.cli", "shell"],
        env=shell_env(state, TRAINBOT_INGEST_PORT=str(port)),
        input="",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 2
    assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr, second.stderr
    assert "already in use" in second.stderr and "TRAINBOT_INGEST_PORT" in second.stderr
    # Left to choose, a second shell takes free ports and works beside the first.
    third = subprocess.run(
        [sys.executable, "-m", "bot.cli", "shell"],
        env=shell_env(state),
        input="list all\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert third.returncode == 0 and "No runs" in third.stdout, third
    assert "Traceback" not in third.stderr
    first.stdin.close()  # type: ignore[union-attr]  # Ctrl-D
    assert first.wait(60) == 0


def test_the_shell_refuses_the_teams_database(tmp_path: Path) -> None:
    """A shell on the team's PostgreSQL would be another replica of its control plane."""
    settings = load_settings(
        {
            "TRAINBOT_STATE_DIR": str(tmp_path),
            "TRAINBOT_DATABASE_URL": "postgresql://trainbot@db.invalid/trainbot",
        }
    )
    problem = shell_problem(settings)
    assert problem is not None and "one-person local mode" in problem and "TRAINBOT_URL" in problem
    assert shell_problem(load_settings({"TRAINBOT_STATE_DIR": str(tmp_path)})) is None


def processes_with(marker: str) -> list[int]:
    """Processes whose environment holds ``marker`` (the spec's env sets it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if marker.encode() in environ and stat.split(") ", 1)[-1][:1] != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_quitting_the_shell_stops_its_training_processes(
    tmp_path: Path, shells: list[subprocess.Popen[str]]
) -> None:
    marker = f"SHELL_TEST_{uuid.uuid4().hex}"
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "long.yaml").write_text(
        "command: python -m runner.examples.tiny --steps 20000 --step-delay 0.02\n"
        "resources: {cloud: local, disk_gb: 1}\n"
        "budget: {usd: 500}\n"
        "dry_run: {enabled: false}\n"
        f"env: {{SHELL_TEST_MARKER: {marker}}}\n"
    )
    state = tmp_path / "state"
    shell = start_shell(shell_env(state, TRAINBOT_SPECS_DIR=str(specs)))
    shells.append(shell)
    assert shell.stdin is not None and shell.stdout is not None
    wait_for_line(shell.stdout, "trainbot shell:")
    shell.stdin.write("launch long\n")
    shell.stdin.flush()
    engine = make_engine(load_settings({"TRAINBOT_STATE_DIR": str(state)}).database_url)
    try:

        def state() -> RunState | None:
            with session_scope(engine) as session:
                runs = session.exec(select(Run)).all()
                return runs[0].state if runs else None

        # Without a dry run the preflight warns and waits; a resubmit launches it anyway.
        wait_until(lambda: state() == RunState.AWAITING_CONFIRMATION, 60, "the preflight")
        with session_scope(engine) as session:
            run_id = session.exec(select(Run.id)).one()
        shell.stdin.write(f"resubmit {run_id}\n")
        shell.stdin.flush()
        wait_until(lambda: state() == RunState.RUNNING, 60, "the run to start")
        wait_until(lambda: bool(processes_with(marker)), 30, "its training process")
        started = time.monotonic()
        shell.send_signal(signal.SIGTERM)
        assert shell.wait(60) == 128 + signal.SIGTERM
        assert time.monotonic() - started < 30
        assert processes_with(marker) == [], "no training process outlives the shell"
        _, err = shell.communicate()
        assert "Traceback" not in err and "stopped r-" in err, err
        with session_scope(engine) as session:
            (run,) = session.exec(select(Run)).all()
            assert run.state == RunState.STOPPED
            leases = session.exec(select(SchedulerLease)).all()
            assert all(lease.expires_at <= datetime.now(timezone.utc) for lease in leases)
    finally:
        engine.dispose()
