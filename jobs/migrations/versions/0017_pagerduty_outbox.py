"""PagerDuty events are queued in the database: ``pagerduty_outbox``.

A replica used to hold them in memory and lose them when it died; each is now a row
written before it is sent, claimed by one replica at a time and adopted by another when
its owner stops renewing the claim (:mod:`jobs.outbound.pagerduty`). A new table; nothing
existing changes, so the previous release runs on this schema.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "pagerduty_outbox",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("action", sa.String(), nullable=False),
        sa.Column("alert_id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("owner_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tries", sa.Integer(), nullable=False),
        sa.Column("next_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("done_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("outcome", sa.String(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pagerduty_outbox")),
    )
    for column in ("alert_id", "owner_until", "done_at"):
        op.create_index(
            op.f(f"ix_pagerduty_outbox_{column}"), "pagerduty_outbox", [column], unique=False
        )


def downgrade() -> None:
    for column in ("alert_id", "owner_until", "done_at"):
        op.drop_index(op.f(f"ix_pagerduty_outbox_{column}"), table_name="pagerduty_outbox")
    op.drop_table("pagerduty_outbox")
