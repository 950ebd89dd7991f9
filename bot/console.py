"""The terminal front end: the local equivalent of Slack, over the same command layer.

``trainbot shell`` reads `/train …` commands (the ``/train`` is optional), prints the
same messages Slack would show, and prints alerts as they fire. Messages in a run's
thread are indented under the run; updates in place are printed as a new line only
when something a person cares about changed (state, alert status, count).

The person at the terminal is authorised as in Slack, by the same decision
(:class:`bot.auth.LocalAuthorizer`): their login name must be on ``TRAINBOT_LAUNCHERS``
(when it is set) to start compute, and only ``TRAINBOT_ADMINS`` change others' runs.
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
from collections.abc import Callable
from typing import TextIO

from bot import messages
from bot.auth import Caller, LocalAuthorizer, Policy
from bot.dispatch import Reply, handle_text
from jobs.outbound.notify import AlertMessage, Message, MessageRef, RunCard
from jobs.process.deps import Deps


class ConsoleNotifier:
    """Prints messages to a stream; never blocks on anything but the stream."""

    def __init__(self, out: TextIO | None = None, *, channel: str = "console") -> None:
        self.out = out or sys.stdout
        self.channel = channel
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._last: dict[str, str] = {}
        #: Every message posted or updated, for the demo's checks and tests.
        self.history: list[tuple[str, MessageRef, Message]] = []
        self.listeners: list[Callable[[str, MessageRef, Message], None]] = []

    def post(self, msg: Message) -> MessageRef:
        ref = MessageRef(channel=msg.channel, ts=f"{next(self._ids):06d}")
        self._emit("post", ref, msg)
        return ref

    def update(self, ref: MessageRef, msg: Message) -> None:
        self._emit("update", ref, msg)

    def _emit(self, kind: str, ref: MessageRef, msg: Message) -> None:
        text = messages.render(msg)
        with self._lock:
            self.history.append((kind, ref, msg))
            for listener in self.listeners:
                listener(kind, ref, msg)
            summary = _summary(msg)
            if kind == "update" and self._last.get(ref.ts) == summary:
                return
            self._last[ref.ts] = summary
            prefix = "  ↳ " if msg.thread_ts else ""
            if kind == "update":
                prefix = "  ↻ " if msg.thread_ts else "↻ "
            body = text.replace("\n", "\n" + " " * len(prefix))
            print(f"{prefix}{body}", file=self.out, flush=True)


@functools.singledispatch
def _summary(msg: Message) -> str:
    """What must change for an update to be worth printing again: by default, its text."""
    return messages.render(msg)


@_summary.register
def _(msg: RunCard) -> str:
    return f"{msg.state}|{msg.attempt}|{msg.reason}"


@_summary.register
def _(msg: AlertMessage) -> str:
    # A repeat raises the count on the message; only a change of state is news here.
    return f"{msg.state}|{msg.severity}|{msg.escalate_to}|{msg.snoozed_until}"


class Shell:
    """A read-eval-print loop over the command layer."""

    PROMPT = "trainbot> "

    def __init__(
        self,
        deps: Deps,
        *,
        user: str,
        channel: str = "console",
        stdin: TextIO | None = None,
        out: TextIO | None = None,
    ) -> None:
        self.deps = deps
        #: The person at the terminal, in the console's one channel, of this team.
        self.caller = Caller(team=None, user=user, channel=channel)
        #: The rules as the settings say them now, decided as for Slack.
        self.auth = LocalAuthorizer(Policy.from_settings(deps.settings), journal=deps.journal)
        # The launches that happen later on their own ask the same list, when they happen.
        deps.may_launch = self.auth.may_start
        self.stdin = stdin or sys.stdin
        self.out = out or sys.stdout

    def run_line(self, line: str) -> Reply | None:
        text = line.strip()
        if not text or text.startswith("#"):
            return None
        if text in ("quit", "exit", "/quit", "/exit"):
            raise EOFError
        reply = handle_text(self.deps, text, self.caller, auth=self.auth)
        print(reply.text, file=self.out, flush=True)
        return reply

    def loop(self) -> int:
        interactive = self.stdin.isatty()
        print(
            "trainbot shell: type /train help (the /train is optional); quit with Ctrl-D.",
            file=self.out,
            flush=True,
        )
        while True:
            if interactive:
                print(self.PROMPT, end="", file=self.out, flush=True)
            line = self.stdin.readline()
            if not line:
                return 0
            try:
                self.run_line(line)
            except EOFError:
                return 0
            except KeyboardInterrupt:
                print("", file=self.out)
                continue
