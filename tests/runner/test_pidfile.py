"""A dry run left behind by a crashed control plane is ended by whoever finds its pid
file, including one whose spawn the crash interrupted (the file named no group yet)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.pidfile import end_stale_dry_run, record_process_group, record_spawn

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")


def _spawn(run_id: str, *, phase: str | None = "save") -> subprocess.Popen[bytes]:
    env = {**os.environ, "TRAINBOT_RUN_ID": run_id}
    if phase is not None:
        env["TRAINBOT_DRY_RUN_PHASE"] = phase
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True
    )
    # Its environment is readable once the interpreter has been exec'd.
    deadline = time.monotonic() + 10
    while (
        f"TRAINBOT_RUN_ID={run_id}".encode() not in Path(f"/proc/{proc.pid}/environ").read_bytes()
    ):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return proc


def _ended(proc: subprocess.Popen[bytes]) -> bool:
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return True


def test_the_group_the_file_names_is_killed(tmp_path: Path) -> None:
    proc = _spawn("r-1-dry-run")
    pid_file = tmp_path / "dry-run.pid"
    record_process_group(pid_file, proc.pid, run_id="r-1-dry-run")
    try:
        assert end_stale_dry_run(pid_file)
        assert _ended(proc)
        assert not pid_file.exists()
    finally:
        proc.kill()


def test_a_process_whose_spawn_the_crash_interrupted_is_found_by_its_run_id(
    tmp_path: Path,
) -> None:
    """The file was written before the spawn and never updated: the crash came between."""
    pid_file = tmp_path / "dry-run.pid"
    record_spawn(pid_file, run_id="r-2-dry-run")
    proc = _spawn("r-2-dry-run")
    other_run = _spawn("r-3-dry-run")
    not_a_dry_run = _spawn("r-2-dry-run", phase=None)
    try:
        assert end_stale_dry_run(pid_file)
        assert _ended(proc)
        # Another run's dry run, and a process of that id that is no dry run, are left.
        assert other_run.poll() is None and not_a_dry_run.poll() is None
    finally:
        for p in (proc, other_run, not_a_dry_run):
            p.kill()
            p.wait()


def test_an_unreadable_file_ends_nothing(tmp_path: Path) -> None:
    pid_file = tmp_path / "dry-run.pid"
    pid_file.write_text("{not json")
    assert not end_stale_dry_run(pid_file)
    assert not pid_file.exists()
    assert not end_stale_dry_run(tmp_path / "absent.pid")
