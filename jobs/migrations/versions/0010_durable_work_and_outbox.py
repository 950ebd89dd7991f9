"""Deferred work and the Slack outbox live in the database, not in one replica's memory.

``deferred_work`` holds work due later (a resubmit after its backoff, a launch retry, a
day's digest) with its kind, JSON arguments, due time and claim, so the leader runs
what a dead replica had deferred. ``slack_outbox`` holds the Slack posts and updates a
replica has queued, written before they are sent, and the ts each post got;
``slack_pace`` is when each channel may next be sent to, shared by every replica.
Three new tables: nothing existing changes.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BIG_INT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "deferred_work",
        sa.Column("key", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("args", sa.JSON(), nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("fence", _BIG_INT, nullable=True),
        sa.Column("claimed_by", sa.String(), nullable=True),
        sa.Column("claimed_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("claimed_fence", _BIG_INT, nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.String(), nullable=True),
        sa.Column("done_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_deferred_work")),
    )
    op.create_index(op.f("ix_deferred_work_due_at"), "deferred_work", ["due_at"], unique=False)
    op.create_table(
        "slack_outbox",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("channel", sa.String(), nullable=False),
        sa.Column("op", sa.String(), nullable=False),
        sa.Column("target", sa.String(), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("key", sa.String(), nullable=True),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("owner_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ts", sa.String(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_slack_outbox")),
        sa.UniqueConstraint("key", name=op.f("uq_slack_outbox_key")),
    )
    op.create_index(op.f("ix_slack_outbox_target"), "slack_outbox", ["target"], unique=False)
    op.create_index(
        op.f("ix_slack_outbox_owner_until"), "slack_outbox", ["owner_until"], unique=False
    )
    op.create_table(
        "slack_pace",
        sa.Column("channel", sa.String(), nullable=False),
        sa.Column("next_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("channel", name=op.f("pk_slack_pace")),
    )


def downgrade() -> None:
    op.drop_table("slack_pace")
    op.drop_index(op.f("ix_slack_outbox_owner_until"), table_name="slack_outbox")
    op.drop_index(op.f("ix_slack_outbox_target"), table_name="slack_outbox")
    op.drop_table("slack_outbox")
    op.drop_index(op.f("ix_deferred_work_due_at"), table_name="deferred_work")
    op.drop_table("deferred_work")
