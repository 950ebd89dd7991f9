"""One process of a dry run, and the conclusion both kinds of dry run draw from what they
measured.

The session's dry run (:mod:`runner.dryrun`) and the dry run of a script that writes its
own checkpoints (:mod:`runner.dryrun_sync`) each start their command as a :class:`Phase`
(its own process group, its events followed, killed with SIGKILL as a lost instance
would be) and end with :func:`finish_report`. Both import this module, and the sync dry
run is one of :mod:`runner.dryrun`'s ways to run, so neither imports the other back.
"""

from __future__ import annotations

import dataclasses
import os
import secrets as tokens
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from runner import env as contract
from runner.container import Container, run_paths
from runner.dryrun_report import DryRunReport
from runner.pidfile import record_process_group, record_spawn
from runner.preemption import choose_interval, flush_fits
from runner.telemetry import follow_file

__all__ = ["Phase", "finish_report"]


class Phase:
    """One process of the dry run, with its events collected."""

    def __init__(
        self,
        command: Sequence[str],
        env: dict[str, str],
        events: Path,
        log: IO[bytes] | None,
        pid_file: Path | None = None,
        cwd: Path | None = None,
        container: Container | None = None,
    ) -> None:
        """``container``: the spec's image, checked; the phase runs in a container of
        its own, removed when the phase is killed."""
        events.touch()
        self.container: Container | None = None
        self._watched_pid: int | None = None
        if container is not None:
            self.container = dataclasses.replace(container, name=f"trainbot-{tokens.token_hex(6)}")
            command = self.container.command(
                command, env=env, cwd=cwd or Path.cwd(), paths=run_paths(env, events.parent)
            )
        self.follower = follow_file(events)
        self.events: list[tuple[str, float, dict[str, Any]]] = []
        if pid_file is not None:
            # Named before the spawn: a crash of ours in the middle of it leaves a process
            # that end_stale_dry_run still finds, by the run id in its environment.
            record_spawn(pid_file, run_id=env.get(contract.RUN_ID.name))
        self.proc = subprocess.Popen(
            list(command),
            env=env,
            start_new_session=True,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT if log is not None else None,
        )
        if pid_file is not None:
            # Its own process group, so whoever finds this file after a crash of ours can
            # end the whole dry run (end_stale_dry_run), the command's children included.
            record_process_group(pid_file, self.proc.pid, run_id=env.get(contract.RUN_ID.name))

    def pump(self) -> None:
        self.events.extend(self.follower)

    def find(self, type_: str, **match: Any) -> dict[str, Any] | None:
        for t, _, data in self.events:
            if t != type_:
                continue
            inner = data.get("report", data)
            if all(inner.get(k) == v for k, v in match.items()):
                return dict(inner)
        return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self.container is not None:  # killing the runtime's client leaves it running
            self.container.remove()

    def watched_pid(self) -> int | None:
        """The process whose open files tell what is still being written: the command,
        or the container's first process (the runtime's client holds none of them)."""
        if self.container is None:
            return self.proc.pid
        if self._watched_pid is None:
            self._watched_pid = self.container.host_pid()
        return self._watched_pid


def finish_report(report: DryRunReport, *, mtbp_s: float) -> DryRunReport:
    """Daly's interval and the termination windows an emergency checkpoint fits, from
    the measured write; ``ok`` when no problem was found."""
    if report.write_s is not None and report.write_s > 0:
        report.daly_interval_s = choose_interval(
            write_s=report.write_s, stall_s=report.stall_s, mtbp_s=mtbp_s, flush_fits_window=False
        ).interval_s
        for name, window in contract.TERMINATION_WINDOWS_S.items():
            report.emergency_fits[name] = flush_fits(
                nbytes=report.checkpoint_bytes or 0,
                bandwidth_bps=(report.checkpoint_bytes or 0) / report.write_s
                if report.write_s > 0
                else None,
                time_left_s=window,
            )
    report.ok = not report.problems
    return report
