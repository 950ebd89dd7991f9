"""A run's checkpoint directory is a column that trainbot alone writes.

Before, a run that resumes another run's checkpoints carried that run's id in its spec's
``env.TRAINBOT_CHECKPOINT_PREFIX``, where a chat override could set it too and point the
run (and its cleanup) at anyone's checkpoints. ``runs.checkpoint_prefix`` holds it now;
NULL means the run's own id. The upgrade moves the value out of the stored specs of the
runs that have one when it is a run id (the only value trainbot ever wrote), and drops
the variable from every stored spec; the downgrade puts it back.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_VARIABLE = "TRAINBOT_CHECKPOINT_PREFIX"
_RUN_ID = re.compile(r"r-[a-z0-9]{1,64}")

_runs = sa.table(
    "runs",
    sa.column("id", sa.String()),
    sa.column("spec", sa.JSON()),
    sa.column("checkpoint_prefix", sa.String()),
)


def upgrade() -> None:
    # A plain ADD/DROP COLUMN: SQLite has both (3.35+), and a batch copy of ``runs`` would
    # trip the foreign keys that attempts, alerts and checkpoints hold on it.
    op.add_column("runs", sa.Column("checkpoint_prefix", sa.String(), nullable=True))
    bind = op.get_bind()
    for run_id, spec in bind.execute(sa.select(_runs.c.id, _runs.c.spec)).all():
        env: dict[str, Any] = dict((spec or {}).get("env") or {})
        if _VARIABLE not in env:
            continue
        value = str(env.pop(_VARIABLE))
        prefix = value if _RUN_ID.fullmatch(value) else None
        bind.execute(
            _runs.update()
            .where(_runs.c.id == run_id)
            .values(spec={**spec, "env": env}, checkpoint_prefix=prefix)
        )


def downgrade() -> None:
    bind = op.get_bind()
    rows = bind.execute(
        sa.select(_runs.c.id, _runs.c.spec, _runs.c.checkpoint_prefix).where(
            _runs.c.checkpoint_prefix.is_not(None)
        )
    ).all()
    for run_id, spec, prefix in rows:
        env = {**((spec or {}).get("env") or {}), _VARIABLE: prefix}
        bind.execute(_runs.update().where(_runs.c.id == run_id).values(spec={**spec, "env": env}))
    op.drop_column("runs", "checkpoint_prefix")
