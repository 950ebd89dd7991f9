"""The Slack notifier's durable side: an outbox, the handles' ts, one pace per channel.

With several replicas on PostgreSQL, :class:`bot.slack_notifier.SlackNotifier` keeps
its in-memory queues (coalescing, threads waiting for their root, 429 handling) and
writes each post and update here *before* queueing it, in its own short transaction:

- **Nothing queued is lost with its replica.** A row is its owner's while the owner
  renews ``owner_until``; a replica that dies stops renewing, and after ``hold_s`` any
  other replica's notifier adopts its unsent rows, oldest first, into its own queues. A
  replica that stops cleanly hands its rows over at once. A post sent but not yet marked
  sent when its replica died is sent again: at least once, never lost.
- **Once per key.** A message with a ``key`` (a day's digest of a channel) is queued
  once: the second insert of the key finds the first and queues nothing.
- **Handles resolve everywhere.** A post's row keeps the ts Slack gave its handle, so a
  replica updating a run card another replica posted edits it instead of posting anew,
  and a reply whose root is still queued elsewhere waits for it.
- **One pace per channel.** Before each call a notifier takes the channel's slot in
  ``slack_pace`` (one UPDATE whose WHERE says the slot is free, which moves it on by the
  interval), so all replicas together send to a channel at most once per interval.

Messages are stored as JSON, their type by name from :data:`MESSAGE_TYPES`, never
pickled. SQLite is one process's database, and the notifier is called inside the
control plane's SQLite transactions, which a second writer would wait on: the outbox
is for PostgreSQL (:func:`bot.slack_wsgi.attach` turns it on there).
"""

from __future__ import annotations

import base64
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import date, datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Engine, select, update
from sqlalchemy.dialects import postgresql, sqlite

from bot.slack_queue import DROPPED, HANDLE_PREFIX, ChannelQueues, Op
from jobs.database.db import claim_rows, delete_before, session_scope
from jobs.database.models import table_of, utcnow
from jobs.database.replica_tables import SlackOutbox, SlackPace
from jobs.domain.errors import DatabaseError
from jobs.outbound.notify import (
    AlertMessage,
    CheckLine,
    DigestMessage,
    Message,
    PreflightMessage,
    RunCard,
    TextMessage,
)

log = logging.getLogger(__name__)

_OUTBOX = table_of(SlackOutbox)
_PACE = table_of(SlackPace)
_GONE = datetime(1970, 1, 1, tzinfo=timezone.utc)

#: The types a stored message may have, by name.
MESSAGE_TYPES: dict[str, type[Any]] = {
    cls.__name__: cls
    for cls in (RunCard, PreflightMessage, AlertMessage, DigestMessage, TextMessage, CheckLine)
}
#: What :meth:`Outbox.ts_of` says of a handle whose post is queued and not sent yet.
PENDING = object()
#: Seconds a call waits, with its channel, for a root or message that another replica
#: has queued and not sent yet, before asking the outbox again.
REMOTE_WAIT_S = 0.25
#: Sent rows are kept this long, for the handles other replicas may still resolve.
KEEP_SENT = timedelta(days=1)


