"""What the control plane tells people, as data; the chat front ends render it.

The jobs layer never formats chat text. It posts typed messages through a
:class:`Notifier` (the console prints them, Slack renders Block Kit), and records every
step of the story in a :class:`Journal` (the demo's ``--events`` file, tests, logs).
A message without ``thread_ts`` is a run's root message; everything else about the run
goes in its thread.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from jobs.database.models import utcnow


@dataclass(frozen=True)
class MessageRef:
    """Where a posted message lives, so it can be updated in place."""

    #: Channel id (or the console's channel name).
    channel: str
    #: Message timestamp, Slack's message id.
    ts: str


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base of every message."""

    #: Channel to post in.
    channel: str
    #: The run's root message, when this belongs in its thread.
    thread_ts: str | None = None
    #: Posted once per key where the notifier keeps a durable outbox (a day's digest of
    #: a channel, which a new leader may make again); None: no such promise.
    key: str | None = None
    #: Messages that share a fold key may be shown as one message, edited: the newest,
    #: with how many there were (a run's runner warnings). None: each is its own.
    fold: str | None = None


@dataclass(frozen=True, kw_only=True)
class RunCard(Message):
    """The run's root message: updated in place as the run moves."""

    run_id: str
    spec_name: str
    state: str
    requester: str
    attempt: int = 0
    step: int | None = None
    target_steps: int | None = None
    loss: float | None = None
    spent_usd: float = 0.0
    budget_usd: float | None = None
    instance_id: str | None = None
    zone: str | None = None
    #: The attempt's market, "spot" or "on-demand" (a fallback is paid at on-demand prices).
    market: str | None = None
    #: The attempt's region (after a failover, not the spec's first).
    region: str | None = None
    #: The provider the attempt runs on ("aws", "local"), by its registry name.
    provider: str | None = None
    reason: str | None = None
    #: Where the spec was read (``ml@1a2b3c4 (specs/gpt.yaml)``); None for older runs.
    spec_from: str | None = None
    #: The staged copy the run reads and the dataset it copies
    #: (``s3://stage/… (staged copy of s3://data/…)``); None: it reads its data_uri as written.
    data_from: str | None = None
    #: A failed attempt's instance kept to look at (debug.keep_failed_instance): until
    #: when, and how to connect; None: none is kept.
    kept: str | None = None


@dataclass(frozen=True)
class CheckLine:
    """One preflight check as shown to people."""

    name: str
    #: "pass", "warn" or "fail".
    status: str
    detail: str
    remedy: str = ""


@dataclass(frozen=True, kw_only=True)
class PreflightMessage(Message):
    """The preflight report, posted in the run's thread."""

    run_id: str
    checks: tuple[CheckLine, ...]
    #: True when no check failed.
    ok: bool
    #: True when warnings wait for a "Launch anyway".
    needs_confirmation: bool
    estimate_usd: float | None = None
    interval_s: float | None = None
    #: The data check's offer to copy the dataset into the run's region (size, cost,
    #: time), for a "Stage the data" button; None: none.
    stage: str | None = None


@dataclass(frozen=True, kw_only=True)
class AlertMessage(Message):
    """An alert; updated in place on repeats, acknowledgement and resolution."""

    alert_id: str
    run_id: str | None
    rule: str
    severity: str
    state: str
    title: str
    detail: str
    hint: str
    count: int = 1
    acked_by: str | None = None
    acked_at: datetime | None = None
    snoozed_until: datetime | None = None
    #: User group mentioned when an unacknowledged critical alert escalates.
    escalate_to: str | None = None
    #: The step trainbot offers to resubmit from after it stopped the run (the newest
    #: checkpoint from before the divergence); None when it made no such offer.
    resume_step: int | None = None


@dataclass(frozen=True, kw_only=True)
class ProjectionMessage(Message):
    """The projection from a run's profiled start, in its thread; when ``stopped``, the
    question it asks (Continue, optionally with a raised budget, or Stop)."""

    run_id: str
    #: The step the profile reached, of ``target_steps`` (None: the command gives none).
    step: int
    target_steps: int | None
    #: Where the profiled attempt ran.
    zone: str | None
    #: What the runner measured: median seconds per step, mean data-wait fraction, mean
    #: GPU utilisation in percent (None: no GPU).
    step_time_s: float | None
    data_wait: float | None
    gpu_util: float | None
    #: Hours still to go (the steps left, with the work preemptions are expected to
    #: lose), the cost in all (spent so far included), and when it would finish.
    hours_left: float | None
    cost_usd: float | None
    spent_usd: float
    budget_usd: float | None
    max_hours: float | None
    finish_at: datetime | None
    #: Preemptions expected over the hours left, and the work they lose in seconds, at
    #: the checkpoint interval ``interval_s``.
    preemptions: float | None
    lost_s: float | None
    interval_s: float | None
    #: USD per hour for the run's instances.
    price_per_hour: float
    #: Why it should not go on as it is; empty: it goes on.
    reasons: tuple[str, ...] = ()
    #: A budget that covers the projection, offered with Continue.
    suggested_budget_usd: float | None = None
    #: The run was stopped at a checkpoint and waits for Continue or Stop.
    stopped: bool = False


@dataclass(frozen=True, kw_only=True)
class DigestMessage(Message):
    """The daily spend digest for one channel."""

    #: The figures, as computed by ``jobs.spend`` (a plain mapping keeps this module light).
    figures: dict[str, Any]
    #: Optional chart image (PNG bytes).
    chart_png: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True, kw_only=True)
class TextMessage(Message):
    """A line in a run's thread: launched, preempted, resubmitted, checkpoint summary …"""

    #: What kind of line, for styling: launched, preempted, resubmitted, checkpoint, info, error.
    kind: str
    text: str
    run_id: str | None = None
    #: The last lines the run's command printed (a failure's), shown under the text as
    #: the front end can fit them; None: none.
    log_tail: str | None = None


class Notifier(Protocol):
    """Posts and updates messages. Implementations queue; they never drop."""

    def post(self, msg: Message) -> MessageRef: ...

    def update(self, ref: MessageRef, msg: Message) -> None: ...


class Journal(Protocol):
    """Records what happened, one typed event at a time (the demo's --events file)."""

    def record(self, type: str, run: str | None, /, **data: Any) -> None: ...


class NullJournal:
    def record(self, type: str, run: str | None, /, **data: Any) -> None:
        return None


class JsonlJournal:
    """Appends ``{"type", "run", "time", …}`` lines to a file; thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def record(self, type: str, run: str | None, /, **data: Any) -> None:
        line = {"type": type, "run": run, "time": utcnow().isoformat(), **data}
        text = json.dumps(line, default=str, sort_keys=True)
        with self._lock:
            self._file.write(text + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


class FanoutJournal:
    """Records into several journals (a file and a progress display, say)."""

    def __init__(self, *journals: Journal) -> None:
        self.journals = journals

    def record(self, type: str, run: str | None, /, **data: Any) -> None:
        for j in self.journals:
            j.record(type, run, **data)


class CallbackJournal:
    """Calls a function for each record (tests, progress displays)."""

    def __init__(self, fn: Callable[[str, str | None, dict[str, Any]], None]) -> None:
        self.fn = fn

    def record(self, type: str, run: str | None, /, **data: Any) -> None:
        self.fn(type, run, data)
