"""Attempts remember the spot price beside the price they pay.

``attempts.spot_price_per_hour`` is the spot price of the attempt's request when it was
priced (at launch, refreshed with ``price_per_hour``). For an on-demand attempt the
difference is the on-demand premium, one of the badput categories of the digest and the
final summary. Attempts from before this revision have none: their premium is unknown.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A plain ADD/DROP COLUMN, as in 0005, 0007 and 0009.
    op.add_column("attempts", sa.Column("spot_price_per_hour", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("attempts", "spot_price_per_hour")
