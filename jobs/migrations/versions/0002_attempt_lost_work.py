"""Attempts record the work they lost, for resubmit reports, goodput and the digest.

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
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("resumed_from_step", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("lost_steps", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("lost_seconds", sa.Float(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("step_time_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("step_time_s")
        batch.drop_column("lost_seconds")
        batch.drop_column("lost_steps")
        batch.drop_column("resumed_from_step")
