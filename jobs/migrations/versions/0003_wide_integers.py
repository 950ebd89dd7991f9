"""Sequence numbers, steps and checkpoint sizes become 64-bit integers.

They were INTEGER, which is 32-bit on PostgreSQL: a 3 GiB checkpoint's size, or a step
or an event sequence number past 2,147,483,647, did not fit. They are BIGINT now.

SQLite's INTEGER already holds 64 bits, and the models declare these columns as
``BigInteger().with_variant(Integer(), "sqlite")``, so there is nothing to change on
SQLite. Nothing is changed there on purpose: batch mode would rebuild each table (copy,
drop, rename), and with foreign keys enforced SQLite refuses to drop ``runs`` or
``attempts`` while other tables reference their rows, so the upgrade would fail on
every database that has a run in it.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: table -> (column, nullable) of every column widened here.
WIDENED: dict[str, tuple[tuple[str, bool], ...]] = {
    "runs": (("target_steps", True), ("last_step", True), ("last_committed_step", True)),
    "attempts": (
        ("last_step", True),
        ("last_seq", True),
        ("resumed_from_step", True),
        ("lost_steps", False),
    ),
    "events": (("seq", False),),
    "checkpoints": (("step", False), ("bytes", False)),
}


def _alter(old: sa.types.TypeEngine[int], new: sa.types.TypeEngine[int]) -> None:
    if op.get_context().dialect.name == "sqlite":
        return  # INTEGER is 64-bit there already; see the module docstring
    for table, columns in WIDENED.items():
        with op.batch_alter_table(table) as batch:
            for name, nullable in columns:
                batch.alter_column(name, type_=new, existing_type=old, existing_nullable=nullable)


def upgrade() -> None:
    _alter(sa.Integer(), sa.BigInteger())


def downgrade() -> None:
    # Fails, and changes nothing, if a value no longer fits in 32 bits.
    _alter(sa.BigInteger(), sa.Integer())
