"""``trainbot-runner exec -- CMD…``: run a training command under supervision.

The supervisor starts the command with the run's settings in ``TRAINBOT_*`` variables,
forwards the stop signal, watches the metadata notice, forwards the child's events and
its own system samples to the control plane, and reports the exit status. A script that
uses the session API gets every feature through its environment. A script that only
writes checkpoint folders or files into ``$TRAINBOT_CHECKPOINT_DIR`` gets them synced to
the store (:mod:`runner.sync`) and the newest restored before it starts.

A notice (SIGTERM to the supervisor, or a metadata poller) makes the attempt resumable
whatever moment it comes and whatever the child then does: before the child starts, while
it starts up (before it has a handler of its own), before its first checkpoint, during a
write. The attempt exits 75 (preempted: resubmit, resume from the newest checkpoint or
from step 0), unless the child reports through the session API that it finished with its
last step committed (0). A plain script's 0 after a notice is taken as stopped by it: it
cannot say that it had finished, and a resumed script that had finishes at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from runner import EXIT_FAILED, EXIT_PREEMPTED, EXIT_SUCCEEDED
from runner import env as contract
from runner.container import Container, ContainerError, run_paths
from runner.errors import CheckpointError, RunnerError, StoreError
from runner.exits import exit_code, flush_before_start
from runner.frameworks import FrameworkMetrics
from runner.logship import LogShipper, pump
from runner.preemption import PreemptionFlag, SignalHandlers, start_pollers, write_notice
from runner.secrets import SecretUnavailable, resolve
from runner.setup import SetupFailed, SetupInterrupted, Workspace
from runner.stacks import StackDumper, StallWatch
from runner.sync import CheckpointSync, nothing_synced, open_files
from runner.telemetry import EventSink, FileFollower, SystemSampler, follow_file

log = logging.getLogger(__name__)

#: What only node 0 of a multi-node attempt forwards: the run's progress, which every
#: node's first rank reports alike (a node after the first keeps its data wait).
_RANK_ZEROS = frozenset({"metrics", "restored", "checkpoint_committed"})
#: Seconds the last log segment may take to reach the store, when no notice is counting.
_LOG_CLOSE_S = 15.0


class Supervisor:
    """Runs one command to completion, preemption or failure."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        sink: EventSink,
        flag: PreemptionFlag | None = None,
        env: Mapping[str, str] | None = None,
        window_s: float = contract.DEFAULT_TERMINATION_WINDOW_S,
        preemption_sources: str = "",
        sync: CheckpointSync | None = None,
        scratch_dir: Path | None = None,
        scratch_bytes: int | None = None,
        poll_s: float = 0.2,
        sample_s: float = 10.0,
        install_signals: bool = True,
        under_torchrun: bool = False,
        node: int = 0,
        logs: LogShipper | None = None,
        workspace: Workspace | None = None,
    ) -> None:
        """``under_torchrun``: the command is torchrun (:mod:`runner.nodes`), which exits 1
        whatever its workers exited with: the exit code the session reported wins.
        ``node``: this runner's node of a multi-node attempt. Node 0 reports the run's
        progress; the others report their own system figures, data wait, notice and exit,
        and not their ranks' metrics and checkpoints, which rank 0's already are.
        ``logs``: where the command's output goes besides the runner's own stdout and
        stderr (:mod:`runner.logship`); its tail goes with the exit event.
        ``workspace``: the run's code and setup (:mod:`runner.setup`), made ready before
        the command starts, which then runs in the code directory."""
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
        self.sync = sync
        self.scratch_dir = scratch_dir or contract.SCRATCH_DIR.get(self.env) or Path(".")
        self.scratch_bytes = scratch_bytes
        self.poll_s = poll_s
        self.sample_s = sample_s
        self.install_signals = install_signals
        self.under_torchrun = under_torchrun
        self.node = node
        self.logs = logs
        self.workspace = workspace
        #: The command's working directory (the code directory, once it is ready).
        self.cwd: Path | None = None
        self._sampling = False
        #: The threads reading the command's stdout and stderr, while ``logs`` is set.
        self._pumps: list[threading.Thread] = []
        #: Data-wait fractions a node after the first heard since its last system sample.
        self._waits: list[float] = []
        self._waits_lock = threading.Lock()  # the sampler's thread takes them
        #: The child process, once started.
        self.child: subprocess.Popen[bytes] | None = None
        #: The child's exit code, once it has exited.
        self.child_code: int | None = None
        #: The exit code and reason the child reported in its last event (session API).
        self._child_reported: int | None = None
        self._child_reason: str | None = None
        #: What the session's flushes did in its notice window (its exit's ``flush``).
        self._child_flush: dict[str, Any] | None = None
        #: Whether the child committed checkpoints itself (session API); sent any event.
        self._child_checkpoints = self._child_spoke = False
        #: Whether the exit was reported already (a preempted session's, before teardown).
        self._exit_reported = False
        #: Whether the preemption notice was reported (it must come before the exit).
        self._announced = False
        #: Where the child reads the notice's real deadline (runner.preemption.relay).
        self._notice_file: Path | None = None
        #: Dumps the child's stacks when its step stands still (runner.stacks).
        self.stacks: StackDumper | None = None
        #: The spec's image the command runs in (runner.container), once checked.
        self.container: Container | None = None
        #: The container's first process as this machine sees it, once known.
        self._container_pid: int | None = None
        #: A script without the session API: its framework's logged steps (set at restore).
        self._framework: FrameworkMetrics | None = None
        #: Whether the child reported metrics itself (session API): then those win.
        self._child_metrics = False

    def run(self) -> int:
        # The handlers go in first: a notice during the restore or the start-up is a
        # preemption like any other, never a death by SIGTERM (exit 143, a failure).
        signals = (
            SignalHandlers(self.flag, window_s=self.window_s) if self.install_signals else None
        )
        if signals is not None:
            signals.__enter__()
        pollers = start_pollers(self.flag, sources=self.preemption_sources)
        try:
            with tempfile.TemporaryDirectory(prefix="trainbot-exec-") as tmp:
                events = Path(tmp) / "events.jsonl"
                events.touch()
                env = dict(self.env)
                self._notice_file = Path(tmp) / "notice.json"
                env |= contract.render(
                    {
                        contract.EVENTS_FILE: events,
                        contract.NOTICE_FILE: self._notice_file,
                        contract.TERMINATION_WINDOW_S: self.window_s,
                        contract.CHECKPOINT_DIR: self.sync.root if self.sync else None,
                    }
                )
                env.pop(contract.PREEMPTION_SOURCES.name, None)  # we poll, then signal
                self.stacks = StackDumper(
                    Path(tmp) / "stacks",
                    sink=self.sink,
                    feed=self.logs.feed if self.logs is not None else None,
                    watch=StallWatch(
                        factor=contract.HANG_FACTOR.get(self.env),
                        floor_s=contract.HANG_FLOOR_S.get(self.env),
                    ),
                )
                sampler = SystemSampler(
                    self.sink,
                    disk_path=self.scratch_dir,
                    declared_total=self.scratch_bytes,
                    interval_s=self.sample_s,
                    extra=self._node_figures if self.node else None,
                )
                try:
                    try:  # before setup: a secret that cannot be read ends it at once
                        secrets = self._secrets()
                    except SecretUnavailable as exc:
                        return self._secret_unavailable(exc)
                    try:  # before the code and setup: a missing image ends it at once
                        self.container = self._container()
                    except (ContainerError, contract.EnvError) as exc:
                        return self._image_unavailable(exc)
                    if self.workspace is not None:
                        # Samples while setup runs: a long install is not a silent instance.
                        sampler.start()
                        self._sampling = True
                        ended = self._prepare(env)
                        if ended is not None:
                            return ended
                    if self.sync is not None:
                        self._restore()
                    if self.flag.is_set:
                        return self._preempted_before_start()
                    env |= secrets  # the command's environment only, never setup's
                    env |= self.stacks.env(env)
                    return self._supervise(env, events, sampler)
                finally:
                    sampler.stop()
        finally:
            pollers.stop()
            if signals is not None:
                signals.__exit__(None, None, None)
            if self.logs is not None:
                self.logs.close(timeout=0.0)  # done already, unless the start failed

    def _prepare(self, env: dict[str, str]) -> int | None:
        """Check the code out and run setup (or restore its environment), the output in
        the attempt's log; the exit code when the attempt ends here (a setup failure, a
        notice), else None with ``env`` and :attr:`cwd` set for the command."""
        assert self.workspace is not None
        if self.logs is not None:
            self.logs.start()
        feed = self.logs.feed if self.logs is not None else None
        try:
            ready = self.workspace.prepare(env, feed=feed, stop=lambda: self.flag.is_set)
        except SetupInterrupted:
            return self._preempted_before_start()
        except SetupFailed as exc:
            if self.flag.is_set:  # the notice's kill, not the setup's own failure
                return self._preempted_before_start()
            log.error("%s", exc)
            self._finish_logs(preempted=False)
            self.sink.emit(
                "exit",
                {
                    "code": EXIT_FAILED,
                    "reason": "setup_failed",
                    # What failed first, then its last lines.
                    "log_tail": f"{exc}\n{exc.tail or (self.logs.tail() if self.logs else '')}",
                },
            )
            self._exit_reported = True
            return EXIT_FAILED
        env.clear()
        env.update(ready.env)
        self.cwd = ready.cwd
        for line in ready.lines():
            text = f"trainbot-runner: {line}\n".encode()
            with contextlib.suppress(OSError):
                os.write(1, text)
            if feed is not None:
                feed(text)
            self.sink.emit("log", {"level": "info", "message": line})
        return None

    def _secrets(self) -> dict[str, str]:
        """The spec's secrets, read with this machine's identity (:mod:`runner.secrets`);
        only their names are said anywhere."""
        refs = contract.SECRETS.get(self.env)
        if not refs:
            return {}
        values = resolve(refs, self.env)
        names = ", ".join(sorted(values))
        self.sink.emit("log", {"level": "info", "message": f"secrets read: {names}"})
        return values

    def _secret_unavailable(self, exc: SecretUnavailable) -> int:
        """A secret the command needs cannot be read: the attempt fails, before setup,
        as its own end (another instance with the same role would fail alike)."""
        log.error("%s", exc)
        self.sink.emit(
            "exit", {"code": EXIT_FAILED, "reason": "secret_unavailable", "log_tail": str(exc)}
        )
        self._exit_reported = True
        return EXIT_FAILED

    def _container(self) -> Container | None:
        """The spec's image, checked (its runtime, the image pulled, its Python)."""
        container = Container.from_env(self.env)
        if container is None:
            return None
        facts = container.check()
        library = (
            f"its own trainbot {facts.trainbot}" if facts.trainbot else "the runner's, mounted"
        )
        self.sink.emit(
            "log",
            {
                "level": "info",
                "message": f"the command runs in {container.image} ({container.runtime}, "
                f"Python {facts.python}, runner library: {library})",
            },
        )
        return container

    def _image_unavailable(self, exc: RunnerError) -> int:
        """The spec's image cannot run here: the attempt fails before anything started,
        as its own end (another instance would fail alike)."""
        log.error("%s", exc)
        self.sink.emit(
            "exit", {"code": EXIT_FAILED, "reason": "image_unavailable", "log_tail": str(exc)}
        )
        self._exit_reported = True
        return EXIT_FAILED

    def _restore(self) -> None:
        assert self.sync is not None
        self.sync.root.mkdir(parents=True, exist_ok=True)
        max_step = contract.RESUME_MAX_STEP.get(self.env)
        t0 = time.perf_counter()
        restored = self.sync.restore(stop=lambda: self.flag.is_set, max_step=max_step)
        self._framework = FrameworkMetrics(
            self.sync.root, after_step=restored.step if restored is not None else -1
        )
        if restored is not None:
            # The step the attempt resumes from, as a session says it (the run's resume).
            self.sink.emit(
                "restored",
                {
                    "step": restored.step,
                    "fallback_from": None,
                    "restore_s": time.perf_counter() - t0,
                },
            )
            names = ", ".join(restored.names)
            self.sink.emit(
                "log", {"level": "info", "message": f"restored step {restored.step}: {names}"}
            )

    def _preempted_before_start(self) -> int:
        """A notice before the child started: nothing to stop, the next attempt does it all."""
        self._announce()
        log.warning("preemption notice before the command started; not starting it")
        self.sink.emit("exit", {"code": EXIT_PREEMPTED, "reason": "preempted"})
        return EXIT_PREEMPTED

    def _supervise(self, env: dict[str, str], events: Path, sampler: SystemSampler) -> int:
        follower = follow_file(events)
        # One pipe for both streams keeps them in the order they were written; a Python
        # command writes unbuffered unless it says otherwise, so its last lines before a
        # crash come before its traceback, and none is lost with the process. That costs
        # a few microseconds per printed line (two writes to the pipe, not one per 8 KiB):
        # nothing next to a step; a script that prints in bulk sets PYTHONUNBUFFERED= in
        # its env to keep Python's buffer.
        if self.logs is not None:
            env.setdefault("PYTHONUNBUFFERED", "1")
        piped = subprocess.PIPE if self.logs is not None else None
        joined = subprocess.STDOUT if self.logs is not None else None
        command = self.command
        if self.container is not None:
            command = self.container.command(
                self.command,
                env=env,
                cwd=self.cwd or Path.cwd(),
                # The events and notice files, the synced directory, the run's own.
                paths=run_paths(self.env, events.parent, self.sync.root if self.sync else None),
            )
        try:
            child = self.child = subprocess.Popen(
                command, env=env, stdout=piped, stderr=joined, cwd=self.cwd
            )
        except OSError as exc:
            raise RunnerError(f"cannot start {command[0]!r}: {exc.strerror}") from exc
        try:
            return self._watch(child, events, sampler, follower)
        finally:
            if self.container is not None:
                self.container.remove()  # left behind where the runtime was killed

    def _watch(
        self,
        child: subprocess.Popen[bytes],
        events: Path,
        sampler: SystemSampler,
        follower: FileFollower,
    ) -> int:
        if self.logs is not None:
            self._capture(child)
        # The attempt is running from here, whatever the command: a plain script never
        # says so itself (a session's own "started" is dropped in _forward: one per attempt).
        self.sink.emit("started", {"pid": child.pid, "host": socket.gethostname()})
        if not self._sampling:
            sampler.start()
        while True:
            code = child.poll()
            # A notice once the child has ended (the last sync, say) changes nothing.
            noticed = self.flag.is_set
            self._forward(follower)
            if code is None and self.stacks is not None:
                self.stacks.poll()
            if noticed and code is None and self._announce():
                if self.sync is not None:
                    # One look before the script is told: what it has closed by now is
                    # whole, so it is committed even if it has not settled yet.
                    self._sync(final=False, notice=True)
                self._relay_notice()
                child.send_signal(signal.SIGTERM)
                if self.logs is not None:
                    self.logs.flush()  # what it printed so far, before the instance goes
            if code is not None:
                break
            if self.sync is not None:
                self._sync(final=False)
                self._framework_metrics(force=False)
            # Wakes as soon as the child exits: its teardown is paid time that makes no
            # progress, so the exit is reported without a poll's delay.
            try:
                child.wait(timeout=self.poll_s)
            except subprocess.TimeoutExpired:
                pass
        self._forward(follower)
        if noticed:
            self._announce()  # a notice between the last look and the exit
        if self.sync is not None:
            self._sync(final=True, clean=code == 0)
            self._framework_metrics(force=True)
            self._warn_if_nothing_synced(preempted=noticed)
        self.child_code = code
        result = self._exit_code(code, noticed=noticed)
        # The last segment reaches the store before the exit is reported: the control
        # plane ends the instance when it hears of the exit.
        self._finish_logs(preempted=noticed)
        if not self._exit_reported:
            reason = {EXIT_SUCCEEDED: "succeeded", EXIT_PREEMPTED: "preempted"}.get(
                result, "failed"
            )
            if result == self._child_reported and self._child_reason is not None:
                reason = self._child_reason  # "stopped" is the session's to say
            exit_data = self._preempted_exit() if reason == "preempted" else {}
            if reason != "succeeded":
                exit_data.update(self._log_tail())
            self.sink.emit("exit", {**exit_data, "code": result, "reason": reason})
        return result

    def _capture(self, child: subprocess.Popen[bytes]) -> None:
        """Read the command's output (stdout and stderr, one pipe) in a thread: it goes on
        to the runner's own stdout (the console, a local instance's log file) and to the
        log shipper."""
        assert self.logs is not None and child.stdout is not None
        self.logs.start()
        self._pumps.append(pump(child.stdout, echo=1, shipper=self.logs))

    def _finish_logs(self, *, preempted: bool) -> None:
        """Wait for the pipes' last bytes, then upload the last segment: within the
        notice's window after a notice, else within a bound of its own."""
        if self.logs is None:
            return
        for thread in self._pumps:
            # A process the command left behind may hold the pipes open: not waited for.
            thread.join(timeout=2.0)
        left = self.flag.time_left() if preempted else None
        timeout = _LOG_CLOSE_S if left is None else max(min(_LOG_CLOSE_S, left - 2.0), 1.0)
        if not self.logs.close(timeout=timeout):
            log.warning("the command's last output did not all reach the store")

    def _log_tail(self) -> dict[str, Any]:
        """The exit's ``log_tail``: the command's last lines, when its output is captured."""
        return {"log_tail": self.logs.tail()} if self.logs is not None else {}

    def _preempted_exit(self) -> dict[str, Any]:
        """A preempted exit, with the session's report of its flushes when it made one."""
        data: dict[str, Any] = {"code": EXIT_PREEMPTED, "reason": "preempted"}
        if self._child_flush is not None:
            data["flush"] = self._child_flush
        elif self.flag.is_set and not self._child_spoke and (self.child_code or 0) < 0:
            data["flush"] = flush_before_start()  # killed by the notice before a word
        data.update(self._log_tail())
        return data

    def _forward(self, follower: FileFollower) -> None:
        for type_, when, data in follower:
            self._child_spoke = True
            if type_ == "exit":
                self._child_reported = int(data["code"])
                self._child_reason = str(data.get("reason") or "") or None
                flush = data.get("flush")
                self._child_flush = flush if isinstance(flush, dict) else None
                if self._child_reported == EXIT_PREEMPTED and self.flag.is_set:
                    self._announce()  # the notice goes first: the exit ends the attempt
                    # The session has committed what it could and ended: the instance is
                    # going away, so report the end now and let the control plane release
                    # it, instead of paying for the interpreter's teardown (a second or
                    # more with torch loaded) before saying so.
                    if self.logs is not None:
                        self.logs.flush()
                    self.sink.emit("exit", self._preempted_exit())
                    self._exit_reported = True
                    send_now = getattr(self.sink, "flush", None)
                    if send_now is not None:
                        send_now(0.0)  # ask the sender to ship it now; do not wait here
                continue  # the supervisor reports the exit itself, once
            if type_ in ("preemption_notice", "started"):
                continue
            if self.stacks is not None:
                self.stacks.saw(type_, data)
            if self.node and type_ in _RANK_ZEROS:
                if type_ == "metrics" and data.get("data_wait_fraction") is not None:
                    with self._waits_lock:
                        self._waits.append(float(data["data_wait_fraction"]))
                continue
            if type_ in ("checkpoint_committed", "restored"):
                self._child_checkpoints = True
            self._child_metrics = self._child_metrics or type_ == "metrics"
            self.sink.emit(type_, data, time=when)

    def _node_figures(self) -> dict[str, Any]:
        """This node's own fields of a "system" sample: its rank and recent data wait."""
        with self._waits_lock:
            waits, self._waits = self._waits, []
        wait = sum(waits) / len(waits) if waits else None
        return {"node": self.node, "data_wait_fraction": wait}

    def _relay_notice(self) -> None:
        """Hand the child the notice's real deadline before the signal that carries none."""
        notice = self.flag.notice
        if notice is None or self._notice_file is None:
            return
        try:
            write_notice(self._notice_file, notice)
        except OSError as exc:  # the child then counts the window from the signal
            log.warning("could not hand the notice to the command: %s", exc)

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

    def _framework_metrics(self, *, force: bool) -> None:
        """Send the steps a framework logged into the sync dir (:mod:`runner.frameworks`)
        as metrics events, unless the script reports its own (node 0 only)."""
        if self._framework is None or self._child_metrics or self.node:
            return
        for when, data in self._framework.poll(now=time.monotonic(), force=force):
            self.sink.emit("metrics", data, time=when)
            if self.stacks is not None:
                self.stacks.saw("metrics", data)

    def _sync(self, *, final: bool, clean: bool = True, notice: bool = False) -> None:
        assert self.sync is not None
        child = self.child

        def open_paths() -> set[str] | None:
            if child is None:
                return None
            if self.container is not None:  # the runtime's client holds none of them
                if self._container_pid is None:
                    self._container_pid = self.container.host_pid()
                pid = self._container_pid
                return open_files(pid) if pid is not None else None
            return open_files(child.pid)

        try:
            for info in self.sync.poll(
                now=time.monotonic(),
                final=final,
                clean=clean,
                open_paths=open_paths,
                notice=notice,
            ):
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

    def _warn_if_nothing_synced(self, *, preempted: bool) -> None:
        """Say plainly that a script under ``--sync-dir`` left nothing to resume from: the
        run card says checkpoints are on, and the next attempt would start from step 0."""
        sync = self.sync
        assert sync is not None
        if sync.done or self._child_checkpoints:
            return
        msg = nothing_synced(sync, preempted=preempted)
        log.warning(msg)
        self.sink.emit("log", {"level": "warning", "message": msg})

    def _exit_code(self, code: int, *, noticed: bool) -> int:
        return exit_code(
            code,
            reported=self._child_reported,
            under_torchrun=self.under_torchrun,
            noticed=noticed,
        )
