"""The Slack notifier's queues: one per channel, the handle → ts map, and coalescing.

Plain state, with no thread and no lock of its own: :class:`bot.slack_notifier.SlackNotifier`
holds its condition's lock around every call, and its one worker thread sends what
:meth:`ChannelQueues.next` hands it.

- A message's handle (``"pending-<session>-<n>"``) stands for its ts until Slack has
  sent it; :meth:`~ChannelQueues.follow` says where a handle, or a message that had to
  be posted again, lives now.
- A reply under a root not yet sent, or an update of a message not yet sent, waits for
  it (:meth:`~ChannelQueues.next` skips that channel meanwhile).
- Coalescing: new content for a message whose post, or previous update, is still queued
  replaces that queued content (:meth:`~ChannelQueues.coalesce`); an update sent back
  to its queue is dropped when a newer one is already there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from jobs.outbound.notify import AlertMessage, Message

HANDLE_PREFIX = "pending-"
#: The resolved value of a handle whose post Slack refused for good.
DROPPED = ""

Attachment = tuple[str, bytes]

#: The ranks of :func:`rank`, most urgent first.
CRITICAL_RANK, ALERT_RANK, OTHER_RANK = 0, 1, 2


@dataclass(eq=False)
class Op:
    """One queued Web API call (or, for an update of an unknown message, a post)."""

    kind: Literal["post", "update", "upload"]
    channel: str
    #: post: the message's own handle; update: the target (handle or real ts);
    #: upload: the handle of the message the file belongs to.
    target: str
    msg: Message | None = None
    #: The thread as the caller gave it (may be a handle); upload: the real ts of the
    #: thread the file is shared into.
    thread: str | None = None
    #: post: what attachments are looked up from (the content as first posted).
    first: Message | None = None
    upload: Attachment | None = None
    attempts: int = 0
    #: Slack refused the full blocks: send views.compact (then, refused again, text only).
    compact: bool = False
    text_only: bool = False
    #: update: the message is unknown or gone, so post the content as a new one.
    as_post: bool = False
    #: Its row in the durable outbox (``bot.slack_outbox``), when there is one.
    row: int | None = None


def rank(op: Op) -> int:
    """How soon ``op`` goes out in its channel: a critical alert (new, or its change of
    state) before other alerts, alerts before run cards, thread lines and files."""
    if isinstance(op.msg, AlertMessage):
        return CRITICAL_RANK if op.msg.severity.upper() == "CRITICAL" else ALERT_RANK
    return OTHER_RANK


class ChannelQueues:
    """The calls waiting per channel, when each channel may send again, and the handles.

    ``notify`` is called whenever an op is queued (the notifier wakes its worker).
    """

    def __init__(self, notify: Callable[[], None]) -> None:
        self._notify = notify
        self.queues: dict[str, deque[Op]] = {}
        self.ready_at: dict[str, float] = {}
        #: handle -> real ts; absent while pending; DROPPED when Slack refused the post.
        self.resolved: dict[str, str] = {}
        self.channels: dict[str, str] = {}
        #: Queued (not in flight) posts by handle, and updates by (channel, target).
        self.queued_posts: dict[str, Op] = {}
        self.queued_updates: dict[tuple[str, str], Op] = {}
        self.in_flight: Op | None = None

    def add_post(self, op: Op) -> None:
        self.channels[op.target] = op.channel
        self.queued_posts[op.target] = op
        self.enqueue(op)

    def add_update(self, op: Op) -> None:
        self.queued_updates[(op.channel, op.target)] = op
        self.enqueue(op)

    def coalesce(self, channel: str, target: str, msg: Message) -> Op | None:
        """Put ``msg`` in the queued post or update of ``target`` and return that op;
        None when none is queued."""
        post = self.queued_posts.get(target)
        if post is not None:
            post.msg = msg  # the post has not gone: it goes with this content
            return post
        queued = self.queued_updates.get((channel, target))
        if queued is not None:
            queued.msg = msg
            return queued
        return None

    def enqueue(self, op: Op, *, front: bool = False) -> None:
        """Queue ``op`` after the ops of its rank or a more urgent one (``front``: ahead
        of those of its own rank: a retry, a message's file), and never ahead of the post
        of the root or message it needs."""
        queue = self.queues.setdefault(op.channel, deque())
        mine = rank(op)
        at = len(queue)
        for index, queued in enumerate(queue):
            theirs = rank(queued)
            if theirs > mine or (front and theirs == mine):
                at = index
                break
        if op.kind == "post":  # a retried root: never behind the replies that wait for it
            for index, queued in enumerate(queue):
                if index >= at:
                    break
                if op.target in (queued.thread, queued.target):
                    at = index
                    break
        needs = {op.thread, op.target if op.kind != "post" else None} - {None}
        for index in range(len(queue) - 1, at - 1, -1):
            queued = queue[index]
            if queued.kind == "post" and queued.target in needs:
                at = index + 1
                break
        queue.insert(at, op)
        self._notify()

    def run_backlog(self, channel: str, run_id: str) -> int:
        """Posts about run ``run_id`` queued in ``channel`` (alerts not counted)."""
        return sum(
            1
            for op in self.queues.get(channel, ())
            if op.kind == "post"
            and not isinstance(op.msg, AlertMessage)
            and getattr(op.msg, "run_id", None) == run_id
        )

    def requeue(self, op: Op) -> bool:
        """Back to the head of its channel's queue; False when newer content supersedes it."""
        if op.kind == "update" and not op.as_post:
            key = (op.channel, op.target)
            if key in self.queued_updates:
                return False  # the newer update carries the latest content
            self.queued_updates[key] = op
        elif op.kind == "post":
            self.queued_posts[op.target] = op
        self.enqueue(op, front=True)
        return True

    def idle(self) -> bool:
        return self.in_flight is None and not any(self.queues.values())

    def waiting(self) -> int:
        """Ops queued, not counting the one in flight."""
        return sum(len(q) for q in self.queues.values())

    def depths(self) -> dict[str, int]:
        """Ops waiting per channel, the one in flight included."""
        depths = {channel: len(queue) for channel, queue in self.queues.items() if queue}
        if self.in_flight is not None:
            channel = self.in_flight.channel
            depths[channel] = depths.get(channel, 0) + 1
        return depths

    def next(self, now: float) -> tuple[Op | None, float | None]:
        """The op to send now, or how long to wait for one (None: until notified)."""
        best: tuple[float, str] | None = None
        wait: float | None = None
        for channel, queue in self.queues.items():
            if not queue or self._blocked_on(queue[0]):
                continue
            ready = self.ready_at.get(channel, 0.0)
            if ready <= now:
                if best is None or ready < best[0]:
                    best = (ready, channel)
            else:
                wait = ready - now if wait is None else min(wait, ready - now)
        if best is None:
            return None, wait
        op = self.queues[best[1]].popleft()
        self._unindex(op)
        return op, None

    def follow(self, ts: str) -> str:
        """Where a handle (or a message that had to be posted again) lives now.

        The ts itself when nothing is known about it; ``DROPPED`` when its post was
        refused; a handle still pending stays that handle.
        """
        for _ in range(8):  # handle -> ts -> re-posted ts …; never a long chain
            following = self.resolved.get(ts)
            if following is None or following == ts:
                return ts
            if following == DROPPED:
                return DROPPED
            ts = following
        return ts

    def _blocked_on(self, op: Op) -> bool:
        """Whether the op needs a root (or its own message) that has not been sent yet."""
        for ts in (op.thread, op.target if op.kind != "post" else None):
            if ts is None or not ts.startswith(HANDLE_PREFIX):
                continue
            if ts in self.channels and ts not in self.resolved:
                return True
        return False

    def _unindex(self, op: Op) -> None:
        if op.kind == "post":
            self.queued_posts.pop(op.target, None)
        elif op.kind == "update":
            self.queued_updates.pop((op.channel, op.target), None)
