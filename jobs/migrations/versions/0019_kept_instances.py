"""Kept instances: ``kept_instances``, one row per failed attempt whose instance is kept
running for a person to look at (``debug.keep_failed_instance``).

A new table; nothing existing changes, so the previous release runs on this schema
(it terminates a failed attempt's instance, as it always did).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
#: Only adds: the release before this one runs on the schema it leaves.
expand_only: bool = True


def upgrade() -> None:
    op.create_table(
        "kept_instances",
        sa.Column("attempt_id", sa.String(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("provider", sa.String(), nullable=False),
        sa.Column("instance_id", sa.String(), nullable=False),
        sa.Column("zone", sa.String(), nullable=True),
        sa.Column("kept_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("price_per_hour", sa.Float(), nullable=True),
        sa.Column("instances", sa.Integer(), nullable=False),
        sa.Column("connect", sa.String(), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_by", sa.String(), nullable=True),
        sa.ForeignKeyConstraint(
            ["attempt_id"], ["attempts.id"], name=op.f("fk_kept_instances_attempt_id_attempts")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_kept_instances_run_id_runs")
        ),
        sa.PrimaryKeyConstraint("attempt_id", name=op.f("pk_kept_instances")),
    )
    op.create_index(op.f("ix_kept_instances_run_id"), "kept_instances", ["run_id"], unique=False)
    op.create_index(op.f("ix_kept_instances_until"), "kept_instances", ["until"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_kept_instances_until"), table_name="kept_instances")
    op.drop_index(op.f("ix_kept_instances_run_id"), table_name="kept_instances")
    op.drop_table("kept_instances")
