"""The control plane's Prometheus metrics, served at ``/metrics`` by :mod:`jobs.web.server`.

Each :class:`ControlPlaneMetrics` owns a ``CollectorRegistry`` of its own (never the
library's global default registry), so a test process with several control planes, or a
benchmark next to one, never mixes their series. Three kinds of source feed it:

- **Counted as it happens:** ingest events, batches and latency (the HTTP route records
  each batch), and the scheduler's job runs, failures and lag (an APScheduler listener,
  :meth:`ControlPlaneMetrics.watch_scheduler`). Their label is ``task``, not ``job``,
  which Prometheus reserves for the scrape target.
- **Read from the database at scrape time** (:class:`DatabaseCollector`): runs by
  state, attempts, preemptions and resubmits, spend and goodput per run and per
  channel, budget share, alerts and escalations, and whether this replica holds the
  scheduler lease. The database is the truth every replica shares, so each replica
  reports the same figures (aggregate with ``max``, not ``sum``), and a restart loses
  nothing. A scrape costs a handful of aggregate queries.
- **About this process:** ``trainbot_build_info`` (1, labelled with the ``version`` and
  the ``python`` it runs on, so a dashboard shows which release each replica runs), and
  ``prometheus_client``'s process collector: ``process_resident_memory_bytes``,
  ``process_open_fds`` (and ``_max_fds``), ``process_cpu_seconds_total``,
  ``process_start_time_seconds`` (read from ``/proc``: Linux only; elsewhere absent),
  with ``python_info``.
- **Asked of the Slack post queue** at scrape time, through the small
  :class:`PostQueue` interface (``bot.slack_notifier.SlackNotifier`` has it), so
  ``jobs/`` never imports ``bot/``: :meth:`ControlPlaneMetrics.watch_post_queue`.

Per-run series (spend, goodput, budget share) exist for runs that are active or ended
within :data:`RECENT_RUN_S`, so their number follows the runs in flight, not the history.
Channel totals are counters over every run: ``increase()`` gives spend over any window,
and ``1 - increase(lost) / increase(paid)`` goodput over it. The metric names are the
contract of ``deploy/prometheus/alerts.yaml`` and ``deploy/grafana/trainbot.json``.
"""

from __future__ import annotations

import importlib.metadata
import logging
import platform
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Protocol

from apscheduler.events import (
    EVENT_JOB_ERROR,
    EVENT_JOB_EXECUTED,
    EVENT_JOB_MISSED,
    EVENT_JOB_SUBMITTED,
    JobExecutionEvent,
    JobSubmissionEvent,
    SchedulerEvent,
)
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Connection, Engine, func, or_, select

from jobs.database.models import (
    Alert,
    AlertState,
    Attempt,
    Budget,
    Run,
    SpendRecord,
    table_of,
    utcnow,
)
from jobs.database.replica_tables import LEADER_LEASE, SchedulerLease
from jobs.domain.lifecycle import AttemptState, RunState
from jobs.domain.severity import Severity

if TYPE_CHECKING:
    from apscheduler.schedulers.base import BaseScheduler

__all__ = [
    "LATENCY_BUCKETS",
    "RECENT_RUN_S",
    "ControlPlaneMetrics",
    "DatabaseCollector",
    "PostQueue",
]

log = logging.getLogger(__name__)

#: Upper bounds of the ingest latency histogram, in seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: Upper bounds of the scheduler lag histogram (fire time → submitted), in seconds.
LAG_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 3600.0)
#: A finished run keeps its per-run series this long after it ended.
RECENT_RUN_S = 24 * 3600.0

_RUNS = table_of(Run)
_ATTEMPTS = table_of(Attempt)
_ALERTS = table_of(Alert)
_SPEND = table_of(SpendRecord)
_BUDGETS = table_of(Budget)
_LEASES = table_of(SchedulerLease)
_ACTIVE_RUN_STATES = [s for s in RunState if not s.is_terminal()]


class PostQueue(Protocol):
    """What a chat notifier with an outgoing queue tells the metrics (SlackNotifier)."""

    def queue_depths(self) -> Mapping[str, int]:
        """Messages waiting (queued or in flight) per channel."""
        ...

    @property
    def metrics(self) -> Mapping[str, int]:
        """Counters since start: ``sent``, ``retried_429``, ``retried``, ``coalesced``,
        ``dropped`` (others are ignored)."""
        ...


