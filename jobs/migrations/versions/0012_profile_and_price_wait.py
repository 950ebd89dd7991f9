"""A run may wait for a price, and its first attempt is profiled before it goes on.

``runs.price_wait``: while a run waits for spot capacity at or below
``resubmit.max_price``, the limit, the price last seen and where (the scheduled price
job launches it once the price is met); NULL when it is not waiting.
``runs.projection``: the projection made from the profiled start of the run (hours,
cost, finish, preemptions) and, once a person answered the question it asked, who
chose what; a run that has one is not profiled again.
``attempts.profile_until_step`` and ``attempts.profile_until_s``: where the attempt's
profile window ends (a step, seconds after launch); ``attempts.profiled_at``: when the
ingest API saw it end, so the projection is made once.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BIG_INT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    # Plain ADD COLUMNs of nullable columns, as in 0005 and 0007.
    op.add_column("runs", sa.Column("price_wait", sa.JSON(), nullable=True))
    op.add_column("runs", sa.Column("projection", sa.JSON(), nullable=True))
    op.add_column("attempts", sa.Column("profile_until_step", _BIG_INT, nullable=True))
    op.add_column("attempts", sa.Column("profile_until_s", sa.Float(), nullable=True))
    op.add_column("attempts", sa.Column("profiled_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("attempts", "profiled_at")
    op.drop_column("attempts", "profile_until_s")
    op.drop_column("attempts", "profile_until_step")
    op.drop_column("runs", "projection")
    op.drop_column("runs", "price_wait")
