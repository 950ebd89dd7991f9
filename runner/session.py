"""The session API: what a torch training loop needs to survive spot capacity.

    with Session.from_env() as s:  # starts reading the newest checkpoint
        model, opt, sched, loader = build()  # while the model is built
        s.track(model=model, optimizer=opt, scheduler=sched, data=loader)
        for step in s.steps(total_steps):
            batch = s.next_batch(it)
            loss = train_step(batch)
            s.log(loss=loss.item())
    sys.exit(s.exit_code)

The session restores the newest committed checkpoint (every tracked object, every RNG,
the step). It starts reading and verifying that checkpoint on background threads as soon
as it is created, so creating it before building the model hides most of the read; a
session created later restores just the same. It checkpoints asynchronously when its
policy says so, reports telemetry, and ends the loop on a preemption notice, a dry-run
limit or a stop request, flushing a checkpoint if one fits the time left. The signal
handler only sets a flag; the loop acts between steps.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from runner import EXIT_FAILED, EXIT_PREEMPTED, EXIT_SUCCEEDED
from runner.checkpoint import CheckpointWriter, CommitInfo, Prefetch, Restored, restore_latest
from runner.errors import NoCheckpointError, RunnerError
from runner.preemption import (
    Notice,
    PreemptionFlag,
    SignalHandlers,
    flush_fits,
    start_pollers,
    write_seconds,
)
from runner.state import capture_rng, flatten, restore_rng, state_digest
from runner.store import Store, run_store
from runner.telemetry import EventSink, FileSink, NullSink, Reporter

log = logging.getLogger(__name__)

#: What the loop keeps back, beyond the write and a step, when it trains on after a
#: preemption notice: the notice reaches a supervised process a poll after the instance.
TRAIN_ON_MARGIN_S = 0.25


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


class SaveDecision(Protocol):
    """Whether to checkpoint after a step (orbax's SaveDecisionPolicy, with time passed in)."""

    def should_save(self, *, step: int, now: float, last_step: int, last_time: float) -> bool: ...


@dataclass(frozen=True)
class EverySteps:
    steps: int

    def should_save(self, *, step: int, now: float, last_step: int, last_time: float) -> bool:
        return step - last_step >= self.steps


@dataclass(frozen=True)
class EverySeconds:
    seconds: float

    def should_save(self, *, step: int, now: float, last_step: int, last_time: float) -> bool:
        return step > last_step and now - last_time >= self.seconds


@dataclass(frozen=True)
class AnyOf:
    policies: tuple[SaveDecision, ...]

    def should_save(self, *, step: int, now: float, last_step: int, last_time: float) -> bool:
        return any(
            p.should_save(step=step, now=now, last_step=last_step, last_time=last_time)
            for p in self.policies
        )


def _env_float(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise RunnerError(f"{name}={raw!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise RunnerError(f"{name}={raw!r} must be a positive number")
    return value


def _env_flag(env: Mapping[str, str], name: str, *, default: bool) -> bool:
    raw = (env.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise RunnerError(f"{name}={raw!r}: expected 1 or 0 (true or false)")


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise RunnerError(f"{name}={raw!r} is not a whole number") from None
    if value <= 0:
        raise RunnerError(f"{name}={raw!r} must be positive")
    return value


@dataclass(frozen=True)
class SessionConfig:
    """Everything a session takes from its environment (``TRAINBOT_*``)."""

    #: Run id; checkpoints live under ``{checkpoint_uri}/{run_id}``.
    run_id: str = "local"
    #: Attempt id (one per instance), carried on every event.
    attempt_id: str = "local-1"
    #: Where checkpoints go: a path, file:// or s3://.
    checkpoint_uri: str = "checkpoints"
    #: Directory of this run's checkpoints under the URI (default: the run id); a
    #: resubmitted run names its predecessor's to resume from it.
    checkpoint_prefix: str | None = None
    #: Checkpoint every N steps.
    every_steps: int | None = None
    #: Checkpoint every T seconds (the control plane passes Daly's interval here).
    every_s: float | None = None
    #: Stop (with a checkpoint) after this many steps: the dry-run limit.
    max_steps: int | None = None
    #: Seconds between a SIGTERM and the SIGKILL that follows it.
    window_s: float = 30.0
    #: Metadata pollers to run: "aws", "gcp", "aws,gcp" or "" (none).
    preemption_sources: str = ""
    #: JSONL file the supervisor tails (set by ``trainbot-runner exec``).
    events_file: str | None = None
    #: Ingest URL and token for direct reporting (without a supervisor).
    ingest_url: str | None = None
    token: str | None = field(default=None, repr=False)
    spool_dir: str | None = None
    #: "save" or "verify" while ``trainbot-runner dry-run`` drives the script.
    dry_run_phase: str | None = None
    #: A file whose appearance asks the loop to stop (deliberate stop).
    stop_file: str | None = None
    #: Emit a metrics event every N steps.
    metrics_every: int = 1
    #: On a preemption notice with a known deadline, train on while the emergency
    #: checkpoint still fits what is left of the window (see Session._train_on).
    train_through_notice: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SessionConfig:
        e = os.environ if env is None else env
        phase = e.get("TRAINBOT_DRY_RUN_PHASE") or None
        if phase not in (None, "save", "verify"):
            raise RunnerError(f"TRAINBOT_DRY_RUN_PHASE={phase!r}: expected 'save' or 'verify'")
        return cls(
            run_id=e.get("TRAINBOT_RUN_ID") or "local",
            attempt_id=e.get("TRAINBOT_ATTEMPT_ID") or "local-1",
            checkpoint_uri=e.get("TRAINBOT_CHECKPOINT_URI") or "checkpoints",
            checkpoint_prefix=e.get("TRAINBOT_CHECKPOINT_PREFIX") or None,
            every_steps=_env_int(e, "TRAINBOT_CHECKPOINT_EVERY_STEPS"),
            every_s=_env_float(e, "TRAINBOT_CHECKPOINT_INTERVAL_S"),
            max_steps=_env_int(e, "TRAINBOT_MAX_STEPS"),
            window_s=_env_float(e, "TRAINBOT_TERMINATION_WINDOW_S") or 30.0,
            preemption_sources=e.get("TRAINBOT_PREEMPTION_SOURCES", ""),
            events_file=e.get("TRAINBOT_EVENTS_FILE") or None,
            ingest_url=e.get("TRAINBOT_INGEST_URL") or None,
            token=e.get("TRAINBOT_TOKEN") or None,
            spool_dir=e.get("TRAINBOT_SPOOL_DIR") or None,
            dry_run_phase=phase,
            stop_file=e.get("TRAINBOT_STOP_FILE") or None,
            metrics_every=_env_int(e, "TRAINBOT_METRICS_EVERY") or 1,
            train_through_notice=_env_flag(e, "TRAINBOT_TRAIN_THROUGH_NOTICE", default=False),
        )

    def decision(self) -> SaveDecision | None:
        policies: list[SaveDecision] = []
        if self.every_steps:
            policies.append(EverySteps(self.every_steps))
        if self.every_s:
            policies.append(EverySeconds(self.every_s))
        if not policies:
            return None
        return policies[0] if len(policies) == 1 else AnyOf(tuple(policies))


def _default_sink(cfg: SessionConfig) -> EventSink:
    if cfg.events_file:
        return FileSink(Path(cfg.events_file))
    if cfg.ingest_url and cfg.token:
        spool = Path(cfg.spool_dir or Path.cwd() / ".trainbot-spool" / cfg.attempt_id)
        return Reporter(
            cfg.ingest_url, cfg.token, attempt=cfg.attempt_id, run=cfg.run_id, spool_dir=spool
        )
    return NullSink()


#: How many times the dry run saves its checkpoint (see ``Session._save_as_the_run_will``).
DRY_RUN_SAVES = 3


class Session:
    """One process's part of a run. Use it as a context manager around the training loop.

    Creating it starts reading and verifying the newest committed checkpoint on background
    threads (unless ``prefetch=False``), so create it before building the model and
    optimizer: the read then overlaps with their construction, and :meth:`restore` only
    waits for what is left. The memory held is the checkpoint's size, which the restore
    needs anyway; closing the session without restoring stops the read and frees it.
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
        self.sink = sink if sink is not None else _default_sink(config)
        self.store = (
            store
            if store is not None
            else run_store(config.checkpoint_uri, config.checkpoint_prefix or config.run_id)
        )
        self.flag = flag if flag is not None else PreemptionFlag()
        self.decision = decision or config.decision() or EverySteps(100)
        self.writer = CheckpointWriter(
            self.store, on_commit=self._committed, on_error=self._save_failed
        )
        self._tracked: dict[str, Stateful] = {}
        self._install_signals = install_signals
        self._signals: SignalHandlers | None = None
        self._pollers: Any = None
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
        #: The state's size in bytes, once counted (see _checkpoint_bytes).
        self._state_nbytes: int | None = None
        #: The newest checkpoint, being read and verified in the background while the caller
        #: builds its model; None once restored or closed, or when ``prefetch=False``.
        #: Started last, once nothing else here can fail.
        self.prefetch: Prefetch | None = Prefetch(self.store) if prefetch else None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> Session:
        return cls(SessionConfig.from_env(env), **kwargs)

    # -- set-up and teardown

    def __enter__(self) -> Session:
        if self._install_signals:
            self._signals = SignalHandlers(self.flag, window_s=self.config.window_s)
            self._signals.__enter__()
        self._pollers = start_pollers(self.flag, sources=self.config.preemption_sources)
        self.sink.emit("started", {"pid": os.getpid(), "host": socket.gethostname()})
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
        self.writer.close()
        if self._pollers is not None:
            self._pollers.stop()
            self._pollers = None
        if self._signals is not None:
            self._signals.__exit__(None, None, None)
            self._signals = None
        self.sink.emit("exit", {"code": self.exit_code, "reason": self._exit_reason()})
        self.sink.close()

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
        """Load the newest committed checkpoint into the tracked objects; returns its step."""
        self._restored = True
        try:
            restored = self._take_prefetched() or restore_latest(self.store)
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
            self._dry_run_event("restored")
        return self.step

    def _take_prefetched(self) -> Restored | None:
        """The checkpoint read since the session was created; None to read it now."""
        prefetch, self.prefetch = self.prefetch, None
        return prefetch.take() if prefetch is not None else None

    # -- the loop

    def steps(self, total: int) -> Iterator[int]:
        """Yield step indices from the restored step to ``total``; ends early when told to."""
        if not self._restored:
            self.restore()
        limit = self.config.max_steps
        if self.config.dry_run_phase == "verify":
            limit = self.step + 2
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
            now = time.monotonic()
            if not self.flag.is_set and self.decision.should_save(
                step=self.step,
                now=now,
                last_step=self._last_save_step,
                last_time=self._last_save_time,
            ):
                self._save()
        else:
            self.stop_reason = "finished"
        self._finish()

    def next_batch(self, it: Iterator[Any]) -> Any:
        """``next(it)``, timed: the data-wait fraction is built from this."""
        t0 = time.perf_counter()
        try:
            return next(it)
        finally:
            self._wait_s += time.perf_counter() - t0

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

    def _train_on(self) -> bool:
        """Whether the loop may take another step after a preemption notice.

        The instance is paid for until the deadline whatever the loop does, so the window
        is used for training for as long as the emergency checkpoint would still be
        started (:func:`~runner.preemption.flush_fits`, the test the flush itself makes)
        after the save in flight, one more step (the longest lately) and
        :data:`TRAIN_ON_MARGIN_S`. Without a known deadline, or with
        ``train_through_notice`` off, the loop stops at once.
        """
        left = self.flag.time_left()
        if not self.config.train_through_notice or left is None:
            return False
        self._report_notice(left)
        nbytes = self._checkpoint_bytes()
        bandwidth = self.writer.bandwidth_bps
        budget = left - self._step_s - TRAIN_ON_MARGIN_S
        if self.writer.in_flight:
            budget -= write_seconds(nbytes, bandwidth)
        return budget > 0 and flush_fits(nbytes=nbytes, bandwidth_bps=bandwidth, time_left_s=budget)

    def _report_notice(self, left: float | None) -> None:
        if self._notice_reported:
            return
        self._notice_reported = True
        notice = self.flag.notice
        self.sink.emit(
            "preemption_notice",
            {"source": notice.source if notice else "signal", "time_left_s": left},
        )

    def _notice_source(self) -> str | None:
        notice = self.flag.notice
        return notice.source if notice else None

    # -- checkpoints

    def _committed(self, info: CommitInfo) -> None:
        self.committed_step = max(self.committed_step or 0, info.step)
        # stall_s is how long the loop was blocked (Daly's C for an asynchronous save);
        # write_s ran beside the next steps.
        self.sink.emit(
            "checkpoint_committed",
            {
                "step": info.step,
                "bytes": info.bytes,
                "write_s": info.write_s,
                "stall_s": info.stall_s,
                "uri": info.uri,
            },
        )

    def _save_failed(self, step: int, exc: Exception) -> None:
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
            ok = self._save_as_the_run_will() if dry_run_save else self._save_now()
            self.exit_code = EXIT_SUCCEEDED if ok else EXIT_FAILED
            if ok and dry_run_save:
                self._dry_run_event("saved")
                self._await_kill()
        elif reason in ("preempted", "stopped"):
            self._flush_on_notice()

    def _save_as_the_run_will(self) -> bool:
        """The dry run's checkpoint, saved :data:`DRY_RUN_SAVES` times the way periodic saves
        are (copying the state into staging buffers), so that their stall is measured.

        The first save also allocates the buffers, which a run pays once per attempt; the
        later ones show the stall of every other save. Each rewrites the same step.
        """
        for _ in range(DRY_RUN_SAVES):
            self._save()
            info = self.writer.wait()
            if info is None or info.step != self.step:
                return False
        return True

    def _flush_on_notice(self) -> None:
        stopped = time.monotonic()  # the loop has just ended
        left = self.flag.time_left()
        self._report_notice(left)
        # Finish the save in flight, if any, within the window.
        try:
            self.writer.wait(timeout=left)
        except TimeoutError:
            pass
        if self.stop_reason == "preempted" and self._flush_costs_more(stopped):
            pass  # the next attempt redoes the few steps since the newest checkpoint
        elif self.committed_step != self.step:
            left = self.flag.time_left()
            nbytes = self._checkpoint_bytes()
            if flush_fits(nbytes=nbytes, bandwidth_bps=self.writer.bandwidth_bps, time_left_s=left):
                self._save_now(timeout=left)
            else:
                msg = (
                    f"no time for an emergency checkpoint of {nbytes} bytes "
                    f"({left:.1f}s left); resuming from step {self.committed_step}"
                )
                log.warning(msg)
                self.sink.emit("log", {"level": "warning", "message": msg})
        if self.stop_reason == "stopped":
            self.exit_code = EXIT_SUCCEEDED if self.committed_step == self.step else EXIT_FAILED
        else:
            # Resumable either way: from the newest checkpoint, or from the start if none.
            self.exit_code = EXIT_PREEMPTED

    def _flush_costs_more(self, stopped: float) -> bool:
        """Whether writing the current step would take longer than redoing the steps done
        since the newest checkpoint's snapshot (both are paid time that makes no progress).

        Only when that checkpoint is this process's last save (a failed save proves
        nothing) and a write was measured; the work is timed from the save to the loop's
        end, which over-counts for a process that has not saved yet, so it then flushes.
        """
        last = self.writer.last_commit
        if last is None or self.committed_step == self.step:
            return False
        if self.committed_step != self._last_save_step:
            return False
        work_s = stopped - self._last_save_time
        if work_s >= last.write_s:
            return False
        msg = (
            f"no emergency checkpoint: the steps since step {self.committed_step} took "
            f"{work_s:.2f}s, less than the {last.write_s:.2f}s a checkpoint takes to write; "
            f"resuming from step {self.committed_step}"
        )
        log.info(msg)
        self.sink.emit("log", {"level": "info", "message": msg})
        return True

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

    def _dry_run_event(self, phase: str) -> None:
        report = {"phase": phase, "step": self.step, "state_sha256": self.state_digest()}
        self.sink.emit("dry_run", {"report": report})
        print(json.dumps({"dry_run": report}), file=sys.stderr, flush=True)

    def _await_kill(self) -> None:
        """In the dry run's first phase, wait to be killed like a lost instance would be."""
        if hasattr(self.sink, "flush"):
            self.sink.flush(10.0)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not self.flag.is_set:
            time.sleep(0.05)
