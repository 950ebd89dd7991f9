"""The Slack notifier: posts and updates messages from a queue, within Slack's rate limits.

:meth:`SlackNotifier.post` returns at once: the control plane calls it inside database
transactions and request handlers, and Slack can take seconds, or answer 429. The
returned :class:`~jobs.outbound.notify.MessageRef` carries a local handle
(``"pending-<session>-<n>"``) in place of Slack's ``ts``; the caller stores it like a
ts (a run's ``thread_ts``, an alert's ``message_ts``) and hands it back to
:meth:`~SlackNotifier.update` or as a message's ``thread_ts``. One worker thread sends
everything, from one queue per channel:

- **Threads.** A reply whose ``thread_ts`` is the handle of a root not yet sent waits
  for it, then goes under the root's real ts.
- **Pace.** At most one call per channel per ``min_interval_s`` (Slack allows about one
  message per second per channel). A 429 holds the channel for its ``Retry-After`` and
  the same call is sent again: nothing is lost and no 429 escapes.
- **Coalescing.** An update of a message whose post, or previous update, is still
  queued replaces that queued content: only the newest is sent, so ten quick updates
  of a run card cost one ``chat.update`` (or none, when the post had not gone yet).
  Posts are never skipped, and alerts never merged: every alert goes out.
- **Folding** (:mod:`bot.slack_fold`). Text lines that share a ``fold`` key (a run's
  runner warnings), and a run's lines past ``max_run_backlog`` queued posts in a
  channel, become one message, edited, with their count, for ``fold_window_s``.
- **Severity.** A channel's queue sends critical alerts first, then other alerts, then
  the rest (:func:`bot.slack_queue.rank`): another run's backlog never holds a page back.
- **Errors.** 5xx answers, Slack's ``internal_error``-like errors and broken
  connections are retried with exponential backoff, ``max_retries`` times (alerts
  without end). Blocks Slack refuses (``msg_blocks_too_long``, ``invalid_blocks`` …)
  are sent again as a compact version that keeps the start, the end (the verdict, the
  ``/train`` command) and the buttons, then, if refused again, as that text alone; an
  update of a message that is gone, or whose post was refused, is posted as a new one,
  which later updates then edit. Anything else (``channel_not_found``,
  ``not_in_channel`` …) is logged, with what to do, and that message is dropped.
- **Mentions.** An escalation's on-call handle is resolved to an id (``mentions``, a
  :class:`bot.mentions.MentionResolver`) on the worker thread, so the page notifies.
- **Attachments.** After a post, ``attachments(msg)`` may name a PNG (the divergent
  loss alert's curve); a digest's ``chart_png`` is used as is. The file goes into the
  message's thread with files upload v2. ``attachments`` runs on the worker thread
  (drawing a chart there keeps it off the caller's path) and may return None.

The handle → ts map lives in memory. Without an outbox nothing is written to the
database here: after a restart the handles stored by the previous process are unknown,
so an update of such a message is posted as a new message in its thread (and a reply
under an unknown root as a new top-level message); later updates of the same handle
then edit that new message. ``on_resolved`` lets the composition root persist the map
if it wants to.

With an outbox (:mod:`bot.slack_outbox`, PostgreSQL and several replicas: see
:meth:`SlackNotifier.use_outbox`), every post and update is written to the database
before it is queued and marked when Slack has it; the worker takes each channel's pace
slot from the database before a call, asks the outbox for handles other replicas
posted, renews its rows and adopts those of replicas that died. The queues above stay
as they are: coalescing, 429s and threads work the same.

Give this class a ``WebClient`` without ``RateLimitErrorRetryHandler``: it handles 429s
itself, per channel, without blocking the other channels.

The queues, the handle → ts map and the coalescing live in :mod:`bot.slack_queue`; this
module sends, classifies Slack's answers and decides what happens next.
"""

from __future__ import annotations

import http.client
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError

