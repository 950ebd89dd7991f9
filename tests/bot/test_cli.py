"""`trainbot serve` as a person starts it: flags, the environment, and stopping."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests

from tests.paths import ROOT


def trainbot_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment without its TRAINBOT_ settings, the state under ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINBOT_")}
    env.update(PYTHONPATH=str(ROOT), TRAINBOT_STATE_DIR=str(tmp_path / "state"), **extra)
    return env


@contextmanager
def serving(tmp_path: Path, **env: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`trainbot serve --host 127.0.0.1 --port 0` with ``env``; yields the process and the
    first line it printed (the banner). At the end it gets SIGTERM and must exit 0
    without a traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bot.cli", "serve", "--host", "127.0.0.1", "--port", "0"],
        env=trainbot_env(tmp_path, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield proc, proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


def test_serve_takes_host_and_port_flags_over_the_environment(tmp_path: Path) -> None:
    served = serving(tmp_path, TRAINBOT_INGEST_HOST="192.0.2.1", TRAINBOT_INGEST_PORT="1")
    with served as (proc, line):
        match = re.search(
            r"on (http://127\.0\.0\.1:(\d+)).*metrics on (http://127\.0\.0\.1:\d+)", line
        )
        assert match is not None, line + (proc.stderr.read() if proc.poll() is not None else "")
        assert int(match.group(2)) not in (0, 1)
        assert requests.get(f"{match.group(3)}/healthz", timeout=10).status_code == 200
        assert requests.get(f"{match.group(1)}/healthz", timeout=10).status_code == 404


def test_serve_refuses_a_bad_port_with_a_usage_message(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bot.cli", "serve", "--port", "80000"],
        env=trainbot_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "80000 is not a port" in done.stderr and "Traceback" not in done.stderr
