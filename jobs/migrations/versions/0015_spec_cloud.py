"""A stored spec's ``resources.cloud`` names the provider its run is really on.

Before, ``resources.cloud`` defaulted to ``local`` and was ignored: every run went to
the one configured provider. Now it picks a provider, and a spec without it runs on the
default one. So each stored spec's cloud becomes what it always was in effect: the
provider of the run's latest attempt, or, for a run without one, nothing (the default
provider, where the old code would have put it).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_runs = sa.table("runs", sa.column("id", sa.String()), sa.column("spec", sa.JSON()))
_attempts = sa.table(
    "attempts",
    sa.column("run_id", sa.String()),
    sa.column("number", sa.Integer()),
    sa.column("provider", sa.String()),
)


def upgrade() -> None:
    bind = op.get_bind()
    launched_on: dict[str, str] = {}
    for run_id, provider in bind.execute(
        sa.select(_attempts.c.run_id, _attempts.c.provider).order_by(_attempts.c.number)
    ):
        launched_on[run_id] = provider  # the latest attempt's wins
    for run_id, spec in bind.execute(sa.select(_runs.c.id, _runs.c.spec)).all():
        if not isinstance(spec, dict) or not isinstance(spec.get("resources"), dict):
            continue
        resources: dict[str, Any] = dict(spec["resources"])
        cloud = launched_on.get(run_id)
        if resources.get("cloud") == cloud:
            continue
        if cloud is None:
            resources.pop("cloud", None)
        else:
            resources["cloud"] = cloud
        bind.execute(
            sa.update(_runs)
            .where(_runs.c.id == run_id)
            .values(spec={**spec, "resources": resources})
        )


def downgrade() -> None:
    pass  # the old code ignores resources.cloud
