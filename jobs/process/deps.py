"""The dependencies every use-case takes: built once by ``jobs.process.bootstrap``.

Use-cases are plain functions of ``(deps, …)``; nothing here reaches for a global. Tests
build a ``Deps`` of their own with a temp database, the local provider and an in-memory
notifier.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import os
import secrets
import socket
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine

from jobs.background.deferred import Later, current_fence, defer, run_now
from jobs.background.workers import Workers
from jobs.database.models import utcnow
from jobs.domain.errors import DatabaseError
from jobs.outbound.notify import Journal, Notifier, NullJournal
from jobs.outbound.pagerduty import PagerDutyBridge
from jobs.process.settings import Settings
from jobs.providers import ProviderNotConfigured, registration
from jobs.providers.base import Provider, ProviderError
from jobs.spec import JobSpec, Resources

log = logging.getLogger(__name__)

#: This process's name among the replicas: on the scheduler lease, on the deferred work
#: and Slack posts it claims (tests running several replicas in one process give each
#: its own).
PROCESS_REPLICA = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def load_secret(state_dir: Path) -> bytes:
    """The control plane's secret for deriving runner tokens; created once, mode 0600."""
    path = state_dir / "secret"
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return bytes.fromhex(path.read_text().strip())
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return bytes.fromhex(path.read_text().strip())


def anyone_may_launch(requester: str) -> bool | None:
    """The launcher check where no front end set one: no launcher list, everyone may."""
    return True


def runner_token_key(configured: str) -> bytes:
    """The key runner tokens are derived with, from ``TRAINBOT_RUNNER_TOKEN_SECRET``."""
    return hashlib.sha256(b"trainbot runner tokens\0" + configured.encode()).digest()


