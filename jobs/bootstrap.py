"""The one place that builds real adapters: database, provider, ingest, server, scheduler.

Everything else receives what it needs as arguments. :class:`ControlPlane` is what
``trainbot serve``, ``trainbot shell`` and ``trainbot demo`` run: one process with the
HTTP server (runner ingest, health, metrics, and the Slack app when configured), the
background scheduler and the database.
"""

from __future__ import annotations

import logging
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any

from apscheduler.schedulers.background import BackgroundScheduler

from jobs import alerts
from jobs.db import make_engine, migrate, session_scope
from jobs.deps import Deps, load_secret
from jobs.ingest import IngestService
from jobs.models import Run
from jobs.notify import Journal, Notifier, NullJournal
from jobs.providers import provider_from_settings
from jobs.providers.base import Provider
from jobs.rules import Rule, Signal, default_rules
from jobs.runs import alert_config, alert_target, on_attempt_event, spec_of
from jobs.scheduler import start_scheduler, stop_scheduler
from jobs.server import ControlPlaneApp, CredentialBroker, ServerHandle, serve
from jobs.service import resume_preflights
from jobs.settings import Settings

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIApplication

log = logging.getLogger(__name__)

#: The rules the ingest API evaluates on the runner's stream of metrics.
STREAM_RULES = frozenset({"divergent_loss", "low_utilisation", "disk"})


def build_provider(settings: Settings) -> Provider:
    """The provider the settings name, through the registry (``jobs.providers``)."""
    return provider_from_settings(settings)


def build_credential_broker(settings: Settings) -> CredentialBroker | None:
    """The runners' checkpoint-credential broker: AWS with a storage role, GCP with a
    runner-storage service account; otherwise none (runners use their instance's own)."""
    if settings.provider == "aws" and settings.aws_runner_storage_role_arn:
        from jobs.providers.aws.credentials import StorageCredentialBroker

        return StorageCredentialBroker(
            settings.aws_runner_storage_role_arn,
            region=settings.aws_region,
            endpoint_url=settings.aws_endpoint_url,
        )
    if settings.provider == "gcp" and settings.gcp_runner_storage_service_account:
        from jobs.providers.gcp.credentials import StorageTokenBroker

        return StorageTokenBroker(service_account=settings.gcp_runner_storage_service_account)
    return None


def build_ingest(deps: Deps) -> IngestService:
    """The runner events API, wired to the alert lifecycle and the attempt lifecycle."""

    def rules_for(run: Run) -> list[Rule]:
        # Rules over the runner's metrics only; preemptions, resubmits, heartbeats and
        # budgets are raised once by the lifecycle, the reconcile job and the spend job.
        return [r for r in default_rules(alert_config(spec_of(run))) if r.name in STREAM_RULES]

    def on_signals(run_id: str, signals: list[Signal], now: datetime) -> None:
        if not any(not s.resolved for s in signals) and not _has_open(run_id):
            return
        with session_scope(deps.engine) as session:
            run = session.get(Run, run_id)
            if run is None:
                return
            alerts.process_signals(
                session,
                run=run,
                signals=signals,
                now=now,
                target=alert_target(run),
                notifier=deps.notifier,
                journal=deps.journal,
            )

    def _has_open(run_id: str) -> bool:
        with session_scope(deps.engine) as session:
            return bool(alerts.open_alerts(session, run_id=run_id))

    def on_event(attempt_id: str, type_: str, data: dict[str, Any]) -> None:
        on_attempt_event(deps, attempt_id, type_, data)

    return IngestService(
        deps.engine,
        rules_for=rules_for,
        on_signals=on_signals,
        on_attempt_event=on_event,
        now=deps.clock,
    )


class ControlPlane:
    """The whole control plane in one process; use it as a context manager."""

    def __init__(
        self,
        settings: Settings,
        *,
        notifier: Notifier,
        journal: Journal | None = None,
        provider: Provider | None = None,
        scheduler: bool = True,
        scheduler_intervals: dict[str, float] | None = None,
        extra_apps: dict[str, WSGIApplication] | None = None,
    ) -> None:
        self.settings = settings
        engine = make_engine(settings.database_url)
        migrate(engine)
        self.deps = Deps(
            settings=settings,
            engine=engine,
            provider=provider or build_provider(settings),
            notifier=notifier,
            journal=journal or NullJournal(),
            secret=load_secret(settings.state_dir),
        )
        self.ingest = build_ingest(self.deps)
        self.app = ControlPlaneApp(
            engine, self.ingest, credentials=build_credential_broker(settings)
        )
        for prefix, app in (extra_apps or {}).items():
            self.app.mount(prefix, app)
        self._want_scheduler = scheduler
        self._intervals = scheduler_intervals
        self.server: ServerHandle | None = None
        self.scheduler: BackgroundScheduler | None = None

    def start(self) -> ControlPlane:
        self.server = serve(self.app, self.settings.ingest_host, self.settings.ingest_port)
        public = self.settings.public_url or self.server.url
        self.deps.ingest_url = public.rstrip("/") + "/v1/events"
        resumed = resume_preflights(self.deps)
        if resumed:
            log.warning("preflight interrupted by a restart, running again: %s", resumed)
        if self._want_scheduler:
            self.scheduler = start_scheduler(self.deps, intervals=self._intervals)
        log.info("control plane listening on %s", self.server.url)
        return self

    def close(self) -> None:
        if self.scheduler is not None:
            stop_scheduler(self.scheduler)
            self.scheduler = None
        self.deps.close()
        if self.server is not None:
            self.server.shutdown()
            self.server = None
        self.deps.provider.close()
        self.deps.engine.dispose()

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
