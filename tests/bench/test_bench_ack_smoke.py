"""The ack-latency benchmark still runs and still speaks its output format.

Run as the Makefile runs it (a script), on a tiny workload and without the training run
(which only adds load); timings at this size mean nothing, so only the shape of the last
line is checked, never ``met`` or the values.
"""

from __future__ import annotations

from pathlib import Path

from tests.bench.running import last_line

TINY = ["--quick", "--rounds", "1", "--concurrency", "5", "--no-training"]


def test_bench_ack_latency_prints_its_figures_as_the_last_line(tmp_path: Path) -> None:
    result = last_line(
        "bench_ack_latency.py", *TINY, "--dir", str(tmp_path), bench="ack_latency", goal=1.0
    )
    figures = result["figures"]
    for contender in ("http", "bolt_dispatch"):
        assert set(figures[contender]) >= {"p50_ms", "p99_ms", "requests"}
        assert figures[contender]["requests"] == 5
        assert figures[contender]["p50_ms"] <= figures[contender]["p99_ms"]
    assert figures["rounds"] == 1
    assert {k: len(v) for k, v in figures["p99_ms_by_round"].items()} == {
        "http": 1,
        "bolt_dispatch": 1,
    }
    assert figures["failures"] == {"http": 0, "bolt_dispatch": 0}
    assert figures["replies"] == figures["commands"], "every command's work ran and replied"
    assert figures["training_run"] is None
    assert list(tmp_path.iterdir()) == []  # the state directory was removed


def test_quick_mode_is_five_rounds() -> None:
    """The goal is judged on five quick runs of five rounds each."""
    from bench.bench_ack_latency import QUICK_ROUNDS

    assert QUICK_ROUNDS == 5
