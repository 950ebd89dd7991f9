"""The session: one process's part of a run, around its training loop.

It restores the newest committed checkpoint, counts steps and reports their metrics,
checkpoints when its policy says so, and ends the loop on a preemption notice, a dry-run
limit or a stop request, flushing a checkpoint if one fits the time left.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, Protocol, Self

from runner import EXIT_FAILED, EXIT_PREEMPTED, EXIT_SUCCEEDED
from runner._site import sitecustomize as stack_hook
from runner.checkpoint import CheckpointWriter, CommitInfo, Prefetch
from runner.errors import NoCheckpointError, RunnerError
from runner.preemption import (
    Notice,
    Pollers,
    PreemptionFlag,
    SignalHandlers,
    flush_fits,
    start_pollers,
)
from runner.session import phases
from runner.session.alerts import DEFAULT_WAIT_S, AlertGate, alert_payload
from runner.session.config import SessionConfig, default_sink
from runner.session.exit_guard import ExitGuard
from runner.session.notice import NoticeWindow
from runner.session.on_notice import OnNotice
from runner.session.policy import EverySteps, SaveDecision
from runner.session.restoring import Restoring
from runner.state import capture_rng, flatten, restore_rng, state_digest
from runner.store import Store, run_store
from runner.telemetry import EventSink

log = logging.getLogger(__name__)

#: How many recent writes the emergency checkpoint's estimate looks back on: it takes
#: the slowest of them, so one fast write does not talk the loop into a late flush.
WRITE_HISTORY = 8


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


class Session(Restoring, OnNotice):
    """One process's part of a run. Use it as a context manager around the training loop.

    Creating it starts reading and verifying the newest committed checkpoint on background
    threads (unless ``prefetch=False``), so create it before building the model and
    optimizer: the read then overlaps with their construction, and :meth:`restore` only
    waits for what is left. The memory held is the checkpoint's size, which the restore
    needs anyway; closing the session without restoring stops the read and frees it. A
    preemption notice while it restores ends the attempt at once when the window has no
    room left for the restore, a step and a flush (:mod:`runner.session.restoring`).
    """

    def __init__(
        self,
        config: SessionConfig,
        *,
        sink: EventSink | None = None,
        store: Store | None = None,
        flag: PreemptionFlag | None = None,
        decision: SaveDecision | None = None,
        install_signals: bool = True,
        prefetch: bool = True,
    ) -> None:
        self.config = config
        self.sink = sink if sink is not None else default_sink(config)
        self.store = (
            store
            if store is not None
            else run_store(config.checkpoint_uri, config.checkpoint_prefix or config.run_id)
        )
        self.flag = flag if flag is not None else PreemptionFlag()
        #: The ``"auto"`` interval, following this process's save cost; None otherwise.
        self._measured = None if decision is not None else config.measured_interval()
        self.decision = decision or config.decision(self._measured) or EverySteps(100)
        #: Steps of the periodic saves not committed yet, while ``_measured`` follows
        #: their cost (Daly's C).
        self._periodic: set[int] = set()
        self.writer = CheckpointWriter(
            self.store, on_commit=self._committed, on_error=self._save_failed
        )
        self._tracked: dict[str, Stateful] = {}
        self._install_signals = install_signals
        self._signals: SignalHandlers | None = None
        self._pollers: Pollers | None = None
        #: Steps completed so far (restored, then counted).
        self.step = 0
        #: Step of the newest committed checkpoint known to this process.
        self.committed_step: int | None = None
        #: Why the loop ended: "finished", "preempted", "limit", "stopped", "failed".
        self.stop_reason: str | None = None
        self.exit_code: int = EXIT_FAILED
        self._restored = False
        self._last_save_step = 0
        self._last_save_time = time.monotonic()
        self._metrics: dict[str, float] = {}
        self._loss: float | None = None
        self._wait_s = 0.0
        self._stop_checked = 0.0
        #: The longest step seen lately (seconds), for the train-on budget.
        self._step_s = 0.0
        self._notice_reported = False
        #: The notice window's plan and record, once the loop has seen a notice.
        self._window: NoticeWindow | None = None
        #: What the flushes of a preempted exit did (the exit event's ``flush``).
        self._flush_report: dict[str, Any] | None = None
        #: Whether the exit event has been emitted (a preempted one goes first); set under
        #: ``_exit_lock``, since the exit guard's thread may send it too.
        self._exit_sent = False
        self._exit_lock = threading.Lock()
        #: Sends a preempted exit just before the deadline if the main thread has not.
        self._guard: ExitGuard | None = None
        #: The script's alerts sent, per title (session.alert's wait).
        self._alerts = AlertGate()
        #: Whether the supervisor's notice (with the real deadline) has been read.
        self._relayed = False
        #: (bandwidth in bytes/s, stall in s) of the recent writes, newest last: this
        #: process's commits, and the one it restored (its manifest's write time).
        self._writes: deque[tuple[float, float]] = deque(maxlen=WRITE_HISTORY)
        #: A write measured before this process (the dry run's, on the run's store), for
        #: as long as ``_writes`` is empty.
        self._prior_write: tuple[float, float] | None = (
            (config.measured_write_bps, config.measured_stall_s or 0.0)
            if config.measured_write_bps
            else None
        )
        #: The state's size in bytes, once counted (see _checkpoint_bytes).
        self._state_nbytes: int | None = None
        #: The newest checkpoint, being read and verified in the background while the caller
        #: builds its model; None once restored or closed, or when ``prefetch=False``.
        #: Started last, once nothing else here can fail.
        #: Not with a maximum resume step: the prefetch reads the newest checkpoint of all.
        wanted = prefetch and config.resume_max_step is None
        self.prefetch: Prefetch | None = Prefetch(self.store) if wanted else None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> Self:
        return cls(SessionConfig.from_env(env), **kwargs)

    # -- set-up and teardown

    def __enter__(self) -> Self:
        if self._install_signals:
            self._signals = SignalHandlers(self.flag, window_s=self.config.window_s)
            self._signals.__enter__()
        self._pollers = start_pollers(self.flag, sources=self.config.preemption_sources)
        # Ready to dump its stacks when the supervisor asks (runner.stacks), even when
        # started with ``python -I``, which skips the site hook; a no-op outside it.
        stack_hook.install()
        self.sink.emit("started", {"pid": os.getpid(), "host": socket.gethostname()})
        self._guard = ExitGuard(
            self.flag, send=self._send_late_exit, refresh=self._read_relayed_notice
        )
        self._guard.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and not isinstance(exc, SystemExit):
            self.stop_reason = "failed"
            self.exit_code = EXIT_FAILED
            # The loop crashed: the last committed checkpoint stands; do not save a broken state.
            self.writer.wait()
        self.close()

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
            self.prefetch = None
        self._send_preempted_exit()
        self.writer.close()
        if self._pollers is not None:
            self._pollers.stop()
            self._pollers = None
        if self._signals is not None:
            self._signals.__exit__(None, None, None)
            self._signals = None
        if self._guard is not None:
            self._guard.stop()  # before the sink closes: it may be sending the exit
            self._guard = None
        if self._mark_exit_sent():
            self.sink.emit("exit", {"code": self.exit_code, "reason": self._exit_reason()})
        self.sink.close()

    def _mark_exit_sent(self) -> bool:
        """Mark the exit sent; whether it was not already (so the caller sends it)."""
        with self._exit_lock:
            sent, self._exit_sent = self._exit_sent, True
        return not sent

    def _send_preempted_exit(self) -> None:
        """A preempted attempt's exit, with its flush report, sent now: the instance is
        going away, and the exit must not wait for a write still in flight (or, on a
        gang, for the other ranks), which would hold it past the kill (issue 29). The
        write goes on while the process lives; the next attempt restores whatever is
        committed by then. Any other exit is sent last, once everything is done."""
        if self._exit_reason() != "preempted" or not self._mark_exit_sent():
            return
        data: dict[str, Any] = {"code": self.exit_code, "reason": "preempted"}
        if self._flush_report is not None:
            data["flush"] = self._flush_report
        self.sink.emit("exit", data)

    def _exit_reason(self) -> str:
        if self.exit_code == EXIT_SUCCEEDED:
            return "stopped" if self.stop_reason == "stopped" else "succeeded"
        if self.exit_code == EXIT_PREEMPTED:
            return "preempted"
        return "failed"

    # -- state

    def track(self, **objects: Stateful) -> None:
        """Objects saved and restored with every checkpoint (model, optimizer, data …)."""
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise RunnerError(
                    f"{name} has no state_dict()/load_state_dict(): wrap it so it can be saved"
                )
            self._tracked[name] = obj

    def state(self) -> dict[str, Any]:
        """The whole training state as it is now."""
        return {
            "step": self.step,
            "objects": {name: obj.state_dict() for name, obj in self._tracked.items()},
            "rng": capture_rng(),
        }

    def state_digest(self) -> str:
        return state_digest(self.state())

    def restore(self) -> int:
        """Load the newest committed checkpoint into the tracked objects; returns its step.

        With ``resume_max_step`` (a run resubmitted from step N), the newest at or before
        that step: a later one belongs to the diverged run."""
        self._restored = True
        cap = self.config.resume_max_step
        below = None if cap is None else cap + 1
        try:
            restored = self._read_latest(below)
        except NoCheckpointError:
            self.sink.emit("restored", {"step": 0, "fallback_from": None, "restore_s": 0.0})
            return 0
        state = restored.state
        missing = set(self._tracked) - set(state["objects"])
        if missing:
            raise RunnerError(
                f"checkpoint step {restored.step} has no state for {sorted(missing)}: "
                "track the same objects as the run that saved it"
            )
        for name, obj in self._tracked.items():
            obj.load_state_dict(state["objects"][name])
        restore_rng(state["rng"])
        self.step = int(state["step"])
        self.committed_step = self.step
        manifest = restored.manifest
        if manifest.write_s > 0 and manifest.bytes > 0:
            # The write that committed it, on the run's store: a measured bandwidth for a
            # notice that comes before this process has saved anything.
            self._writes.append((manifest.bytes / manifest.write_s, 0.0))
        self._last_save_step = self.step
        for skipped_step, why in restored.skipped:
            msg = f"checkpoint step {skipped_step} is corrupt ({why}); fell back to {self.step}"
            log.warning(msg)
            self.sink.emit("log", {"level": "warning", "message": msg})
        self.sink.emit(
            "restored",
            {
                "step": self.step,
                "fallback_from": restored.skipped[0][0] if restored.skipped else None,
                "restore_s": restored.restore_s,
            },
        )
        print(f"trainbot: resumed at step {self.step}", file=sys.stderr, flush=True)
        if self.config.dry_run_phase == "verify":
            self._report_dry_run("restored")
        return self.step

    # -- the loop

    def steps(self, total: int) -> Iterator[int]:
        """Yield step indices from the restored step to ``total``; ends early when told to."""
        if not self._restored:
            self.restore()
        limit = phases.step_limit(
            self.config.dry_run_phase, step=self.step, max_steps=self.config.max_steps
        )
        while self.step < total:
            if self._must_stop():
                break
            started = time.perf_counter()
            self._wait_s = 0.0
            self._loss = None
            self._metrics = {}
            yield self.step
            self.step += 1
            step_s = time.perf_counter() - started
            self._step_s = max(step_s, 0.9 * self._step_s)
            self._report_step(step_s)
            if limit is not None and self.step >= limit:
                self.stop_reason = "limit"
                break
            self._maybe_save()
        else:
            self.stop_reason = "finished"
        self._finish()

    def _maybe_save(self) -> None:
        """The periodic save after a step, when the policy says so (not after a notice)."""
        if self._save_due():
            if self._measured is not None:
                self._periodic.add(self.step)
            self._save()

    def _save_due(self) -> bool:
        return not self.flag.is_set and self.decision.should_save(
            step=self.step,
            now=time.monotonic(),
            last_step=self._last_save_step,
            last_time=self._last_save_time,
        )

    def next_batch(self, it: Iterator[Any]) -> Any:
        """``next(it)``, timed: the data-wait fraction is built from this."""
        t0 = time.perf_counter()
        try:
            return next(it)
        finally:
            self._wait_s += time.perf_counter() - t0

    def alert(
        self,
        title: str,
        text: str = "",
        severity: str = "warning",
        *,
        wait_s: float = DEFAULT_WAIT_S,
    ) -> bool:
        """Raise an alert of the run from the training code (as ``wandb.alert``):
        ``severity`` is info, warning or critical. It reaches the run's thread as the
        built-in alerts do; a repeat of the same title updates that alert, and is not
        sent at all within ``wait_s`` of the last. Whether it was sent."""
        payload = alert_payload(title, text, severity, step=self.step)
        if not self._alerts.admit(payload["title"], wait_s=wait_s):
            return False
        self.sink.emit("alert", payload)
        return True

    def log(self, loss: float | None = None, **metrics: float) -> None:
        """Metrics of the current step."""
        if loss is not None:
            self._loss = float(loss)
        self._metrics.update({k: float(v) for k, v in metrics.items()})

    def _report_step(self, step_time: float) -> None:
        loss = self._loss
        diverged = loss is not None and not math.isfinite(loss)
        if self.step % self.config.metrics_every and not diverged:
            return
        wait = min(1.0, self._wait_s / step_time) if step_time > 0 else None
        self.sink.emit(
            "metrics",
            {
                "step": self.step,
                "loss": loss,
                "step_time_s": step_time,
                "data_wait_fraction": wait,
                "metrics": dict(self._metrics),
            },
        )

    def _must_stop(self) -> bool:
        if self.flag.is_set:
            stop = self._notice_source() == "stop"
            if not stop and self._train_on():
                return False
            self.stop_reason = "stopped" if stop else "preempted"
            return True
        stop_file = self.config.stop_file
        if stop_file:
            now = time.monotonic()
            if now - self._stop_checked >= 1.0:
                self._stop_checked = now
                if os.path.exists(stop_file):
                    self.flag.set(
                        Notice(
                            source="stop",
                            reason="stop requested",
                            received_at=now,
                            deadline=now + 3600,
                        )
                    )
                    self.stop_reason = "stopped"
                    return True
        return False

    def _write_measured(self) -> tuple[float | None, float]:
        """The slowest recent write's bandwidth (None before any), and the median stall
        of the recent saves (the snapshot before an emergency write: on a GPU, its copy)."""
        writes = list(self._writes) or ([self._prior_write] if self._prior_write else [])
        if not writes:
            return None, 0.0
        return min(b for b, _ in writes), statistics.median(st for _, st in writes)

    def _flush_fits(self, nbytes: int, left: float | None) -> bool:
        bandwidth, stall = self._write_measured()
        return flush_fits(nbytes=nbytes, bandwidth_bps=bandwidth, stall_s=stall, time_left_s=left)

    def _committed(self, info: CommitInfo) -> None:
        self.committed_step = max(self.committed_step or 0, info.step)
        if self._window is not None:
            self._window.landed(info.step, write_s=info.write_s)
        if info.write_s > 0:
            self._writes.append((info.bytes / info.write_s, info.stall_s))
        # An "auto" interval follows what this process's periodic saves cost.
        moved_from = None
        if self._measured is not None and info.step in self._periodic:
            self._periodic.discard(info.step)
            before = self._measured.seconds
            if self._measured.observe(write_s=info.write_s, stall_s=info.stall_s) is not None:
                moved_from = before
        # stall_s is how long the loop was blocked (Daly's C for an asynchronous save);
        # write_s ran beside the next steps.
        data: dict[str, Any] = {
            "step": info.step,
            "bytes": info.bytes,
            "write_s": info.write_s,
            "stall_s": info.stall_s,
            "uri": info.uri,
        }
        if self._measured is not None:
            data["interval_s"] = self._measured.seconds
        self.sink.emit("checkpoint_committed", data)
        if moved_from is not None:
            self.sink.emit(
                "log",
                {
                    "level": "info",
                    "message": f"checkpoint interval {data['interval_s']:.3g} s (was "
                    f"{moved_from:.3g} s), for the save cost measured here",
                },
            )

    def _save_failed(self, step: int, exc: Exception) -> None:
        if self._window is not None:
            self._window.failed(step)
        self.sink.emit("checkpoint_failed", {"step": step, "error": str(exc)})

    def _save(self, *, copy: bool = True) -> None:
        metrics = dict(self._metrics)
        if self._loss is not None:
            metrics["loss"] = self._loss
        self.writer.save(self.step, self.state(), metrics=metrics, copy=copy)
        self._last_save_step = self.step
        self._last_save_time = time.monotonic()

    def _save_now(self, timeout: float | None = None) -> bool:
        """Save the current state and wait for the commit."""
        if self.committed_step == self.step:
            return True
        # The loop has ended, so nothing changes the state any more: write it from where
        # it is instead of copying it first (on a preemption, the copy eats the window).
        self._save(copy=False)
        try:
            info = self.writer.wait(timeout=timeout)
        except TimeoutError:
            return False
        return info is not None and info.step == self.step

    def _finish(self) -> None:
        reason = self.stop_reason
        if reason in ("finished", "limit"):
            self.writer.wait()  # a save of this very step may be in flight: no second write
        if reason == "finished":
            ok = self._save_now()
            self.exit_code = EXIT_SUCCEEDED if ok else EXIT_FAILED
        elif reason == "limit":
            dry_run_save = self.config.dry_run_phase == "save"
            if dry_run_save:
                ok = phases.save_as_the_run_will(self._save, self.writer, step=self.step)
            else:
                ok = self._save_now()
            self.exit_code = EXIT_SUCCEEDED if ok else EXIT_FAILED
            if ok and dry_run_save:
                self._report_dry_run("saved")
                phases.await_kill(self.sink, self.flag)
        elif reason in ("preempted", "stopped"):
            self._flush_on_notice()

    def _checkpoint_bytes(self) -> int:
        """The last save's size, or the state's before any save (counted once: the loop
        asks every step while it trains on through a notice window)."""
        if self.writer.last_bytes:
            return self.writer.last_bytes
        if self._state_nbytes is None:
            _, tensors = flatten(self.state())
            self._state_nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return self._state_nbytes

    # -- dry run

    def _report_dry_run(self, phase: str) -> None:
        phases.report(self.sink, phase, step=self.step, state_sha256=self.state_digest())
