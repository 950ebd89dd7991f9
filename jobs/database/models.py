"""The control plane's tables (SQLModel), the same on SQLite and PostgreSQL.

Conventions that keep both databases alike:

- Datetimes are timezone-aware UTC in Python. :class:`UTCDateTime` rejects naive
  values on the way in (a naive time is a bug: whose local time?), stores naive UTC
  on SQLite and ``timestamptz`` on PostgreSQL, and hands back aware UTC from both.
- States are stored as their names in a ``VARCHAR(32)``, not as a database enum, so
  adding a state needs no enum migration; :class:`EnumText` turns them back into members.
- JSON columns use SQLAlchemy's portable ``JSON``. Mutating a loaded dict in place
  is not tracked: assign a new value.
- Constraint and index names follow :data:`NAMING_CONVENTION`, so migrations can
  refer to them on both databases.

The tables the replicas coordinate through (the leader's lease, deferred work, the
outboxes) are in :mod:`jobs.database.replica_tables`, on the same conventions.

The schema is created by the migrations in ``jobs/migrations`` (:func:`jobs.database.db.migrate`),
never by ``create_all``; a test checks the two agree.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timezone
from enum import Enum
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Dialect,
    Index,
    Integer,
    String,
    Table,
    UniqueConstraint,
)
from sqlalchemy.types import TypeDecorator
from sqlmodel import Field, SQLModel

from jobs.domain.lifecycle import AttemptState, RunState
from jobs.domain.severity import Severity

__all__ = [
    "BIG_INT",
    "NAMING_CONVENTION",
    "Alert",
    "AlertState",
    "ApiToken",
    "Attempt",
    "Budget",
    "Checkpoint",
    "DryRunInstance",
    "EnumText",
    "EventRow",
    "MetricBlock",
    "OnCall",
    "Run",
    "SpendRecord",
    "UTCDateTime",
    "alert_dedupe_key",
    "hash_token",
    "new_id",
    "table_of",
    "utcnow",
]

#: Names for constraints and indexes, identical on every database.
NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
SQLModel.metadata.naming_convention = NAMING_CONVENTION

#: Steps, sequence numbers and byte counts: BIGINT on PostgreSQL, whose INTEGER is 32-bit
#: (a 3 GiB checkpoint overflows it); INTEGER on SQLite, which is 64-bit already.
BIG_INT = BigInteger().with_variant(Integer(), "sqlite")


def table_of(model: type[SQLModel]) -> Table:
    """A table model's Core table, for statements built once and run on a hot path."""
    return cast(Table, model.__table__)  # type: ignore[attr-defined]


def utcnow() -> datetime:
    """The current time, aware, in UTC: the only kind of datetime the tables accept."""
    return datetime.now(timezone.utc)


def new_id(prefix: str) -> str:
    """A short random id people can type in chat (``r-3f9c2a1b``)."""
    return f"{prefix}-{secrets.token_hex(4)}"


def hash_token(token: str) -> str:
    """What is stored for a runner token: its SHA-256, never the token itself."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def alert_dedupe_key(run_id: str | None, rule: str, key: str) -> str:
    """The value that keeps one open alert per (run, rule, key); see :class:`Alert`."""
    return f"{run_id or '-'}|{rule}|{key}"


class UTCDateTime(TypeDecorator[datetime]):
    """A datetime column that stores and returns aware UTC on every database."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(
                f"naive datetime {value.isoformat()} given to a UTC column: pass an aware "
                "datetime, e.g. datetime.now(timezone.utc)"
            )
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


class EnumText(TypeDecorator[Enum]):
    """A ``str`` Enum stored as its value in a ``VARCHAR(32)``."""

    impl = String(32)
    cache_ok = True

    def __init__(self, enum_cls: type[Enum]) -> None:
        super().__init__()
        self.enum_cls = enum_cls

    def process_bind_param(self, value: Enum | str | None, dialect: Dialect) -> str | None:
        if value is None:
            return None
        return str(self.enum_cls(value).value)

    def process_result_value(self, value: str | None, dialect: Dialect) -> Enum | None:
        return None if value is None else self.enum_cls(value)


class AlertState(str, Enum):
    """An alert's lifecycle, after PagerDuty: ``OPEN → ACKED → RESOLVED``."""

    OPEN = "OPEN"
    ACKED = "ACKED"
    RESOLVED = "RESOLVED"

    def __str__(self) -> str:
        return self.value


