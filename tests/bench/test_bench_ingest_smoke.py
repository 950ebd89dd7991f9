"""The ingest benchmark still runs and still speaks its output format.

Run as the Makefile runs it (a script, ``--quick``) on a tiny workload; timings at this
size mean nothing, so only the shape of the last line is checked, never ``met`` or the
figures' values.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.bench.running import last_line

TINY = ["--quick", "--batches", "2", "--batch-size", "50", "--repeats", "1", "--alert-trials", "1"]


def test_bench_ingest_prints_its_figures_as_the_last_line(tmp_path: Path) -> None:
    result = last_line("bench_ingest.py", *TINY, "--dir", str(tmp_path), bench="ingest", goal=1.0)
    figures = result["figures"]
    assert isinstance(figures["sqlite_events_per_s"], float)
    assert isinstance(figures["alert_latency_s"], float)
    assert set(figures["breakdown_us_per_event"]) == {"decode_batch", "rules", "store_and_rest"}
    if os.environ.get("TRAINBOT_TEST_POSTGRES_URL"):
        assert isinstance(figures["postgres_events_per_s"], float)
    else:
        assert figures["postgres_events_per_s"] is None
        assert "TRAINBOT_TEST_POSTGRES_URL" in figures["postgres_skipped"]
    assert list(tmp_path.iterdir()) == []  # the SQLite file was removed
