"""The staging table: one row per copy of a dataset into another region's bucket.

The row is the copy's whole state, so a control plane killed mid-copy (SIGKILL included)
resumes where it stopped: the objects are copied in the order the store lists them
(lexicographic by key, on S3 and GCS), ``after_key`` is the last one finished, and the
object in progress keeps its multipart upload id and the parts already copied (S3) or
its rewrite token (GCS). Each is written after the request that made it, so at most one
part is copied twice.
"""

from __future__ import annotations

from datetime import datetime
from enum import Enum
from typing import Any

from sqlalchemy import JSON, BigInteger, Integer
from sqlmodel import Field, SQLModel

from jobs.database.models import EnumText, UTCDateTime, utcnow

__all__ = ["Staging", "StagingState"]

_BIG_INT = BigInteger().with_variant(Integer(), "sqlite")


class StagingState(str, Enum):
    """Where a copy stands. ``DONE``, ``FAILED`` and ``DELETED`` are final."""

    #: Recorded; its deferred work has not started copying.
    QUEUED = "QUEUED"
    COPYING = "COPYING"
    #: Every object is in the target; runs may use it.
    DONE = "DONE"
    FAILED = "FAILED"
    #: Removed by the retention rule (or by hand).
    DELETED = "DELETED"

    def is_terminal(self) -> bool:
        return self in (StagingState.DONE, StagingState.FAILED, StagingState.DELETED)


class Staging(SQLModel, table=True):
    """One dataset copied (or being copied) into the staging bucket of a region."""

    __tablename__ = "staging"

    id: str = Field(primary_key=True)
    #: The dataset as the spec names it (``s3://bucket/prefix/``).
    source: str = Field(index=True)
    #: Where it is copied to: the region's staging bucket and a prefix of its own.
    target: str
    #: The region the copy is for (the run's accelerators' region).
    region: str
    state: StagingState = Field(
        default=StagingState.QUEUED, sa_type=EnumText(StagingState), index=True
    )
    #: Who asked (a Slack user id), and the run it was asked for (None: ``/train stage``).
    requested_by: str
    run_id: str | None = Field(default=None, index=True)
    #: Where its progress message is: the channel, the thread it sits in, its own ts.
    channel: str | None = None
    thread_ts: str | None = None
    message_ts: str | None = None
    #: The source as listed when the copy started.
    total_objects: int = 0
    total_bytes: int = Field(default=0, sa_type=_BIG_INT)
    #: Objects finished, and their bytes (parts of the object in progress not counted).
    objects_done: int = 0
    bytes_done: int = Field(default=0, sa_type=_BIG_INT)
    #: The last source key finished; the copy goes on after it.
    after_key: str | None = None
    #: The object in progress, its multipart upload id (S3) or rewrite token (GCS), and
    #: the parts copied so far: ``[{"n": 1, "etag": "…", "size": …}]``.
    current_key: str | None = None
    upload_id: str | None = None
    parts: list[dict[str, Any]] = Field(default_factory=list, sa_type=JSON)
    #: Parts copied over the copy's life, resumes included (each UploadPartCopy or
    #: rewrite call that finished): what a restart did not repeat.
    part_copies: int = 0
    #: The estimated transfer cost, USD, when it was offered.
    usd: float = 0.0
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    #: When the last run that used it finished (or it finished, if none has): the
    #: retention rule counts from here.
    last_used_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    deleted_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    error: str | None = None
