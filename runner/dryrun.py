"""``trainbot-runner dry-run -- CMD…``: prove the checkpoint round trip before paying for a run.

Phase one runs the command for a few steps and commits a checkpoint to the real store;
the process is then killed with SIGKILL, as a lost instance would be. Phase two starts
it again: it must restore, show a state bit-identical to the one saved (a sha256 over
every tensor and RNG state), and run two more steps. The report gives the step time,
the checkpoint size, write and restore seconds, the stall (how long a save blocks the
loop), and Daly's optimal checkpoint interval √(2CM) − C for a mean time between
preemptions M, with C the stall and the write time as the floor
(:func:`runner.preemption.choose_interval`).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from runner import env as contract
from runner.container import Container, ContainerError
from runner.dryrun_phase import Phase, finish_report
from runner.dryrun_report import DryRunReport
from runner.dryrun_sync import run_sync_phases
from runner.errors import RunnerError
from runner.layout import delete_steps, scan
from runner.nodes import Node
from runner.pidfile import end_stale_dry_run
from runner.preemption import daly_interval
from runner.secrets import SecretUnavailable, resolve
from runner.setup import SetupFailed, Workspace
from runner.store import open_store, run_store

__all__ = ["DryRunReport", "daly_interval", "end_stale_dry_run", "run_dry_run"]


def run_dry_run(
    command: Sequence[str],
    *,
    checkpoint_uri: str,
    run_id: str,
    steps: int = 5,
    mtbp_s: float = 3600.0,
    timeout_s: float = 600.0,
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    pid_file: Path | None = None,
    on_saved: Callable[[], None] | None = None,
    read_sample: bool = False,
    sync: bool = False,
) -> DryRunReport:
    """Run both phases and report. The run id should be the dry run's own namespace.

    The command's output goes to ``log_path`` when given (the control plane keeps it out
    of its own terminal), else to this process's stdout and stderr. ``pid_file`` names
    the running phase's process group while it runs, so that a caller restarted after a
    crash can end it (:func:`end_stale_dry_run`); it is removed when the dry run ends.
    ``on_saved`` is called once the first phase has committed its checkpoint and died.
    ``read_sample``: first list ``TRAINBOT_DATA_URI`` and read a byte of it with this
    machine's own credentials, as the script will (:func:`read_sample`).
    ``sync``: the command writes its own checkpoints into ``$TRAINBOT_CHECKPOINT_DIR``
    (``exec --sync-dir``) instead of using the session API (:mod:`runner.dryrun_sync`).
    """
    if not command:
        raise RunnerError("no command: write `trainbot-runner dry-run -- python train.py …`")
    if steps < 1:
        raise RunnerError("the dry run needs at least one step before the checkpoint")
    report = DryRunReport(mtbp_s=mtbp_s)
    store = run_store(checkpoint_uri, run_id)
    found = scan(store)
    delete_steps(store, found, set(found.objects))  # a dry run starts from nothing
    base = dict(os.environ if env is None else env)
    base |= contract.render({contract.RUN_ID: run_id, contract.CHECKPOINT_URI: checkpoint_uri})
    dropped: list[contract.Var[Any, Any]]
    dropped = [contract.CHECKPOINT_INTERVAL_S, contract.STOP_FILE, contract.CHECKPOINT_PREFIX]
    if base.get(contract.STORE_CREDENTIALS.name) != "broker":
        # Events go to each phase's file; the URL stays only for the store's broker.
        dropped.append(contract.INGEST_URL)
    for var in dropped:
        base.pop(var.name, None)
    if Node.from_env(base) is not None:
        # A script written for torchrun: its dry run is one process under torchrun, so
        # its process group initialises; the gang itself first meets at the launch.
        command = Node.alone().command(command)
    sample = contract.DATA_URI.get(base)
    if read_sample and sample:
        report.sample_uri = sample
        try:
            report.sample_objects, report.sample_bytes = _read_sample(sample)
        except RunnerError as exc:
            report.problems.append(
                f"the data sample {sample} cannot be read with this instance's own "
                f"credentials (the training script's): {exc}"
            )
    deadline = time.monotonic() + timeout_s
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(log_path, "ab")) if log_path is not None else None
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="trainbot-dry-run-"))
        if pid_file is not None:
            stack.callback(pid_file.unlink, missing_ok=True)
        # The run's code and its setup, as an attempt has them: the dry run runs in the
        # checked-out commit, and its report says how long setup took.
        # Its secrets, read as an attempt reads them, for the command only (not setup).
        try:
            secrets = resolve(contract.SECRETS.get(base) or {}, base)
        except SecretUnavailable as exc:
            report.problems.append(f"{exc}: the run would fail alike (secret_unavailable)")
            return report
        try:  # the spec's image, checked as an attempt checks it
            container = Container.from_env(base)
            if container is not None:
                container.check()
        except (ContainerError, contract.EnvError) as exc:
            report.problems.append(f"{exc} (the run would fail alike: image_unavailable)")
            return report
        workspace = Workspace.from_env(base)
        cwd: Path | None = None
        if workspace is not None:
            try:
                ready = workspace.prepare(
                    base, feed=log.write if log is not None else None, echo=log is None
                )
            except SetupFailed as exc:
                report.problems.append(f"setup failed: {exc}; its last lines:\n{exc.tail[-2000:]}")
                return report
            if log is not None:
                log.flush()  # before the phases write to the same file
            report.setup_s = round(ready.code_s + ready.prepared.seconds, 3)
            report.setup = ready.lines()
            base, cwd = ready.env, ready.cwd
        base = base | secrets
        if sync:
            return run_sync_phases(
                command,
                report,
                base,
                deadline,
                Path(tmp),
                log,
                store=store,
                pid_file=pid_file,
                on_saved=on_saved,
                cwd=cwd,
                container=container,
            )
        return _run_phases(
            command,
            report,
            base,
            deadline,
            Path(tmp),
            log,
            steps=steps,
            mtbp_s=mtbp_s,
            pid_file=pid_file,
            on_saved=on_saved,
            cwd=cwd,
            container=container,
        )


def _run_phases(
    command: Sequence[str],
    report: DryRunReport,
    base: dict[str, str],
    deadline: float,
    tmp: Path,
    log: IO[bytes] | None,
    *,
    steps: int,
    mtbp_s: float,
    pid_file: Path | None = None,
    on_saved: Callable[[], None] | None = None,
    cwd: Path | None = None,
    container: Container | None = None,
) -> DryRunReport:
    first = Phase(
        command,
        base
        | contract.render(
            {
                contract.MAX_STEPS: steps,
                contract.DRY_RUN_PHASE: "save",
                contract.EVENTS_FILE: tmp / "save.jsonl",
            }
        ),
        tmp / "save.jsonl",
        log,
        pid_file,
        cwd,
        container,
    )
    try:
        saved = _wait_for(first, "dry_run", deadline, phase="saved")
    finally:
        first.kill()
        first.pump()
    if saved is None:
        report.problems.append(_why_not(first, "commit a checkpoint", deadline))
        return report
    report.steps_before_kill = int(saved["step"])
    report.saved_sha256 = str(saved["state_sha256"])
    times = [d["step_time_s"] for t, _, d in first.events if t == "metrics"]
    if len(times) > 1:
        times = times[1:]  # the first step pays for warm-up
    report.step_time_s = statistics.median(times) if times else None
    _read_commits(first, report)
    if on_saved is not None:
        on_saved()

    second = Phase(
        command,
        base
        | contract.render(
            {contract.DRY_RUN_PHASE: "verify", contract.EVENTS_FILE: tmp / "verify.jsonl"}
        ),
        tmp / "verify.jsonl",
        log,
        pid_file,
        cwd,
        container,
    )
    try:
        while second.proc.poll() is None and time.monotonic() < deadline:
            second.pump()
            time.sleep(0.05)
    finally:
        second.kill()
        second.pump()
    restored = second.find("dry_run", phase="restored")
    restore_event = second.find("restored")
    if restore_event is not None:
        report.restore_s = float(restore_event["restore_s"])
    if restored is None:
        report.problems.append(_why_not(second, "restore the checkpoint", deadline))
        return report
    report.restored_sha256 = str(restored["state_sha256"])
    last = [d["step"] for t, _, d in second.events if t == "metrics"]
    report.steps_after_restore = max(last, default=int(restored["step"])) - int(restored["step"])
    if int(restored["step"]) != report.steps_before_kill:
        report.problems.append(
            f"restored step {restored['step']} but step {report.steps_before_kill} was saved"
        )
    if report.restored_sha256 != report.saved_sha256:
        report.problems.append(
            "the restored state differs from the saved one: some state is not tracked "
            "(model, optimizer, scheduler, data position) or is not deterministic"
        )
    if second.proc.returncode != 0:
        report.problems.append(f"after the restore the command exited {second.proc.returncode}")
    elif report.steps_after_restore < 2:
        report.problems.append("the command did not run two steps after the restore")
    return finish_report(report, mtbp_s=mtbp_s)


def _read_sample(uri: str) -> tuple[int, int]:
    """(objects, bytes) under the sample; its first object is opened and a byte read, so
    both the listing and the read are allowed. Raises RunnerError."""
    store = open_store(uri, credentials="default")
    found = store.list()
    if not found:
        raise RunnerError("it holds no object")
    with store.open_read(found[0].key) as stream:
        stream.read(1)
    return len(found), sum(o.size for o in found)


def _read_commits(phase: Phase, report: DryRunReport) -> None:
    """Size, write time and stall of the saved step's commits (the session saves it more
    than once; the first save also allocates the staging buffers, so its stall is not
    counted unless it is the only one)."""
    commits = [
        d
        for t, _, d in phase.events
        if t == "checkpoint_committed" and d.get("step") == report.steps_before_kill
    ]
    if not commits:
        return
    report.checkpoint_bytes = int(commits[-1]["bytes"])
    report.write_s = statistics.median(float(c["write_s"]) for c in commits)
    stalls = [float(c["stall_s"]) for c in commits if isinstance(c.get("stall_s"), int | float)]
    if stalls:
        report.stall_s = statistics.median(stalls[1:] or stalls)


def _wait_for(proc: Phase, type_: str, deadline: float, **match: Any) -> dict[str, Any] | None:
    while time.monotonic() < deadline:
        proc.pump()
        found = proc.find(type_, **match)
        if found is not None:
            return found
        if proc.proc.poll() is not None:
            proc.pump()
            return proc.find(type_, **match)
        time.sleep(0.05)
    return None


def _why_not(phase: Phase, what: str, deadline: float) -> str:
    code = phase.proc.poll()
    if time.monotonic() >= deadline:
        return f"timed out before the command could {what}"
    if not phase.events:
        return (
            f"the command exited {code} without reporting anything: the dry run needs a "
            "script that uses the session API (runner.session.Session)"
        )
    return f"the command exited {code} before it could {what}"
