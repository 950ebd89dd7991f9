"""Folding a run's text lines into one message, so one run cannot flood a channel.

Slack takes about one message per second per channel: a runner batch of 300 warnings,
posted one by one, is five minutes of queue in front of everything else in the channel.
:class:`Folder` turns such lines into one message, edited:

- Lines that share a ``fold`` key (:attr:`jobs.outbound.notify.Message.fold`, a run's runner
  warnings) go into one message: its first line posts it; each later one replaces its
  content with the newest line and how many there were. Until the post goes out that
  is a change of the queued post (nothing more is queued); after, one ``chat.update``
  that later lines coalesce into. Either way a key holds at most one queued call.
- A run that already has ``max_run_backlog`` posts waiting in a channel has its further
  lines folded the same way, into a message that says they came too fast.

Nothing is dropped: every line is counted in the message people read. A fold takes
lines for ``window_s`` after its first (after that, a new line starts a new message,
where people will see it), and a fold whose post Slack refused starts anew.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone

from jobs.outbound.notify import Message, MessageRef, TextMessage


@dataclass
class _Fold:
    """The one message a fold key's lines go into."""

    ref: MessageRef
    #: Lines it stands for, the first included.
    count: int
    #: When its first line came: the notifier's clock, and the wall clock people read.
    since: float
    since_text: str
    #: Folded because its run had too many posts queued (not by the sender's key).
    backlog: bool


class Folder:
    """The fold keys of one notifier and the message each one's lines go into.

    ``post`` and ``update`` are the notifier's own (``post`` never folds);
    ``run_backlog(channel, run_id)`` counts that run's queued posts in the channel;
    ``refused(handle)`` says whether Slack refused a post for good.
    """

    def __init__(
        self,
        *,
        post: Callable[[Message], MessageRef],
        update: Callable[[MessageRef, Message], None],
        run_backlog: Callable[[str, str], int],
        refused: Callable[[str], bool],
        clock: Callable[[], float],
        max_run_backlog: int,
        window_s: float,
    ) -> None:
        self._post = post
        self._update = update
        self._run_backlog = run_backlog
        self._refused = refused
        self._clock = clock
        self.max_run_backlog = max_run_backlog
        self.window_s = window_s
        #: Lines shown only in an earlier message's count.
        self.folded = 0
        self._folds: dict[tuple[str, str | None, str], _Fold] = {}
        # Keeps one key's count and edits in order; the notifier's queue lock is never
        # held here over a call (its outbox writes to the database).
        self._lock = threading.Lock()

    def fold(self, msg: TextMessage) -> MessageRef | None:
        """Fold ``msg`` into its message (posting that message when ``msg`` is its first
        line): the message's ref; None when ``msg`` is to be posted as it is."""
        name, backlog = msg.fold, False
        if name is None:
            if not msg.run_id or self.max_run_backlog <= 0:
                return None
            if self._run_backlog(msg.channel, msg.run_id) < self.max_run_backlog:
                return None
            name, backlog = f"backlog:{msg.run_id}", True
        key = (msg.channel, msg.thread_ts, name)
        with self._lock:
            now = self._clock()
            group = self._folds.get(key)
            if group is not None and (
                now - group.since > self.window_s or self._refused(group.ref.ts)
            ):
                group = None
            if group is None:
                self._forget(now)
                since = datetime.now(timezone.utc).strftime("%H:%M UTC")
                ref = self._post(msg)
                self._folds[key] = _Fold(ref, 1, now, since, backlog)
                return ref
            group.count += 1
            self.folded += 1
            self._update(group.ref, replace(msg, text=msg.text + count_line(msg, group)))
            return group.ref

    def _forget(self, now: float) -> None:
        """Drop the folds that take no more lines (a long-lived notifier sees many runs)."""
        self._folds = {k: g for k, g in self._folds.items() if now - g.since <= self.window_s}


def count_line(msg: TextMessage, group: _Fold) -> str:
    """What a folded message says about the lines it stands for."""
    run = f"run {msg.run_id}" if msg.run_id else "this run"
    if group.backlog:
        return (
            f"\n({group.count} messages from {run} since {group.since_text} came faster than "
            "Slack takes them (about one a second per channel), so they are folded into this "
            "one; this is the newest.)"
        )
    what = "warnings" if msg.kind == "warning" else "messages like this"
    return f"\n({group.count} {what} from {run} since {group.since_text}; this is the newest.)"
