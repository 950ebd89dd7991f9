"""`trainbot-runner exec`: signal forwarding, telemetry to the ingest API, file sync."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from runner import EXIT_PREEMPTED, EXIT_SUCCEEDED
from runner.checkpoint import list_committed, read_manifest
from runner.preemption import Notice, PreemptionFlag
from runner.store import LocalStore
from runner.supervisor import Supervisor
from runner.telemetry import NullSink
from tests.fakes.ingest import FakeIngest
from tests.runner.stand_ins import Recorder
from tests.runner.tinyproc import ROOT, TINY, first_line_then_stop, preempt_once_synced, tiny_env

pytestmark = pytest.mark.slow


def _exec(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "runner.cli", "exec", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _reporting_env(tmp_path: Path, ingest: FakeIngest, run_id: str, **extra: str) -> dict[str, str]:
    """The tiny run's environment, its events sent to ``ingest`` (with its token) as
    attempt ``{run_id}-1`` instead of written to a file."""
    env = tiny_env(tmp_path, run_id=run_id)
    env.pop("TRAINBOT_EVENTS_FILE")
    env.update(
        TRAINBOT_INGEST_URL=ingest.url,
        TRAINBOT_TOKEN=ingest.token,
        TRAINBOT_ATTEMPT_ID=f"{run_id}-1",
        TRAINBOT_SPOOL_DIR=str(tmp_path / "spool"),
        **extra,
    )
    return env


def test_sigterm_to_the_supervisor_flushes_the_child_and_reports_everything(
    tmp_path: Path,
) -> None:
    with FakeIngest(token="tok-1").start() as ingest:
        env = _reporting_env(tmp_path, ingest, "r-sup", TRAINBOT_CHECKPOINT_EVERY_STEPS="1000")
        proc = _exec(
            ["--", sys.executable, "-m", "runner.examples.tiny", *TINY, "--steps", "100000"], env
        )

        def metrics() -> int:
            return sum(1 for e in ingest.accepted if e.type == "metrics")

        assert ingest.wait_for(lambda: metrics() >= 10, timeout=60), proc.stderr
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == EXIT_PREEMPTED, err
        assert ingest.wait_for(lambda: any(e.type == "exit" for e in ingest.accepted), 10)
    types = [e.type for e in ingest.accepted]
    assert types.count("exit") == 1 and types.count("preemption_notice") == 1
    exit_event = next(e for e in ingest.accepted if e.type == "exit")
    flush = exit_event.data.pop("flush")
    assert isinstance(exit_event.data.pop("log_tail"), str)  # the command's last lines
    assert exit_event.data == {"code": EXIT_PREEMPTED, "reason": "preempted"}
    committed = [e for e in ingest.accepted if e.type == "checkpoint_committed"]
    assert committed, "the emergency flush must be reported"
    # The session's report of its flush travels with the supervisor's exit (issue 29).
    assert flush["committed_step"] == committed[-1].data["step"]
    assert all(f["landed"] for f in flush["flushes"])
    store = LocalStore(tmp_path / "ck" / "r-sup")
    assert list_committed(store)[-1].step == committed[-1].data["step"]
    # Seqs are 0..n-1 with no gaps and nothing accepted twice.
    seqs = ingest.accepted_seqs()
    assert sorted(seqs) == list(range(len(seqs)))
    assert all(e.attempt == "r-sup-1" and e.run == "r-sup" for e in ingest.accepted)
    assert "system" in types and "heartbeat" in types


FILE_WRITER = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    root = pathlib.Path(os.environ["TRAINBOT_CHECKPOINT_DIR"])
    existing = sorted(root.glob("epoch-*"))
    start = int(existing[-1].name.split("-")[1]) if existing else 0
    print("start", start, flush=True)
    stop = False
    def on_term(*_):
        global stop
        stop = True
    signal.signal(signal.SIGTERM, on_term)
    for epoch in range(start + 1, 1000):
        time.sleep(0.2)
        d = root / f"epoch-{epoch}"
        d.mkdir(parents=True)
        (d / "weights.bin").write_bytes(bytes([epoch % 256]) * 1000)
        if stop:
            sys.exit(0)
    """
)


def test_a_script_that_only_writes_files_gets_them_synced_and_restored(tmp_path: Path) -> None:
    env = tiny_env(tmp_path, run_id="r-files")
    env.pop("TRAINBOT_EVENTS_FILE")
    sync = tmp_path / "instance-1" / "ckpt"
    proc = _exec(
        ["--sync-dir", str(sync), "--settle", "0.3", "--", sys.executable, "-c", FILE_WRITER], env
    )
    err = preempt_once_synced(proc, sync, timeout_s=30)
    # The script exits 0 after SIGTERM, but the run was preempted with files committed.
    assert proc.returncode == EXIT_PREEMPTED, err
    store = LocalStore(tmp_path / "ck" / "r-files")
    steps = [e.step for e in list_committed(store)]
    assert steps and steps == sorted(steps)
    newest = read_manifest(store, steps[-1])
    assert newest.kind == "files" and newest.label == f"epoch-{steps[-1]}"

    # A new instance (empty disk) gets the newest directory back before the script starts.
    sync2 = tmp_path / "instance-2" / "ckpt"
    proc = _exec(
        ["--sync-dir", str(sync2), "--", sys.executable, "-c", FILE_WRITER + "\nsys.exit(0)"],
        env,
    )
    # The script resumes from the restored epoch; stop it once it says so.
    first_line = first_line_then_stop(proc, timeout_s=30)
    assert first_line.strip() == f"start {steps[-1]}"
    restored = sync2 / f"epoch-{steps[-1]}" / "weights.bin"
    assert restored.read_bytes() == bytes([steps[-1] % 256]) * 1000


