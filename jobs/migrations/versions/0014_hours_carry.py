"""A resubmitted run carries the hours its instances ran, as it carries their spend.

``runs.carried_hours`` is what the runs a resubmit continues had run, so the new run's
``max_hours`` counts it. Existing runs carry nothing (NULL).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMN, as in 0005 and 0006 (a batch copy of ``runs`` trips foreign keys).
    op.add_column("runs", sa.Column("carried_hours", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "carried_hours")
