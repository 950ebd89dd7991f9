"""The start-up benchmark still runs and still speaks its output format.

Run as a script on the smallest workload (two small pure-Python wheels, one round): real
``pip download``, a loopback index, setup into a virtual environment, the archive and its
restore. Timings at this size mean nothing on a shared machine, so only the shape of the
last line and the relations that hold whatever the timings are checked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.running import last_line, run_bench


@pytest.mark.slow
def test_bench_startup_prints_its_figures_as_the_last_line(tmp_path: Path) -> None:
    result = last_line(
        "bench_startup.py",
        *("--quick", "--repeats", "1", "--packages", "six,attrs", "--dir", str(tmp_path)),
        bench="startup",
        goal=1.3,
        timeout=180,
    )
    checks = {c["check"]: c for c in result["checks"]}
    assert set(checks) == {"ready_vs_raw", "ready_vs_setup"}
    assert checks["ready_vs_raw"]["value"] == result["ratio"]
    assert checks["ready_vs_setup"]["goal"] == 0.25
    assert result["met"] == all(c["met"] for c in checks.values())
    figures = result["figures"]
    assert figures["packages"] == ["six", "attrs"] and figures["wheels"] >= 2
    assert figures["archive_bytes"] > 0, "setup installed something, and it was archived"
    # Attempt 2's start-up is its code plus its environment; raw is the read plus tar.
    ready = figures["attempt2_code_s"] + figures["attempt2_restore_s"]
    assert figures["attempt2_ready_s"] == pytest.approx(ready, abs=2e-4)
    assert figures["raw_s"] == pytest.approx(
        figures["raw_read_s"] + figures["raw_unpack_s"], abs=2e-4
    )
    assert figures["setup_s"] > 0 and figures["attempt1_ready_s"] >= figures["setup_s"]
    assert list(tmp_path.iterdir()) == []  # wheels, store, index and code dirs were removed


def test_bench_startup_rejects_an_empty_package_list_in_one_line(tmp_path: Path) -> None:
    done = run_bench("bench_startup.py", "--packages", ",", "--dir", str(tmp_path), timeout=60)

    assert done.returncode == 1
    assert done.stderr.strip() == "error: --packages names no package"
    assert done.stdout == ""