def test_exit_codes_pass_through(tmp_path: Path) -> None:
    env = tiny_env(tmp_path)
    env.pop("TRAINBOT_EVENTS_FILE")
    ok = _exec(["--", sys.executable, "-c", "pass"], env)
    ok.communicate(timeout=30)
    assert ok.returncode == EXIT_SUCCEEDED
    bad = _exec(["--", sys.executable, "-c", "import sys; sys.exit(3)"], env)
    bad.communicate(timeout=30)
    assert bad.returncode == 3
    missing = _exec(["--", str(tmp_path / "no-such-program")], env)
    _, err = missing.communicate(timeout=30)
    assert missing.returncode == 1 and "cannot start" in err and "Traceback" not in err
    none = _exec([], env)
    _, err = none.communicate(timeout=30)
    assert none.returncode == 1 and "no command given" in err


def test_env_is_passed_to_the_child(tmp_path: Path) -> None:
    env = tiny_env(tmp_path, run_id="r-env")
    env.pop("TRAINBOT_EVENTS_FILE")
    out_file = tmp_path / "env.txt"
    code = "import os, sys; open(sys.argv[1], 'w').write(repr(sorted((k, v) for k, v in os.environ.items() if k.startswith('TRAINBOT_'))))"
    proc = _exec(["--", sys.executable, "-c", code, str(out_file)], env)
    proc.communicate(timeout=30)
    seen = dict(eval(out_file.read_text()))
    assert seen["TRAINBOT_RUN_ID"] == "r-env"
    assert seen["TRAINBOT_CHECKPOINT_URI"] == str(tmp_path / "ck")
    assert "TRAINBOT_EVENTS_FILE" in seen and "TRAINBOT_TERMINATION_WINDOW_S" in seen
    assert os.fspath(ROOT) in env["PYTHONPATH"]


