"""The tables through which the replicas act as one control plane.

The leader's lease and its fencing token, the log of commands already handled, work
deferred to a later time, and the outboxes of Slack and PagerDuty: each row outlives the
replica that wrote it, so another replica (or the same one restarted) takes over what a
dead one left. The run's own tables (runs, attempts, events, alerts, spend) are in
:mod:`jobs.database.models`, whose column conventions these follow.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON
from sqlmodel import Field, SQLModel

from jobs.database.models import BIG_INT, UTCDateTime, utcnow

#: The lease the scheduler's leader holds (``SchedulerLease.name``).
LEADER_LEASE = "leader"


class SchedulerLease(SQLModel, table=True):
    """A named lease: the replica holding an unexpired one runs the scheduled jobs."""

    __tablename__ = "scheduler_leases"

    name: str = Field(primary_key=True)
    holder: str
    acquired_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    expires_at: datetime = Field(sa_type=UTCDateTime)
    #: The fencing token: raised by one each time the lease changes holder, so work a
    #: deposed leader started carries a token that is no longer current and is refused.
    token: int = Field(default=0, sa_type=BIG_INT)


class CommandLog(SQLModel, table=True):
    """Commands already handled, by idempotency key: a retried command counts once."""

    __tablename__ = "command_log"

    key: str = Field(primary_key=True)
    #: What kind of command it was (``launch``, ``stop``, ``ack``…).
    kind: str = ""
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    #: What the first handling produced, returned again to a retry.
    result: dict[str, Any] | None = Field(default=None, sa_type=JSON)


class DeferredWork(SQLModel, table=True):
    """Work due later (a resubmit after its backoff, a launch retry, a day's digest),
    kept in a row so that it outlives the replica that deferred it
    (``jobs.background.deferred``)."""

    __tablename__ = "deferred_work"

    #: What the work is for (``resubmit:<attempt>``): deferring it twice keeps one row.
    key: str = Field(primary_key=True)
    #: The registered function that does it (``jobs.background.deferred.Later``), never a pickle.
    kind: str
    #: Its keyword arguments, JSON.
    args: dict[str, Any] = Field(default_factory=dict, sa_type=JSON)
    due_at: datetime = Field(sa_type=UTCDateTime, index=True)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    #: The fencing token of the scheduled work that deferred it (NULL: a person's or a
    #: runner's), which it runs under when its own replica's timer runs it.
    fence: int | None = Field(default=None, sa_type=BIG_INT)
    #: Who is running it, until when; a leader's claim also holds its token, so the
    #: next leader takes back at once what a dead one left half done.
    claimed_by: str | None = None
    claimed_until: datetime | None = Field(default=None, sa_type=UTCDateTime)
    claimed_fence: int | None = Field(default=None, sa_type=BIG_INT)
    attempts: int = 0
    #: The last failure, for whoever looks at the table.
    error: str | None = None
    #: Done (kept a week, so the same key is not deferred again meanwhile).
    done_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class SlackOutbox(SQLModel, table=True):
    """A Slack post or update written before it is sent (``bot.slack_outbox``): a
    replica that dies leaves what it had queued to the others."""

    __tablename__ = "slack_outbox"

    id: int | None = Field(default=None, primary_key=True)
    channel: str
    #: ``post`` or ``update``.
    op: str
    #: post: the message's handle (``pending-…``); update: the message it edits.
    target: str = Field(index=True)
    #: The message: its type and fields as JSON.
    payload: dict[str, Any] = Field(sa_type=JSON)
    #: Posted once per key (a digest's channel and day); NULL: no such promise.
    key: str | None = Field(default=None, unique=True)
    #: The replica sending it, and until when its claim holds unless renewed.
    owner: str
    owner_until: datetime = Field(sa_type=UTCDateTime, index=True)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    #: Sent (or refused for good); the row stays a day for the handle below.
    sent_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    #: post: Slack's ts for the handle ("" when refused), so any replica can resolve it.
    ts: str | None = None


class SlackPace(SQLModel, table=True):
    """When each channel may next be sent to: one pace for every replica together."""

    __tablename__ = "slack_pace"

    channel: str = Field(primary_key=True)
    next_at: datetime = Field(sa_type=UTCDateTime)


class PagerDutyOutbox(SQLModel, table=True):
    """A PagerDuty event written before it is sent (:mod:`jobs.outbound.pagerduty`): a replica
    that dies leaves what it had queued to the others, or to itself restarted."""

    __tablename__ = "pagerduty_outbox"

    id: int | None = Field(default=None, primary_key=True)
    #: ``trigger``, ``acknowledge`` or ``resolve``.
    action: str
    #: The alert it is about (no foreign key: the row is written while the alert's own
    #: transaction holds it locked).
    alert_id: str = Field(index=True)
    #: The replica sending it, and until when its claim holds unless renewed.
    owner: str
    owner_until: datetime = Field(sa_type=UTCDateTime, index=True)
    #: Failed tries so far, and when the next may be made (the backoff).
    tries: int = 0
    next_at: datetime = Field(sa_type=UTCDateTime)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    #: Done: ``sent``, ``refused`` (400), ``gave_up`` or ``not_paged`` (an acknowledge or
    #: resolve of an alert that never paged); the row stays a day after ``done_at``.
    done_at: datetime | None = Field(default=None, sa_type=UTCDateTime, index=True)
    outcome: str | None = None