class Run(SQLModel, table=True):
    """One launched training job, from ``/train launch`` to its final state."""

    __tablename__ = "runs"

    id: str = Field(default_factory=lambda: new_id("r"), primary_key=True)
    #: The spec it was launched from, and the spec as validated (overrides applied).
    spec_name: str = Field(index=True)
    spec: dict[str, Any] = Field(default_factory=dict, sa_type=JSON)
    state: RunState = Field(default=RunState.PENDING, sa_type=EnumText(RunState), index=True)
    #: Why it is in its state, for people (the failing check, who stopped it).
    reason: str | None = None
    #: Chat user id of who launched it, and where it reports.
    requester: str = Field(index=True)
    channel: str | None = Field(default=None, index=True)
    thread_ts: str | None = None
    #: Checkpoint root resolved at submit (the spec's, or the process default).
    checkpoint_uri: str | None = None
    #: The directory under the root that holds its checkpoints, when it is not the
    #: run's own id: a resubmitted run resumes the checkpoints of the run it continues.
    #: Written by trainbot alone, never from a spec.
    checkpoint_prefix: str | None = None
    #: The budget alerts and the hard cap are measured against.
    budget_usd: float | None = None
    #: What the runs it continues had spent (a resubmit carries the spend so far), so a
    #: resubmit cannot walk around the budget's hard cap; counted in its spend. NULL: none.
    carried_usd: float | None = None
    #: Hours the instances of the runs it continues ran, so ``max_hours`` counts them as
    #: the budget counts their spend. NULL: none.
    carried_hours: float | None = None
    #: Chat user id of who raised the budget when resubmitting (``budget.usd=N``).
    budget_raised_by: str | None = None
    #: When its cloud budget (AWS Budgets) was removed; NULL while it may still exist.
    cloud_budget_removed_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    #: Steps the training is expected to take, when known (progress).
    target_steps: int | None = Field(default=None, sa_type=BIG_INT)
    #: Latest step reported by any attempt, and latest committed checkpoint step.
    last_step: int | None = Field(default=None, sa_type=BIG_INT)
    last_committed_step: int | None = Field(default=None, sa_type=BIG_INT)
    #: Attempts ended by preemption so far (the resubmit policy reads it).
    preemptions: int = 0
    #: Key of the chat command that created it: a retried command finds this run.
    idempotency_key: str | None = Field(default=None, unique=True)
    #: The preflight report (checks and figures), once preflight has run.
    preflight: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    #: Seconds between checkpoints chosen at preflight (Daly's optimum for "auto").
    checkpoint_interval_s: float | None = None
    #: While the run waits for a price at or below ``resubmit.max_price``: the limit, the
    #: price last seen, where, and since when (``jobs.runs.price``); NULL otherwise.
    price_wait: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    #: The projection made from the profiled start of the run (``jobs.runs.profile``),
    #: with who answered its question; a run that has one is not profiled again.
    projection: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    ended_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class Attempt(SQLModel, table=True):
    """One instance working on a run. A preemption ends it; the next attempt is a new row."""

    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("run_id", "number"),)

    id: str = Field(default_factory=lambda: new_id("a"), primary_key=True)
    run_id: str = Field(foreign_key="runs.id", index=True)
    #: 1 for the first attempt of a run, then 2, 3…
    number: int
    state: AttemptState = Field(
        default=AttemptState.REQUESTED, sa_type=EnumText(AttemptState), index=True
    )
    provider: str
    region: str | None = None
    zone: str | None = None
    instance_type: str | None = None
    #: The provider's id for the instance (EC2 instance id, GCE name, local pid).
    instance_id: str | None = Field(default=None, index=True)
    spot: bool = True
    instances: int = 1
    #: Price per instance-hour at launch, refreshed while it runs.
    price_per_hour: float | None = None
    #: The spot price of the same request when it was priced (at launch, refreshed with
    #: ``price_per_hour``): what an on-demand attempt's premium is measured against.
    spot_price_per_hour: float | None = None
    #: SHA-256 of the runner's token (:func:`hash_token`); set to NULL when the attempt
    #: ends, which revokes the token.
    token_hash: str | None = Field(default=None, unique=True)
    exit_code: int | None = None
    #: Why it ended, for people ("spot interruption notice", "no heartbeat for 15 min").
    end_reason: str | None = None
    last_heartbeat: datetime | None = Field(default=None, sa_type=UTCDateTime)
    last_step: int | None = Field(default=None, sa_type=BIG_INT)
    #: Highest event sequence number stored, so the ingest API can acknowledge batches.
    last_seq: int | None = Field(default=None, sa_type=BIG_INT)
    #: When the runner or the provider first reported the preemption notice.
    preemption_notice_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    #: Step this attempt resumed from (the newest committed checkpoint at launch).
    resumed_from_step: int | None = Field(default=None, sa_type=BIG_INT)
    #: Steps done after the last committed checkpoint and lost when the attempt ended.
    lost_steps: int = Field(default=0, sa_type=BIG_INT)
    #: Paid seconds whose work was lost (since the last commit, plus start-up to restore).
    lost_seconds: float = 0.0
    #: Seconds the runner measured per step (median of recent steps), for lost-work figures.
    step_time_s: float | None = None
    #: Where the attempt's profile window ends: at this step, or this many seconds after
    #: launch, whichever comes first (``jobs.runs.profile``); NULL: it is not profiled.
    profile_until_step: int | None = Field(default=None, sa_type=BIG_INT)
    profile_until_s: float | None = None
    #: When the ingest API saw the window end (the projection is made once).
    profiled_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    started_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    ended_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class DryRunInstance(SQLModel, table=True):
    """The cloud instance of one preflight dry run (``jobs.preflight.cloud_dry_run``).

    The row is written, with its token's hash, before the instance is launched, so that
    a control plane restarted in the middle finds the instance (by id, or by the dry
    run's id in its tags when the launch had not answered) and terminates it. Not an
    attempt: nothing bills a run's attempts, retries or resubmits for it.
    """

    __tablename__ = "dry_runs"

    id: str = Field(default_factory=lambda: new_id("d"), primary_key=True)
    run_id: str = Field(foreign_key="runs.id", index=True)
    provider: str
    region: str | None = None
    zone: str | None = None
    instance_type: str | None = None
    spot: bool = True
    #: The provider's id for the instance; None until the launch answers.
    instance_id: str | None = None
    #: SHA-256 of the instance's token (:func:`hash_token`); NULL once the dry run has
    #: ended, which revokes it (reports, credentials).
    token_hash: str | None = Field(default=None, unique=True)
    #: The last phase the instance reported ("started", "saved", "restored", "finished").
    phase: str | None = None
    #: ``runner.dryrun.DryRunReport`` as JSON, once the instance sent it.
    report: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    #: Price per instance-hour at launch.
    price_per_hour: float | None = None
    #: Price × the seconds from launch to the end of its terminate.
    cost_usd: float | None = None
    #: Why it ended ("reported", "timed out", "instance ended", "control plane restarted").
    end_reason: str | None = None
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    launched_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    ended_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class EventRow(SQLModel, table=True):
    """One telemetry event from a runner. ``(attempt_id, seq)`` makes redelivery harmless.

    Every type but ``metrics``, which is stored by the batch in :class:`MetricBlock`.
    """

    __tablename__ = "events"
    __table_args__ = (
        UniqueConstraint("attempt_id", "seq"),
        Index("ix_events_run_id_type_time", "run_id", "type", "time"),
    )

    id: int | None = Field(default=None, primary_key=True)
    attempt_id: str = Field(foreign_key="attempts.id")
    run_id: str = Field(foreign_key="runs.id")
    seq: int = Field(sa_type=BIG_INT)
    #: The wire event type (``metrics``, ``checkpoint``, ``preempted``…).
    type: str
    #: When the runner says it happened.
    time: datetime = Field(sa_type=UTCDateTime)
    data: dict[str, Any] = Field(default_factory=dict, sa_type=JSON)
    received_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class MetricBlock(SQLModel, table=True):
    """The ``metrics`` events of one batch, in one row.

    A runner reports metrics many times a second, and they are nearly every event it
    sends; a row each cost the ingest API most of its time (two index entries, two
    foreign-key look-ups and a formatted time per event). So the new metrics of a batch
    are stored together: their seqs, times (unix seconds) and payloads as three JSON
    arrays of equal length, in seq order, with the block's seq and time range for the
    queries. Every other event type keeps a row of its own in ``events``. A seq is
    stored once per attempt across both tables (see :mod:`jobs.ingest`), and
    :mod:`jobs.database.metrics` reads the points back.
    """

    __tablename__ = "metric_blocks"
    __table_args__ = (
        UniqueConstraint("attempt_id", "first_seq"),
        Index("ix_metric_blocks_run_id_last_time", "run_id", "last_time"),
    )

    id: int | None = Field(default=None, primary_key=True)
    attempt_id: str = Field(foreign_key="attempts.id")
    run_id: str = Field(foreign_key="runs.id")
    first_seq: int = Field(sa_type=BIG_INT)
    last_seq: int = Field(sa_type=BIG_INT)
    count: int
    first_time: datetime = Field(sa_type=UTCDateTime)
    last_time: datetime = Field(sa_type=UTCDateTime)
    #: Per point, in seq order: its seq, its unix time, its payload (non-finite floats
    #: as the wire's strings; :func:`runner.wire.restore_floats` turns them back).
    seqs: list[int] = Field(default_factory=list, sa_type=JSON)
    times: list[float] = Field(default_factory=list, sa_type=JSON)
    data: list[dict[str, Any]] = Field(default_factory=list, sa_type=JSON)
    received_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class Checkpoint(SQLModel, table=True):
    """A committed checkpoint (its manifest exists in the store)."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "step"),)

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="runs.id")
    attempt_id: str | None = Field(default=None, foreign_key="attempts.id")
    step: int = Field(sa_type=BIG_INT)
    #: The checkpoint's directory in the store (``…/{run_id}/step-0000000100``).
    uri: str
    bytes: int = Field(default=0, sa_type=BIG_INT)
    committed_at: datetime = Field(sa_type=UTCDateTime)
    #: Metrics at that step, for keep-best retention.
    metrics: dict[str, Any] = Field(default_factory=dict, sa_type=JSON)
    #: Set when retention deleted it from the store.
    deleted_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class Alert(SQLModel, table=True):
    """An alert and its lifecycle.

    Deduplication: ``dedupe_key`` is :func:`alert_dedupe_key` while the alert is OPEN or
    ACKED and NULL once RESOLVED. It is UNIQUE, and NULLs never collide, so the
    database allows one unresolved alert per (run, rule, key) and any number of
    resolved ones, on SQLite and PostgreSQL alike. Whoever resolves an alert must clear it.
    """

    __tablename__ = "alerts"

    id: str = Field(default_factory=lambda: new_id("al"), primary_key=True)
    #: ``None`` for alerts about a team budget rather than a run.
    run_id: str | None = Field(default=None, foreign_key="runs.id", index=True)
    rule: str
    #: What the rule is about within the run (a metric name, a threshold), or "".
    key: str = ""
    dedupe_key: str | None = Field(default=None, unique=True)
    severity: Severity = Field(default=Severity.WARNING, sa_type=EnumText(Severity))
    state: AlertState = Field(default=AlertState.OPEN, sa_type=EnumText(AlertState), index=True)
    title: str
    detail: str = ""
    #: What to do about it.
    hint: str = ""
    #: Times the rule fired while this alert was unresolved.
    count: int = 1
    first_seen: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    last_seen: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    acked_by: str | None = None
    acked_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    resolved_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    snoozed_until: datetime | None = Field(default=None, sa_type=UTCDateTime)
    #: When the latest escalation page went out (NULL: never escalated).
    escalated_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    #: Escalation pages sent so far: the on-call, then the next level, then repeats at
    #: the last level (``jobs.alerts.escalate_due``); 0: not escalated.
    escalation_level: int = 0
    #: The chat message showing it, updated on repeats instead of posting again.
    message_channel: str | None = None
    message_ts: str | None = None
    #: The signals joined in this alert (one incident), by key: their severity, title,
    #: detail and whether they are firing. NULL for an alert of one key.
    members: dict[str, Any] | None = Field(default=None, sa_type=JSON)
    #: Times the alert reopened after resolving (within the quiet period).
    reopened: int = 0
    #: Start of the current flap window, and the reopens counted in it.
    flap_since: datetime | None = Field(default=None, sa_type=UTCDateTime)
    flaps: int = 0
    #: When the alert was first said to be flapping (said once per flap window).
    flapping_since: datetime | None = Field(default=None, sa_type=UTCDateTime)
    #: The step at which the problem began (the divergence's first bad step).
    began_step: int | None = Field(default=None, sa_type=BIG_INT)
    #: When trainbot stops the run if this is still unresolved (and, unless a member
    #: stops at once, unacknowledged); NULL: never.
    stop_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    #: When trainbot stopped the run for this alert, and the checkpoint step it offers
    #: to resubmit from (the newest one before the problem began); retention keeps it.
    stopped_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    resume_step: int | None = Field(default=None, sa_type=BIG_INT)


class SpendRecord(SQLModel, table=True):
    """Money one attempt accrued over one interval: price × hours × instances."""

    __tablename__ = "spend_records"
    __table_args__ = (UniqueConstraint("attempt_id", "period_start"),)

    id: int | None = Field(default=None, primary_key=True)
    attempt_id: str = Field(foreign_key="attempts.id")
    run_id: str = Field(foreign_key="runs.id", index=True)
    period_start: datetime = Field(sa_type=UTCDateTime)
    period_end: datetime = Field(sa_type=UTCDateTime, index=True)
    usd: float
    instances: int = 1
    price_per_hour: float


class Budget(SQLModel, table=True):
    """A spending limit for a team (channel) or one run, with the thresholds it alerts at."""

    __tablename__ = "budgets"
    __table_args__ = (UniqueConstraint("scope", "name"),)

    id: int | None = Field(default=None, primary_key=True)
    #: ``"team"`` (name is a channel) or ``"run"`` (name is a run id).
    scope: str
    name: str
    usd: float
    #: ``"month"`` for team budgets; ``"run"`` for a run's lifetime.
    period: str = "month"
    #: Percentages that alert, and those already alerted in the current period.
    thresholds: list[int] = Field(default_factory=lambda: [50, 80, 100], sa_type=JSON)
    alerted: list[int] = Field(default_factory=list, sa_type=JSON)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class OnCall(SQLModel, table=True):
    """Who is on call for a channel: mentioned when a critical alert escalates."""

    __tablename__ = "oncall"

    channel: str = Field(primary_key=True)
    #: A Slack user id or user-group handle ("U123", "S0ONCALL", "@ml-oncall").
    user: str
    set_by: str
    set_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class ApiToken(SQLModel, table=True):
    """A person's token for the HTTP API (``/train token``; :mod:`jobs.web.api_tokens`).

    It acts as the person who asked for it, in the channel they asked in, with the
    permissions chat gives them there; only its hash is kept, so it is shown once.
    """

    __tablename__ = "api_tokens"

    #: Short id to name it by (``tk-…``), shown in ``/train token list`` and revoke.
    id: str = Field(default_factory=lambda: new_id("tk"), primary_key=True)
    #: SHA-256 of the token (:func:`hash_token`), never the token itself.
    token_hash: str = Field(unique=True)
    #: The Slack user id it acts as, and the channel it was issued in (its runs report there).
    user: str = Field(index=True)
    channel: str
    #: What its holder called it ("ci", "laptop").
    name: str
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    expires_at: datetime = Field(sa_type=UTCDateTime)
    last_used_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    #: Set by ``/train token revoke``: the token is refused from then on.
    revoked_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class KeptInstance(SQLModel, table=True):
    """The instance of a failed attempt kept running for a person to look at
    (``debug.keep_failed_instance``; :mod:`jobs.runs.kept`).

    The attempt stays FAILED and its token revoked; the instance bills until ``until``
    (or an earlier ``/train release``), accrued like an attempt's time as spend records
    of the attempt from ``kept_at``. ``until`` is stored, so the scheduled reconcile ends
    it on time after a restart.
    """

    __tablename__ = "kept_instances"

    attempt_id: str = Field(foreign_key="attempts.id", primary_key=True)
    run_id: str = Field(foreign_key="runs.id", index=True)
    provider: str
    instance_id: str
    zone: str | None = None
    #: When the attempt ended and the keeping began (its spend records start here).
    kept_at: datetime = Field(sa_type=UTCDateTime)
    #: When reconcile terminates it.
    until: datetime = Field(sa_type=UTCDateTime, index=True)
    #: Price per instance-hour (the attempt's), and its instances (a gang's nodes).
    price_per_hour: float | None = None
    instances: int = 1
    #: The command that connects to it (an SSM session, ``gcloud compute ssh``, a directory).
    connect: str = ""
    #: When it was terminated (its spend stops here); None while it is kept.
    ended_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    #: Who ended it: a user id (``/train release``), ``"time"``, ``"budget"`` (the run's
    #: hard cap), or ``"gone"`` (it ended outside trainbot: reclaimed, terminated by hand).
    ended_by: str | None = None
