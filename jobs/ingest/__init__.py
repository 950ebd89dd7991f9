"""The runner events API: :class:`IngestService` takes a runner's batch of events, stores
it once, applies its effects on the attempt and run, and evaluates the alert rules.

Modules: :mod:`~jobs.ingest.auth` (tokens), :mod:`~jobs.ingest.writers` (SQLite and
PostgreSQL inserts), :mod:`~jobs.ingest.effects` (attempt and run updates),
:mod:`~jobs.ingest.windows` (the rules' windows), :mod:`~jobs.ingest.service`. The design
is in ``docs/architecture.md``, section "Ingest".
"""

from jobs.ingest.service import LIFECYCLE_EVENTS, IngestResult, IngestService
from jobs.ingest.windows import RECENT_OBS, WINDOW_MAX_OBS, WINDOW_SPAN_S

__all__ = [
    "LIFECYCLE_EVENTS",
    "RECENT_OBS",
    "WINDOW_MAX_OBS",
    "WINDOW_SPAN_S",
    "IngestResult",
    "IngestService",
]
