"""Running a benchmark as the Makefile runs it (a script, this checkout on its path), and
the output contract every benchmark keeps: its figures as one JSON object, the last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``bench/<script>`` with ``args``, its output captured."""
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )


def last_line(
    script: str, *args: str, bench: str, goal: float, timeout: float = 120
) -> dict[str, Any]:
    """Runs ``script`` to a clean exit and returns its last line, checked for what every
    result holds: its name, its goal, whether it was met and the ratio judged."""
    done = run_bench(script, *args, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bench"] == bench
    assert result["goal"] == goal
    assert isinstance(result["met"], bool)
    assert isinstance(result["ratio"], float)
    return result
