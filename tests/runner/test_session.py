"""The session API end to end: exact resume, preemption, emergency flush, stop requests."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from runner import EXIT_PREEMPTED, EXIT_SUCCEEDED
from runner.checkpoint import list_committed, read_manifest
from runner.store import LocalStore
from tests.runner.tinyproc import metric_steps, run_tiny, tiny_env

pytestmark = pytest.mark.slow
STEPS = 60


def test_resume_after_repeated_sigterm_is_bit_identical(tmp_path: Path) -> None:
    base = ["--steps", str(STEPS), "--seed", "7", "--checkpoint-every", "25"]
    straight = run_tiny(base, tiny_env(tmp_path / "a"))
    assert straight.code == EXIT_SUCCEEDED, straight.stderr
    assert straight.result is not None and straight.result["step"] == STEPS

    rng = random.Random(99)
    interrupted = tmp_path / "b"
    preemptions = 0
    for _ in range(6):
        target = rng.randint(3, 20)
        first = None

        def when(events: list, target: int = target) -> bool:
            steps = metric_steps(events)
            return bool(steps) and steps[-1] - steps[0] + 1 >= target

        run = run_tiny(base, tiny_env(interrupted), signal_when=when)
        steps = metric_steps(run.events)
        first = steps[0] if steps else None
        assert run.result is not None, run.stderr
        if run.code == EXIT_SUCCEEDED:
            break
        assert run.code == EXIT_PREEMPTED, run.stderr
        preemptions += 1
        # The flushed checkpoint is the step the loop stopped at, and its manifest exists.
        stopped_at = run.result["step"]
        committed = [e.step for e in list_committed(LocalStore(interrupted / "ck" / "r-test"))]
        assert committed[-1] == stopped_at
        assert (
            read_manifest(LocalStore(interrupted / "ck" / "r-test"), stopped_at).step == stopped_at
        )
        assert first is not None
    else:
        pytest.fail("the interrupted run never finished")
    assert preemptions >= 2, "the test should interrupt the run several times"
    assert run.result is not None
    assert run.result["params_sha256"] == straight.result["params_sha256"]


def test_emergency_flush_is_skipped_when_it_cannot_fit_the_window(tmp_path: Path) -> None:
    """With 1 ms left (less than the measured write: a stall and one and a half writes),
    no emergency save is started; the run exits 75 and resumes from the last periodic
    checkpoint."""
    env = tiny_env(tmp_path, TRAINBOT_TERMINATION_WINDOW_S="0.001")
    args = ["--steps", "200", "--checkpoint-every", "10", "--step-delay", "0.01"]

    def when(events: list) -> bool:
        return (
            any(t == "checkpoint_committed" for t, _, _ in events)
            and len(metric_steps(events)) % 10 == 5
        )

    run = run_tiny(args, env, signal_when=when)
    assert run.code == EXIT_PREEMPTED, run.stderr
    assert run.result is not None
    committed = [e.step for e in list_committed(LocalStore(tmp_path / "ck" / "r-test"))]
    assert committed and committed[-1] % 10 == 0
    assert committed[-1] < run.result["step"]
    assert any(
        t == "log" and "no time for an emergency checkpoint" in d["message"]
        for t, _, d in run.events
    )
    notice = [d for t, _, d in run.events if t == "preemption_notice"]
    assert notice and notice[0]["time_left_s"] <= 0.2


def test_stop_file_ends_the_run_with_a_checkpoint(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    env = tiny_env(tmp_path, TRAINBOT_STOP_FILE=str(stop))

    def when(events: list) -> bool:
        if len(metric_steps(events)) >= 5:
            stop.touch()
        return False

    run = run_tiny(["--steps", "5000", "--step-delay", "0.005"], env, signal_when=when)
    assert run.code == EXIT_SUCCEEDED, run.stderr
    assert run.result is not None and run.result["stop_reason"] == "stopped"
    committed = [e.step for e in list_committed(LocalStore(tmp_path / "ck" / "r-test"))]
    assert committed[-1] == run.result["step"] < 5000
    exits = [d for t, _, d in run.events if t == "exit"]
    assert exits == [{"code": 0, "reason": "stopped", "flush": None, "log_tail": None}]  # no report


def test_a_too_high_learning_rate_diverges_visibly(tmp_path: Path) -> None:
    run = run_tiny(["--steps", "30", "--lr", "50"], tiny_env(tmp_path))
    losses = [d["loss"] for t, _, d in run.events if t == "metrics"]
    assert len(losses) == 30
    assert any(v is None or v != v or v > 1000 * losses[0] for v in losses[5:]), losses


def test_events_carry_step_time_and_data_wait(tmp_path: Path) -> None:
    run = run_tiny(["--steps", "8", "--data-delay", "0.05"], tiny_env(tmp_path))
    assert run.code == EXIT_SUCCEEDED, run.stderr
    metrics = [d for t, _, d in run.events if t == "metrics"]
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert all(m["step_time_s"] > 0.05 for m in metrics)
    assert all(0.3 < m["data_wait_fraction"] <= 1.0 for m in metrics)
    types = [t for t, _, _ in run.events]
    assert types[0] == "started" and "restored" in types and types[-1] == "exit"
