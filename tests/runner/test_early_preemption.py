"""A preemption notice at any moment of an attempt's life ends it resumable (exit 75).

The notice is swept across an attempt: before the command starts, right after it starts
(before the training script has a handler or a session), before the first checkpoint,
during a checkpoint write, and just before the last step; for a session-API script (the
tiny example) and a plain script under ``exec --sync-dir``. The SIGTERM goes to the whole
process group, as a spot instance's shutdown and the local provider send it. A restart
on the same store resumes (from step 0 when nothing was committed) and ends with the
same state as a run that was never interrupted.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from runner import EXIT_PREEMPTED, EXIT_SUCCEEDED
from runner.layout import list_committed
from runner.preemption import Notice, PreemptionFlag
from runner.store import LocalStore
from runner.sync import CheckpointSync
from tests.runner.stand_ins import Recorder, supervising
from tests.runner.tinyproc import TINY, preempt_when, tiny_env

EXEC = [sys.executable, "-m", "runner.cli", "exec"]
SCRIPTS = Path(__file__).parent / "scripts"
PLAIN = [sys.executable, str(SCRIPTS / "plain_counter.py")]
MOMENTS = ["start", "before_first", "mid_write", "before_last"]


def _env(tmp: Path, run_id: str) -> dict[str, str]:
    env = tiny_env(tmp, run_id=run_id, TRAINBOT_SCRATCH_DIR=str(tmp / "scratch"))
    env.pop("TRAINBOT_EVENTS_FILE")
    (tmp / "scratch").mkdir(exist_ok=True)
    return env


def _start(args: list[str], env: Mapping[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*EXEC, *args],
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as on an instance
    )


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
    except OSError:
        pass
    return out


def _committed(store: Path) -> list[int]:
    return [e.step for e in list_committed(LocalStore(store))] if store.exists() else []


def test_sleep_sent_sigterm_one_second_in_exits_75(tmp_path: Path) -> None:
    proc = _start(["--", "sleep", "60"], _env(tmp_path, "r-sleep"))
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)  # to the supervisor only: it forwards the notice
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_PREEMPTED, err


#: What ``exec`` imports after its SIGTERM handler is installed (boto3 and the GCS client
#: come with the store, msgspec and orjson with telemetry).
_HEAVY = ("runner.supervisor", "runner.store", "runner.telemetry", "runner.preemption")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_exec_catches_sigterm_before_its_heavy_imports(tmp_path: Path) -> None:
    """The supervisor's own start: importing ``runner.cli`` loads none of what ``exec``
    needs (so ``main`` installs its SIGTERM handler first thing), and a SIGTERM at the
    first moment the process catches it is a preemption notice: exit 75, not 143."""
    probe = f"import sys, runner.cli; print([m for m in {_HEAVY!r} if m in sys.modules])"
    env = _env(tmp_path, "r-early")
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stderr
    proc = _start(["--", "sleep", "60"], env)

    def catches_sigterm() -> bool:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            return False
        caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
        return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))

    deadline = time.monotonic() + 30
    while not catches_sigterm():
        assert proc.poll() is None and time.monotonic() < deadline, "no handler installed"
        time.sleep(0.001)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_PREEMPTED, err


def test_a_notice_before_the_command_starts_does_not_start_it(tmp_path: Path) -> None:
    """The notice came during the restore (or anything before the start): the command is
    not started at all, and the attempt says it was preempted."""
    marker = tmp_path / "started"
    flag = PreemptionFlag()
    now = time.monotonic()
    flag.set(Notice(source="aws", reason="test", received_at=now, deadline=now + 120))
    sink = Recorder()
    sync = CheckpointSync(store=LocalStore(tmp_path / "ck"), root=tmp_path / "sync")
    script = f"open({str(marker)!r}, 'w')"
    code = supervising(script, sink, env=_env(tmp_path, "r-before"), flag=flag, sync=sync).run()
    assert code == EXIT_PREEMPTED
    assert not marker.exists()
    assert [t for t, _ in sink.events] == ["preemption_notice", "exit"]
    assert sink.events[-1][1] == {"code": EXIT_PREEMPTED, "reason": "preempted"}


@pytest.mark.parametrize(
    ("on_term", "exit_code"),
    [
        ("sys.exit(0)", 0),  # it stops on SIGTERM, as it was told
        ("raise RuntimeError('interrupted')", 1),  # it crashes
        ("raise KeyboardInterrupt", -signal.SIGINT),  # Python re-raises SIGINT
        ("signal.signal(15, signal.SIG_DFL); os.kill(os.getpid(), 15)", -signal.SIGTERM),
    ],
    ids=["exits-0", "crashes-1", "keyboard-interrupt", "dies-of-sigterm"],
)
def test_a_plain_script_ends_preempted_whatever_it_exits_after_a_notice(
    tmp_path: Path, on_term: str, exit_code: int
) -> None:
    """A metadata notice (a poller sets the flag) is forwarded as SIGTERM; whatever the
    script then does, the attempt ends preempted."""
    script = (
        "import os, signal, sys, time\n"
        "def on(*_):\n"
        f"    {on_term}\n"
        "signal.signal(signal.SIGTERM, on)\n"
        "time.sleep(30)\n"
    )
    flag = PreemptionFlag()
    sink = Recorder()
    sup = supervising(script, sink, env=_env(tmp_path, "r-codes"), flag=flag, poll_s=0.02)

    def notice() -> None:
        while sup.child is None:
            time.sleep(0.01)
        time.sleep(0.3)  # the child has installed its handler by now
        now = time.monotonic()
        flag.set(Notice(source="gcp", reason="test", received_at=now, deadline=now + 30))

    threading.Thread(target=notice, daemon=True).start()
    assert sup.run() == EXIT_PREEMPTED
    assert sup.child_code == exit_code
    kind, data = sink.events[-1]
    if exit_code < 0:  # killed by a signal, with nothing said: the exit says so (issue 29)
        assert data.pop("flush")["before_start"] is True
    assert (kind, data) == ("exit", {"code": EXIT_PREEMPTED, "reason": "preempted"})


# --- a plain script under exec --sync-dir -----------------------------------------------


def _chain(steps: int) -> str:
    state = hashlib.sha256(b"seed").hexdigest()
    for step in range(steps):
        state = hashlib.sha256(f"{state}:{step}".encode()).hexdigest()
    return state


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_plain_script_preempted_at_any_moment_resumes(tmp_path: Path, moment: str) -> None:
    env = _env(tmp_path, "r-plain")
    store = tmp_path / "ck" / "r-plain"
    progress = tmp_path / "progress"
    # Steps of 0.15 s: the supervisor (which looks every 0.2 s) sees ckpt-8 closed before
    # step 11, however busy the machine; with 0.05 s steps that was a race.
    script = [
        *PLAIN,
        "--steps",
        "12",
        "--every",
        "4",
        "--step-s",
        "0.15",
        "--progress",
        str(progress),
    ]

    def at(text: str) -> Callable[[], bool]:
        return lambda: progress.exists() and progress.read_text() == text

    ready = {
        "start": lambda: bool(_children(proc.pid)),
        "before_first": at("running 2"),
        "mid_write": at("writing 8"),
        "before_last": at("running 11"),
    }[moment]
    sync1 = tmp_path / "instance-1" / "ckpt"
    proc = _start(["--sync-dir", str(sync1), "--settle", "0.3", "--", *script], env)
    code, _, err = preempt_when(proc, ready)
    assert code == EXIT_PREEMPTED, err
    committed = _committed(store)
    if moment in ("start", "before_first"):
        assert committed == []
        if moment == "before_first":  # it ran, wrote nothing: say so
            assert "no checkpoint was synced" in err and "starts from step 0" in err
    if moment == "mid_write":
        assert 8 not in committed, "a checkpoint torn by the kill must not be committed"
    if moment == "before_last":
        assert committed == [4, 8]  # ckpt-8 was closed, so committed though not settled
    resume = committed[-1] if committed else 0

    # A new instance: an empty directory, the same store.
    sync2 = tmp_path / "instance-2" / "ckpt"
    done = subprocess.run(
        [*EXEC, "--sync-dir", str(sync2), "--settle", "0.3", "--", *script],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == EXIT_SUCCEEDED, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"step": 12, "state": _chain(12), "resumed_from": resume}


# --- a session-API script: the tiny example -----------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("reference")
    env = _env(tmp, "r-ref")
    out = subprocess.run(
        [sys.executable, "-m", "runner.examples.tiny", *TINY, "--steps", "12"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return str(json.loads(out.stdout.strip().splitlines()[-1])["params_sha256"])


@pytest.mark.slow  # two real trainings a case: about 8 s each
@pytest.mark.parametrize("moment", MOMENTS)
def test_a_session_script_preempted_at_any_moment_resumes(
    tmp_path: Path, moment: str, uninterrupted: str
) -> None:
    env = _env(tmp_path, "r-tiny")
    store = tmp_path / "ck" / "r-tiny"
    steps_log = tmp_path / "scratch" / "train.log"  # one byte per step
    tiny = [sys.executable, "-m", "runner.examples.tiny", *TINY, "--steps", "12"]
    tiny += ["--checkpoint-every", "4", "--step-delay", "0.05", "--scratch-fill-mb", "0.000001"]

    def steps() -> int:
        return steps_log.stat().st_size if steps_log.exists() else 0

    ready = {
        # The child exists and is importing torch: no session, no handler of its own.
        "start": lambda: bool(_children(proc.pid)),
        "before_first": lambda: steps() >= 2,
        # As soon as the save of step 4 has started writing its step directory.
        "mid_write": lambda: (store / "step-0000000004").exists(),
        # Step 11 of 12 is under way (its 0.05 s delay): the loop stops after it.
        "before_last": lambda: steps() >= 10,
    }[moment]
    proc = _start(["--", *tiny], env)
    code, _, err = preempt_when(proc, ready)
    assert code == EXIT_PREEMPTED, err
    committed = _committed(store)
    if moment == "start":
        assert committed == [] and steps() == 0
    else:
        assert committed, "the session flushes a checkpoint on the notice"
    resume = committed[-1] if committed else 0

    before = steps()
    done = subprocess.run(
        [*EXEC, "--", *tiny], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == EXIT_SUCCEEDED, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["step"] == 12
    assert steps() - before == 12 - resume, "the restart resumes from the newest checkpoint"
    assert result["params_sha256"] == uninterrupted
