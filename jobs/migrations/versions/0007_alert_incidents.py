"""Alerts reopen, join incidents, detect flapping and can stop a diverging run.

``alerts.members`` holds the signals joined in one alert (a loss spike and a rising
trend are one divergence); ``reopened``, ``flap_since``, ``flaps`` and
``flapping_since`` count an alert that resolves and fires again within the quiet
period; ``began_step``, ``stop_at``, ``stopped_at`` and ``resume_step`` let trainbot
stop a run nobody looks after and offer the checkpoint from before the problem began.
Existing alerts have none of it (NULL, or 0 for the counts).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_DATETIMES = ("flap_since", "flapping_since", "stop_at", "stopped_at")
_COUNTS = ("reopened", "flaps")
_STEPS = ("began_step", "resume_step")


def upgrade() -> None:
    # Plain ADD/DROP COLUMN, as in 0005: a batch copy of a table the others point at
    # would trip their foreign keys.
    op.add_column("alerts", sa.Column("members", sa.JSON(), nullable=True))
    for name in _COUNTS:
        op.add_column("alerts", sa.Column(name, sa.Integer(), nullable=False, server_default="0"))
    for name in _DATETIMES:
        op.add_column("alerts", sa.Column(name, sa.DateTime(timezone=True), nullable=True))
    for name in _STEPS:
        op.add_column(
            "alerts",
            sa.Column(name, sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        )


def downgrade() -> None:
    for name in (*_STEPS, *_DATETIMES, *_COUNTS, "members"):
        op.drop_column("alerts", name)
