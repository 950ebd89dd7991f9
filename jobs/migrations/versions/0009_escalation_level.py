"""Escalation has levels: alerts count the pages they have sent.

``alerts.escalation_level`` is the number of escalation pages an unacknowledged
critical alert has sent: the on-call first, then the second level, then repeats at the
last level up to a cap. ``escalated_at`` is when the latest page went out. An alert
escalated before this revision paged once, so it starts at 1; the others at 0.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_alerts = sa.table(
    "alerts",
    sa.column("escalated_at", sa.DateTime(timezone=True)),
    sa.column("escalation_level", sa.Integer()),
)


def upgrade() -> None:
    # A plain ADD/DROP COLUMN, as in 0005 and 0007.
    op.add_column(
        "alerts",
        sa.Column("escalation_level", sa.Integer(), nullable=False, server_default="0"),
    )
    op.get_bind().execute(
        _alerts.update().where(_alerts.c.escalated_at.is_not(None)).values(escalation_level=1)
    )


def downgrade() -> None:
    op.drop_column("alerts", "escalation_level")
