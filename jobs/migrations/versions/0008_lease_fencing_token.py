"""The scheduler lease carries a fencing token.

``scheduler_leases.token`` rises by one each time the lease changes holder. The leader's
scheduled launches and terminations carry the token they started under and check it is
still current before they call the provider, so a deposed leader's late call is refused.
An existing lease starts at 0; the next change of holder makes it 1.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A plain ADD COLUMN, as in 0005.
    op.add_column(
        "scheduler_leases",
        sa.Column(
            "token",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            nullable=False,
            server_default="0",
        ),
    )


def downgrade() -> None:
    op.drop_column("scheduler_leases", "token")