def test_exec_runs_a_command_without_importing_torch(tmp_path: Path) -> None:
    """Every restart pays for the supervisor's start before the training process starts:
    it must not import torch (only the training process does), with or without a synced
    directory."""
    env = tiny_env(tmp_path)
    env.pop("TRAINBOT_EVENTS_FILE")
    probe = textwrap.dedent(
        """
        import sys
        from runner.cli import main
        for args in (["exec"], ["exec", "--sync-dir", sys.argv[1]]):
            code = main([*args, "--", sys.executable, "-c", "pass"])
            assert code == 0, code
        print("torch" in sys.modules)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "sync")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


SLOW_TEARDOWN = textwrap.dedent(
    """
    import signal, sys, time
    from runner.session import Session
    from runner.state import capture_rng

    class Counter:
        def __init__(self):
            self.n = 0
        def state_dict(self):
            return {"n": self.n}
        def load_state_dict(self, state):
            self.n = state["n"]

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # after the session: the group's SIGTERM
    with Session.from_env() as s:
        counter = Counter()
        s.track(counter=counter)
        for _ in s.steps(10**9):
            counter.n += 1
            time.sleep(0.01)
    time.sleep(float(sys.argv[1]))  # a teardown that takes its time (torch's takes a second)
    sys.exit(s.exit_code)
    """
)


EXEC = [sys.executable, "-m", "runner.cli", "exec"]


def test_a_preempted_session_is_reported_ended_before_its_process_tears_down(
    tmp_path: Path,
) -> None:
    """Once the session has flushed and exited 75 on a notice, the instance is going away:
    the supervisor reports the exit at once, so the control plane can release the
    instance without paying for the interpreter's teardown; it reports it once."""
    with FakeIngest(token="tok-2").start() as ingest:
        env = _reporting_env(tmp_path, ingest, "r-slow")
        proc = subprocess.Popen(
            [*EXEC, "--", sys.executable, "-c", SLOW_TEARDOWN, "30"],  # 30 s of teardown
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own group, as on an instance
        )
        assert ingest.wait_for(
            lambda: any(e.type == "metrics" for e in ingest.accepted), timeout=60
        ), proc.stderr
        proc.send_signal(signal.SIGTERM)
        reported = ingest.wait_for(lambda: any(e.type == "exit" for e in ingest.accepted), 15)
        still_running = proc.poll() is None
        os.killpg(proc.pid, signal.SIGKILL)  # the control plane terminates the instance
        proc.communicate(timeout=30)
    assert reported and still_running, "the exit must be reported before the teardown ends"
    exits = [e for e in ingest.accepted if e.type == "exit"]
    assert len(exits) == 1 and exits[0].data.pop("flush")["committed_step"] is not None
    assert isinstance(exits[0].data.pop("log_tail"), str)  # the command's last lines
    assert exits[0].data == {"code": EXIT_PREEMPTED, "reason": "preempted"}
    committed = [e.data["step"] for e in ingest.accepted if e.type == "checkpoint_committed"]
    assert (
        committed
        and list_committed(LocalStore(tmp_path / "ck" / "r-slow"))[-1].step == (committed[-1])
    )


def _run_noticed_once(
    supervisor: Supervisor, flag: PreemptionFlag, *, when: Path, after_s: float = 0.0
) -> int:
    """Run ``supervisor``; a metadata notice (5 s to the kill) comes ``after_s`` after the
    child has written the file ``when``."""

    def notice() -> None:
        end = time.monotonic() + 30
        while not when.exists() and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(after_s)
        now = time.monotonic()
        flag.set(Notice("aws", "instance-action", received_at=now, deadline=now + 5.0))

    thread = threading.Thread(target=notice, daemon=True)
    thread.start()
    code = supervisor.run()
    thread.join(timeout=5)
    return code


RELAY_READER = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    from runner.preemption import read_notice
    got = []
    signal.signal(signal.SIGTERM, lambda *_: got.append(time.monotonic()))
    pathlib.Path(sys.argv[1]).write_text("ready")
    end = time.monotonic() + 30
    while not got and time.monotonic() < end:
        time.sleep(0.01)
    notice = read_notice(os.environ["TRAINBOT_NOTICE_FILE"])
    left = "none" if notice is None else repr(notice.deadline - time.monotonic())
    pathlib.Path(sys.argv[2]).write_text(left)
    sys.exit(75)
    """
)


def test_the_child_learns_the_notices_real_deadline_before_its_sigterm(tmp_path: Path) -> None:
    """A metadata notice seen by the supervisor reaches the child as a SIGTERM, which says
    nothing of when the kill comes; the notice file the supervisor writes first does."""
    ready, out = tmp_path / "ready", tmp_path / "left"
    flag = PreemptionFlag()
    supervisor = Supervisor(
        [sys.executable, "-c", RELAY_READER, str(ready), str(out)],
        sink=NullSink(),
        flag=flag,
        env=tiny_env(tmp_path),
        window_s=30.0,  # what the child would count from its signal without the file
        install_signals=False,
    )

    code = _run_noticed_once(supervisor, flag, when=ready)
    assert code == EXIT_PREEMPTED
    left = float(out.read_text())
    assert 0.0 < left <= 5.0


NO_HANDLER_YET = textwrap.dedent(
    """
    import pathlib, sys, time
    pathlib.Path(sys.argv[1]).write_text("up")  # imports done; no session, no handler yet
    time.sleep(30)
    """
)


@pytest.mark.parametrize("spoke", [False, True], ids=["before-a-word", "after-a-word"])
def test_a_command_the_notice_kills_before_its_session_is_reported_as_such(
    tmp_path: Path, spoke: bool
) -> None:
    """A notice in the moments between a script's imports and its session's start: the
    forwarded SIGTERM kills it (no handler yet), and the exit still carries a flush report
    saying so, instead of none (issue 29, bench_goodput's unreported attempt). Once the
    command has said anything, the supervisor invents no report for it."""
    up = tmp_path / "up"
    script = NO_HANDLER_YET
    if spoke:  # a line of its own through the events file, as a session's would be
        script = script.replace(
            "time.sleep(30)",
            "import json, os\n"
            "with open(os.environ['TRAINBOT_EVENTS_FILE'], 'a') as f:\n"
            "    f.write(json.dumps({'type': 'log', 'time': time.time(), "
            "'data': {'level': 'info', 'message': 'step 1'}}) + '\\n')\n"
            "time.sleep(30)",
        )
    sink = Recorder()
    flag = PreemptionFlag()
    supervisor = Supervisor(
        [sys.executable, "-c", script, str(up)],
        sink=sink,
        flag=flag,
        env=tiny_env(tmp_path),
        window_s=5.0,
        install_signals=False,
    )

    # With a line said, the notice waits for the poll that reads it.
    code = _run_noticed_once(supervisor, flag, when=up, after_s=0.5 if spoke else 0.0)
    assert code == EXIT_PREEMPTED and supervisor.child_code == -signal.SIGTERM
    [exit_data] = sink.of("exit")
    assert exit_data["code"] == EXIT_PREEMPTED and exit_data["reason"] == "preempted"
    if spoke:
        assert "flush" not in exit_data, exit_data
        return
    flush = exit_data["flush"]
    assert flush["before_start"] is True and flush["flushes"] == []
    assert "no trainbot session had started" in flush["summary"]
