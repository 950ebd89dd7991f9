"""The dry run of a script that writes its own checkpoints (``exec --sync-dir``).

A Hugging Face Trainer or Lightning script knows nothing of the session API, so the
session's dry run (N steps, a state hash saved and compared) cannot drive it. This one
drives it from the outside, as an attempt does: the command runs with
``$TRAINBOT_CHECKPOINT_DIR`` on an empty folder until its checkpoints are synced to the
real store (two, so the time between them gives the step time; one when the script
ends or waits too long for the second), and is killed with SIGKILL, as a lost instance
would be. The newest synced checkpoint is then restored into a *fresh* folder (a new
instance), its files checked against the manifest's hashes, and the command started
again there. It passes when the first checkpoint the restarted script writes is past
the synced step: it continued from it. One at or before it means the script started
over (it does not look in ``$TRAINBOT_CHECKPOINT_DIR`` for a checkpoint to resume
from), and a run would redo its work after every preemption.

The step time comes from the framework's own log (:mod:`runner.frameworks`), else from
the checkpoints' pace; the write time is the sync's upload. The stall is not known (the
script's own save blocks its loop, unseen from here).
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from runner import env as contract
from runner.container import Container
from runner.dryrun_phase import Phase, finish_report
from runner.dryrun_report import DryRunReport
from runner.errors import CheckpointError, StoreError
from runner.frameworks import FrameworkMetrics
from runner.layout import CommitInfo, read_manifest
from runner.store import Store
from runner.sync import CheckpointSync, open_files

__all__ = ["run_sync_phases"]

#: Quiet time before a checkpoint is synced during the dry run (an attempt's default is
#: 2 s; the dry run waits on it twice).
SETTLE_S = 0.5
#: After the first checkpoint, how long the second is waited for at most: this many
#: times the time the first took, and at least MIN_SECOND_WAIT_S.
SECOND_WAIT_RATIO = 1.0
MIN_SECOND_WAIT_S = 10.0
#: After the restart, how long a checkpoint past the synced step is waited for at most:
#: this many times the time the first phase took to its first, and at least
#: MIN_VERIFY_S (the restart pays the start-up again, and the restore on top).
VERIFY_RATIO = 3.0
MIN_VERIFY_S = 60.0
_POLL_S = 0.1


class _Watched:
    """One phase's process, its sync dir synced to the store and its framework log read."""

    def __init__(
        self,
        command: Sequence[str],
        env: dict[str, str],
        tmp: Path,
        name: str,
        log: IO[bytes] | None,
        *,
        sync: CheckpointSync,
        after_step: int,
        pid_file: Path | None,
        cwd: Path | None,
        container: Container | None = None,
    ) -> None:
        self.sync = sync
        self.metrics = FrameworkMetrics(sync.root, after_step=after_step, every_s=0.2)
        self.points: list[dict[str, Any]] = []
        self.commits: list[tuple[float, CommitInfo]] = []
        self.started = time.monotonic()
        self.phase = Phase(
            command,
            env
            | contract.render(
                {
                    contract.CHECKPOINT_DIR: sync.root,
                    contract.DRY_RUN_PHASE: name,
                    contract.EVENTS_FILE: tmp / f"{name}.jsonl",
                }
            ),
            tmp / f"{name}.jsonl",
            log,
            pid_file,
            cwd,
            container,
        )

    def look(self, *, final: bool = False) -> None:
        now = time.monotonic()
        pid = self.phase.watched_pid()
        code = self.phase.proc.poll()
        found = self.sync.poll(
            now=now,
            final=final,
            clean=code == 0,
            open_paths=lambda: open_files(pid) if pid is not None else None,
        )
        self.commits.extend((now, c) for c in found)
        self.points.extend(d for _, d in self.metrics.poll(now=now, force=final))

    def run(self, *, until: Callable[[], bool], deadline: float) -> None:
        """Look until ``until()``, the process ends or the deadline; then kill it."""
        try:
            while time.monotonic() < deadline:
                self.look()
                if until():
                    break
                if self.phase.proc.poll() is not None:
                    self.look(final=True)
                    break
                time.sleep(_POLL_S)
        finally:
            self.phase.kill()

    @property
    def code(self) -> int | None:
        return self.phase.proc.returncode


