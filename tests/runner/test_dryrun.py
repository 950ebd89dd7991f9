"""`trainbot-runner dry-run`: checkpoint, kill -9, restore, verify, two more steps."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from runner.dryrun import daly_interval, run_dry_run
from runner.errors import RunnerError
from tests.runner.tinyproc import TINY, tiny_env


def test_daly_interval() -> None:
    assert daly_interval(10, 3600) == pytest.approx(math.sqrt(2 * 10 * 3600) - 10)
    assert daly_interval(100, 10) == 100  # never shorter than one checkpoint
    with pytest.raises(RunnerError):
        daly_interval(0, 10)


@pytest.mark.slow
def test_dry_run_of_the_example_passes_and_reports(tmp_path: Path) -> None:
    env = tiny_env(tmp_path)
    env.pop("TRAINBOT_EVENTS_FILE")
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable, "-m", "runner.cli", "dry-run", "--steps", "4", "--mtbp", "10m",
            "--checkpoint-uri", str(tmp_path / "ck"), "--run-id", "r-dry", "--report",
            str(report_path), "--", sys.executable, "-m", "runner.examples.tiny", *TINY,
            "--steps", "100", "--dim", "256",
        ],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    # Width 256 (a 19 MB checkpoint): its write takes several times the snapshot that
    # stalls the loop. At the tiny width (360 KB) both are a few ms of fixed costs, and a
    # loaded machine's scheduling decides which is longer.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dry run: PASSED" in proc.stdout
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["problems"] == []
    assert report["steps_before_kill"] == 4 and report["steps_after_restore"] == 2
    assert report["saved_sha256"] == report["restored_sha256"]
    assert report["checkpoint_bytes"] > 0 and report["write_s"] > 0
    assert report["restore_s"] > 0 and report["step_time_s"] > 0
    # Daly's C is the stall of an asynchronous save (measured on the saves after the
    # first), and the write time is the floor.
    c, w = report["stall_s"], report["write_s"]
    assert 0 < c < w
    assert report["daly_interval_s"] == pytest.approx(max(w, c, math.sqrt(2 * c * 600) - c))
    assert report["emergency_fits"] == {"aws": True, "gcp": True}
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == report


@pytest.mark.slow
def test_dry_run_of_a_script_without_the_session_api_fails_clearly(tmp_path: Path) -> None:
    report = run_dry_run(
        [sys.executable, "-c", "print('training without checkpoints')"],
        checkpoint_uri=str(tmp_path / "ck"),
        run_id="r-plain",
        steps=3,
        timeout_s=60,
    )
    assert not report.ok
    assert "session API" in report.problems[0]


@pytest.mark.slow
def test_dry_run_catches_untracked_state(tmp_path: Path) -> None:
    """A script that forgets to checkpoint part of its state does not restore identically."""
    script = tmp_path / "leaky.py"
    script.write_text(
        "import torch\n"
        "from runner.session import Session\n"
        "class Counter:\n"
        "    def __init__(self): self.n = torch.zeros(1)\n"
        "    def state_dict(self): return {'n': self.n}\n"
        "    def load_state_dict(self, s): pass  # forgets to restore\n"
        "c = Counter()\n"
        "with Session.from_env() as s:\n"
        "    s.track(counter=c)\n"
        "    for _ in s.steps(100):\n"
        "        c.n += 1\n"
        "raise SystemExit(s.exit_code)\n"
    )
    env = tiny_env(tmp_path)
    env.pop("TRAINBOT_EVENTS_FILE")
    report = run_dry_run(
        [sys.executable, str(script)],
        checkpoint_uri=str(tmp_path / "ck"),
        run_id="r-leaky",
        steps=3,
        timeout_s=120,
        env=env,
    )
    assert not report.ok
    assert any("differs from the saved one" in p for p in report.problems)
