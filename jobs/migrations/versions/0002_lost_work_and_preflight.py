"""Attempts record the work they lost (resubmit reports, goodput, the digest); runs keep
their preflight report and chosen checkpoint interval; channels have an on-call user.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "oncall",
        sa.Column("channel", sa.String(), nullable=False),
        sa.Column("user", sa.String(), nullable=False),
        sa.Column("set_by", sa.String(), nullable=False),
        sa.Column("set_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("channel", name=op.f("pk_oncall")),
    )
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("preflight", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("checkpoint_interval_s", sa.Float(), nullable=True))
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("resumed_from_step", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("lost_steps", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("lost_seconds", sa.Float(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("step_time_s", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_table("oncall")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("step_time_s")
        batch.drop_column("lost_seconds")
        batch.drop_column("lost_steps")
        batch.drop_column("resumed_from_step")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("checkpoint_interval_s")
        batch.drop_column("preflight")
