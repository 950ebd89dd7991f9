"""Alembic migrations for the control plane's database; run them with ``jobs.db.migrate``."""
