"""Initial schema: every table of jobs/database/models.py.

Drafted with Alembic's autogenerate, then reviewed: the types are plain SQLAlchemy ones
(VARCHAR(32) for states, timezone-aware DATETIME, portable JSON) so this file never
changes when the application's column helpers do.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "budgets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("scope", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("usd", sa.Float(), nullable=False),
        sa.Column("period", sa.String(), nullable=False),
        sa.Column("thresholds", sa.JSON(), nullable=False),
        sa.Column("alerted", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_budgets")),
        sa.UniqueConstraint("scope", "name", name=op.f("uq_budgets_scope_name")),
    )
    op.create_table(
        "command_log",
        sa.Column("key", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_command_log")),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("spec_name", sa.String(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("reason", sa.String(), nullable=True),
        sa.Column("requester", sa.String(), nullable=False),
        sa.Column("channel", sa.String(), nullable=True),
        sa.Column("thread_ts", sa.String(), nullable=True),
        sa.Column("checkpoint_uri", sa.String(), nullable=True),
        sa.Column("budget_usd", sa.Float(), nullable=True),
        sa.Column("target_steps", sa.Integer(), nullable=True),
        sa.Column("last_step", sa.Integer(), nullable=True),
        sa.Column("last_committed_step", sa.Integer(), nullable=True),
        sa.Column("preemptions", sa.Integer(), nullable=False),
        sa.Column("idempotency_key", sa.String(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_runs_idempotency_key")),
    )
    op.create_index(op.f("ix_runs_channel"), "runs", ["channel"], unique=False)
    op.create_index(op.f("ix_runs_requester"), "runs", ["requester"], unique=False)
    op.create_index(op.f("ix_runs_spec_name"), "runs", ["spec_name"], unique=False)
    op.create_index(op.f("ix_runs_state"), "runs", ["state"], unique=False)

    op.create_table(
        "scheduler_leases",
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("holder", sa.String(), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_scheduler_leases")),
    )
    op.create_table(
        "alerts",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=True),
        sa.Column("rule", sa.String(), nullable=False),
        sa.Column("key", sa.String(), nullable=False),
        sa.Column("dedupe_key", sa.String(), nullable=True),
        sa.Column("severity", sa.String(length=32), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("title", sa.String(), nullable=False),
        sa.Column("detail", sa.String(), nullable=False),
        sa.Column("hint", sa.String(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("acked_by", sa.String(), nullable=True),
        sa.Column("acked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("snoozed_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("escalated_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("message_channel", sa.String(), nullable=True),
        sa.Column("message_ts", sa.String(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_alerts_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alerts")),
        sa.UniqueConstraint("dedupe_key", name=op.f("uq_alerts_dedupe_key")),
    )
    op.create_index(op.f("ix_alerts_run_id"), "alerts", ["run_id"], unique=False)
    op.create_index(op.f("ix_alerts_state"), "alerts", ["state"], unique=False)

    op.create_table(
        "attempts",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("provider", sa.String(), nullable=False),
        sa.Column("region", sa.String(), nullable=True),
        sa.Column("zone", sa.String(), nullable=True),
        sa.Column("instance_type", sa.String(), nullable=True),
        sa.Column("instance_id", sa.String(), nullable=True),
        sa.Column("spot", sa.Boolean(), nullable=False),
        sa.Column("instances", sa.Integer(), nullable=False),
        sa.Column("price_per_hour", sa.Float(), nullable=True),
        sa.Column("token_hash", sa.String(), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("end_reason", sa.String(), nullable=True),
        sa.Column("last_heartbeat", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_step", sa.Integer(), nullable=True),
        sa.Column("last_seq", sa.Integer(), nullable=True),
        sa.Column("preemption_notice_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_attempts_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempts")),
        sa.UniqueConstraint("run_id", "number", name=op.f("uq_attempts_run_id_number")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_attempts_token_hash")),
    )
    op.create_index(op.f("ix_attempts_instance_id"), "attempts", ["instance_id"], unique=False)
    op.create_index(op.f("ix_attempts_run_id"), "attempts", ["run_id"], unique=False)
    op.create_index(op.f("ix_attempts_state"), "attempts", ["state"], unique=False)

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("attempt_id", sa.String(), nullable=True),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("uri", sa.String(), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("committed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["attempt_id"], ["attempts.id"], name=op.f("fk_checkpoints_attempt_id_attempts")
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_checkpoints_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("run_id", "step", name=op.f("uq_checkpoints_run_id_step")),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("attempt_id", sa.String(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("type", sa.String(), nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["attempt_id"], ["attempts.id"], name=op.f("fk_events_attempt_id_attempts")
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_events_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
        sa.UniqueConstraint("attempt_id", "seq", name=op.f("uq_events_attempt_id_seq")),
    )
    op.create_index(
        op.f("ix_events_run_id_type_time"), "events", ["run_id", "type", "time"], unique=False
    )

    op.create_table(
        "spend_records",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("attempt_id", sa.String(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("period_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("period_end", sa.DateTime(timezone=True), nullable=False),
        sa.Column("usd", sa.Float(), nullable=False),
        sa.Column("instances", sa.Integer(), nullable=False),
        sa.Column("price_per_hour", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["attempt_id"], ["attempts.id"], name=op.f("fk_spend_records_attempt_id_attempts")
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_spend_records_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_spend_records")),
        sa.UniqueConstraint(
            "attempt_id", "period_start", name=op.f("uq_spend_records_attempt_id_period_start")
        ),
    )
    op.create_index(
        op.f("ix_spend_records_period_end"), "spend_records", ["period_end"], unique=False
    )
    op.create_index(op.f("ix_spend_records_run_id"), "spend_records", ["run_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_spend_records_run_id"), table_name="spend_records")
    op.drop_index(op.f("ix_spend_records_period_end"), table_name="spend_records")

    op.drop_table("spend_records")
    op.drop_index(op.f("ix_events_run_id_type_time"), table_name="events")

    op.drop_table("events")
    op.drop_table("checkpoints")
    op.drop_index(op.f("ix_attempts_state"), table_name="attempts")
    op.drop_index(op.f("ix_attempts_run_id"), table_name="attempts")
    op.drop_index(op.f("ix_attempts_instance_id"), table_name="attempts")

    op.drop_table("attempts")
    op.drop_index(op.f("ix_alerts_state"), table_name="alerts")
    op.drop_index(op.f("ix_alerts_run_id"), table_name="alerts")

    op.drop_table("alerts")
    op.drop_table("scheduler_leases")
    op.drop_index(op.f("ix_runs_state"), table_name="runs")
    op.drop_index(op.f("ix_runs_spec_name"), table_name="runs")
    op.drop_index(op.f("ix_runs_requester"), table_name="runs")
    op.drop_index(op.f("ix_runs_channel"), table_name="runs")

    op.drop_table("runs")
    op.drop_table("command_log")
    op.drop_table("budgets")
