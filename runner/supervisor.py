"""``trainbot-runner exec -- CMD…``: run a training command under supervision.

The supervisor starts the command with the run's settings in ``TRAINBOT_*`` variables,
forwards the stop signal, watches the metadata notice, forwards the child's events and
its own system samples to the control plane, and reports the exit status. A script that
uses the session API gets every feature through its environment. A script that only
writes checkpoint directories into ``$TRAINBOT_CHECKPOINT_DIR`` gets them synced to the
store (each once it has settled, and at the end) and restored before it starts.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from runner import EXIT_PREEMPTED, EXIT_SUCCEEDED
from runner.errors import CheckpointError, RunnerError, StoreError
from runner.layout import CommitInfo, list_committed, read_manifest
from runner.preemption import PreemptionFlag, SignalHandlers, start_pollers
from runner.store import Store
from runner.telemetry import EventSink, FileFollower, SystemSampler, follow_file

log = logging.getLogger(__name__)

_DIGITS = re.compile(r"(\d+)\D*$")


@dataclass
class DirSync:
    """Uploads checkpoint directories a script writes, once each has stopped changing."""

    store: Store
    root: Path
    settle_s: float = 2.0
    #: Steps already committed (by us or earlier attempts).
    done: set[int] = field(default_factory=set)
    _seen: dict[str, tuple[tuple[tuple[str, int, int], ...], float]] = field(default_factory=dict)

    def restore(self) -> Path | None:
        """Put the newest committed directory back where the script expects it."""
        for entry in reversed(list_committed(self.store)):
            self.done.add(entry.step)
        for entry in reversed(list_committed(self.store)):
            try:
                manifest = read_manifest(self.store, entry.step)
                if manifest.kind == "files":
                    from runner.checkpoint import download_files  # torch only when syncing

                    return download_files(self.store, manifest, self.root)
            except (CheckpointError, StoreError) as exc:
                log.warning(
                    "checkpoint step %d unusable (%s); trying an older one", entry.step, exc
                )
        return None

    def poll(self, *, now: float, final: bool = False) -> list[CommitInfo]:
        """Commit every settled directory not yet committed."""
        committed: list[CommitInfo] = []
        if not self.root.is_dir():
            return committed
        for d in sorted(p for p in self.root.iterdir() if p.is_dir()):
            m = _DIGITS.search(d.name)
            if m is None:
                continue
            step = int(m.group(1))
            if step in self.done:
                continue
            sig = tuple(
                (p.relative_to(d).as_posix(), st.st_size, st.st_mtime_ns)
                for p in sorted(d.rglob("*"))
                if p.is_file() and (st := p.stat())
            )
            if not sig:
                continue
            previous = self._seen.get(d.name)
            if previous is None or previous[0] != sig:
                self._seen[d.name] = (sig, now)
                if not final:
                    continue
            elif not final and now - previous[1] < self.settle_s:
                continue
            from runner.checkpoint import commit_files  # torch only when syncing

            committed.append(commit_files(self.store, step, d))
            self.done.add(step)
        return committed


class Supervisor:
    """Runs one command to completion, preemption or failure."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        sink: EventSink,
        flag: PreemptionFlag | None = None,
        env: Mapping[str, str] | None = None,
        window_s: float = 30.0,
        preemption_sources: str = "",
        dir_sync: DirSync | None = None,
        scratch_dir: Path | None = None,
        scratch_bytes: int | None = None,
        poll_s: float = 0.2,
        sample_s: float = 10.0,
        install_signals: bool = True,
    ) -> None:
        if not command:
            raise RunnerError(
                "no command to run: write `trainbot-runner exec -- python train.py …`"
            )
        self.command = list(command)
        self.sink = sink
        self.flag = flag or PreemptionFlag()
        self.env = dict(os.environ if env is None else env)
        self.window_s = window_s
        self.preemption_sources = preemption_sources
        self.dir_sync = dir_sync
        self.scratch_dir = scratch_dir or Path(self.env.get("TRAINBOT_SCRATCH_DIR") or ".")
        self.scratch_bytes = scratch_bytes
        self.poll_s = poll_s
        self.sample_s = sample_s
        self.install_signals = install_signals
        #: The child's exit code, once it has exited.
        self.child_code: int | None = None
        #: The exit code the child reported in its last event, if it uses the session API.
        self._child_reported: int | None = None
        #: Whether the exit was reported already (a preempted session's, before teardown).
        self._exit_reported = False
        #: Whether the preemption notice was reported (it must come before the exit).
        self._announced = False

    def run(self) -> int:
        with tempfile.TemporaryDirectory(prefix="trainbot-exec-") as tmp:
            events = Path(tmp) / "events.jsonl"
            events.touch()
            env = dict(self.env)
            env["TRAINBOT_EVENTS_FILE"] = str(events)
            env["TRAINBOT_TERMINATION_WINDOW_S"] = str(self.window_s)
            env.pop("TRAINBOT_PREEMPTION_SOURCES", None)  # the supervisor polls, then signals
            if self.dir_sync is not None:
                env["TRAINBOT_CHECKPOINT_DIR"] = str(self.dir_sync.root)
                self.dir_sync.root.mkdir(parents=True, exist_ok=True)
                restored = self.dir_sync.restore()
                if restored is not None:
                    self.sink.emit("log", {"level": "info", "message": f"restored {restored.name}"})
            signals = (
                SignalHandlers(self.flag, window_s=self.window_s) if self.install_signals else None
            )
            if signals is not None:
                signals.__enter__()
            pollers = start_pollers(self.flag, sources=self.preemption_sources)
            sampler = SystemSampler(
                self.sink,
                disk_path=self.scratch_dir,
                declared_total=self.scratch_bytes,
                interval_s=self.sample_s,
            )
            try:
                return self._supervise(env, events, sampler)
            finally:
                sampler.stop()
                pollers.stop()
                if signals is not None:
                    signals.__exit__(None, None, None)

    def _supervise(self, env: dict[str, str], events: Path, sampler: SystemSampler) -> int:
        follower = follow_file(events)
        try:
            child = subprocess.Popen(self.command, env=env)
        except OSError as exc:
            raise RunnerError(f"cannot start {self.command[0]!r}: {exc.strerror}") from exc
        sampler.start()
        while True:
            code = child.poll()
            self._forward(follower)
            if self.flag.is_set and self._announce() and code is None:
                child.send_signal(signal.SIGTERM)
            if self.dir_sync is not None:
                self._sync(final=False)
            if code is not None:
                break
            # Wakes as soon as the child exits: its teardown is paid time that makes no
            # progress, so the exit is reported without a poll's delay.
            try:
                child.wait(timeout=self.poll_s)
            except subprocess.TimeoutExpired:
                pass
        self._forward(follower)
        if self.dir_sync is not None:
            self._sync(final=True)
        self.child_code = code
        result = self._exit_code(code)
        if not self._exit_reported:
            reason = {EXIT_SUCCEEDED: "succeeded", EXIT_PREEMPTED: "preempted"}.get(
                result, "failed"
            )
            self.sink.emit("exit", {"code": result, "reason": reason})
        return result

    def _forward(self, follower: FileFollower) -> None:
        for type_, when, data in follower:
            if type_ == "exit":
                self._child_reported = int(data["code"])
                if self._child_reported == EXIT_PREEMPTED and self.flag.is_set:
                    self._announce()  # the notice goes first: the exit ends the attempt
                    # The session has committed what it could and ended: the instance is
                    # going away, so report the end now and let the control plane release
                    # it, instead of paying for the interpreter's teardown (a second or
                    # more with torch loaded) before saying so.
                    self.sink.emit("exit", {"code": EXIT_PREEMPTED, "reason": "preempted"})
                    self._exit_reported = True
                    send_now = getattr(self.sink, "flush", None)
                    if send_now is not None:
                        send_now(0.0)  # ask the sender to ship it now; do not wait here
                continue  # the supervisor reports the exit itself, once
            if type_ == "preemption_notice":
                continue
            self.sink.emit(type_, data, time=when)

    def _announce(self) -> bool:
        """Report the preemption notice, once: True the first time, False after."""
        if self._announced:
            return False
        self._announced = True
        notice = self.flag.notice
        self.sink.emit(
            "preemption_notice",
            {
                "source": notice.source if notice else "signal",
                "time_left_s": self.flag.time_left(),
            },
        )
        return True

    def _sync(self, *, final: bool) -> None:
        assert self.dir_sync is not None
        try:
            for info in self.dir_sync.poll(now=time.monotonic(), final=final):
                self.sink.emit(
                    "checkpoint_committed",
                    {
                        "step": info.step,
                        "bytes": info.bytes,
                        "write_s": info.write_s,
                        "uri": info.uri,
                    },
                )
        except (CheckpointError, StoreError, OSError) as exc:
            self.sink.emit("checkpoint_failed", {"step": -1, "error": str(exc)})

    def _exit_code(self, code: int) -> int:
        if code < 0 and self._child_reported is not None:
            # The child decided its exit code and said so, then a second SIGTERM (sent to
            # the whole process group as well as forwarded by us) ended it first.
            code = self._child_reported
        if code == EXIT_PREEMPTED:
            return EXIT_PREEMPTED
        if self.flag.is_set and self.dir_sync is not None and self.dir_sync.done:
            # A script without the session API does not know code 75: a preempted run with a
            # committed checkpoint is resumable whatever the script returned.
            return EXIT_PREEMPTED
        if code < 0:
            return 128 - code  # killed by signal N: the shell's 128 + N
        return code