@dataclass
class Deps:
    """What the control plane's use-cases work with."""

    settings: Settings
    engine: Engine
    #: The default provider (``TRAINBOT_PROVIDER``): a spec naming no ``resources.cloud``
    #: runs on it. Where a run, an attempt or a dry run is at hand, ask
    #: :meth:`provider_for` or :meth:`provider_named` instead.
    provider: Provider
    notifier: Notifier
    #: Every configured provider by name (``TRAINBOT_PROVIDERS``), the default first;
    #: the default is added when missing. Reconcile, spend and cleanup cover them all.
    providers: dict[str, Provider] = field(default_factory=dict)
    journal: Journal = field(default_factory=NullJournal)
    #: Secret used to derive per-attempt runner tokens (so a relaunch after a crash, or
    #: by another replica, can give the instance the same token that is stored hashed);
    #: ``TRAINBOT_RUNNER_TOKEN_SECRET`` replaces it when set.
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    clock: Callable[[], datetime] = utcnow
    #: Whether a requester (a run's ``requester``) may start compute now: asked again at
    #: every launch that happens later on its own (after preflight, when a price is met,
    #: a resubmit after a preemption, a retry), since the launcher list may have changed
    #: since the request. None: it cannot be told now (Slack could not list a launcher
    #: group), and the launch waits for its next try. The front end that takes commands
    #: sets it (it alone can resolve ``TRAINBOT_LAUNCHERS``' user groups); without one,
    #: everyone may.
    may_launch: Callable[[str], bool | None] = anyone_may_launch
    #: Where runners send events (``{public_url}/v1/events``); set once the server listens.
    ingest_url: str = ""
    #: Whether runners get their checkpoint credentials from ``POST /v1/credentials``
    #: (the provider's broker is configured) rather than their instance's own.
    store_credentials: bool = False
    #: The PagerDuty bridge (``TRAINBOT_PAGERDUTY_ROUTING_KEY``), closed with the rest.
    pager: PagerDutyBridge | None = None
    #: This replica's name (the lease holder's), on the deferred work it claims.
    replica: str = PROCESS_REPLICA
    #: Seconds a claim on deferred work holds: a replica that dies holding one frees it
    #: then (the control plane makes it twice the scheduler lease).
    hold_s: float = 120.0
    #: Background work; a task waiting on a cloud instance gives its worker back
    #: (:func:`jobs.background.workers.waiting`), up to 64 such waits at once.
    _pool: Workers = field(
        default_factory=lambda: Workers(workers=4, max_waiting=64, name="trainbot")
    )
    #: Stops and terminations: their own lane, never queued behind other work.
    _urgent_pool: Workers = field(
        default_factory=lambda: Workers(workers=4, max_waiting=0, name="trainbot-stop")
    )
    _timers: list[threading.Timer] = field(default_factory=list)
    _closed: bool = False
    #: Instances being terminated, each with the event set when its terminate returns.
    _terminating: dict[str, threading.Event] = field(default_factory=dict)
    _terminating_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.providers = {self.provider.name: self.provider, **self.providers}
        configured = self.settings.runner_token_secret
        if configured is not None:
            # The deployment's shared secret (every replica's) wins over a per-process one.
            self.secret = runner_token_key(configured.get_secret_value())

    def provider_named(self, name: str) -> Provider:
        """The configured provider ``name`` (an attempt's, a dry run's, a spec's cloud);
        :class:`ProviderNotConfigured`, saying what to set, when this control plane has
        not configured it."""
        found = self.providers.get(name)
        if found is not None:
            return found
        configured = ", ".join(self.providers)
        try:
            prefix = registration(name).settings_prefix
        except ProviderError:
            prefix = ""
        how = f" and its {prefix}* settings" if prefix else ""
        raise ProviderNotConfigured(
            f"the {name} provider is not configured on this control plane (configured: "
            f"{configured}): an admin adds it to TRAINBOT_PROVIDERS (e.g. "
            f"TRAINBOT_PROVIDERS={','.join([*self.providers, name])}){how}; or set "
            f"resources.cloud to one of {configured}",
            name=name,
        )

    def provider_for(
        self, spec: JobSpec | Resources, *, launched_on: str | None = None
    ) -> Provider:
        """The provider a run goes on: the one its attempts were launched on
        (``launched_on``: a run stays with its provider), else its spec's
        ``resources.cloud`` (``spec`` may be the resources section alone, read
        leniently from a stored run), else the default."""
        res = spec.resources if isinstance(spec, JobSpec) else spec
        return self.provider_named(launched_on or res.cloud or self.provider.name)

    def provider_or_default(self, spec: JobSpec | Resources) -> Provider:
        """:meth:`provider_for`, or the default provider where the spec's cloud is not
        configured: for ending what a run started, where nothing can have started on a
        provider that preflight refused."""
        try:
            return self.provider_for(spec)
        except ProviderNotConfigured:
            return self.provider

    def close_providers(self) -> None:
        """Close every configured provider (their instances keep running)."""
        for provider in self.providers.values():
            try:
                provider.close()
            except Exception:
                log.exception("closing the %s provider failed", provider.name)

    def claim_termination(self, instance_id: str) -> tuple[threading.Event, bool]:
        """The event that is set once ``instance_id``'s terminate returns, and whether the
        caller should do it (False: another thread is terminating it already).

        A provider's terminate can wait for the instance to end (the local one waits out
        the runner's last flush); two threads doing it at once would wait twice.
        """
        with self._terminating_lock:
            done = self._terminating.get(instance_id)
            if done is not None:
                return done, False
            done = self._terminating[instance_id] = threading.Event()
            return done, True

    def release_termination(self, instance_id: str) -> None:
        with self._terminating_lock:
            done = self._terminating.pop(instance_id, None)
        if done is not None:
            done.set()

    def runner_token(self, attempt_id: str) -> str:
        """Random per attempt (attempt ids are random) and reproducible by this control plane."""
        return hmac.new(self.secret, attempt_id.encode(), hashlib.sha256).hexdigest()

    def background(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run slow work off the request thread; failures are logged, never lost silently."""
        return self._submit(self._pool, fn, *args, **kwargs)

    def urgent(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Like :meth:`background`, on the stop lane: a stop, a termination. Whatever the
        other workers are doing (four preflights, a slow launch), this starts now."""
        return self._submit(self._urgent_pool, fn, *args, **kwargs)

    def _submit(
        self, pool: Workers, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> Future[Any]:
        def guarded() -> Any:
            try:
                return fn(*args, **kwargs)
            except DatabaseError as exc:  # reconcile retries what this left undone
                log.warning("background task %s failed: %s", getattr(fn, "__name__", fn), exc)
                raise
            except Exception:
                log.exception("background task %s failed", getattr(fn, "__name__", fn))
                raise

        # The caller's log context (its run and attempt ids) goes with the work.
        context = contextvars.copy_context()
        return pool.submit(lambda: context.run(guarded))

    def later(self, delay_s: float, kind: Later, /, *, key: str, **args: Any) -> None:
        """Run ``kind``'s function with ``args`` (JSON) after ``delay_s``: a resubmit's
        backoff, a launch retry. ``key`` names the work; deferring it again does nothing.

        The work is a row first (:mod:`jobs.background.deferred`), then a timer here runs it on
        time; if this replica dies or stops before, the leader runs it. Scheduled work
        defers under its fencing token, and the timer runs it under the same token.
        """
        now = self.clock()
        delay = max(0.0, delay_s)
        try:
            new = defer(
                self.engine,
                kind=kind,
                key=key,
                args=args,
                due_at=now + timedelta(seconds=delay),
                fence=current_fence(),
                now=now,
            )
        except DatabaseError as exc:  # reconcile's backstop launches what is due
            log.warning("could not defer %s: %s", key, exc)
            return
        if not new or self._closed:
            return  # deferred already (its timer runs it), or the leader runs it
        timer = threading.Timer(delay, lambda: self.background(run_now, self, key))
        timer.daemon = True
        self._timers = [t for t in self._timers if t.is_alive()] + [timer]
        timer.start()

    @property
    def closing(self) -> bool:
        """``close`` has begun: long waits (a cloud dry run) end early instead of holding
        the shutdown up."""
        return self._closed

    def close(self) -> None:
        self._closed = True
        for t in self._timers:
            t.cancel()
        self._urgent_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        if self.pager is not None:
            self.pager.close()
