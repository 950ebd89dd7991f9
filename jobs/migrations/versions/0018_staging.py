"""Staging copies: ``staging``, one row per dataset copied into a region's bucket.

Each row is its copy's whole state (the last object finished, the object in progress
with its multipart upload id or rewrite token and the parts copied), so a copy resumes
after a restart (:mod:`jobs.staging`). A new table; nothing existing changes, so the
previous release runs on this schema.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BIG = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "staging",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("source", sa.String(), nullable=False),
        sa.Column("target", sa.String(), nullable=False),
        sa.Column("region", sa.String(), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("requested_by", sa.String(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=True),
        sa.Column("channel", sa.String(), nullable=True),
        sa.Column("thread_ts", sa.String(), nullable=True),
        sa.Column("message_ts", sa.String(), nullable=True),
        sa.Column("total_objects", sa.Integer(), nullable=False),
        sa.Column("total_bytes", _BIG, nullable=False),
        sa.Column("objects_done", sa.Integer(), nullable=False),
        sa.Column("bytes_done", _BIG, nullable=False),
        sa.Column("after_key", sa.String(), nullable=True),
        sa.Column("current_key", sa.String(), nullable=True),
        sa.Column("upload_id", sa.String(), nullable=True),
        sa.Column("parts", sa.JSON(), nullable=False),
        sa.Column("part_copies", sa.Integer(), nullable=False),
        sa.Column("usd", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error", sa.String(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_staging")),
    )
    for column in ("source", "state", "run_id"):
        op.create_index(op.f(f"ix_staging_{column}"), "staging", [column], unique=False)


def downgrade() -> None:
    for column in ("source", "state", "run_id"):
        op.drop_index(op.f(f"ix_staging_{column}"), table_name="staging")
    op.drop_table("staging")
