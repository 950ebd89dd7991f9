"""A session's settings from its environment (``TRAINBOT_*``, set by the runner or the
provider's startup script), read through the contract (:mod:`runner.env`), whose errors
say what to set instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from runner import env as contract
from runner.session.policy import (
    AnyOf,
    EverySeconds,
    EverySteps,
    MeasuredInterval,
    SaveDecision,
)
from runner.telemetry import EventSink, FileSink, NullSink, Reporter

#: The SIGTERM-to-SIGKILL window assumed when none is given: the shortest provider's.
DEFAULT_WINDOW_S = contract.DEFAULT_TERMINATION_WINDOW_S


def _text(path: Path | None) -> str | None:
    return None if path is None else str(path)


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
        return cls(
            run_id=contract.RUN_ID.get(e),
            attempt_id=contract.ATTEMPT_ID.get(e),
            checkpoint_uri=contract.CHECKPOINT_URI.get(e),
            checkpoint_prefix=contract.CHECKPOINT_PREFIX.get(e),
            every_steps=contract.CHECKPOINT_EVERY_STEPS.get(e),
            every_s=contract.CHECKPOINT_INTERVAL_S.get(e),
            max_steps=contract.MAX_STEPS.get(e),
            window_s=contract.termination_window_s(e),
            preemption_sources=contract.PREEMPTION_SOURCES.get(e),
            events_file=_text(contract.EVENTS_FILE.get(e)),
            ingest_url=contract.INGEST_URL.get(e),
            token=contract.TOKEN.get(e),
            spool_dir=_text(contract.SPOOL_DIR.get(e)),
            dry_run_phase=contract.DRY_RUN_PHASE.get(e),
            stop_file=_text(contract.STOP_FILE.get(e)),
            metrics_every=contract.METRICS_EVERY.get(e),
            train_through_notice=contract.TRAIN_THROUGH_NOTICE.get(e),
            resume_max_step=contract.RESUME_MAX_STEP.get(e),
            notice_file=_text(contract.NOTICE_FILE.get(e)),
            measured_write_bps=contract.MEASURED_WRITE_BPS.get(e),
            measured_stall_s=contract.MEASURED_STALL_S.get(e),
            auto_mtbp_s=contract.CHECKPOINT_AUTO_MTBP_S.get(e),
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
