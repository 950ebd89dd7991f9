"""The control plane end to end on the embedded defaults: commands, crashes, bad input."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlmodel import func, select

from bot.console import ConsoleNotifier
from bot.dispatch import handle_text
from jobs.database.db import session_scope
from jobs.database.models import Alert, Attempt, EventRow, MetricBlock, Run, hash_token
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.outbound.notify import CallbackJournal
from jobs.process.bootstrap import ControlPlane
from jobs.process.settings import load_settings
from jobs.providers.base import InstanceState, LaunchRequest, Provider
from jobs.runs import reconcile, resource_request, spec_of
from jobs.usecases import service
from jobs.usecases.service import Actor
from tests.bot.test_shell_cleanup import start_shell
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
ADA = Actor(user="ada", channel="#ml", is_admin=False)
#: Overrides that keep runs short and skip the dry run where a test is not about it.
#: One torch thread, as on a one-core instance: the local provider passes no
#: OMP_NUM_THREADS, and torch's default (a thread per core) makes the tiny model several
#: times slower on a test machine whose cores are all busy.
FAST = ("dry_run.enabled=false", "resubmit.backoff_s=0", "env.OMP_NUM_THREADS=1")


def settings_for(state: Path, **extra: str) -> object:
    env = {
        "TRAINBOT_STATE_DIR": str(state),
        "TRAINBOT_INGEST_PORT": "0",
        "TRAINBOT_LOCAL_TERMINATION_WINDOW_S": "5",
        "TRAINBOT_LOCAL_CORES": "8",
        # As in the demo: with no chat front end to keep responsive, the runs need not
        # yield to every other process on a busy test machine.
        "TRAINBOT_LOCAL_NICE": "0",
    }
    env.update(extra)
    return load_settings(env)


def terminate_all(provider: Provider) -> None:
    """Every instance of ``provider`` that has not ended, terminated at once: each waits
    for its runner's last flush (seconds on a busy machine), so one by one they add up."""
    live = [i.instance_id for i in provider.list_instances() if not i.state.is_terminal()]
    with ThreadPoolExecutor(max_workers=max(1, len(live))) as pool:
        list(pool.map(provider.terminate, live))


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
    terminate_all(cp.deps.provider)
    cp.deps.provider.close()  # type: ignore[attr-defined]


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
    # 120 steps rather than the spec's 400: the story is the preemption and the resume,
    # and 110 steps after the first commit (at least 2.2 s of step delay) still leave the
    # preemption time to land mid-run.
    command = "command=python -m runner.examples.tiny --steps 120 --step-delay 0.02"
    run = service.submit(
        cp.deps,
        spec_name="tiny",
        overrides=[*FAST, "checkpoint.every_steps=10", command],
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
        request=resource_request(spec, cp.deps.provider),
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


def trainbot_processes(state: Path) -> dict[int, dict[str, str]]:
    """The live processes that control planes under ``state`` started (dry runs and
    local instances, found by their scratch volume there): pid → their TRAINBOT_ env."""
    marker = str(state)
    found: dict[int, dict[str, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        env = dict(
            v.decode(errors="replace").partition("=")[::2]
            for v in raw
            if v.startswith(b"TRAINBOT_")
        )
        if env.get("TRAINBOT_SCRATCH_DIR", "").startswith(marker):
            found[int(entry.name)] = env
    return found


def dry_run_processes(state: Path) -> list[int]:
    """Pids of processes that are some control plane's dry run under ``state``."""
    preflight = str(state / "preflight")
    return [
        pid
        for pid, env in trainbot_processes(state).items()
        if env["TRAINBOT_SCRATCH_DIR"].startswith(preflight)
    ]


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_the_first_attempt_gets_the_write_its_dry_run_measured(plane, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Preflight's dry run writes a checkpoint to the run's store and measures it; the
    first attempt's runner is handed that bandwidth, so a notice before its first save
    is judged by a measurement, not by the cautious guess; and the M of the "auto"
    interval's rule."""
    cp, _ = plane
    run = service.submit(
        cp.deps, spec_name="tiny", overrides=["checkpoint.every_steps=1000"], actor=ADA
    )
    wait_until(lambda: _started(cp, run.id, 1) is not None, timeout=120, what="the launch")
    with session_scope(cp.deps.engine) as session:
        row = session.get(Run, run.id)
        assert row is not None
        [dry] = [r for r in row.preflight["results"] if r["name"] == "dry_run"]
    data = dry["data"]
    assert dry["status"] == "pass" and data["checkpoint_bytes"] > 0 and data["write_s"] > 0
    state = Path(cp.deps.settings.state_dir)
    envs = [e for e in trainbot_processes(state).values() if e.get("TRAINBOT_RUN_ID") == run.id]
    assert envs, "the first attempt's process"
    expected = f"{data['checkpoint_bytes'] / data['write_s']:.0f}"
    assert {e.get("TRAINBOT_MEASURED_WRITE_BPS") for e in envs} == {expected}
    # The interval is "auto": the runner is told the rule's M, so its session moves the
    # interval to the save cost it measures itself.
    assert {e.get("TRAINBOT_CHECKPOINT_AUTO_MTBP_S") for e in envs} == {
        f"{data['interval_mtbp_s']:.3f}"
    }
    service.stop(cp.deps, run.id, ADA)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Db:
    """The state directory's database, read as the control planes write it."""

    def __init__(self, state: Path) -> None:
        self.path = state / "trainbot.db"

    def rows(self, sql: str, *args: object) -> list[tuple]:
        import sqlite3

        if not self.path.exists():
            return []
        try:
            with sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=5) as db:
                return db.execute(sql, args).fetchall()
        except sqlite3.OperationalError:  # not migrated yet
            return []

    def run_ids(self) -> set[str]:
        return {r[0] for r in self.rows("SELECT id FROM runs")}

    def run_state(self, run_id: str) -> str:
        got = self.rows("SELECT state FROM runs WHERE id = ?", run_id)
        return str(got[0][0]) if got else ""

    def attempt_states(self, run_id: str) -> list[str]:
        return [r[0] for r in self.rows("SELECT state FROM attempts WHERE run_id = ?", run_id)]


#: Without a dry run, preflight warns and the run waits for a person; the sweep's later
#: moments take that path (the dry run is swept by the first two), and the person types
#: "Launch anyway" (``/train resubmit``) in the console.
NO_DRY_RUN = ("dry_run.enabled=false",)

#: The moments of a run's start that the sweep kills the control plane at: the spec
#: overrides that lead there, whether a person confirms the launch, and when the moment
#: has come (a seeded jitter is added).
_MOMENTS: dict[str, tuple[tuple[str, ...], bool, Callable[[_Db, Path, str], bool]]] = {
    # The run is recorded, its preflight under way (or not yet begun).
    "submit": ((), False, lambda db, state, run: db.run_state(run) == "PREFLIGHT"),
    # Its dry run trains; it outlives the kill (a new process group).
    "dry_run": (
        (),
        False,
        lambda db, state, run: (state / "preflight" / run / "dry-run.pid").exists(),
    ),
    # Preflight warned: the run waits for a person, who confirms after the restart.
    "awaiting": (
        NO_DRY_RUN,
        False,
        lambda db, state, run: db.run_state(run) == "AWAITING_CONFIRMATION",
    ),
    # Confirmed; the attempt may be recorded, the instance asked for or not.
    "launching": (NO_DRY_RUN, True, lambda db, state, run: db.run_state(run) == "LAUNCHING"),
    # The instance is launched; its runner has not started yet (or just has).
    "provisioning": (
        NO_DRY_RUN,
        True,
        lambda db, state, run: any(
            a in ("REQUESTED", "PROVISIONING") for a in db.attempt_states(run)
        ),
    ),
    # The runner has started: restored, about to train its first step.
    "first_step": (NO_DRY_RUN, True, lambda db, state, run: "RUNNING" in db.attempt_states(run)),
}


@pytest.fixture
def reaped_state(tmp_path: Path) -> Iterator[Path]:
    """A state directory whose processes (dry runs, local instances) are killed when the
    test ends, whatever it asserted: a failed sweep must not leave runners training."""
    state = tmp_path / "state"
    yield state
    for pid in trainbot_processes(state):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_kill_9_at_random_moments_from_submit_to_the_first_step(reaped_state: Path) -> None:
    """kill -9 of the control plane at seeded random moments of a run's start, preflight
    included, each run submitted to a fresh control plane on the same state directory
    (each start is the restart of the runs before it). After the last restart every run
    reaches its first step, none is left in PREFLIGHT or LAUNCHING, the dry runs killed
    mid-way are ended and run again, each attempt has one instance, and no process or
    instance is left without a live attempt."""
    rng = random.Random(12)
    state = reaped_state
    env = {k: os.environ[k] for k in SHELL_ENV_KEYS if k in os.environ}
    # One address for every control plane, as behind a load balancer: a runner started
    # by a killed one spools its events and delivers them to the next.
    port = str(_free_port())
    env.update(
        PYTHONPATH=str(ROOT),
        TRAINBOT_STATE_DIR=str(state),
        TRAINBOT_INGEST_PORT=port,
        TRAINBOT_LOCAL_CORES="8",
        TRAINBOT_LOCAL_NICE="0",  # as settings_for's, for the last control plane
    )
    db = _Db(state)
    killed: dict[str, str] = {}  # run id → the moment it was killed at
    orphaned_dry_runs: list[int] = []
    for moment, (overrides, confirm, reached) in _MOMENTS.items():
        jitter = rng.uniform(0.0, 1.5 if moment in ("dry_run", "first_step") else 0.3)
        before = db.run_ids()
        proc = start_shell(env, quiet=True)
        assert proc.stdin is not None
        proc.stdin.write(
            "/train launch tiny checkpoint.every_steps=20 resubmit.backoff_s=0 "
            "env.OMP_NUM_THREADS=1 " + " ".join(overrides) + "\n"
        )
        proc.stdin.flush()
        deadline = time.monotonic() + 60
        run_id = None
        confirmed = False
        try:
            while run_id is None or not reached(db, state, run_id):
                assert proc.poll() is None, f"the control plane exited before {moment}"
                assert time.monotonic() < deadline, f"never reached {moment} ({run_id})"
                if run_id is None:
                    new = db.run_ids() - before
                    run_id = next(iter(new)) if new else None
                elif confirm and not confirmed and db.run_state(run_id) == "AWAITING_CONFIRMATION":
                    proc.stdin.write(f"/train resubmit {run_id}\n")  # "Launch anyway"
                    proc.stdin.flush()
                    confirmed = True
                time.sleep(0.01)
            time.sleep(jitter)
        finally:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed[run_id] = moment
        if moment == "dry_run":
            orphaned_dry_runs = dry_run_processes(state)
            assert orphaned_dry_runs, "the dry run outlives the control plane that started it"

    # Whatever the last kill interrupted of a preflight (the runs before it were resumed
    # by the control planes after them) is run again by the last restart.
    in_preflight = {r for r in killed if db.run_state(r) == "PREFLIGHT"}
    records: list[dict] = []
    journal = CallbackJournal(lambda t, run, data: records.append({"type": t, "run": run, **data}))
    settings = settings_for(state, TRAINBOT_INGEST_PORT=port)
    with ControlPlane(
        settings,  # type: ignore[arg-type]
        notifier=ConsoleNotifier(io.StringIO()),
        journal=journal,
        scheduler=False,  # its reconcile is called below, as the leader's would be
    ) as cp:
        deps = cp.deps
        assert {r["run"] for r in records if r["type"] == "preflight_resumed"} == in_preflight
        try:
            [waiting] = [r for r, m in killed.items() if m == "awaiting"]
            deadline = time.monotonic() + 150  # a bound for a busy machine, not a timing
            while True:
                reconcile(deps)
                with session_scope(deps.engine) as session:
                    runs = {r.id: r for r in session.exec(select(Run)).all()}
                if runs[waiting].state == RunState.AWAITING_CONFIRMATION:
                    # The person at the console, after the restart.
                    who = Actor(user=runs[waiting].requester, channel="console", is_admin=True)
                    service.confirm(deps, waiting, who)
                ended = {
                    rid: (r.state, r.reason) for rid, r in runs.items() if r.state.is_terminal()
                }
                assert all(s == RunState.SUCCEEDED for s, _ in ended.values()), ended
                started = {
                    rid
                    for rid, r in runs.items()
                    if r.state == RunState.SUCCEEDED
                    or (r.state == RunState.RUNNING and (r.last_step or 0) >= 1)
                }
                if started == set(killed):
                    break
                stuck = {
                    rid: (
                        runs[rid].state,
                        killed[rid],
                        [r["check"] for r in records if r["run"] == rid and "check" in r],
                        # What a failure needs to be understood: the attempts and the
                        # instances of the run as the database and the provider see them.
                        db.rows(
                            "SELECT number, state, instance_id, created_at, started_at, "
                            "end_reason FROM attempts WHERE run_id = ?",
                            rid,
                        ),
                        [
                            (i.instance_id, i.attempt_id, str(i.state))
                            for i in deps.provider.list_instances()
                            if i.run_id == rid
                        ],
                        [r["type"] for r in records if r["run"] == rid][-12:],
                    )
                    for rid in set(killed) - started
                }
                assert time.monotonic() < deadline, f"runs that never reached a step: {stuck}"
                time.sleep(0.5)
            reconcile(deps)
            assert not any(pid in dry_run_processes(state) for pid in orphaned_dry_runs)
            assert not dry_run_processes(state), "no dry run is left once every run trains"
            instances = deps.provider.list_instances()
            per_attempt: dict[str, int] = {}
            for inst in instances:
                per_attempt[inst.attempt_id] = per_attempt.get(inst.attempt_id, 0) + 1
            assert all(n == 1 for n in per_attempt.values()), per_attempt

            def live_attempts() -> dict[str, Attempt]:
                with session_scope(deps.engine) as session:
                    attempts = session.exec(select(Attempt)).all()
                return {a.instance_id: a for a in attempts if not a.state.is_terminal()}

            def orphans() -> list[tuple[str, str, str]]:
                """Running instances without a live attempt (an attempt that has just
                ended has its instance terminated off the caller's thread: a moment)."""
                live = live_attempts()
                return [
                    (i.instance_id, i.attempt_id, str(i.state))
                    for i in deps.provider.list_instances()
                    if not i.state.is_terminal()
                    and not (i.instance_id in live and live[i.instance_id].id == i.attempt_id)
                ]

            gone_by = time.monotonic() + 15
            while orphans() and time.monotonic() < gone_by:
                reconcile(deps)
                time.sleep(0.2)
            assert not orphans(), f"instances without a live attempt: {orphans()}"
            live = live_attempts()

            # And the process table agrees: every process started under this state
            # directory is a live attempt's instance (one that just finished may take
            # a moment to go).
            def strays() -> dict[int, dict[str, str]]:
                return {
                    pid: penv
                    for pid, penv in trainbot_processes(state).items()
                    if penv.get("TRAINBOT_INSTANCE_ID") not in live
                    or live[penv["TRAINBOT_INSTANCE_ID"]].id != penv.get("TRAINBOT_ATTEMPT_ID")
                }

            gone_by = time.monotonic() + 15
            while strays() and time.monotonic() < gone_by:
                time.sleep(0.2)
            assert not strays(), "processes that belong to no live attempt"
        finally:
            for pid in dry_run_processes(state):
                os.kill(pid, signal.SIGKILL)
    # Instances outlive their control plane: end them once it is closed (a terminated
    # instance looks preempted, and an open one would resubmit it). Six runners each
    # flush a checkpoint on the way out: together, not one after the other.
    terminate_all(cp.deps.provider)
    cp.deps.provider.close()  # type: ignore[attr-defined]
    assert not trainbot_processes(state)


# --- a preempted `trainbot-runner exec` is resubmitted -------------------------------------

PLAIN_SCRIPT = ROOT / "tests" / "runner" / "scripts" / "plain_counter.py"


def attempts_of(cp: ControlPlane, run_id: str) -> list[Attempt]:
    with session_scope(cp.deps.engine) as session:
        rows = session.exec(
            select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number)  # type: ignore[arg-type]
        ).all()
        for row in rows:
            session.expunge(row)
        return list(rows)


def _started(cp: ControlPlane, run_id: str, number: int) -> Attempt | None:
    """Attempt ``number`` of the run, once its runner has said it started."""
    found = [a for a in attempts_of(cp, run_id) if a.number == number]
    booting = (AttemptState.REQUESTED, AttemptState.PROVISIONING)
    if found and found[0].started_at is not None and found[0].state not in booting:
        return found[0]
    return None


def _launch_confirmed(cp: ControlPlane, overrides: list[str]) -> Run:
    run = service.submit(cp.deps, spec_name="tiny", overrides=[*FAST, *overrides], actor=ADA)
    wait_until(lambda: run_state(cp, run.id) == RunState.AWAITING_CONFIRMATION, what="preflight")
    service.confirm(cp.deps, run.id, ADA)
    return run


def _preempted_then_resubmitted(cp: ControlPlane, run_id: str) -> tuple[Attempt, Attempt]:
    """Wait for attempt 1 to end and attempt 2 to start (reconcile as the scheduler
    would: it is what sees an instance whose runner could not report)."""

    def second() -> Attempt | None:
        reconcile(cp.deps)
        return _started(cp, run_id, 2)

    wait_until(lambda: second() is not None, timeout=90, what="attempt 2 to start")
    first, again = attempts_of(cp, run_id)[:2]
    return first, again


@pytest.mark.slow
def test_exec_sleep_preempted_one_second_in_is_resubmitted(plane) -> None:  # type: ignore[no-untyped-def]
    """`exec -- sleep 60` gets its notice one second in: exit 75, attempt PREEMPTED, the
    run resubmitted and its next attempt started."""
    cp, records = plane
    run = _launch_confirmed(cp, ["command=sleep 60"])
    wait_until(lambda: _started(cp, run.id, 1) is not None, what="attempt 1 to start")
    first = _started(cp, run.id, 1)
    assert first is not None and first.instance_id is not None
    time.sleep(1.0)
    cp.deps.provider.preempt(first.instance_id)  # type: ignore[attr-defined]
    first, second = _preempted_then_resubmitted(cp, run.id)
    assert (first.state, first.exit_code) == (AttemptState.PREEMPTED, 75), first.end_reason
    assert second.state == AttemptState.RUNNING
    assert [r["attempt"] for r in records if r["type"] == "preempted" and r["run"] == run.id] == [1]
    wait_until(lambda: run_state(cp, run.id) == RunState.RUNNING, what="the run running again")
    service.stop(cp.deps, run.id, ADA)


@pytest.mark.slow
def test_a_plain_script_under_sync_dir_preempted_before_any_checkpoint_resumes_from_0(
    plane, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A plain script under `exec --sync-dir` (the spec's checkpoint.sync_dir) preempted
    before its first checkpoint: exit 75, PREEMPTED, resubmitted, and the next attempt,
    on a new instance, starts from step 0 and finishes."""
    cp, records = plane
    progress = tmp_path / "progress"
    # 0.2 s a step: 3.6 s between step 2 and the first checkpoint, for a loaded machine.
    script = f"python {PLAIN_SCRIPT} --steps 24 --every 20 --step-s 0.2 --progress {progress}"
    run = _launch_confirmed(cp, [f"command={script}", "checkpoint.sync_dir=ckpt"])
    wait_until(lambda: _started(cp, run.id, 1) is not None, what="attempt 1 to start")

    def step() -> int:
        text = progress.read_text() if progress.exists() else ""
        return int(text.split()[1]) if text.startswith("running ") else -1

    wait_until(lambda: step() >= 2, what="step 2")
    assert step() < 20, "the notice comes before its first checkpoint (step 20)"
    first = _started(cp, run.id, 1)
    assert first is not None and first.instance_id is not None
    cp.deps.provider.preempt(first.instance_id)  # type: ignore[attr-defined]
    first, second = _preempted_then_resubmitted(cp, run.id)
    assert (first.state, first.exit_code) == (AttemptState.PREEMPTED, 75), first.end_reason
    # The runner said nothing could be synced; the thread heard it.
    assert any(r["type"] == "runner_warning" and r["attempt"] == 1 for r in records)
    wait_until(lambda: run_state(cp, run.id).is_terminal(), timeout=90, what="the end")
    assert run_state(cp, run.id) == RunState.SUCCEEDED
    assert second.instance_id is not None
    log_text = cp.deps.provider.log_path(second.instance_id).read_text()  # type: ignore[attr-defined]
    result = json.loads([line for line in log_text.splitlines() if line.startswith("{")][-1])
    assert (result["step"], result["resumed_from"]) == (24, 0)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_a_sigterm_during_the_runners_interpreter_start_is_a_preemption(
    plane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """The notice comes while the runner's interpreter is still starting, before any of
    its code runs (a slow disk: here a sitecustomize that sleeps), so the runner dies of
    the SIGTERM (143) without a word. The provider reports the instance preempted, so
    the attempt is PREEMPTED and resubmitted, not a failure."""
    cp, records = plane
    slow = tmp_path / "slow-start"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text("import time\ntime.sleep(3)\n")
    # Instances' pythons find it (the wrapper runs isolated, -I, and does not).
    monkeypatch.setenv("PYTHONPATH", str(slow))
    run = _launch_confirmed(cp, ["command=sleep 60"])

    def launched() -> Attempt | None:
        found = attempts_of(cp, run.id)
        return found[0] if found and found[0].instance_id else None

    wait_until(lambda: launched() is not None, what="attempt 1's instance")
    first = launched()
    assert first is not None and first.instance_id is not None
    instance = first.instance_id

    def runner_started() -> bool:
        for pid, penv in trainbot_processes(tmp_path / "state").items():
            if penv.get("TRAINBOT_INSTANCE_ID") == instance:
                with contextlib.suppress(OSError):
                    if b"runner.cli" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        return True
        return False

    wait_until(runner_started, what="the runner's interpreter to start")
    time.sleep(0.5)  # it sleeps in its interpreter's start, before any of its code
    cp.deps.provider.preempt(instance)  # type: ignore[attr-defined]
    first, second = _preempted_then_resubmitted(cp, run.id)
    assert first.exit_code == 128 + signal.SIGTERM or first.exit_code == -signal.SIGTERM
    assert first.state == AttemptState.PREEMPTED, first.end_reason
    assert second.state == AttemptState.RUNNING
    assert not any(r["type"] == "run_finished" and r["run"] == run.id for r in records)
    service.stop(cp.deps, run.id, ADA)


@pytest.mark.slow
# Its own budget: 217 s alone on two idle cores, and well past pytest's 300 s default
# beside the other worker's tests; the demo's own waits (300 s each) say which step hung.
@pytest.mark.timeout(900)
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
    assert len(summaries) == 4
    # The two-node run: one gang of two nodes, preempted through one node, resumed whole.
    gangs = [e for e in lines if e["type"] == "launched" and "+" in str(e.get("instance"))]
    assert gangs and {len(e["instance"].split("+")) for e in gangs} == {2}
    (ddp,) = {e["run"] for e in gangs}
    assert summaries[ddp]["attempts"] >= 2 and summaries[ddp]["state"] == "SUCCEEDED"
    assert "node 1 of 2 preempted: both stopped at step" in proc.stdout
    assert kept, "cleanup pruned something"
    for run, summary in summaries.items():
        # The badput split, from what the real runners reported (restore_s, stall_s).
        causes = {c["name"]: c["instance_seconds"] for c in summary["badput"]["categories"]}
        assert causes["startup"] > 0 and causes["checkpoint_stall"] > 0, (run, causes)
        assert summary["storage"]["bytes_kept"] > 0 and summary["storage"]["usd"] == 0, run
        if run in kept:
            assert summary["checkpoints_kept"] == kept[run], run
        else:  # nothing past its retention (a run stopped early): all of it is kept
            # keep_last 3, and for the run stopped for diverging also the checkpoint before
            # the divergence that its resubmit offer resumes from (cleanup protects it; how
            # many saves came after it depends on the machine's pace).
            assert 0 < len(summary["checkpoints_kept"]) <= 4, run
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
    from jobs.background.tasks import refresh_prices

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
