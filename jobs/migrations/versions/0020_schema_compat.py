"""Which releases the schema serves: ``schema_compat``, one row.

Expand, then contract: a migration that only adds (a table, a nullable column, an
index) declares ``expand_only = True``, and the code that migrates writes here the
oldest revision whose release still runs on the schema (:func:`jobs.database.db.serves_from`).
A release rolled back onto a newer schema reads the row instead of refusing the
revision it does not know. A new table; nothing existing changes.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
#: Only adds: the release before this one runs on the schema it leaves.
expand_only: bool = True


def upgrade() -> None:
    op.create_table(
        "schema_compat",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("head", sa.String(), nullable=False),
        sa.Column("serves_from", sa.String(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("schema_compat")