from bot import views
from bot.mentions import MentionResolver
from bot.plots import SPEND_CHART_FILENAME
from bot.slack_fold import Folder
from bot.slack_outbox import Outbox, OutboxLink
from bot.slack_queue import DROPPED, HANDLE_PREFIX, Attachment, ChannelQueues, Op
from jobs.outbound.backoff import Backoff
from jobs.outbound.notify import AlertMessage, DigestMessage, Message, MessageRef, TextMessage

log = logging.getLogger(__name__)

AttachmentsFn = Callable[[Message], tuple[str, bytes] | None]

#: Slack errors that say "try again later", though the HTTP status is 200.
TRANSIENT_ERRORS = frozenset(
    {"internal_error", "fatal_error", "service_unavailable", "request_timeout", "ratelimited"}
)
#: Slack refused the blocks themselves: the text alone still gets through.
BLOCK_ERRORS = frozenset(
    {
        "invalid_blocks",
        "invalid_blocks_format",
        "too_many_blocks",
        "msg_too_long",
        "msg_blocks_too_long",
        "invalid_arguments",
        "invalid_attachments",
    }
)
#: An update whose message is gone or frozen: post the content as a new message instead.
UPDATE_GONE_ERRORS = frozenset({"message_not_found", "cant_update_message", "edit_window_closed"})
#: What to do about the permanent errors people can fix.
REMEDIES = {
    "channel_not_found": "check the channel id (the spec's notify.channel, or the channel the "
    "command came from) and that the app can see it",
    "not_in_channel": "invite the app to the channel: /invite @trainbot",
    "is_archived": "the channel is archived: unarchive it or point the runs at another channel",
    "invalid_auth": "check TRAINBOT_SLACK_BOT_TOKEN: it must be the app's bot token (xoxb-…)",
    "not_authed": "set TRAINBOT_SLACK_BOT_TOKEN to the app's bot token (xoxb-…)",
    "token_revoked": "the bot token was revoked: reinstall the app and update "
    "TRAINBOT_SLACK_BOT_TOKEN",
    "account_inactive": "the bot token belongs to a deactivated app: reinstall it",
    "missing_scope": "add the missing bot scope in the app manifest and reinstall the app",
    "restricted_action": "a workspace admin restricts posting in this channel",
}


@dataclass
class _Outcome:
    status: Literal["ok", "rate", "transient", "text_only", "gone", "drop"]
    ts: str | None = None
    wait: float = 0.0
    error: str = ""


