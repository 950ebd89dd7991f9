"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
${imports if imports else ""}

revision: str = ${repr(up_revision)}
down_revision: str | None = ${repr(down_revision)}
branch_labels: str | Sequence[str] | None = ${repr(branch_labels)}
depends_on: str | Sequence[str] | None = ${repr(depends_on)}
#: True only when this migration adds and changes nothing an older release reads or
#: writes (a new table, a nullable column, an index): then that release runs on the
#: schema it leaves (jobs.database.db.serves_from). A drop, rename or type change is False, and
#: belongs in a later release than the one that stopped using what it removes.
expand_only: bool = False


def upgrade() -> None:
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    ${downgrades if downgrades else "pass"}
