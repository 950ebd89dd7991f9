"""A session's settings from its environment (``TRAINBOT_*``, set by the runner or the
provider's startup script), validated with errors that say what to set instead.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from runner.errors import RunnerError
from runner.preemption import WINDOWS_S
from runner.session.policy import (
    AnyOf,
    EverySeconds,
    EverySteps,
    MeasuredInterval,
    SaveDecision,
)
from runner.telemetry import EventSink, FileSink, NullSink, Reporter

#: The SIGTERM-to-SIGKILL window assumed when none is given: the shortest provider's.
DEFAULT_WINDOW_S = min(WINDOWS_S.values())

_N = TypeVar("_N", int, float)


#: Per number type: what a value that does not parse is not, and what it must be.
_NUMBER_WORDS: dict[type, tuple[str, str]] = {
    float: ("a number of seconds", "a positive number"),
    int: ("a whole number", "positive"),
}


def _env_number(env: Mapping[str, str], name: str, kind: type[_N]) -> _N | None:
    """A positive ``kind`` from ``name``, None when it is unset or blank."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    what, positive = _NUMBER_WORDS[kind]
    try:
        value = kind(raw)
    except ValueError:
        raise RunnerError(f"{name}={raw!r} is not {what}") from None
    if not math.isfinite(value) or value <= 0:
        raise RunnerError(f"{name}={raw!r} must be {positive}")
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
    window_s: float = DEFAULT_WINDOW_S
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
    #: Restore the newest committed checkpoint at or before this step rather than the
    #: newest of all: a run resubmitted "from step N" (after a divergence).
    resume_max_step: int | None = None
    #: Where the supervisor writes the notice it saw, with the real deadline, before it
    #: signals this process (set by ``trainbot-runner exec``; see runner.preemption.relay).
    notice_file: str | None = None
    #: A checkpoint write measured before this process started (the control plane passes
    #: its dry run's, on the run's store): bytes a second, and the stall of its save. Used
    #: for the emergency-flush margin until this process has a write of its own.
    measured_write_bps: float | None = None
    measured_stall_s: float | None = None
    #: With ``every_s``: the interval is ``"auto"``, and follows this process's measured
    #: save cost with this M (:class:`~runner.session.policy.MeasuredInterval`).
    auto_mtbp_s: float | None = None

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
            every_steps=_env_number(e, "TRAINBOT_CHECKPOINT_EVERY_STEPS", int),
            every_s=_env_number(e, "TRAINBOT_CHECKPOINT_INTERVAL_S", float),
            max_steps=_env_number(e, "TRAINBOT_MAX_STEPS", int),
            window_s=_env_number(e, "TRAINBOT_TERMINATION_WINDOW_S", float) or DEFAULT_WINDOW_S,
            preemption_sources=e.get("TRAINBOT_PREEMPTION_SOURCES", ""),
            events_file=e.get("TRAINBOT_EVENTS_FILE") or None,
            ingest_url=e.get("TRAINBOT_INGEST_URL") or None,
            token=e.get("TRAINBOT_TOKEN") or None,
            spool_dir=e.get("TRAINBOT_SPOOL_DIR") or None,
            dry_run_phase=phase,
            stop_file=e.get("TRAINBOT_STOP_FILE") or None,
            metrics_every=_env_number(e, "TRAINBOT_METRICS_EVERY", int) or 1,
            train_through_notice=_env_flag(e, "TRAINBOT_TRAIN_THROUGH_NOTICE", default=False),
            resume_max_step=_env_number(e, "TRAINBOT_RESUME_MAX_STEP", int),
            notice_file=e.get("TRAINBOT_NOTICE_FILE") or None,
            measured_write_bps=_env_number(e, "TRAINBOT_MEASURED_WRITE_BPS", float),
            measured_stall_s=_env_number(e, "TRAINBOT_MEASURED_STALL_S", float),
            auto_mtbp_s=_env_number(e, "TRAINBOT_CHECKPOINT_AUTO_MTBP_S", float),
        )

    def measured_interval(self) -> MeasuredInterval | None:
        """The ``"auto"`` interval that follows the measured save cost, if this is one."""
        if self.every_s and self.auto_mtbp_s:
            return MeasuredInterval(self.every_s, mtbp_s=self.auto_mtbp_s)
        return None

    def decision(self, measured: MeasuredInterval | None = None) -> SaveDecision | None:
        """The save policy: every N steps, every T seconds (``measured``: T follows the
        save cost), or whichever comes first."""
        policies: list[SaveDecision] = []
        if self.every_steps:
            policies.append(EverySteps(self.every_steps))
        if measured is not None:
            policies.append(measured)
        elif self.every_s:
            policies.append(EverySeconds(self.every_s))
        if not policies:
            return None
        return policies[0] if len(policies) == 1 else AnyOf(tuple(policies))


def default_sink(cfg: SessionConfig) -> EventSink:
    """Where events go: the supervisor's file, the ingest API directly, or nowhere."""
    if cfg.events_file:
        return FileSink(Path(cfg.events_file))
    if cfg.ingest_url and cfg.token:
        spool = Path(cfg.spool_dir or Path.cwd() / ".trainbot-spool" / cfg.attempt_id)
        return Reporter(
            cfg.ingest_url, cfg.token, attempt=cfg.attempt_id, run=cfg.run_id, spool_dir=spool
        )
    return NullSink()