class SlackNotifier:
    """A :class:`jobs.outbound.notify.Notifier` that posts to Slack from a background worker."""

    def __init__(
        self,
        client: WebClient,
        *,
        attachments: AttachmentsFn | None = None,
        min_interval_s: float = 1.0,
        max_retries: int = 6,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        on_resolved: Callable[[str, MessageRef], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        mentions: MentionResolver | None = None,
        outbox: Outbox | None = None,
        max_run_backlog: int = 10,
        fold_window_s: float = 600.0,
    ) -> None:
        self.client = client
        self.mentions = mentions if mentions is not None else MentionResolver(client)
        self.attachments = attachments
        self.min_interval_s = min_interval_s
        self.max_retries = max_retries
        self.backoff = Backoff(backoff_s, max_backoff_s)
        self.on_resolved = on_resolved
        self.clock = clock
        # A handle names its process, so one stored by an earlier process is never
        # mistaken for one of ours.
        self._session = secrets.token_hex(3)
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._q = ChannelQueues(notify=self._cond.notify_all)
        self._closing = False
        self._folder = Folder(
            post=self._post,
            update=self.update,
            run_backlog=self._run_backlog,
            refused=self._refused,
            clock=clock,
            max_run_backlog=max_run_backlog,
            window_s=fold_window_s,
        )
        self._metrics = {
            "posted": 0,
            "sent": 0,
            "updated": 0,
            "uploaded": 0,
            "retried_429": 0,
            "retried": 0,
            "coalesced": 0,
            "dropped": 0,
        }
        self._link: OutboxLink | None = None
        if outbox is not None:
            self.use_outbox(outbox)
        self._worker = threading.Thread(target=self._run, name="slack-notifier", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ Notifier

    def use_outbox(self, outbox: Outbox) -> None:
        """Write every post and update to ``outbox`` before queueing it, from now on
        (before the control plane starts posting)."""
        link = OutboxLink(outbox, self._q, self._cond, self.min_interval_s)
        with self._cond:
            self._link = link
        link.start()

    @property
    def outbox(self) -> Outbox | None:
        return self._link.outbox if self._link is not None else None

    def post(self, msg: Message) -> MessageRef:
        """Queue ``msg``; its ref (with a local handle for ``ts``) comes back at once.

        A text line folded into an earlier message gets that message's ref."""
        if isinstance(msg, TextMessage):
            folded = self._folder.fold(msg)
            if folded is not None:
                return folded
        return self._post(msg)

    def _post(self, msg: Message) -> MessageRef:
        handle = f"{HANDLE_PREFIX}{self._session}-{next(self._ids)}"
        op = Op("post", msg.channel, handle, msg=msg, thread=msg.thread_ts, first=msg)
        if self._link is not None and not self._closing:
            written, op.row = self._link.write("post", msg.channel, handle, msg)
            if written and op.row is None:
                log.info("Slack: %s (key %s) was queued already; not again", handle, msg.key)
                return MessageRef(channel=msg.channel, ts=handle)
        with self._cond:
            if self._closing:
                log.error(
                    "Slack notifier is closed; not posting to %s: %s",
                    msg.channel,
                    views.fallback_text(msg)[:200],
                )
                return MessageRef(channel=msg.channel, ts=handle)
            self._q.add_post(op)
        return MessageRef(channel=msg.channel, ts=handle)

    def update(self, ref: MessageRef, msg: Message) -> None:
        """Queue new content for a posted message; only the newest queued content is sent."""
        row: int | None = None
        if self._link is not None and not self._closing:
            _, row = self._link.write("update", ref.channel, ref.ts, msg)
        superseded: int | None = None
        refill: int | None = None
        with self._cond:
            if self._closing:
                log.error("Slack notifier is closed; not updating %s in %s", ref.ts, ref.channel)
                return
            target = self._q.follow(ref.ts)  # a known handle -> its real ts
            if target == DROPPED:
                # Its post was refused (and logged): this content goes out as a new message.
                log.warning("Slack: %s was refused; posting its update as a new message", ref.ts)
                target = ref.ts
            queued = self._q.coalesce(ref.channel, target, msg)
            if queued is None:
                self._q.add_update(
                    Op("update", ref.channel, target, msg=msg, thread=msg.thread_ts, row=row)
                )
            else:
                self._metrics["coalesced"] += 1
                if queued.kind == "update":  # the newest row goes with the op
                    superseded, queued.row = queued.row, row
                else:  # the queued post's row takes the content
                    superseded, refill = row, queued.row
        if self._link is not None:
            self._link.coalesced(msg, refill=refill, superseded=superseded)

    def _run_backlog(self, channel: str, run_id: str) -> int:
        with self._cond:
            return self._q.run_backlog(channel, run_id)

    def _refused(self, handle: str) -> bool:
        with self._cond:
            return self._q.follow(handle) == DROPPED

    # ------------------------------------------------------------------ control

    def resolve(self, ref: MessageRef, *, timeout: float = 0.0) -> MessageRef | None:
        """The message's real ref once Slack has it; None while pending or if refused."""
        with self._cond:
            if ref.ts.startswith(HANDLE_PREFIX):
                self._cond.wait_for(lambda: ref.ts in self._q.resolved, timeout=timeout)
            ts = self._q.follow(ref.ts)
            if not ts or ts.startswith(HANDLE_PREFIX):
                return None
            return MessageRef(channel=self._q.channels.get(ref.ts, ref.channel), ts=ts)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything queued is sent (or dropped); False on timeout."""
        with self._cond:
            return self._cond.wait_for(self._q.idle, timeout=timeout)

    def close(self, timeout: float = 10.0) -> bool:
        """Send what is queued (up to ``timeout``), then stop; False if some was left."""
        flushed = self.flush(timeout)
        with self._cond:
            self._closing = True
            left = self._q.waiting()
            self._cond.notify_all()
        self._worker.join(timeout=5.0)
        if self._link is not None:
            self._link.stop()
            self._link.release()  # the other replicas send what is left
        if left:
            log.error(
                "Slack notifier closed with %d message(s) not sent%s",
                left,
                "; the other replicas send them" if self._link is not None else "",
            )
        return flushed

    @property
    def metrics(self) -> dict[str, int]:
        """Counters: sent (every successful call), posted, updated, uploaded,
        retried_429, retried (other transient errors), coalesced, folded (text lines
        shown in an earlier message's count), dropped."""
        with self._cond:
            return {**self._metrics, "folded": self._folder.folded}

    def queue_depths(self) -> dict[str, int]:
        """Messages waiting per channel, the one in flight included (a
        :class:`jobs.web.prometheus.PostQueue`, with :attr:`metrics` for the 429s)."""
        with self._cond:
            return self._q.depths()

    @property
    def pending(self) -> int:
        with self._cond:
            return self._q.waiting() + (self._q.in_flight is not None)

    # ------------------------------------------------------------------ worker

    def _run(self) -> None:
        while True:
            with self._cond:
                op: Op | None = None
                while op is None:
                    if self._closing:
                        return  # close() has waited for the queue; what is left stays
                    op, wait = self._q.next(self.clock())
                    if op is None:
                        self._cond.wait(timeout=wait)
                self._q.in_flight = op
                link = self._link
            wait = link.held_back(op) if link is not None else 0.0  # outside the lock
            if wait > 0:
                with self._cond:
                    self._q.ready_at[op.channel] = self.clock() + wait
                    self._requeue(op)
                    self._q.in_flight = None
                    self._cond.notify_all()
                if link is not None:
                    link.flush()
                continue
            self._resolve_mentions(op)  # may ask Slack: outside the lock
            with self._cond:
                call = self._prepare(op)
            outcome = self._send(op, call)
            follow_up = self._attachment_after(op, outcome)
            with self._cond:
                self._settle(op, outcome, follow_up)
                self._q.in_flight = None
                self._cond.notify_all()
            if link is not None:
                link.flush()

    def _finish(self, op: Op, ts: str | None) -> None:
        """``op``'s outbox row is settled: sent (post: at ``ts``), refused, superseded."""
        if self._link is not None:
            self._link.finish(op, ts)

    # ------------------------------------------------------------------ sending

    def _thread_ts(self, thread: str | None) -> str | None:
        if not thread:
            return None
        ts = self._q.follow(thread)  # a re-posted root moves its thread too
        if not ts or ts.startswith(HANDLE_PREFIX):
            log.warning(
                "Slack: the thread root %s is unknown (posted before a restart, or refused); "
                "posting at the top level of the channel instead",
                thread,
            )
            return None
        return ts

    def _resolve_mentions(self, op: Op) -> None:
        """An escalation's handle as the id Slack notifies (the handle when unknown)."""
        msg = op.msg
        if not isinstance(msg, AlertMessage) or not msg.escalate_to:
            return
        try:
            found = self.mentions.resolve(msg.escalate_to)
        except Exception:  # the page still goes out, naming the handle
            log.exception("Slack: could not resolve %r to a mention", msg.escalate_to)
            return
        if found is not None:
            op.msg = replace(msg, escalate_to=found)

    def _prepare(self, op: Op) -> tuple[str, dict[str, Any]]:
        """The Web API method and arguments for ``op``, handles resolved (lock held)."""
        if op.kind == "upload":
            assert op.upload is not None
            filename, data = op.upload
            return "files_upload_v2", {
                "channel": op.channel,
                "thread_ts": op.thread,
                "file": data,
                "filename": filename,
                "title": filename,
            }
        assert op.msg is not None
        content: dict[str, Any] = {"text": views.fallback_text(op.msg)}
        if not op.text_only:
            try:
                draw = views.compact if op.compact else views.render
                content["blocks"] = draw(op.msg)
            except Exception:
                log.exception(
                    "Slack: could not render %s; sending text only", type(op.msg).__name__
                )
        if op.kind == "update":
            target = self._q.follow(op.target)
            if target and not target.startswith(HANDLE_PREFIX) and not op.as_post:
                return "chat_update", {"channel": op.channel, "ts": target, **content}
            op.as_post = True
        thread = self._thread_ts(op.thread)
        args = {"channel": op.channel, **content, "unfurl_links": False, "unfurl_media": False}
        if thread:
            args["thread_ts"] = thread
        return "chat_postMessage", args

    def _send(self, op: Op, call: tuple[str, dict[str, Any]]) -> _Outcome:
        method, args = call
        try:
            response = getattr(self.client, method)(**args)
        except SlackApiError as exc:
            return self._classify(exc)
        except (SlackClientError, OSError, http.client.HTTPException) as exc:
            # SlackRequestError (an upload URL that did not answer 200), connection
            # refused or reset, timeouts: worth another try.
            return _Outcome("transient", error=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a bug: it must not kill the worker, and retrying won't help
            log.exception("Slack: %s failed unexpectedly", method)
            return _Outcome("drop", error=f"{type(exc).__name__}: {exc}")
        data = response.data if isinstance(response.data, dict) else {}
        return _Outcome("ok", ts=data.get("ts"))

    def _classify(self, exc: SlackApiError) -> _Outcome:
        response = exc.response
        status = getattr(response, "status_code", 0) or 0
        data = response.data if isinstance(getattr(response, "data", None), dict) else {}
        error = str(data.get("error") or f"HTTP {status}")
        if status == 429 or error == "ratelimited":
            headers = getattr(response, "headers", {}) or {}
            raw = headers.get("Retry-After") or headers.get("retry-after") or "1"
            try:
                wait = max(float(raw), 0.0)
            except (TypeError, ValueError):
                wait = 1.0
            return _Outcome("rate", wait=wait, error=error)
        if status >= 500 or error in TRANSIENT_ERRORS:
            return _Outcome("transient", error=error)
        if error in BLOCK_ERRORS:
            return _Outcome("text_only", error=error)
        if error in UPDATE_GONE_ERRORS:
            return _Outcome("gone", error=error)
        return _Outcome("drop", error=error)

    def _attachment_after(self, op: Op, outcome: _Outcome) -> Op | None:
        """The upload that follows a successful post, if its message has a file."""
        if op.kind == "upload" or outcome.status != "ok" or op.first is None:
            return None
        msg = op.first
        found: Attachment | None = None
        try:
            if isinstance(msg, DigestMessage) and msg.chart_png:
                found = (SPEND_CHART_FILENAME, msg.chart_png)
            elif self.attachments is not None:
                found = self.attachments(msg)
        except Exception:  # a chart is a nicety; the message itself went out
            log.exception("Slack: no attachment for %s: drawing it failed", type(msg).__name__)
            return None
        if not found:
            return None
        # Into the message's thread: the root's, or the message's own when it is a root.
        return Op(
            "upload",
            op.channel,
            op.target,
            thread=msg.thread_ts,
            upload=found,
        )

    # ------------------------------------------------------------------ outcomes

    def _settle(self, op: Op, outcome: _Outcome, follow_up: Op | None) -> None:
        now = self.clock()
        channel = op.channel
        if outcome.status == "ok":
            self._q.ready_at[channel] = now + self.min_interval_s
            self._metrics["sent"] += 1
            if op.kind == "upload":
                self._metrics["uploaded"] += 1
            elif op.kind == "update" and not op.as_post:
                self._metrics["updated"] += 1
                self._finish(op, None)
            else:
                self._metrics["posted"] += 1
                self._finish(op, outcome.ts or "")
                if outcome.ts:
                    self._remember(op.target, channel, outcome.ts)
            if follow_up is not None:
                # The upload's thread: the root the message is in, or the message itself.
                root = self._q.follow(follow_up.thread) if follow_up.thread else None
                if not root or root.startswith(HANDLE_PREFIX):
                    root = None
                follow_up.thread = root or outcome.ts
                if follow_up.thread:
                    self._q.enqueue(follow_up, front=True)
            return
        if outcome.status == "rate":
            self._metrics["retried_429"] += 1
            self._q.ready_at[channel] = now + max(outcome.wait, self.min_interval_s)
            self._requeue(op)
            return
        if outcome.status == "text_only" and not op.text_only and op.kind != "upload":
            log.warning(
                "Slack refused the blocks of a %s in %s (%s); sending it %s",
                type(op.msg).__name__,
                channel,
                outcome.error,
                "as text" if op.compact else "in short",
            )
            op.text_only = op.compact
            op.compact = True
            self._q.ready_at[channel] = now + self.min_interval_s
            self._requeue(op)
            return
        if outcome.status == "gone" and op.kind == "update" and not op.as_post:
            log.warning(
                "Slack: message %s in %s cannot be updated (%s); posting the update as new",
                op.target,
                channel,
                outcome.error,
            )
            op.as_post = True
            self._requeue(op)
            return
        if outcome.status == "transient":
            op.attempts += 1
            never_drop = isinstance(op.msg, AlertMessage)
            if op.attempts <= self.max_retries or never_drop:
                self._metrics["retried"] += 1
                delay = self.backoff.delay(op.attempts)
                self._q.ready_at[channel] = now + max(delay, self.min_interval_s)
                log.warning(
                    "Slack: %s in %s failed (%s); retry %d in %.1f s",
                    op.kind,
                    channel,
                    outcome.error,
                    op.attempts,
                    delay,
                )
                self._requeue(op)
                return
        self._drop(op, outcome)

    def _requeue(self, op: Op) -> None:
        """Back to the head of its channel's queue, unless newer content supersedes it."""
        if not self._q.requeue(op):
            self._metrics["coalesced"] += 1
            self._finish(op, None)

    def _remember(self, handle: str, channel: str, ts: str) -> None:
        """``handle`` (or the ts of a message that had to be posted again) is now ``ts``."""
        if not handle or handle == ts:
            return
        self._q.resolved[handle] = ts
        if handle.startswith(HANDLE_PREFIX):
            self._q.channels.setdefault(handle, channel)
        if self.on_resolved is not None:
            try:
                self.on_resolved(handle, MessageRef(channel=channel, ts=ts))
            except Exception:
                log.exception("Slack: on_resolved(%s) failed", handle)

    def _drop(self, op: Op, outcome: _Outcome) -> None:
        self._metrics["dropped"] += 1
        self._finish(op, "")
        what = type(op.msg).__name__ if op.msg is not None else "file"
        remedy = REMEDIES.get(outcome.error, "see the error in Slack's API documentation")
        log.error(
            "Slack refused a %s %s in channel %s: %s. Dropped that message only; %s.",
            what,
            "upload" if op.kind == "upload" else op.kind,
            op.channel,
            outcome.error,
            remedy,
        )
        was_post = op.kind == "post" or (op.kind == "update" and op.as_post)
        if was_post and op.target.startswith(HANDLE_PREFIX) and op.target not in self._q.resolved:
            self._q.resolved[op.target] = DROPPED
            self._q.channels.setdefault(op.target, op.channel)
