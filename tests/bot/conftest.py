"""The database fixtures of ``tests/jobs`` (``db_engine``: SQLite, and PostgreSQL when
``TRAINBOT_TEST_POSTGRES_URL`` is set), for the Slack outbox's tests."""

from tests.jobs.conftest import db_engine, empty_engine

__all__ = ["db_engine", "empty_engine"]