def run_sync_phases(
    command: Sequence[str],
    report: DryRunReport,
    base: dict[str, str],
    deadline: float,
    tmp: Path,
    log: IO[bytes] | None,
    *,
    store: Store,
    pid_file: Path | None = None,
    on_saved: Callable[[], None] | None = None,
    cwd: Path | None = None,
    container: Container | None = None,
) -> DryRunReport:
    """Both phases of a sync-dir script's dry run, into ``report``; ``container``: the
    spec's image the command runs in."""
    save_dir, restore_dir = tmp / "save", tmp / "restore"
    save_dir.mkdir()
    restore_dir.mkdir()
    first = _Watched(
        command,
        base,
        tmp,
        "save",
        log,
        sync=CheckpointSync(store=store, root=save_dir, settle_s=SETTLE_S),
        after_step=-1,
        pid_file=pid_file,
        cwd=cwd,
        container=container,
    )

    def saved_enough() -> bool:
        if len(first.commits) >= 2:
            return True
        if not first.commits:
            return False
        took = first.commits[0][0] - first.started
        waited = time.monotonic() - first.commits[0][0]
        return waited >= max(MIN_SECOND_WAIT_S, SECOND_WAIT_RATIO * took)

    first.run(until=saved_enough, deadline=deadline)
    if not first.commits:
        report.problems.append(_nothing_synced(first, deadline))
        return report
    to_first = first.commits[0][0] - first.started
    synced = max(c.step for _, c in first.commits)
    newest = next(c for _, c in first.commits if c.step == synced)
    report.steps_before_kill = synced
    report.checkpoint_bytes = newest.bytes
    report.write_s = statistics.median(c.write_s for _, c in first.commits)
    report.step_time_s = _step_time(first)
    if on_saved is not None:
        on_saved()

    second_sync = CheckpointSync(store=store, root=restore_dir, settle_s=SETTLE_S)
    t0 = time.perf_counter()
    try:
        restored = second_sync.restore()
    except (CheckpointError, StoreError, OSError) as exc:
        report.problems.append(f"the synced checkpoint of step {synced} cannot be restored: {exc}")
        return report
    report.restore_s = time.perf_counter() - t0
    if restored is None or restored.step != synced:
        got = "nothing" if restored is None else f"step {restored.step}"
        report.problems.append(f"step {synced} was synced, but a restore found {got}")
        return report
    # Steps the first phase committed before the synced one count again: a script that
    # starts over writes them anew, and that is what this phase is to see.
    second_sync.done = {synced}
    report.saved_sha256, report.restored_sha256 = _digests(store, synced, restore_dir)
    if report.saved_sha256 != report.restored_sha256:
        report.problems.append(f"the files restored for step {synced} differ from the ones synced")
        return report

    second = _Watched(
        command,
        base,
        tmp,
        "verify",
        log,
        sync=second_sync,
        after_step=synced,
        pid_file=pid_file,
        cwd=cwd,
        container=container,
    )
    verify_by = min(deadline, time.monotonic() + max(MIN_VERIFY_S, VERIFY_RATIO * to_first))
    second.run(until=lambda: bool(second.commits), deadline=verify_by)
    after = [c.step for _, c in second.commits]
    if after and min(after) <= synced:
        report.problems.append(
            f"after the restore of step {synced} the command wrote the checkpoint of step "
            f"{min(after)}: it started over instead of continuing, so a preempted run would "
            "redo its work; resume from the newest checkpoint in $TRAINBOT_CHECKPOINT_DIR "
            "(Hugging Face: trainer.train(resume_from_checkpoint=get_last_checkpoint(dir)); "
            "Lightning: trainer.fit(…, ckpt_path=the newest .ckpt there))"
        )
        return report
    steps = [int(d["step"]) for d in second.points] + after
    report.steps_after_restore = max(steps, default=synced) - synced
    if report.steps_after_restore < 1:
        if time.monotonic() >= verify_by:
            report.problems.append(
                f"the restarted command neither wrote a checkpoint nor logged a step past "
                f"{synced} within {verify_by - second.started:.0f} s (its first checkpoint "
                f"took {to_first:.0f} s)"
            )
        else:
            report.problems.append(
                f"after the restore of step {synced} the command exited {second.code} "
                "without a step past it (no new checkpoint, nothing logged)"
            )
        return report
    if report.step_time_s is None:
        report.step_time_s = _step_time(second)
    return finish_report(report, mtbp_s=report.mtbp_s)


def _step_time(w: _Watched) -> float | None:
    """The framework's measured step times, else the pace of the synced checkpoints."""
    logged = [float(d["step_time_s"]) for d in w.points if d["step_time_s"] == d["step_time_s"]]
    if logged:
        return statistics.median(logged)
    if len(w.commits) >= 2:
        (t1, c1), (t2, c2) = w.commits[0], w.commits[-1]
        if c2.step > c1.step:
            return (t2 - t1) / (c2.step - c1.step)
    return None


def _digests(store: Store, step: int, root: Path) -> tuple[str, str]:
    """(the manifest's, the restored files') sha256 over every file's name and hash."""
    manifest = read_manifest(store, step)
    label = manifest.label or ""
    where = root if label in ("", ".") else root / label
    saved, restored = hashlib.sha256(), hashlib.sha256()
    for entry in sorted(manifest.files, key=lambda e: e.name):
        saved.update(f"{entry.name}\0{entry.sha256}\n".encode())
        h = hashlib.sha256()
        try:
            with open(where.joinpath(*entry.name.split("/")), "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        except OSError:
            pass  # missing: its hash differs
        restored.update(f"{entry.name}\0{h.hexdigest()}\n".encode())
    return saved.hexdigest(), restored.hexdigest()


def _nothing_synced(w: _Watched, deadline: float) -> str:
    ignored = sorted(w.sync.ignored)
    held = (
        f"; it holds {', '.join(ignored[:5])}, with no step in the name"
        if ignored
        else "; it wrote nothing there"
    )
    torn = f"; {', '.join(sorted(w.sync.torn))} was not complete" if w.sync.torn else ""
    timed_out = w.code == -9 and time.monotonic() >= deadline  # killed by us, at the deadline
    ended = "timed out" if timed_out else f"the command exited {w.code}"
    return (
        f"{ended} before a checkpoint in $TRAINBOT_CHECKPOINT_DIR could be synced{held}{torn}: "
        "save checkpoints there as folders or files whose names hold the step "
        "(checkpoint-500/, ckpt-500.pt, epoch=0-step=500.ckpt), often enough that the "
        "first comes within the dry run's timeout"
    )