class ControlPlaneMetrics:
    """One control plane's registry and the instruments its code paths record into."""

    def __init__(
        self,
        engine: Engine | None = None,
        *,
        holder: str | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        """``engine``: the database the scrape-time figures come from (None: none);
        ``holder``: this process's scheduler lease holder name (default: the one
        :mod:`jobs.background.scheduler` uses)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.ingest_events, self.ingest_batches = (
            Counter(name, doc, [label], registry=self.registry)
            for name, doc, label in (
                (
                    "trainbot_ingest_events",
                    "Runner events received by the ingest API, by result (accepted, duplicate).",
                    "result",
                ),
                (
                    "trainbot_ingest_batches",
                    "Runner batches answered by the ingest API, by HTTP status.",
                    "status",
                ),
            )
        )
        self.ingest_latency = Histogram(
            "trainbot_ingest_latency_seconds",
            "Time to answer one runner batch (authenticate, store, apply, evaluate alerts).",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        for result in ("accepted", "duplicate"):
            self.ingest_events.labels(result)
        self.job_runs, self.job_failures, self.job_missed = (
            Counter(name, doc, ["task"], registry=self.registry)
            for name, doc in (
                (
                    "trainbot_scheduler_job_runs",
                    "Scheduled job runs that finished on this replica, by job.",
                ),
                ("trainbot_scheduler_job_failures", "Scheduled job runs that raised, by job."),
                (
                    "trainbot_scheduler_jobs_missed",
                    "Scheduled job runs skipped because they were later than their grace time.",
                ),
            )
        )
        self.job_lag = Histogram(
            "trainbot_scheduler_job_lag_seconds",
            "How late a scheduled job was handed to its executor, after its fire time.",
            ["task"],
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        self.job_last_success = Gauge(
            "trainbot_scheduler_job_last_success_timestamp_seconds",
            "Unix time the job last finished without raising, on this replica.",
            ["task"],
            registry=self.registry,
        )
        build = Gauge(
            "trainbot_build_info",
            "Always 1; the labels say which trainbot release and Python this replica runs.",
            ["version", "python"],
            registry=self.registry,
        )
        build.labels(_version(), platform.python_version()).set(1)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self._queue = _PostQueueCollector()
        self.registry.register(self._queue)
        if engine is not None:
            self.registry.register(DatabaseCollector(engine, holder=holder, clock=clock))
        self._watched: set[int] = set()
        self._lock = threading.Lock()

    # --- recording -------------------------------------------------------------------

    def record_ingest(self, status: int, body: Mapping[str, Any], seconds: float) -> None:
        """Count one answered batch (its status and JSON answer) and how long it took."""
        self.ingest_batches.labels(str(status)).inc()
        if status == 200:
            self.ingest_events.labels("accepted").inc(int(body.get("accepted", 0)))
            self.ingest_events.labels("duplicate").inc(int(body.get("duplicates", 0)))
        self.ingest_latency.observe(seconds)

    def watch_scheduler(self, scheduler: BaseScheduler) -> None:
        """Count the scheduler's job runs, failures, misses and lag (idempotent)."""
        with self._lock:
            if id(scheduler) in self._watched:
                return
            self._watched.add(id(scheduler))
        scheduler.add_listener(
            self._on_job_event,
            EVENT_JOB_SUBMITTED | EVENT_JOB_EXECUTED | EVENT_JOB_ERROR | EVENT_JOB_MISSED,
        )

    def watch_post_queue(self, queue: PostQueue | None) -> None:
        """Report this queue's depth and counters (None: no queue, e.g. the console)."""
        self._queue.source = queue

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """The scrape's body and content type, in the format ``accept`` asks for."""
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    def value(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """One sample's current value (tests and benchmarks read figures this way)."""
        return self.registry.get_sample_value(name, dict(labels or {}))

    def _on_job_event(self, event: SchedulerEvent) -> None:
        if isinstance(event, JobSubmissionEvent):
            now = datetime.now(timezone.utc)
            for fire_time in event.scheduled_run_times:
                lag = (now - fire_time).total_seconds()
                self.job_lag.labels(event.job_id).observe(max(0.0, lag))
            return
        if not isinstance(event, JobExecutionEvent):
            return
        if event.code == EVENT_JOB_MISSED:
            self.job_missed.labels(event.job_id).inc()
            return
        self.job_runs.labels(event.job_id).inc()
        if event.code == EVENT_JOB_ERROR:
            self.job_failures.labels(event.job_id).inc()
        else:
            self.job_last_success.labels(event.job_id).set(time.time())


class _PostQueueCollector(Collector):
    """The Slack post queue's depth and counters, asked at scrape time."""

    def __init__(self) -> None:
        self.source: PostQueue | None = None

    def describe(self) -> Iterable[Metric]:
        return []  # which families exist depends on the source, known at scrape time

    def collect(self) -> Iterator[Metric]:
        source = self.source
        if source is None:
            return
        depth = GaugeMetricFamily(
            "trainbot_slack_queue_depth",
            "Slack messages waiting to be sent (queued or in flight), by channel.",
            labels=["channel"],
        )
        for channel, count in sorted(source.queue_depths().items()):
            depth.add_metric([channel], count)
        yield depth
        counters = source.metrics
        yield CounterMetricFamily(
            "trainbot_slack_rate_limited",
            "Slack Web API calls answered 429 (each held its channel and was sent again).",
            value=counters.get("retried_429", 0),
        )
        calls = CounterMetricFamily(
            "trainbot_slack_calls",
            "Slack Web API calls by outcome: sent, retried (transient error), "
            "coalesced (an update replaced a queued one), dropped (refused for good).",
            labels=["outcome"],
        )
        for outcome in ("sent", "retried", "coalesced", "dropped"):
            calls.add_metric([outcome], counters.get(outcome, 0))
        yield calls


@dataclass(frozen=True)
class _RunFigures:
    run_id: str
    channel: str
    spent_usd: float
    paid_s: float
    lost_s: float
    budget_usd: float | None


class DatabaseCollector(Collector):
    """Figures read from the database when Prometheus scrapes (see the module doc)."""

    def __init__(
        self,
        engine: Engine,
        *,
        holder: str | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self._engine = engine
        self._holder = holder
        self._clock = clock

    def describe(self) -> Iterable[Metric]:
        return []  # the families are built at scrape time; nothing to check at register

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "trainbot_database_up", "1 when the last scrape could read the database, else 0."
        )
        try:
            with self._engine.connect() as connection:
                families = list(self._read(connection, now=self._clock()))
        except Exception as exc:
            log.warning("metrics: could not read the database: %s", type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _read(self, c: Connection, *, now: datetime) -> Iterator[Metric]:
        yield from self._runs(c)
        yield from self._attempts(c)
        yield from self._alerts(c)
        yield from self._spend(c, now=now)
        yield self._leader(c, now=now)

    def _runs(self, c: Connection) -> Iterator[Metric]:
        counts: dict[RunState, int] = {
            state: count
            for state, count in c.execute(
                select(_RUNS.c.state, func.count()).group_by(_RUNS.c.state)
            ).all()
        }
        runs = GaugeMetricFamily("trainbot_runs", "Runs by state.", labels=["state"])
        for state in RunState:
            runs.add_metric([state.value], counts.get(state, 0))
        yield runs

    def _attempts(self, c: Connection) -> Iterator[Metric]:
        a = _ATTEMPTS.c
        counts: dict[AttemptState, int] = {
            state: count
            for state, count in c.execute(select(a.state, func.count()).group_by(a.state)).all()
        }
        attempts = GaugeMetricFamily(
            "trainbot_attempts", "Attempts (one instance or gang each) by state.", labels=["state"]
        )
        for state in AttemptState:
            attempts.add_metric([state.value], counts.get(state, 0))
        yield attempts
        yield CounterMetricFamily(
            "trainbot_attempts_launched",
            "Attempts ever started (first attempts and resubmits).",
            value=sum(counts.values()),
        )
        yield CounterMetricFamily(
            "trainbot_preemptions",
            "Attempts that ended preempted.",
            value=counts.get(AttemptState.PREEMPTED, 0),
        )
        resubmits = c.execute(select(func.count()).where(a.number > 1)).scalar_one()
        yield CounterMetricFamily(
            "trainbot_resubmits", "Attempts launched after a run's first one.", value=resubmits
        )

    def _alerts(self, c: Connection) -> Iterator[Metric]:
        al = _ALERTS.c
        rows = c.execute(
            select(al.severity, al.state, func.count(), func.count(al.escalated_at)).group_by(
                al.severity, al.state
            )
        ).all()
        open_ = dict.fromkeys(Severity, 0)
        unacked = dict.fromkeys(Severity, 0)
        escalated = dict.fromkeys(Severity, 0)
        for severity, state, count, escalations in rows:
            escalated[severity] += escalations
            if state != AlertState.RESOLVED:
                open_[severity] += count
            if state == AlertState.OPEN:
                unacked[severity] += count
        for name, help_text, values, family in (
            (
                "trainbot_alerts_open",
                "Alerts not resolved (open or acknowledged), by severity.",
                open_,
                GaugeMetricFamily,
            ),
            (
                "trainbot_alerts_unacknowledged",
                "Alerts open and not acknowledged by anyone, by severity.",
                unacked,
                GaugeMetricFamily,
            ),
            (
                "trainbot_alert_escalations",
                "Alerts escalated to the on-call group, by severity.",
                escalated,
                CounterMetricFamily,
            ),
        ):
            metric = family(name, help_text, labels=["severity"])
            for severity, value in values.items():
                metric.add_metric([severity.value.lower()], value)
            yield metric

    def _spend(self, c: Connection, *, now: datetime) -> Iterator[Metric]:
        runs = self._run_figures(c, now=now)
        spend = GaugeMetricFamily(
            "trainbot_run_spend_usd",
            "What the run has cost so far, all attempts (active and recent runs).",
            labels=["run", "channel"],
        )
        goodput = GaugeMetricFamily(
            "trainbot_run_goodput_ratio",
            "Share of the run's paid instance time whose work was kept (active and recent runs).",
            labels=["run", "channel"],
        )
        share = GaugeMetricFamily(
            "trainbot_run_budget_used_ratio",
            "Run spend ÷ its budget (runs with a budget).",
            labels=["run", "channel"],
        )
        for run in runs:
            labels = [run.run_id, run.channel]
            spend.add_metric(labels, round(run.spent_usd, 6))
            if run.paid_s > 0:
                goodput.add_metric(labels, max(0.0, 1.0 - run.lost_s / run.paid_s))
            if run.budget_usd:
                share.add_metric(labels, run.spent_usd / run.budget_usd)
        yield from (spend, goodput, share)

        channels = self._channel_figures(c)
        usd = CounterMetricFamily(
            "trainbot_spend_usd", "Spend of every run, by channel.", labels=["channel"]
        )
        paid = CounterMetricFamily(
            "trainbot_paid_instance_seconds",
            "Instance time paid for, by channel.",
            labels=["channel"],
        )
        lost = CounterMetricFamily(
            "trainbot_lost_instance_seconds",
            "Paid instance time whose work was lost to interruptions, by channel.",
            labels=["channel"],
        )
        ratio = GaugeMetricFamily(
            "trainbot_channel_goodput_ratio",
            "Share of the channel's paid instance time whose work was kept, all runs.",
            labels=["channel"],
        )
        for channel, (spent, paid_s, lost_s) in sorted(channels.items()):
            usd.add_metric([channel], round(spent, 6))
            paid.add_metric([channel], paid_s)
            lost.add_metric([channel], lost_s)
            if paid_s > 0:
                ratio.add_metric([channel], max(0.0, 1.0 - lost_s / paid_s))
        yield from (usd, paid, lost, ratio)
        yield self._team_budgets(c, now=now)

    def _run_figures(self, c: Connection, *, now: datetime) -> list[_RunFigures]:
        r, s, a = _RUNS.c, _SPEND.c, _ATTEMPTS.c
        cutoff = now - timedelta(seconds=RECENT_RUN_S)
        current = (
            select(r.id)
            .where(or_(r.state.in_(_ACTIVE_RUN_STATES), r.ended_at >= cutoff))
            .subquery()
        )
        spend = dict(
            (row[0], (float(row[1] or 0.0), float(row[2] or 0.0)))
            for row in c.execute(
                select(s.run_id, func.sum(s.usd), func.sum(_instance_seconds(s)))
                .where(s.run_id.in_(select(current.c.id)))
                .group_by(s.run_id)
            ).all()
        )
        lost = dict(
            c.execute(
                select(a.run_id, func.sum(a.lost_seconds * a.instances))
                .where(a.run_id.in_(select(current.c.id)))
                .group_by(a.run_id)
            ).all()
        )
        out = []
        for run_id, channel, budget in c.execute(
            select(r.id, r.channel, r.budget_usd).where(r.id.in_(select(current.c.id)))
        ).all():
            spent, paid_s = spend.get(run_id, (0.0, 0.0))
            out.append(
                _RunFigures(
                    run_id=run_id,
                    channel=channel or "",
                    spent_usd=spent,
                    paid_s=paid_s,
                    lost_s=float(lost.get(run_id) or 0.0),
                    budget_usd=budget,
                )
            )
        return sorted(out, key=lambda f: f.run_id)

    def _channel_figures(self, c: Connection) -> dict[str, tuple[float, float, float]]:
        r, s, a = _RUNS.c, _SPEND.c, _ATTEMPTS.c
        figures: dict[str, list[float]] = {}
        for channel, usd, paid_s in c.execute(
            select(r.channel, func.sum(s.usd), func.sum(_instance_seconds(s)))
            .join_from(_SPEND, _RUNS, r.id == s.run_id)
            .group_by(r.channel)
        ).all():
            figures.setdefault(channel or "", [0.0, 0.0, 0.0])[:2] = [
                float(usd or 0.0),
                float(paid_s or 0.0),
            ]
        for channel, lost_s in c.execute(
            select(r.channel, func.sum(a.lost_seconds * a.instances))
            .join_from(_ATTEMPTS, _RUNS, r.id == a.run_id)
            .group_by(r.channel)
        ).all():
            figures.setdefault(channel or "", [0.0, 0.0, 0.0])[2] = float(lost_s or 0.0)
        return {k: (v[0], v[1], v[2]) for k, v in figures.items()}

    def _team_budgets(self, c: Connection, *, now: datetime) -> Metric:
        r, s, b = _RUNS.c, _SPEND.c, _BUDGETS.c
        month = now.astimezone(timezone.utc).replace(
            day=1, hour=0, minute=0, second=0, microsecond=0
        )
        share = GaugeMetricFamily(
            "trainbot_team_budget_used_ratio",
            "Month-to-date spend of the channel's runs ÷ the team budget (UTC months).",
            labels=["channel"],
        )
        for channel, usd in c.execute(
            select(b.name, b.usd).where(b.scope == "team", b.usd > 0)
        ).all():
            spent = c.execute(
                select(func.coalesce(func.sum(s.usd), 0.0))
                .join_from(_SPEND, _RUNS, r.id == s.run_id)
                .where(r.channel == channel, s.period_end >= month)
            ).scalar_one()
            share.add_metric([channel], float(spent) / float(usd))
        return share

    def _leader(self, c: Connection, *, now: datetime) -> Metric:
        lease = c.execute(
            select(_LEASES.c.holder, _LEASES.c.expires_at).where(_LEASES.c.name == LEADER_LEASE)
        ).first()
        holder = self._holder if self._holder is not None else _scheduler_holder()
        leads = lease is not None and lease.holder == holder and lease.expires_at > now
        metric = GaugeMetricFamily(
            "trainbot_scheduler_leader",
            "1 while this replica holds the scheduler lease (runs the scheduled jobs), else 0.",
        )
        metric.add_metric([], 1 if leads else 0)
        return metric


def _version() -> str:
    """The installed trainbot's version ("unknown" in a source tree without metadata)."""
    try:
        return importlib.metadata.version("trainbot")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _instance_seconds(s: Any) -> Any:
    """A spend record's paid instance-seconds: usd = price × hours × instances."""
    return func.coalesce(s.usd / func.nullif(s.price_per_hour, 0.0), 0.0) * 3600.0


def _scheduler_holder() -> str:
    """The lease holder name :mod:`jobs.background.scheduler` takes the lease under here."""
    from jobs.background import scheduler

    return scheduler._holder
