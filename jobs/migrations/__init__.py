"""Alembic migrations for the control plane's database.

Run them with ``jobs.database.db.migrate``.
"""
