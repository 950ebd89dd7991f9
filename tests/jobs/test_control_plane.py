"""The control plane end to end on the embedded defaults: commands, crashes, bad input."""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlmodel import func, select

from bot.console import ConsoleNotifier
from bot.dispatch import handle_text
from jobs import service
from jobs.bootstrap import ControlPlane
from jobs.db import session_scope
from jobs.lifecycle import AttemptState, RunState
from jobs.models import Alert, Attempt, EventRow, MetricBlock, Run, hash_token
from jobs.notify import CallbackJournal
from jobs.providers.base import InstanceState, LaunchRequest
from jobs.runs import reconcile, resource_request, spec_of
from jobs.service import Actor
from jobs.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
ADA = Actor(user="ada", channel="#ml", is_admin=False)
#: Overrides that keep runs short and skip the dry run where a test is not about it.
FAST = ("dry_run.enabled=false", "resubmit.backoff_s=0")


def settings_for(state: Path, **extra: str) -> object:
    env = {
        "TRAINBOT_STATE_DIR": str(state),
        "TRAINBOT_INGEST_PORT": "0",
        "TRAINBOT_LOCAL_TERMINATION_WINDOW_S": "5",
        "TRAINBOT_LOCAL_CORES": "8",
    }
    env.update(extra)
    return load_settings(env)


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[tuple[ControlPlane, list[dict]]]:
    records: list[dict] = []
    journal = CallbackJournal(lambda t, run, data: records.append({"type": t, "run": run, **data}))
    cp = ControlPlane(
        settings_for(tmp_path / "state"),  # type: ignore[arg-type]
        notifier=ConsoleNotifier(io.StringIO()),
        journal=journal,
        scheduler=False,
    )
    with cp:
        yield cp, records
    # Local instances outlive their control plane, like cloud ones: end them here, once it
    # is closed (a terminated instance looks preempted, and would be resubmitted).
    for inst in cp.deps.provider.list_instances():
        if not inst.state.is_terminal():
            cp.deps.provider.terminate(inst.instance_id)
    cp.deps.provider.close()  # type: ignore[attr-defined]


