"""The benchmarks still run and still speak their output format.

Each runs as the Makefile runs it (a script, ``--quick``), on a tiny state and one
round. Timings on a shared two-core machine mean nothing at this size, so only the
shape of the last line is checked, never ``met`` or the figures' values.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--quick", "--size-mb", "8", "--repeats", "1"]
BENCHES = {
    "bench_checkpoint_stall.py": [],
    "bench_write_throughput.py": [],
    "bench_preemption_flush.py": [],
    # Dropping the page cache would slow down everything else on the machine.
    "bench_resume.py": ["--keep-page-cache"],
    # Local, S3 on moto's server and GCS on the emulator, side by side.
    "bench_stores.py": [],
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str, Path]]:
    """Run every benchmark at once (they are mostly waiting on subprocesses and disks)."""
    procs = {}
    for name, extra in BENCHES.items():
        workdir = tmp_path_factory.mktemp(name.removesuffix(".py"))
        procs[name] = (
            subprocess.Popen(
                [sys.executable, str(ROOT / "bench" / name), *TINY, "--dir", str(workdir), *extra],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            ),
            workdir,
        )
    results = {}
    try:
        for name, (proc, workdir) in procs.items():
            out, err = proc.communicate(timeout=120)
            results[name] = (proc.returncode, out, err, workdir)
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_last_line_is_the_result(name: str, outputs: dict[str, tuple[int, str, str, Path]]) -> None:
    code, out, err, workdir = outputs[name]
    assert code == 0, err[-2000:]
    lines = out.strip().splitlines()
    assert lines, f"{name} printed nothing on stdout"
    doc: Any = json.loads(lines[-1])
    assert isinstance(doc, dict)
    assert {"ratio", "goal", "met", "figures"} <= doc.keys()
    assert isinstance(doc["ratio"], float | int)
    assert isinstance(doc["goal"], float | int)
    assert isinstance(doc["met"], bool)
    assert isinstance(doc["figures"], dict) and doc["figures"]
    assert "disk" in doc["figures"]
    # Everything it wrote is gone.
    assert list(workdir.iterdir()) == []


def test_bad_option_is_a_clear_error() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_write_throughput.py"), "--size-mb", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--size-mb must be a positive number" in done.stderr
    assert "Traceback" not in done.stderr
