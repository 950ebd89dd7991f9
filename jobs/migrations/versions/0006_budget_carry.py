"""A resubmitted run carries its budget's spend; a cloud budget is removed once.

``runs.carried_usd`` is what the runs a resubmit continues had spent, so the new run's
hard cap counts it; ``runs.budget_raised_by`` is who raised the budget to continue past
the cap; ``runs.cloud_budget_removed_at`` is when the run's cloud budget (AWS Budgets)
was deleted after it ended. Existing runs carry nothing (NULL) and keep their cloud budgets
until the cleanup job removes them.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD/DROP COLUMN, as in 0005: a batch copy of ``runs`` would trip the foreign
    # keys that attempts, alerts and checkpoints hold on it.
    op.add_column("runs", sa.Column("carried_usd", sa.Float(), nullable=True))
    op.add_column("runs", sa.Column("budget_raised_by", sa.String(), nullable=True))
    op.add_column(
        "runs", sa.Column("cloud_budget_removed_at", sa.DateTime(timezone=True), nullable=True)
    )


def downgrade() -> None:
    op.drop_column("runs", "cloud_budget_removed_at")
    op.drop_column("runs", "budget_raised_by")
    op.drop_column("runs", "carried_usd")
