"""The one place that builds real adapters: database, provider, ingest, server, scheduler.

Everything else receives what it needs as arguments. :class:`ControlPlane` is what
``trainbot serve``, ``trainbot shell`` and ``trainbot demo`` run: one process with the
HTTP server (runner ingest, health, metrics, and the Slack app when configured), the
background scheduler and the database.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from apscheduler.schedulers.background import BackgroundScheduler
from sqlalchemy import Engine

from jobs import alerts
from jobs.background.scheduler import LeaderElector
from jobs.database.db import make_engine, migrate, session_scope
from jobs.database.models import Run
from jobs.domain.errors import SettingsError
from jobs.ingest import IngestService
from jobs.ingest.auth import check_secret
from jobs.outbound.notify import FanoutJournal, Journal, Notifier, NullJournal
from jobs.outbound.pagerduty import EventsClient, PagerDutyBridge
from jobs.process.deps import Deps, load_secret
from jobs.process.settings import Settings
from jobs.providers import (
    credential_broker_from_settings,
    providers_from_settings,
)
from jobs.providers.base import Provider
from jobs.rules import Signal
from jobs.runs import on_attempt_event, raise_signals
from jobs.runs.end import project_then_stop
from jobs.runs.start import resume_preflights
from jobs.staging import work as _staging  # noqa: F401  (binds Later.STAGING)
from jobs.web.prometheus import ControlPlaneMetrics
from jobs.web.server import ControlPlaneApp, CredentialBroker, ServerHandle, serve

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIApplication

log = logging.getLogger(__name__)


def build_providers(
    settings: Settings, *, default: Provider | None = None, built: Sequence[Provider] = ()
) -> dict[str, Provider]:
    """Every provider the settings configure (``TRAINBOT_PROVIDERS`` and
    ``TRAINBOT_PROVIDER``), the default first; ``default`` and ``built`` ones (a test's)
    are used as they are, ``default`` in place of ``TRAINBOT_PROVIDER``'s."""
    return providers_from_settings(settings, default=default, built=built)


def build_credential_broker(settings: Settings) -> CredentialBroker | None:
    """The runners' checkpoint-credential broker, when the provider has one and the
    settings enable it (``TRAINBOT_AWS_RUNNER_STORAGE_ROLE_ARN``,
    ``TRAINBOT_GCP_RUNNER_STORAGE_SERVICE_ACCOUNT``); otherwise none, and runners use
    their instance's own credentials."""
    broker: CredentialBroker | None = credential_broker_from_settings(settings)
    return broker


def build_pager(settings: Settings, engine: Engine) -> PagerDutyBridge | None:
    """The PagerDuty bridge when ``TRAINBOT_PAGERDUTY_ROUTING_KEY`` is set: it hears the
    alerts' escalations, acknowledgements and resolutions in the journal."""
    if settings.pagerduty_routing_key is None:
        return None
    client = EventsClient(
        settings.pagerduty_routing_key.get_secret_value(), url=settings.pagerduty_url
    )
    return PagerDutyBridge(client, engine=engine, source=settings.public_url or "trainbot")


def build_ingest(deps: Deps) -> IngestService:
    """The runner events API, wired to the alert lifecycle and the attempt lifecycle."""

    def on_signals(run_id: str, signals: list[Signal], now: datetime) -> None:
        if not any(not s.resolved for s in signals) and not _has_open(run_id):
            return
        with session_scope(deps.engine) as session:
            run = session.get(Run, run_id)
            if run is None:
                return
            raise_signals(deps, session, run, signals, now=now)

    def _has_open(run_id: str) -> bool:
        with session_scope(deps.engine) as session:
            return bool(alerts.open_alerts(session, run_id=run_id))

    def on_event(attempt_id: str, type_: str, data: dict[str, Any]) -> None:
        on_attempt_event(deps, attempt_id, type_, data)

    def on_profile_due(attempt_id: str) -> None:
        # Off the request thread: a projection past the budget stops the run, and the
        # runner whose batch ended the window waits for this request's answer.
        deps.background(project_then_stop, deps, attempt_id)

    return IngestService(
        deps.engine,
        on_signals=on_signals,
        on_attempt_event=on_event,
        on_profile_due=on_profile_due,
        now=deps.clock,
        attempt_token=deps.runner_token,
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
        providers: Sequence[Provider] = (),
        scheduler: bool = True,
        scheduler_intervals: dict[str, float] | None = None,
        extra_apps: dict[str, WSGIApplication] | None = None,
        lease_s: float | None = None,
        lease_holder: str | None = None,
    ) -> None:
        """``lease_s``: how long the scheduler lease lasts unless renewed (a dead leader
        is replaced within it; default: ``TRAINBOT_SCHEDULER_LEASE_S``); ``lease_holder``:
        this replica's name on the lease (default: one per process; tests running
        several replicas in one process give each its own); ``provider``, ``providers``:
        providers built already (a test's), used instead of building them from the
        settings (``provider`` is the default one)."""
        self.settings = settings
        engine = make_engine(settings.database_url)
        migrate(engine)
        base_journal = journal or NullJournal()
        pager = build_pager(settings, engine)
        configured = build_providers(settings, default=provider, built=providers)
        self.deps = Deps(
            settings=settings,
            engine=engine,
            provider=next(iter(configured.values())),
            providers=configured,
            notifier=notifier,
            journal=FanoutJournal(base_journal, pager) if pager is not None else base_journal,
            secret=load_secret(settings.state_dir),
            pager=pager,
            # A claim on deferred work outlives its replica as long as two leases.
            hold_s=2 * (settings.scheduler_lease_s if lease_s is None else lease_s),
        )
        if lease_holder is not None:
            self.deps.replica = lease_holder
        try:  # beside replicas that sign runner tokens with another secret: refuse
            check_secret(
                engine, self.deps.runner_token, replica=self.deps.replica, now=self.deps.clock()
            )
        except SettingsError:
            engine.dispose()
            raise
        self.ingest = build_ingest(self.deps)
        broker = build_credential_broker(settings)
        # Runners ask it for their checkpoint credentials only when there is one.
        self.deps.store_credentials = broker is not None
        metrics = ControlPlaneMetrics(engine, holder=lease_holder)
        self.app = ControlPlaneApp(engine, self.ingest, credentials=broker, metrics=metrics)
        for prefix, app in (extra_apps or {}).items():
            self.app.mount(prefix, app)
        self._want_scheduler = scheduler
        self._intervals = scheduler_intervals
        self._lease_s = settings.scheduler_lease_s if lease_s is None else lease_s
        self._lease_holder = lease_holder
        self.server: ServerHandle | None = None
        #: Takes the scheduler lease; runs the scheduler while this replica leads.
        self.elector: LeaderElector | None = None

    def start(self) -> ControlPlane:
        self.server = serve(
            self.app,
            self.settings.ingest_host,
            self.settings.ingest_port,
            admin_host=self.settings.admin_host,
            admin_port=self.settings.admin_port,
            request_deadline_s=self.settings.request_deadline_s,
            max_connections_per_client=self.settings.max_connections_per_client,
        )
        public = self.settings.public_url or self.server.url
        self.deps.ingest_url = public.rstrip("/") + "/v1/events"
        resumed = resume_preflights(self.deps)
        if resumed:
            log.warning("preflight interrupted by a restart, running again: %s", resumed)
        if self._want_scheduler:
            elector = LeaderElector(
                self.deps,
                lease_s=self._lease_s,
                intervals=self._intervals,
                on_scheduler=self.app.metrics.watch_scheduler,
                holder=self._lease_holder,
            )
            self.elector = elector.start()
        log.info("control plane listening on %s", self.server.url)
        return self

    @property
    def scheduler(self) -> BackgroundScheduler | None:
        """The running scheduler while this replica leads, else None."""
        return self.elector.scheduler if self.elector is not None else None

    def close(self) -> None:
        if self.elector is not None:
            # Waits for the jobs running, then hands the lease over at once.
            self.elector.stop(release=True)
            self.elector = None
        self.deps.close()
        if self.server is not None:
            self.server.shutdown()
            self.server = None
        self.deps.close_providers()
        self.deps.engine.dispose()

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
