"""Alembic environment: runs the migrations on the connection ``jobs.database.db`` hands over.

There is no ``alembic.ini``: :func:`jobs.database.db.alembic_config` builds the configuration
and puts an open connection in ``config.attributes["connection"]``. Offline mode
(``--sql``) renders SQL for the URL in the ``sqlalchemy.url`` option instead.
"""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

import jobs.database.models  # registers the tables on SQLModel.metadata
import jobs.database.replica_tables  # noqa: F401  (and the replicas' own)
from jobs.staging import models as _staging  # noqa: F401  (and the staging copies')

config = context.config
target_metadata = SQLModel.metadata


def run_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        raise RuntimeError(
            "jobs/migrations needs an open connection: "
            "run them with jobs.database.db.migrate(engine)"
        )
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        # SQLite cannot ALTER most things; batch mode recreates the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