def wait_until(pred, timeout: float = 60.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def run_state(cp: ControlPlane, run_id: str) -> RunState:
    with session_scope(cp.deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None
        return run.state


def counts(cp: ControlPlane) -> tuple[int, int, int, int, int]:
    with session_scope(cp.deps.engine) as session:
        return (
            session.exec(select(func.count()).select_from(Run)).one(),
            session.exec(select(func.count()).select_from(Attempt)).one(),
            session.exec(select(func.count()).select_from(EventRow)).one(),
            session.exec(select(func.count()).select_from(MetricBlock)).one(),
            session.exec(select(func.count()).select_from(Alert)).one(),
        )


@pytest.mark.slow
def test_a_run_is_preempted_resubmitted_and_resumes(plane) -> None:  # type: ignore[no-untyped-def]
    cp, records = plane
    run = service.submit(
        cp.deps,
        spec_name="tiny",
        overrides=[*FAST, "checkpoint.every_steps=10"],
        actor=ADA,
    )
    # Without a dry run, preflight warns and waits for a person: "Launch anyway".
    wait_until(lambda: run_state(cp, run.id) == RunState.AWAITING_CONFIRMATION, what="preflight")
    service.confirm(cp.deps, run.id, ADA)
    wait_until(lambda: any(r["type"] == "checkpoint_committed" for r in records), what="a commit")
    with session_scope(cp.deps.engine) as session:
        first = session.exec(select(Attempt).where(Attempt.run_id == run.id)).one()
    cp.deps.provider.preempt(first.instance_id)  # type: ignore[attr-defined]
    wait_until(lambda: any(r["type"] == "resumed" for r in records), what="the resume")
    resub = next(r for r in records if r["type"] == "resubmitted")
    resumed = next(r for r in records if r["type"] == "resumed")
    assert resumed["step"] == resub["resume_from_step"] > 0
    wait_until(lambda: run_state(cp, run.id).is_terminal(), timeout=120, what="the end")
    assert run_state(cp, run.id) == RunState.SUCCEEDED
    with session_scope(cp.deps.engine) as session:
        attempts = session.exec(
            select(Attempt).where(Attempt.run_id == run.id).order_by(Attempt.number)
        ).all()
        assert [a.state for a in attempts] == [AttemptState.PREEMPTED, AttemptState.SUCCEEDED]
        assert all(a.token_hash is None for a in attempts), "tokens are revoked at the end"
        preempt_alert = session.exec(select(Alert).where(Alert.rule == "preemption")).one()
        assert preempt_alert.run_id == run.id
    # Nothing is left running (the last instance is terminated by script, not memory).
    wait_until(
        lambda: all(i.state.is_terminal() for i in cp.deps.provider.list_instances()),
        timeout=30,
        what="every instance to end",
    )


def test_a_repeated_command_launches_once(plane) -> None:  # type: ignore[no-untyped-def]
    cp, _ = plane
    results: list[str] = []

    def submit() -> None:
        run = service.submit(
            cp.deps,
            spec_name="tiny",
            overrides=[*FAST, "budget.usd=1"],
            actor=ADA,
            idempotency_key="slack:T1:trigger-123",
            launch=False,
        )
        results.append(run.id)

    threads = [threading.Thread(target=submit) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    submit()  # a replay after the fact
    assert len(set(results)) == 1
    with session_scope(cp.deps.engine) as session:
        assert session.exec(select(func.count()).select_from(Run)).one() == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("/train launch tinyy", "did you mean 'tiny'"),
        ("/train launch tiny budgte.usd=5", "unknown key 'budgte'"),
        ("/train launch tiny budget.usd=-5", "budget.usd"),
        ("/train lanch tiny", "did you mean"),
        ("/train stop r-nope", "no run r-nope"),
        ("/train ack al-nope", "al-nope"),
        ('/train launch "tiny', "quote"),
    ],
)
def test_bad_commands_get_a_clear_message_and_change_nothing(
    plane,
    text: str,
    message: str,  # type: ignore[no-untyped-def]
) -> None:
    cp, _ = plane
    before = counts(cp)
    reply = handle_text(cp.deps, text, ADA)
    assert reply.ephemeral
    assert message.lower() in reply.text.lower()
    assert "Traceback" not in reply.text
    assert counts(cp) == before


def test_bad_events_and_tokens_change_nothing(plane) -> None:  # type: ignore[no-untyped-def]
    cp, _ = plane
    with session_scope(cp.deps.engine) as session:
        run = Run(
            id="r-evt", spec_name="tiny", spec={"name": "tiny", "command": ["x"]}, requester="ada"
        )
        session.add(run)
        session.flush()
        session.add(
            Attempt(
                id="a-evt", run_id=run.id, number=1, provider="local",
                token_hash=hash_token("good-token"),
            )
        )  # fmt: skip
    before = counts(cp)
    bad_bodies = [b"{not json", b'{"v": 1, "attempt": "a-evt", "run": "r-evt", "events": "x"}']
    for body in bad_bodies:
        result = cp.ingest.handle("Bearer good-token", body)
        assert result.status == 400 and result.body["error"]
    assert cp.ingest.handle("Bearer wrong-token", b"{}").status == 401
    assert cp.ingest.handle(None, b"{}").status == 401
    assert counts(cp) == before


def test_another_users_run_cannot_be_stopped(plane) -> None:  # type: ignore[no-untyped-def]
    cp, _ = plane
    run = service.submit(
        cp.deps, spec_name="tiny", overrides=[*FAST, "budget.usd=1"], actor=ADA, launch=False
    )
    reply = handle_text(cp.deps, f"/train stop {run.id}", Actor(user="bob", channel="#ml"))
    assert "belongs to ada" in reply.text and reply.ephemeral
    assert not run_state(cp, run.id).is_terminal()


def _launch_request(cp: ControlPlane, run: Run, attempt: Attempt) -> LaunchRequest:
    spec = spec_of(run)
    return LaunchRequest(
        run_id=run.id,
        attempt_id=attempt.id,
        owner=run.requester,
        request=resource_request(spec),
        zone=None,
        command=[sys.executable, "-c", "import time; time.sleep(60)"],
        env={},
        idempotency_key=attempt.id,
    )


def test_reconcile_adopts_a_launch_the_database_missed_and_kills_orphans(plane) -> None:  # type: ignore[no-untyped-def]
    """A control plane that died between the provider call and its database write: on
    restart there is exactly one instance for the attempt, and no orphan."""
    cp, records = plane
    deps = cp.deps
    with session_scope(deps.engine) as session:
        run = Run(
            id="r-crash",
            spec_name="tiny",
            spec={
                "name": "tiny",
                "command": ["python", "-c", "pass"],
                "dry_run": {"enabled": False},
            },
            requester="ada",
            state=RunState.LAUNCHING,
        )
        session.add(run)
        session.flush()
        attempt = Attempt(id="a-crash", run_id=run.id, number=1, provider="local")
        attempt.token_hash = hash_token(deps.runner_token(attempt.id))
        session.add(attempt)
        session.flush()
        session.expunge_all()
    # The provider launched it, but the database never heard.
    deps.provider.launch(_launch_request(cp, run, attempt))
    # And an instance tagged by trainbot that no attempt owns.
    stray = Attempt(id="a-stray", run_id="r-gone", number=1, provider="local")
    deps.provider.launch(
        _launch_request(cp, Run(id="r-gone", spec_name="x", spec=run.spec, requester="x"), stray)
    )

    result = reconcile(deps)
    assert result["orphans"] == 1 and result["adopted"] == 1
    instances = [i for i in deps.provider.list_instances() if not i.state.is_terminal()]
    assert [(i.run_id, i.attempt_id) for i in instances] == [("r-crash", "a-crash")]
    with session_scope(deps.engine) as session:
        adopted = session.get(Attempt, "a-crash")
        assert adopted is not None and adopted.instance_id == instances[0].instance_id
        assert adopted.state == AttemptState.PROVISIONING
    assert any(r["type"] == "orphan_terminated" for r in records)
    # Running it again changes nothing: still one instance.
    reconcile(deps)
    live = [i for i in deps.provider.list_instances() if not i.state.is_terminal()]
    assert len(live) == 1
    deps.provider.terminate(live[0].instance_id)


def test_reconcile_leaves_an_instance_being_terminated_to_its_terminator(plane) -> None:  # type: ignore[no-untyped-def]
    """An ended attempt's instance is terminated off the request thread; reconcile meets
    it still running and must neither wait on the same terminate nor do it twice."""
    cp, records = plane
    deps = cp.deps
    spec = {"name": "tiny", "command": ["python", "-c", "pass"], "dry_run": {"enabled": False}}
    gone = Run(id="r-ended", spec_name="tiny", spec=spec, requester="ada")
    ended = Attempt(id="a-ended", run_id=gone.id, number=1, provider="local")
    instance = deps.provider.launch(_launch_request(cp, gone, ended))
    done, mine = deps.claim_termination(instance.instance_id)  # end_attempt's, in flight
    assert mine
    assert reconcile(deps)["orphans"] == 0
    assert deps.provider.status(instance.instance_id).state == InstanceState.RUNNING
    assert deps.claim_termination(instance.instance_id) == (done, False)
    deps.release_termination(instance.instance_id)
    assert done.is_set()
    # Once no one is terminating it, it is an orphan like any other.
    assert reconcile(deps)["orphans"] == 1
    assert deps.provider.status(instance.instance_id).state.is_terminal()
    assert [r["instance"] for r in records if r["type"] == "orphan_terminated"] == [
        instance.instance_id
    ]


SHELL_ENV_KEYS = ("PATH", "HOME", "LANG")


@pytest.mark.slow
def test_kill_9_during_a_launch_then_restart_leaves_one_instance_per_attempt(
    tmp_path: Path,
) -> None:
    """Kill the control plane at random points of a launch; after a restart every attempt
    has exactly one instance, nothing is orphaned, and the run goes on."""
    rng = random.Random(7)
    state = tmp_path / "state"
    env = {k: os.environ[k] for k in SHELL_ENV_KEYS if k in os.environ}
    env.update(
        PYTHONPATH=str(ROOT),
        TRAINBOT_STATE_DIR=str(state),
        TRAINBOT_INGEST_PORT="0",
        TRAINBOT_LOCAL_CORES="8",
    )
    spec = "/train launch tiny checkpoint.every_steps=20 resubmit.backoff_s=0\n"
    # Early (during preflight), around the launch call, and after it.
    for delay in (rng.uniform(0.5, 4), rng.uniform(4, 9), rng.uniform(9, 14)):
        proc = subprocess.Popen(
            [sys.executable, "-m", "bot.cli", "shell"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stdin is not None
        proc.stdin.write(spec)
        proc.stdin.flush()
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    # Restart: a control plane on the same state directory reconciles.
    settings = settings_for(state, TRAINBOT_HEARTBEAT_DEADLINE_S="600")
    with ControlPlane(settings, notifier=ConsoleNotifier(io.StringIO()), scheduler=False) as cp:  # type: ignore[arg-type]
        deps = cp.deps
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            reconcile(deps)
            with session_scope(deps.engine) as session:
                attempts = session.exec(select(Attempt)).all()
                runs = session.exec(select(Run)).all()
            pending = [a for a in attempts if a.instance_id is None and not a.state.is_terminal()]
            if runs and not pending:
                break
            time.sleep(1)
        instances = deps.provider.list_instances()
        live = [i for i in instances if not i.state.is_terminal()]
        with session_scope(deps.engine) as session:
            attempts = session.exec(select(Attempt)).all()
        by_attempt: dict[str, int] = {}
        for inst in instances:
            by_attempt[inst.attempt_id] = by_attempt.get(inst.attempt_id, 0) + 1
        assert all(n == 1 for n in by_attempt.values()), by_attempt
        known = {a.id for a in attempts}
        assert all(i.attempt_id in known for i in live), "no orphan survives reconcile"
        for a in attempts:
            if not a.state.is_terminal():
                assert a.instance_id is not None
                status = deps.provider.status(a.instance_id)
                assert status.state in (InstanceState.RUNNING, InstanceState.SUCCEEDED)
        for inst in live:
            deps.provider.terminate(inst.instance_id)
        deps.provider.close()  # type: ignore[attr-defined]


def dry_run_processes(state: Path) -> list[int]:
    """Pids of processes that are some control plane's dry run under ``state``."""
    marker = f"TRAINBOT_SCRATCH_DIR={state / 'preflight'}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(marker) for v in environ):
            found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_kill_9_during_the_dry_run_then_restart_ends_it_and_runs_preflight_again(
    tmp_path: Path,
) -> None:
    """A control plane killed while its dry run trains leaves that process behind and the
    run in PREFLIGHT; the next start ends the process and runs the checks again."""
    state = tmp_path / "state"
    env = {k: os.environ[k] for k in SHELL_ENV_KEYS if k in os.environ}
    env.update(PYTHONPATH=str(ROOT), TRAINBOT_STATE_DIR=str(state), TRAINBOT_INGEST_PORT="0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bot.cli", "shell"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdin is not None
    # A dry run slow enough to be caught in the middle of.
    proc.stdin.write("/train launch tiny dry_run.steps=50 resubmit.backoff_s=0\n")
    proc.stdin.flush()
    deadline = time.monotonic() + 60
    while not list(state.glob("preflight/*/dry-run.pid")):
        assert time.monotonic() < deadline and proc.poll() is None, "no dry run started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    orphans = dry_run_processes(state)
    assert orphans, "the dry run outlives the control plane that started it"

    records: list[dict] = []
    journal = CallbackJournal(lambda t, run, data: records.append({"type": t, "run": run, **data}))
    settings = settings_for(state, TRAINBOT_HEARTBEAT_DEADLINE_S="600")
    with ControlPlane(
        settings,
        notifier=ConsoleNotifier(io.StringIO()),
        journal=journal,
        scheduler=False,  # type: ignore[arg-type]
    ) as cp:
        deps = cp.deps
        [run_id] = [r["run"] for r in records if r["type"] == "preflight_resumed"]
        assert [r["run"] for r in records if r["type"] == "dry_run_ended"] == [run_id]
        wait_until = time.monotonic() + 5
        while dry_run_processes(state) and time.monotonic() < wait_until:
            time.sleep(0.05)
        assert not any(pid in dry_run_processes(state) for pid in orphans)
        # The checks run again, to the end, and the run launches.
        deadline = time.monotonic() + 120
        while True:
            with session_scope(deps.engine) as session:
                run = session.get(Run, run_id)
                assert run is not None
                state_now = run.state
            if state_now not in (RunState.PREFLIGHT,):
                break
            assert time.monotonic() < deadline, "the run stayed in PREFLIGHT"
            time.sleep(0.2)
        assert state_now in (RunState.LAUNCHING, RunState.RUNNING), state_now
        for inst in deps.provider.list_instances():
            if not inst.state.is_terminal():
                deps.provider.terminate(inst.instance_id)
    assert not dry_run_processes(state)


@pytest.mark.slow
def test_the_demo_tells_the_whole_story(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINBOT_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "bot.cli", "demo", "--events", str(events)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert all("type" in e and "run" in e for e in lines)
    types = {e["type"] for e in lines}
    for needed in (
        "preflight_check", "launched", "checkpoint_committed", "preemption_notice", "preempted",
        "resubmitted", "resumed", "alert_opened", "alert_acknowledged", "cleanup", "digest",
        "run_finished", "budget_threshold",
    ):  # fmt: skip
        assert needed in types, needed
    rules = {e["rule"] for e in lines if e["type"] == "alert_opened"}
    assert {"divergent_loss", "low_utilisation", "disk", "budget", "preemption"} <= rules
    checks = [e["check"] for e in lines if e["type"] == "preflight_check"]
    assert {"quota", "capacity", "data", "dry_run", "budget"} <= set(checks)
    # The digest covers the demo's own day, preemption and spend included.
    (digest,) = [e for e in lines if e["type"] == "digest"]
    assert digest["preemptions"] >= 1 and digest["day_usd"] > 0
    # Its badput and storage: every attempt booted (paid); the local store costs nothing.
    assert digest["badput"]["startup"] > 0
    assert digest["storage_usd"] == 0 and digest["storage_bytes_kept"] > 0
    # What the database says is kept is what cleanup left in the store, the stopped
    # run's last flush included.
    kept = {e["run"]: e["kept"] for e in lines if e["type"] == "cleanup"}
    summaries = {e["run"]: e for e in lines if e["type"] == "summary"}
    assert len(summaries) == 3
    assert kept, "cleanup pruned something"
    for run, summary in summaries.items():
        # The badput split, from what the real runners reported (restore_s, stall_s).
        causes = {c["name"]: c["instance_seconds"] for c in summary["badput"]["categories"]}
        assert causes["startup"] > 0 and causes["checkpoint_stall"] > 0, (run, causes)
        assert summary["storage"]["bytes_kept"] > 0 and summary["storage"]["usd"] == 0, run
        if run in kept:
            assert summary["checkpoints_kept"] == kept[run], run
        else:  # nothing past its retention (a run stopped early): all of it is kept
            assert 0 < len(summary["checkpoints_kept"]) <= 3, run
    resumed = [s for s in summaries.values() if s["attempts"] > 1]
    assert resumed and all(
        c["instance_seconds"] > 0
        for s in resumed
        for c in s["badput"]["categories"]
        if c["name"] == "restore"
    )
    # The diverging run is stopped by trainbot, not trained to the end, and its one
    # problem makes at most two alerts (one incident, reopened rather than reposted).
    (diverge,) = {e["run"] for e in lines if e.get("rule") == "divergent_loss"}
    stops = [e for e in lines if e["type"] == "run_finished" and e["run"] == diverge]
    assert [(e["state"], e.get("by")) for e in stops] == [("STOPPED", "trainbot")]
    assert summaries[diverge]["state"] == "STOPPED"
    assert summaries[diverge]["reason"].startswith("stopped by trainbot")
    assert "stopped by trainbot" in proc.stdout
    opened = [e for e in lines if e["type"] == "alert_opened" and e["run"] == diverge]
    assert 1 <= len(opened) <= 2, opened
    assert "code None" not in proc.stdout
    assert "database failed" not in proc.stderr, proc.stderr[-3000:]
    assert "Demo complete" in proc.stdout


def test_the_spend_job_refreshes_prices_of_live_attempts(plane) -> None:  # type: ignore[no-untyped-def]
    cp, _ = plane
    from jobs.tasks import refresh_prices

    with session_scope(cp.deps.engine) as session:
        run = Run(
            id="r-price", spec_name="tiny", spec={"name": "tiny", "command": ["x"]}, requester="ada"
        )
        session.add(run)
        session.flush()
        session.add(
            Attempt(
                id="a-price", run_id=run.id, number=1, provider="local",
                state=AttemptState.RUNNING, price_per_hour=99.0, spot=True,
            )
        )  # fmt: skip
    assert refresh_prices(cp.deps) == 1
    with session_scope(cp.deps.engine) as session:
        attempt = session.get(Attempt, "a-price")
        assert attempt is not None
        assert attempt.price_per_hour == cp.deps.provider.spot_usd_per_hour  # type: ignore[attr-defined]
    assert refresh_prices(cp.deps) == 0
