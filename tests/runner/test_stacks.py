"""The stacks of a stalled step (runner.stacks): when they are due, and who can give them.

A plain script (no trainbot import) gets the site hook through PYTHONPATH and dumps; a
process started with ``python -I`` skips it, gets no signal and is left running; the
supervisor's watch asks once per stall, at 3/4 of max(factor × median step time, floor).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from runner.stacks import DUMP_AT, StackDumper, StallWatch, dump_stacks, stall_limit_s
from tests.runner.stand_ins import Recorder
from tests.waiting import wait_until

PLAIN = """
import sys, threading, time
def wait_for_rank_3():
    threading.Event().wait()
print("ready", flush=True)
wait_for_rank_3()
"""


def start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, *args, "-c", PLAIN], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_a_plain_script_dumps_and_an_isolated_one_is_left_alone(tmp_path: Path) -> None:
    sink = Recorder()
    dumper = StackDumper(tmp_path / "stacks", sink=sink, feed=None, watch=StallWatch())
    env = dumper.env({"PATH": "/usr/bin:/bin"})
    plain = start([], env)
    isolated = start(["-I"], env)  # skips PYTHONPATH, so the site hook
    try:
        wait_until(lambda: (tmp_path / "stacks" / f"{plain.pid}.pid").exists(), what="hook")
        text, answered = dump_stacks(tmp_path / "stacks")
        assert answered == 1
        assert text.startswith(f"--- process {plain.pid}: ")
        assert "Current thread" in text and "in wait_for_rank_3" in text
        assert not (tmp_path / "stacks" / f"{isolated.pid}.pid").exists()
        time.sleep(0.2)
        # Asked, the dumping process goes on; the other was never signalled.
        assert plain.poll() is None and isolated.poll() is None
    finally:
        for proc in (plain, isolated):
            proc.kill()
            proc.wait()


def test_a_dead_processes_pid_file_is_not_signalled(tmp_path: Path) -> None:
    directory = tmp_path / "stacks"
    directory.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (directory / f"{gone.pid}.pid").write_text("12345")  # an old process's start time
    assert dump_stacks(directory, wait_s=0.2) == ("", 0)


def test_the_watch_asks_once_per_stall_at_three_quarters_of_the_limit() -> None:
    assert stall_limit_s([0.5, 0.5, 9.0], factor=20, floor_s=3) == 10.0  # the median's
    assert stall_limit_s([0.01], factor=20, floor_s=3) == 3.0  # the floor's
    assert stall_limit_s([], factor=20, floor_s=3) == 3.0
    watch = StallWatch(factor=20, floor_s=600)
    assert watch.due(now=10_000) is None  # no step yet: nothing to call stalled
    for step in range(1, 11):
        watch.saw(step, 2.0, now=100.0 + 2 * step)  # step 10 at 120
    limit = watch.limit_s()
    assert limit == 600.0
    assert watch.due(now=120 + DUMP_AT * limit - 1) is None
    assert watch.due(now=120 + DUMP_AT * limit) == DUMP_AT * limit
    assert watch.due(now=120 + limit * 5) is None  # once per stall
    watch.saw(11, 2.0, now=2000)  # it moved: the next stall is asked about again
    assert watch.due(now=2000 + DUMP_AT * limit) is not None


def test_the_environments_own_sitecustomize_still_runs(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    dumper = StackDumper(tmp_path / "stacks", sink=Recorder(), feed=None, watch=StallWatch())
    env = dumper.env({"PATH": "/usr/bin:/bin", "PYTHONPATH": str(theirs)})
    code = (
        "import os, sys; print(os.environ.get('THEIRS_RAN'), sys.modules['sitecustomize'].__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["1", str(theirs / "sitecustomize.py")], out.stderr
    assert len(list((tmp_path / "stacks").glob("*.pid"))) == 1  # and ours registered


def test_steps_read_in_bursts_stand_still_for_their_usual_gap() -> None:
    # A framework's steps, read from its files at each save: 100 steps of 5 s every 500 s.
    watch = StallWatch(factor=20, floor_s=120)
    for burst in range(3):
        for step in range(burst * 100, burst * 100 + 100):
            watch.saw(step, 5.0, now=500.0 * burst)  # one read: all at once
    assert watch.limit_s() == 750.0  # 1.5 x the 500 s between bursts, past 20 x 5 s
    last = watch.moved_at
    assert last is not None
    assert watch.due(now=last + 500) is None  # the next burst is simply not due yet
    assert watch.due(now=last + DUMP_AT * 750) is not None
