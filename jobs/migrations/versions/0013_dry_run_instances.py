"""Preflight dry runs on a cloud instance: ``dry_runs``, one row per dry-run instance.

The row is written with the instance's token hash before the launch, so a restarted
control plane can terminate an instance it launched and never heard back from (see
:class:`jobs.database.models.DryRunInstance`). A new table; nothing existing changes.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "dry_runs",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("provider", sa.String(), nullable=False),
        sa.Column("region", sa.String(), nullable=True),
        sa.Column("zone", sa.String(), nullable=True),
        sa.Column("instance_type", sa.String(), nullable=True),
        sa.Column("spot", sa.Boolean(), nullable=False),
        sa.Column("instance_id", sa.String(), nullable=True),
        sa.Column("token_hash", sa.String(), nullable=True),
        sa.Column("phase", sa.String(), nullable=True),
        sa.Column("report", sa.JSON(), nullable=True),
        sa.Column("price_per_hour", sa.Float(), nullable=True),
        sa.Column("cost_usd", sa.Float(), nullable=True),
        sa.Column("end_reason", sa.String(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("launched_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_dry_runs_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dry_runs")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_dry_runs_token_hash")),
    )
    op.create_index(op.f("ix_dry_runs_run_id"), "dry_runs", ["run_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_dry_runs_run_id"), table_name="dry_runs")
    op.drop_table("dry_runs")