def encode(value: Any) -> Any:
    """``value`` (a message, and what its fields hold) as JSON-able data."""
    if is_dataclass(value) and not isinstance(value, type):
        name = type(value).__name__
        if MESSAGE_TYPES.get(name) is not type(value):
            raise TypeError(f"the Slack outbox cannot store a {name}")
        return {"$type": name, **{f.name: encode(getattr(value, f.name)) for f in fields(value)}}
    if isinstance(value, datetime):
        return {"$datetime": value.isoformat()}
    if isinstance(value, date):
        return {"$date": value.isoformat()}
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, float) and not math.isfinite(value):
        return {"$float": repr(value)}  # JSON (and PostgreSQL's json) has no NaN
    if isinstance(value, tuple):
        return {"$tuple": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    return value


def decode(data: Any) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "$type" in data:
        cls = MESSAGE_TYPES[data["$type"]]
        return cls(**{k: decode(v) for k, v in data.items() if k != "$type"})
    if len(data) == 1:
        (tag, raw), *_ = data.items()
        if tag == "$datetime":
            return datetime.fromisoformat(raw)
        if tag == "$date":
            return date.fromisoformat(raw)
        if tag == "$bytes":
            return base64.b64decode(raw)
        if tag == "$float":
            return float(raw)
        if tag == "$tuple":
            return tuple(decode(v) for v in raw)
    return {k: decode(v) for k, v in data.items()}


@dataclass(frozen=True)
class Adopted:
    """An unsent row taken over from a replica that stopped renewing it."""

    row: int
    op: str
    channel: str
    target: str
    msg: Message


class Outbox:
    """The rows of one replica's notifier (``owner``) in the shared database."""

    def __init__(self, engine: Engine, *, owner: str, hold_s: float = 30.0) -> None:
        """``hold_s``: how long this replica's rows stay its own without a renewal."""
        self.engine = engine
        self.owner = owner
        self.hold_s = hold_s
        self._dialect = postgresql if engine.dialect.name == "postgresql" else sqlite

    def _until(self, now: datetime) -> datetime:
        return now + timedelta(seconds=self.hold_s)

    def add(self, *, op: str, channel: str, target: str, msg: Message) -> int | None:
        """Write a post or update before it is queued: its row id; None when its key
        was queued already (nothing to queue)."""
        now = utcnow()
        what = {"channel": channel, "op": op, "target": target, "payload": encode(msg)}
        insert = self._dialect.insert(_OUTBOX).values(
            **what, key=msg.key, owner=self.owner, owner_until=self._until(now), created_at=now
        )
        with session_scope(self.engine) as session:
            row = session.execute(
                insert.on_conflict_do_nothing(index_elements=["key"]).returning(_OUTBOX.c.id)
            ).scalar_one_or_none()
        return None if row is None else int(row)

    def replace(self, row: int, msg: Message) -> None:
        """New content for a row not sent yet (an update coalesced into a queued post)."""
        with session_scope(self.engine) as session:
            session.execute(
                update(_OUTBOX)
                .where(_OUTBOX.c.id == row, _OUTBOX.c.sent_at.is_(None))
                .values(payload=encode(msg))
            )

    def done(self, row: int, *, ts: str | None) -> None:
        """Slack has it (post: at ``ts``; ``""``: refused for good), or newer content
        superseded it."""
        with session_scope(self.engine) as session:
            session.execute(
                update(_OUTBOX).where(_OUTBOX.c.id == row).values(sent_at=utcnow(), ts=ts)
            )

    def ts_of(self, handle: str) -> str | object | None:
        """Where another replica's handle lives: its ts (``""``: refused), ``PENDING``
        while its post is queued, None when no row has it."""
        with session_scope(self.engine) as session:
            found = session.execute(
                select(_OUTBOX.c.ts, _OUTBOX.c.sent_at)
                .where(_OUTBOX.c.target == handle, _OUTBOX.c.op == "post")
                .order_by(_OUTBOX.c.id)
                .limit(1)
            ).first()
        if found is None:
            return None
        return PENDING if found.sent_at is None else (found.ts or "")

    def renew(self) -> None:
        """Keep this replica's unsent rows its own for another ``hold_s``."""
        with session_scope(self.engine) as session:
            session.execute(
                update(_OUTBOX)
                .where(_OUTBOX.c.owner == self.owner, _OUTBOX.c.sent_at.is_(None))
                .values(owner_until=self._until(utcnow()))
            )

    def adopt(self, *, limit: int = 200) -> list[Adopted]:
        """Take over the unsent rows whose owner stopped renewing them, oldest first."""
        now = utcnow()
        with session_scope(self.engine) as session:
            stale = (
                select(_OUTBOX.c.id)
                .where(
                    _OUTBOX.c.sent_at.is_(None),
                    _OUTBOX.c.owner_until < now,
                    _OUTBOX.c.owner != self.owner,  # its own are in its queues already
                )
                .order_by(_OUTBOX.c.id)
                .limit(limit)
            )
            take = (
                update(_OUTBOX)
                .values(owner=self.owner, owner_until=self._until(now))
                .returning(*(_OUTBOX.c[c] for c in ("id", "op", "channel", "target", "payload")))
            )
            rows = claim_rows(session, stale, _OUTBOX.c.id, take)
        adopted = [
            Adopted(row=r.id, op=r.op, channel=r.channel, target=r.target, msg=decode(r.payload))
            for r in rows
        ]
        return sorted(adopted, key=lambda a: a.row)

    def release(self) -> None:
        """Hand this replica's unsent rows to the others now (a clean stop)."""
        with session_scope(self.engine) as session:
            session.execute(
                update(_OUTBOX)
                .where(_OUTBOX.c.owner == self.owner, _OUTBOX.c.sent_at.is_(None))
                .values(owner_until=_GONE)
            )

    def take_slot(self, channel: str, interval_s: float) -> float:
        """Take the channel's next send slot: 0.0 when this replica may send now, else
        the seconds until the slot is free (another replica sent within the interval)."""
        now = utcnow()
        following = now + timedelta(seconds=interval_s)
        with session_scope(self.engine) as session:
            taken = session.execute(
                update(_PACE)
                .where(_PACE.c.channel == channel, _PACE.c.next_at <= now)
                .values(next_at=following)
                .returning(_PACE.c.channel)
            ).first()
            if taken is not None:
                return 0.0
            next_at = session.execute(
                select(_PACE.c.next_at).where(_PACE.c.channel == channel)
            ).scalar_one_or_none()
            if next_at is None:
                inserted = session.execute(
                    self._dialect.insert(_PACE)
                    .values(channel=channel, next_at=following)
                    .on_conflict_do_nothing(index_elements=["channel"])
                    .returning(_PACE.c.channel)
                ).first()
                return 0.0 if inserted is not None else interval_s
        if next_at.tzinfo is None:  # SQLite's DATETIME through Core: naive UTC
            next_at = next_at.replace(tzinfo=timezone.utc)
        return max((next_at - now).total_seconds(), 0.001)

    def prune(self, *, before: datetime) -> int:
        """Forget rows sent before ``before`` (their handles are long resolved)."""
        return delete_before(self.engine, _OUTBOX.c.sent_at, before)


@dataclass(eq=False)
class OutboxLink:
    """A notifier's queues tied to an outbox: what the notifier asks of the database.

    ``cond`` is the notifier's condition: :meth:`finish` is called with it held, the
    other methods take it themselves around the queues and never hold it over a call to
    the database. A failing database is logged and never raised: the message stays in
    memory, paced by this replica alone, as without an outbox.
    """

    outbox: Outbox
    queues: ChannelQueues
    cond: threading.Condition
    #: The channel's pace: seconds between calls, for all replicas together.
    min_interval_s: float
    #: Rows to mark (id, ts) once the lock is released.
    _finished: list[tuple[int, str | None]] = field(default_factory=list)
    _pruned: datetime | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        """Renew and adopt on a thread of its own, every third of the hold, so that a
        slow Slack call on the notifier's worker never lets this replica's rows lapse."""
        self._thread = threading.Thread(target=self._loop, name="slack-outbox", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None

    def _loop(self) -> None:
        while True:
            try:
                self.housekeep()
            except Exception:  # a bug: keep renewing, the rows must not lapse
                log.exception("Slack: outbox housekeeping failed")
            if self._stop.wait(self.outbox.hold_s / 3):
                return

    def write(self, op: str, channel: str, target: str, msg: Message) -> tuple[bool, int | None]:
        """Write a post or update before it is queued: (written, its row; None when its
        key was queued already)."""
        try:
            return True, self.outbox.add(op=op, channel=channel, target=target, msg=msg)
        except (DatabaseError, TypeError) as exc:
            log.warning("Slack: the outbox did not take a %s to %s: %s", op, channel, exc)
            return False, None

    def coalesced(self, msg: Message, *, refill: int | None, superseded: int | None) -> None:
        """An update went into a queued op: ``refill`` (a queued post's row) takes its
        content, ``superseded`` (the older row) is done."""
        if refill is not None:
            self._store(Outbox.replace, refill, msg)
        if superseded is not None:
            self._store(Outbox.done, superseded, ts=None)

    def finish(self, op: Op, ts: str | None) -> None:
        """``op``'s row is settled (lock held): marked by the next :meth:`flush`."""
        if op.row is not None:
            self._finished.append((op.row, ts))
            op.row = None

    def flush(self) -> None:
        """Mark the settled rows (lock not held)."""
        with self.cond:
            finished, self._finished = self._finished, []
        for row, ts in finished:
            self._store(Outbox.done, row, ts=ts)

    def release(self) -> None:
        self._store(Outbox.release)

    def housekeep(self) -> None:
        """Renew this replica's rows; queue those of replicas that stopped renewing theirs."""
        now = utcnow()
        try:
            self.outbox.renew()
            adopted = self.outbox.adopt()
            if self._pruned is None or now - self._pruned > timedelta(hours=1):
                self._pruned = now
                self.outbox.prune(before=utcnow() - KEEP_SENT)
        except DatabaseError as exc:
            log.warning("Slack: cannot renew or adopt outbox rows: %s", exc)
            return
        if not adopted:
            return
        log.warning("Slack: sending %d message(s) queued by a replica that stopped", len(adopted))
        merged: list[int] = []
        with self.cond:
            for row in adopted:
                msg = row.msg
                if row.op == "post":
                    self.queues.add_post(
                        Op("post", row.channel, row.target, msg=msg, thread=msg.thread_ts,
                           first=msg, row=row.row)
                    )  # fmt: skip
                    continue
                target = self.queues.follow(row.target)
                if self.queues.coalesce(row.channel, target, msg) is not None:
                    merged.append(row.row)  # a queued op carries its content now
                    continue
                self.queues.add_update(
                    Op("update", row.channel, target, msg=msg, thread=msg.thread_ts, row=row.row)
                )
            self.cond.notify_all()
        for row_id in merged:
            self._store(Outbox.done, row_id, ts=None)

    def held_back(self, op: Op) -> float:
        """Seconds ``op`` must wait: for the channel's shared pace, or for a root or
        message another replica has queued and not sent. 0.0: send it now."""
        try:
            for handle in (op.thread, op.target if op.kind == "update" else None):
                if handle is None or not handle.startswith(HANDLE_PREFIX):
                    continue
                with self.cond:
                    known = handle in self.queues.channels or handle in self.queues.resolved
                if known:
                    continue
                found = self.outbox.ts_of(handle)
                if found is PENDING:
                    return REMOTE_WAIT_S
                if isinstance(found, str):
                    with self.cond:
                        self.queues.resolved[handle] = found or DROPPED
                        self.queues.channels.setdefault(handle, op.channel)
            return self.outbox.take_slot(op.channel, self.min_interval_s)
        except DatabaseError as exc:
            log.warning("Slack: the outbox is unreachable, pacing %s alone: %s", op.channel, exc)
            return 0.0

    def _store(self, change: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        """``change(outbox, *args, **kwargs)``, a failing database logged."""
        try:
            change(self.outbox, *args, **kwargs)
        except DatabaseError as exc:
            log.warning("Slack: the outbox could not be updated: %s", exc)
