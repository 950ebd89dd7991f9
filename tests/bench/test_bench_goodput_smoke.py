"""The goodput benchmark still runs end to end and still speaks its output format.

Run as a script on the smallest workload (one regime, two runs, a few seconds of
training): the real control plane, local provider and runner, so it takes tens of
seconds. Goodput at this size means nothing, so only the shape of the last line is
checked, never ``met`` or the figures' values. Its accounting, which is arithmetic over
rows, is checked exactly on made-up attempts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import pytest

from bench._goodput_child import ThrottledStore
from bench._goodput_ledger import AttemptRow, RunEvent, account
from bench.bench_goodput import (
    NOTICE_JITTER,
    Costs,
    Scenario,
    _regimes,
    ceiling,
    preemption_gaps,
    run_costs,
)
from tests.bench.running import last_line, run_bench

# Seed 2 draws a first gap longer than the run: one attempt each, the quickest story.
SMALLEST = [
    *("--quick", "--progress-s", "120", "--contenders", "auto,short", "--seed", "2"),
    *("--regimes", "notice"),  # quick's notice-jitter regime is the same run, slowed
]


@pytest.mark.slow
def test_bench_goodput_prints_its_figures_as_the_last_line(tmp_path: Path) -> None:
    result = last_line(
        "bench_goodput.py",
        *SMALLEST,
        "--dir",
        str(tmp_path),
        bench="goodput",
        goal=0.99,
        timeout=150,
    )
    assert result["met"] == all(c["met"] for c in result["checks"])
    figures = result["figures"]
    assert figures["headline"] == "base/notice/auto"
    assert set(figures["scenarios"]) == {"base"}  # quick: the hour scenario is the full run's
    regime = figures["scenarios"]["base"]["regimes"]["notice"]
    assert set(figures["scenarios"]["base"]["regimes"]) == {"notice"}
    # The ceiling is a goodput: at most 1, and no run beats it (a real design pays every
    # cost the ideal one pays, at least as often, and more).
    ceiling = regime["ceiling"]
    assert 0 < ceiling["ceiling"] <= 1
    assert 0 < ceiling["ceiling_expected"] <= 1
    assert ceiling["flush_fits_window"] is True
    assert result["ceiling"] == ceiling["ceiling"]
    assert result["goodput"] <= result["ceiling"]
    assert result["ratio"] == pytest.approx(result["goodput"] / result["ceiling"], abs=2e-4)
    assert {"startup", "restore_s", "write_s", "stall_s", "window", "mtbp"} <= set(
        ceiling["costs_s"]
    )
    runs = regime["runs"]
    assert set(runs) == {"auto", "short"}
    for fig in runs.values():
        assert isinstance(fig["goodput"], float)
        assert fig["goodput"] <= fig["ceiling"] == ceiling["ceiling"]
        assert fig["ratio"] <= 1
        assert isinstance(fig["paid_s"], float) and fig["paid_s"] > 0
        assert isinstance(fig["interval_s"], float) and fig["interval_s"] > 0
        assert {"reports", "below_notice", "unreported", "second_landed", "given_up_steps"} == set(
            fig["notice_flushes"]
        )
        assert set(fig["breakdown_s"]) == {
            "startup",
            "setup_restore",
            "steps_kept",
            "steps_redone",
            "loop_overhead",
            "loop_reporting",
            "tail",
            "shutdown",
            "control_plane_lag",
        }
    daly = figures["daly"]
    assert daly["chosen_interval_s"] == runs["auto"]["interval_s"]
    assert {"daly_stall_s", "daly_write_s", "error_vs_daly_stall", "error_vs_daly_write"} <= set(
        daly
    )
    # The judged optimum uses the M of preflight's rule: the notice fits, so only the
    # unannounced share of preemptions loses work.
    assert daly["emergency_fits_window"] is True
    assert daly["rule_mtbp_s"] > daly["mtbp_s"]
    assert figures["scenarios"]["base"]["scenario"]["compression"] == 60.0
    assert list(tmp_path.iterdir()) == []  # state, database and checkpoints were removed


def _events(attempt: str, *items: tuple[str, float, Mapping[str, object]]) -> list[RunEvent]:
    return [RunEvent(attempt, type_, t, data) for type_, t, data in items]


def _steps(attempt: str, steps: range, *, first_end: float) -> list[RunEvent]:
    return [
        RunEvent(attempt, "metrics", first_end + i, {"step": s, "step_time_s": 1.0})
        for i, s in enumerate(steps)
    ]


def test_ledger_splits_paid_time_and_keeps_the_last_run_of_each_step() -> None:
    # Attempt 1: up at 104, steps 1-10 (1 s each, 105-115), a commit at step 5, the
    # emergency flush commits at 116, exits at 117. Attempt 2 resumes from step 8 (so 9
    # and 10 are run again) and finishes at step 15.
    a1 = AttemptRow("a1", 1, launched=100.0, ended=117.5, state="PREEMPTED")
    a2 = AttemptRow("a2", 2, launched=118.0, ended=131.2, state="SUCCEEDED")
    periodic = {"step": 5, "write_s": 0.5, "stall_s": 0.02}
    flush = {"step": 10, "write_s": 0.5, "stall_s": 0.001}  # no copy: the loop has ended
    final = {"step": 15, "write_s": 0.5, "stall_s": 0.001}
    events = [
        *_events("a1", ("started", 104.0, {}), ("checkpoint_committed", 110.2, periodic)),
        *_steps("a1", range(1, 11), first_end=106.0),
        *_events("a1", ("checkpoint_committed", 116.0, flush), ("exit", 117.0, {})),
        *_events("a2", ("started", 121.0, {}), ("checkpoint_committed", 130.0, final)),
        *_steps("a2", range(9, 16), first_end=123.0),
        *_events("a2", ("exit", 131.0, {})),
    ]

    fig = account(
        [a2, a1],
        events,
        kept_steps=15,
        compression=10.0,
        killed_at={},
        now=1000.0,
        default_step_s=1.0,
    )

    parts = fig["breakdown_s"]
    assert parts == {
        "startup": 7.0,  # 4 + 3: launch to started
        "setup_restore": 2.0,  # started to the first step, twice
        "steps_kept": 15.0,
        "steps_redone": 2.0,  # steps 9 and 10 of attempt 1
        "loop_overhead": 0.0,
        "loop_reporting": 0.0,
        "tail": 2.0,  # last step to the last commit: the flush, then the final save
        "shutdown": 2.0,  # last commit to exit, twice
        "control_plane_lag": 0.7,  # exit to ended_at: 0.5 + 0.2
    }
    assert fig["paid_s"] == pytest.approx(sum(parts.values()))
    assert fig["paid_s"] == pytest.approx(30.7)
    # Start-up, shutdown and lag count once at scale, everything else ten times.
    assert fig["goodput"] == pytest.approx(15.0 / (30.7 - 9.7 * 0.9), abs=1e-4)
    assert fig["goodput_wall"] == pytest.approx(15.0 / 30.7, abs=1e-4)
    assert fig["preemptions"] == 1
    assert fig["preempted_before_first_checkpoint"] == 0
    assert fig["checkpoints"] == 3
    assert fig["steps_imputed"] == 0
    # Daly's C is the stall of the periodic saves: the flush and the final save, which
    # the loop did not go on from, are not counted.
    assert fig["stall_s_median"] == 0.02
    assert fig["write_s_median"] == 0.5


def test_an_attempts_interval_is_weighted_by_the_time_each_was_in_effect() -> None:
    from bench.bench_goodput import attempt_interval

    # Launched at 2 s; from t = 40 (of 100-200) a commit says 4 s: 2·(30/100) + 4·(70/100).
    assert attempt_interval(2.0, start=10.0, end=110.0, commits=[(40.0, 4.0)]) == 3.4
    assert attempt_interval(2.0, start=10.0, end=110.0, commits=[]) == 2.0
    # The same interval again, or a commit after the end, changes nothing.
    assert attempt_interval(2.0, start=0.0, end=10.0, commits=[(5.0, 2.0), (20.0, 9.0)]) == 2.0


def test_ledger_counts_the_training_process_start_as_start_up() -> None:
    """The supervisor's ``started`` comes when it spawns the training process; the
    process's own ``up`` mark comes once its imports are done. The start of a process
    is not simulated work: start-up (1x) runs to ``up``, the set-up (at scale) from it."""
    a1 = AttemptRow("a1", 1, launched=100.0, ended=110.0, state="SUCCEEDED")
    events = [
        *_events("a1", ("started", 101.0, {}), ("up", 103.5, {})),
        *_steps("a1", range(1, 6), first_end=105.0),
        *_events("a1", ("checkpoint_committed", 109.5, {"step": 5, "write_s": 0.5})),
        *_events("a1", ("exit", 110.0, {})),
    ]
    common = {"compression": 10.0, "killed_at": {}, "now": 1000.0, "default_step_s": 1.0}

    with_up = account([a1], events, kept_steps=5, **common)  # type: ignore[arg-type]
    without = account([a1], [e for e in events if e.type != "up"], kept_steps=5, **common)  # type: ignore[arg-type]

    assert with_up["breakdown_s"]["startup"] == 3.5  # launch to up
    assert with_up["breakdown_s"]["setup_restore"] == 0.5  # up to the first step's start
    assert without["breakdown_s"]["startup"] == 1.0  # launch to started
    assert without["breakdown_s"]["setup_restore"] == 3.0
    assert with_up["paid_s"] == without["paid_s"] == 10.0
    assert with_up["goodput"] > without["goodput"]  # 2.5 s more counted once, not 10 times


def test_ledger_counts_the_fixed_work_between_steps_at_its_wall_length() -> None:
    """Reporting a step takes the same wall time after a compressed step as after a real
    one: the median gap between steps, times the gaps, counts at 1x. A save's stall (the
    one long gap) is proportional to the state, and counts at scale."""
    a1 = AttemptRow("a1", 1, launched=100.0, ended=113.0, state="SUCCEEDED")
    gap, stall = 0.01, 0.5
    ends, t = [], 102.0
    for step in range(1, 11):
        t += 1.0  # the step
        ends.append(t)
        t += stall if step == 5 else gap  # then the loop's work before the next step
    steps = [
        RunEvent("a1", "metrics", end, {"step": s, "step_time_s": 1.0})
        for s, end in zip(range(1, 11), ends, strict=True)
    ]
    events = [*_events("a1", ("started", 102.0, {})), *steps]
    events += _events("a1", ("checkpoint_committed", ends[-1], {"step": 10, "write_s": 0.1}))
    events += _events("a1", ("exit", ends[-1] + 0.2, {}))

    fig = account(
        [a1], events, kept_steps=10, compression=10.0, killed_at={}, now=1000.0, default_step_s=1.0
    )

    parts = fig["breakdown_s"]
    assert parts["loop_reporting"] == pytest.approx(9 * gap)
    assert parts["loop_overhead"] == pytest.approx(stall - gap)
    uncompressed = parts["startup"] + parts["loop_reporting"] + parts["shutdown"]
    uncompressed += parts["control_plane_lag"]
    assert fig["goodput"] == pytest.approx(10.0 / (13.0 - uncompressed * 0.9), abs=1e-4)


def test_ledger_ends_a_killed_attempt_at_its_kill_and_imputes_lost_events() -> None:
    # Killed at 110 with no exit event: steps 6-8 ran but their events died with it.
    a1 = AttemptRow("a1", 1, launched=100.0, ended=111.0, state="PREEMPTED")
    events = [
        *_events("a1", ("started", 102.0, {})),
        *_steps("a1", range(1, 6), first_end=104.0),  # steps 1-5 end at 104-108
    ]

    fig = account(
        [a1],
        events,
        kept_steps=8,  # a commit at step 8 reached the store before the kill
        compression=10.0,
        killed_at={"a1": 110.0},
        now=1000.0,
        default_step_s=1.0,
    )

    parts = fig["breakdown_s"]
    assert parts["startup"] == 2.0
    assert parts["tail"] == 2.0  # 108 to the kill at 110: steps whose events were lost
    assert parts["shutdown"] == 0.0  # a killed process does not tear down
    assert parts["control_plane_lag"] == 1.0
    assert fig["steps_imputed"] == 3
    assert fig["progress_s"] == 8.0
    assert fig["preempted_before_first_checkpoint"] == 1  # no commit event arrived


# Costs at scale: launch 2 s, set-up 1 s, restore and write 10 s, stall 0.5 s.
COSTS = Costs(launch_s=2.0, setup_s=1.0, restore_s=10.0, write_s=10.0, stall_s=0.5)


def test_ceiling_with_a_notice_charges_start_restore_and_one_flush_per_preemption() -> None:
    # Notices 100 s and 200 s after the first two starts; the third attempt finishes.
    cl = ceiling(COSTS, progress_s=1000.0, mtbp_s=600.0, window_s=120.0, gaps=[100, 200, 1e9])

    # Attempt 1 trains through its window and flushes: 100 + 120 - 1 - 10 = 209 s kept;
    # attempt 2 restores first: 320 - 1 - 10 - 10 = 299 s; attempt 3 does the last 492 s.
    assert cl.preemptions == 2
    assert cl.flush_fits and cl.overhead == 0.0 and cl.interval_s is None
    paid = 1000 + 3 * (2 + 1) + 2 * (10 + 10) + 10  # P + (N+1)S + N(R + W) + final W
    assert sum(cl.parts_s.values()) == pytest.approx(paid)
    assert cl.goodput == pytest.approx(1000 / paid)
    n = (1000 + 1 + 10) / (600 + 120 - 1 - 10 - 10)  # E[N]
    assert cl.preemptions_expected == pytest.approx(n)
    assert cl.goodput_expected == pytest.approx(1000 / (1000 + (n + 1) * 3 + n * 20 + 10))
    assert 0 < cl.goodput_expected <= 1


def test_ceiling_without_a_notice_is_daly_at_the_measured_costs() -> None:
    cl = ceiling(COSTS, progress_s=1000.0, mtbp_s=600.0, window_s=0.0, gaps=[100, 200, 1e9])

    tau = math.sqrt(2 * 0.5 * 600) - 0.5  # Daly's interval, above the write time
    assert cl.interval_s == pytest.approx(tau)
    assert cl.overhead == pytest.approx(0.5 / tau)
    assert cl.lost_per_preemption_s == pytest.approx(tau / 2 + 10)
    paid = 1000 * (1 + 0.5 / tau) + 3 * 3 + 2 * (10 + tau / 2 + 10) + 10
    assert cl.preemptions == 2
    assert cl.goodput == pytest.approx(1000 / paid)
    assert (
        cl.goodput
        < ceiling(
            COSTS, progress_s=1000.0, mtbp_s=600.0, window_s=120.0, gaps=[100, 200, 1e9]
        ).goodput
    )


def test_ceiling_of_a_run_never_preempted_is_one_start_and_the_final_save() -> None:
    cl = ceiling(COSTS, progress_s=1000.0, mtbp_s=600.0, window_s=120.0, gaps=[1e9])

    assert cl.preemptions == 0
    assert cl.goodput == pytest.approx(1000 / (1000 + 3 + 10))


def test_the_gaps_replayed_are_the_ones_the_preemptor_draws() -> None:
    drawn = preemption_gaps(7, 20.0)
    first = [next(drawn) for _ in range(5)]
    again = preemption_gaps(7, 20.0)

    assert [next(again) for _ in range(5)] == first
    assert all(g > 0 for g in first)


def test_a_run_measured_by_the_ledger_stays_under_the_ceiling_of_its_own_costs() -> None:
    # The made-up run of the first ledger test, with its restore events: notice at 115
    # (11 s after attempt 1 started), a 3 s window, compression 10.
    a1 = AttemptRow("a1", 1, launched=100.0, ended=117.5, state="PREEMPTED")
    a2 = AttemptRow("a2", 2, launched=118.0, ended=131.2, state="SUCCEEDED")
    events = [
        *_events(
            "a1",
            ("started", 104.0, {}),
            ("restored", 104.5, {"step": 0, "restore_s": 0.0}),
            ("checkpoint_committed", 110.2, {"step": 5, "write_s": 0.5, "stall_s": 0.02}),
            ("checkpoint_committed", 116.0, {"step": 10, "write_s": 0.5, "stall_s": 0.001}),
            ("exit", 117.0, {}),
        ),
        *_steps("a1", range(1, 11), first_end=106.0),
        *_events(
            "a2",
            ("started", 121.0, {}),
            ("restored", 121.9, {"step": 8, "restore_s": 0.8}),
            ("checkpoint_committed", 130.0, {"step": 15, "write_s": 0.5, "stall_s": 0.001}),
            ("exit", 131.0, {}),
        ),
        *_steps("a2", range(9, 16), first_end=123.0),
    ]
    common = {"compression": 10.0, "killed_at": {}, "now": 1000.0}
    fig = account([a1, a2], events, kept_steps=15, default_step_s=1.0, **common)  # type: ignore[arg-type]
    costs = run_costs([a1, a2], events, **common)  # type: ignore[arg-type]

    # Medians at scale: launch 4 and 3 s (at 1x); set-up less the read 1.0 and 0.2 s (x10).
    assert costs == pytest.approx(
        {"launch_s": 3.5, "setup_s": 6.0, "restore_s": 8.0, "write_s": 5.0, "stall_s": 0.2}
    )
    cl = ceiling(
        Costs(**costs),  # type: ignore[arg-type]
        progress_s=150.0,
        mtbp_s=600.0,
        window_s=30.0,
        gaps=[110.0, 1e9],
    )
    # The ideal keeps 110 + 30 - 6 - 5 = 129 s in attempt 1, then restores and does 21 s.
    assert cl.preemptions == 1
    assert cl.goodput == pytest.approx(150 / (2 * 3.5 + 6 + 6 + 8 + 150 + 2 * 5))
    assert fig["goodput"] < cl.goodput <= 1


@pytest.mark.slow
def test_bench_goodput_rejects_a_bad_option_in_one_line() -> None:
    done = run_bench("bench_goodput.py", "--contenders", "short", timeout=60)

    assert done.returncode == 2
    assert "--contenders: give auto" in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


def test_the_notice_jitter_regime_slows_uploads_from_the_notice_on(tmp_path: Path) -> None:
    """The regime of issue 29: the base notice window, and from the notice on a store
    whose uploads go f times slower, f lognormal(0, sigma) drawn once per attempt."""
    from runner.store import LocalStore

    scenario = Scenario(
        mtbp_s=600.0,
        checkpoint_s=10.0,
        step_s=3.0,
        progress_s=900.0,
        window_s=120.0,
        compression=60.0,
        state_mb=32.0,
        seed=1,
    )
    regimes = _regimes(scenario, ["notice", "notice-jitter", "no-notice"], jitter=0.5)
    assert [(r.name, r.notice_jitter) for r in regimes] == [
        ("notice", 0.0),
        ("notice-jitter", 0.5),
        ("no-notice", 0.0),
    ]
    assert regimes[0].window_wall_s == regimes[1].window_wall_s == 2.0
    assert NOTICE_JITTER == 0.5

    import random

    noticed = False
    store = ThrottledStore(
        LocalStore(tmp_path),
        1e6,
        noticed=lambda: noticed,
        notice_jitter=0.5,
        rng=random.Random("att-1"),
    )
    assert store._write_bps() == 1e6 and store.notice_factor is None
    noticed = True
    slowed = store._write_bps()
    factor = random.Random("att-1").lognormvariate(0.0, 0.5)
    assert store.notice_factor == pytest.approx(factor)
    assert slowed == pytest.approx(1e6 / factor) and store._write_bps() == slowed
