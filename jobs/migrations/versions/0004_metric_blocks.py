"""Metrics events are stored by the batch, in ``metric_blocks``.

A runner's ``metrics`` events are nearly all it sends, many a second. One ``events`` row
each cost the ingest API most of its time, so the new metrics of a batch now go into one
``metric_blocks`` row: their seqs, times (unix seconds) and payloads as three JSON arrays
(see :class:`jobs.database.models.MetricBlock`). Every other event type keeps its row in
``events``.

The upgrade moves the metrics rows already in ``events`` into blocks of up to
:data:`BLOCK_POINTS` points per attempt, in seq order, and deletes them from ``events``;
the downgrade moves them back. Both run in the migration's transaction, so a failure
leaves the database as it was.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: Points per block when existing rows are moved: the runner's batch size.
BLOCK_POINTS = 500
_BIG_INT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

# Lightweight views of both tables, as they are at this revision.
_events = sa.table(
    "events",
    sa.column("id", sa.Integer()),
    sa.column("attempt_id", sa.String()),
    sa.column("run_id", sa.String()),
    sa.column("seq", _BIG_INT),
    sa.column("type", sa.String()),
    sa.column("time", sa.DateTime(timezone=True)),
    sa.column("data", sa.JSON()),
    sa.column("received_at", sa.DateTime(timezone=True)),
)
_blocks = sa.table(
    "metric_blocks",
    sa.column("id", sa.Integer()),
    sa.column("attempt_id", sa.String()),
    sa.column("run_id", sa.String()),
    sa.column("first_seq", _BIG_INT),
    sa.column("last_seq", _BIG_INT),
    sa.column("count", sa.Integer()),
    sa.column("first_time", sa.DateTime(timezone=True)),
    sa.column("last_time", sa.DateTime(timezone=True)),
    sa.column("seqs", sa.JSON()),
    sa.column("times", sa.JSON()),
    sa.column("data", sa.JSON()),
    sa.column("received_at", sa.DateTime(timezone=True)),
)


def _unix(moment: datetime) -> float:
    """SQLite hands back naive UTC, PostgreSQL aware datetimes."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _moment(seconds: float, like: datetime) -> datetime:
    """Unix seconds as the kind of datetime the database handed back (see _unix)."""
    moment = datetime.fromtimestamp(seconds, timezone.utc)
    return moment.replace(tzinfo=None) if like.tzinfo is None else moment


def _blocks_of(rows: Sequence[Any]) -> Iterator[dict[str, Any]]:
    """Rows of one attempt, in seq order, as blocks of at most BLOCK_POINTS."""
    for start in range(0, len(rows), BLOCK_POINTS):
        part = rows[start : start + BLOCK_POINTS]
        yield {
            "attempt_id": part[0].attempt_id,
            "run_id": part[0].run_id,
            "first_seq": part[0].seq,
            "last_seq": part[-1].seq,
            "count": len(part),
            "first_time": min(r.time for r in part),
            "last_time": max(r.time for r in part),
            "seqs": [r.seq for r in part],
            "times": [_unix(r.time) for r in part],
            "data": [r.data for r in part],
            "received_at": max(r.received_at for r in part),
        }


def _by_attempt(rows: Iterator[Any]) -> Iterator[list[Any]]:
    """Rows ordered by attempt then seq, one list per attempt."""
    current: list[Any] = []
    for row in rows:
        if current and row.attempt_id != current[0].attempt_id:
            yield current
            current = []
        current.append(row)
    if current:
        yield current


def upgrade() -> None:
    op.create_table(
        "metric_blocks",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("attempt_id", sa.String(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("first_seq", _BIG_INT, nullable=False),
        sa.Column("last_seq", _BIG_INT, nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("first_time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("seqs", sa.JSON(), nullable=False),
        sa.Column("times", sa.JSON(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["attempt_id"], ["attempts.id"], name=op.f("fk_metric_blocks_attempt_id_attempts")
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_metric_blocks_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_metric_blocks")),
        sa.UniqueConstraint(
            "attempt_id", "first_seq", name=op.f("uq_metric_blocks_attempt_id_first_seq")
        ),
    )
    op.create_index(
        op.f("ix_metric_blocks_run_id_last_time"),
        "metric_blocks",
        ["run_id", "last_time"],
        unique=False,
    )
    connection = op.get_bind()
    rows = connection.execute(
        sa.select(_events)
        .where(_events.c.type == "metrics")
        .order_by(_events.c.attempt_id, _events.c.seq)
    )
    for attempt_rows in _by_attempt(iter(rows.all())):
        connection.execute(sa.insert(_blocks), list(_blocks_of(attempt_rows)))
    connection.execute(sa.delete(_events).where(_events.c.type == "metrics"))


def downgrade() -> None:
    connection = op.get_bind()
    blocks = connection.execute(
        sa.select(_blocks).order_by(_blocks.c.attempt_id, _blocks.c.first_seq)
    ).all()
    for block in blocks:
        connection.execute(
            sa.insert(_events),
            [
                {
                    "attempt_id": block.attempt_id,
                    "run_id": block.run_id,
                    "seq": seq,
                    "type": "metrics",
                    "time": _moment(time, block.first_time),
                    "data": data,
                    "received_at": block.received_at,
                }
                for seq, time, data in zip(block.seqs, block.times, block.data, strict=True)
            ],
        )
    op.drop_index(op.f("ix_metric_blocks_run_id_last_time"), table_name="metric_blocks")
    op.drop_table("metric_blocks")
