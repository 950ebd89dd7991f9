"""The typed commands ``/train …`` text parses into (:mod:`bot.commands` parses, and
exports them: import them from there).

Each command's help text is its class docstring: the first line is the summary shown by
``/train help``, the rest (with an example) is shown by ``/train help <command>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, ClassVar, dataclass_transform


class BotError(Exception):
    """Root of every error the chat front ends raise on purpose."""


class CommandError(BotError):
    """The ``/train`` text does not follow the grammar; the message shows how to fix it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        #: The message as written, for a front end that shows text as it is (the
        #: console, a form field); ``str()`` may be escaped (:class:`ParseError`).
        self.plain = message


class ParseError(CommandError):
    """What :func:`bot.commands.parse` raises: ``str()`` is safe as Slack mrkdwn. Slack's
    three control characters (``&``, ``<``, ``>``) are escaped, so a ``<!channel>`` the
    message echoes pings nobody and the ``<run>`` of a usage line shows as typed; the
    Slack front end answers with it as it is. :attr:`plain` is the text unescaped."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.args = (message.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;"),)


#: A key that points into the spec's ``env`` (and the key, when text is not key=value).
_SECRET_KEY = re.compile(r"\s*env\b[\w.\-]*", re.IGNORECASE)
#: What a masked value is shown as.
MASK = "…"


def masked_override(text: str) -> str:
    """``key.path=value`` as it may be shown or logged: an ``env`` value (a credential, as
    often as a hyperparameter) becomes ``…``, whatever its name. Decided by where the key
    points, not by what it is called (``jobs.spec.env.shown_override`` is the spec's twin:
    this module stays free of the server's dependencies)."""
    found = _SECRET_KEY.match(text)
    if found is None:
        return text
    key, eq, _ = text.partition("=")
    return f"{key}={MASK}" if eq else f"{found.group(0)}{MASK}"


@dataclass_transform(frozen_default=True)
@dataclass(frozen=True)
class Command:
    """Base of every parsed command; ``verb`` and ``usage`` describe its grammar.

    A subclass is a frozen dataclass that gives its usage line, whose word after
    ``/train`` is its verb: ``class Stop(RunCommand, usage="/train stop <run>")``.
    """

    verb: ClassVar[str] = ""
    usage: ClassVar[str] = ""

    def __init_subclass__(cls, *, usage: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if usage:
            cls.usage = usage
            cls.verb = usage.split()[1]
        dataclass(frozen=True)(cls)
        cls.__repr__ = Command.__repr__  # type: ignore[method-assign]

    def __repr__(self) -> str:
        """The command with every ``env`` value masked: this is what a log line shows."""
        shown = []
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name == "overrides":
                value = tuple(masked_override(text) for text in value)
            elif item.name == "spec_text" and value is not None:
                value = f"<{len(value):,} characters>"  # its env values may be credentials
            shown.append(f"{item.name}={value!r}")
        return f"{type(self).__name__}({', '.join(shown)})"


class RunCommand(Command):
    """A command about one run."""

    #: Run id.
    run: str


class AlertCommand(Command):
    """A command about one alert."""

    #: Alert id.
    alert: str


class Launch(Command, usage="/train launch [<spec> [key.path=value …]]"):
    """Start a run from a spec; preflight checks run first and ask you to confirm.

    Overrides change the spec for this run only. Without a spec, opens the launch form.
    Example: /train launch gpt-small budget.usd=800 resources.zone=us-east-1b
    """

    #: Spec name, or None to open the launch form.
    spec: str | None
    #: Inline overrides, ``key.path=value``, in the order given.
    overrides: tuple[str, ...] = ()
    #: The spec file's text, when the command-line client sent one (``spec`` is then its
    #: name); None: ``spec`` names a file in the specs directory. Never from chat text.
    spec_text: str | None = None


class Preflight(Command, usage="/train preflight <spec> [key.path=value …]"):
    """Run the preflight checks (quota, capacity, data locality, dry run) without launching.

    Example: /train preflight gpt-small accelerator.count=8
    """

    #: Spec name.
    spec: str
    #: Inline overrides, ``key.path=value``, in the order given.
    overrides: tuple[str, ...] = ()


class Specs(Command, usage="/train specs"):
    """List the specs you can launch, each with its description and where it comes from.

    Specs come from the directories and git repositories an admin set; a name in more
    than one of them is launched from the first, and source/name picks another.
    Example: /train specs
    """


class StatusCommand(Command, usage="/train status [<run>]"):
    """Show a run's state, step, spend and alerts; without a run, a summary of yours.

    Example: /train status r-7f3a2c
    """

    #: Run id, or None for a summary.
    run: str | None = None


class ListRuns(Command, usage="/train list [mine|active|all]"):
    """List runs: yours, the active ones (default) or all of them.

    Example: /train list mine
    """

    scopes: ClassVar[tuple[str, ...]] = ("mine", "active", "all")

    #: One of ``scopes``.
    scope: str = "active"


class Stop(RunCommand, usage="/train stop <run>"):
    """Stop a run: checkpoint, terminate its instance, stop billing.

    Example: /train stop r-7f3a2c
    """


class Release(RunCommand, usage="/train release <run>"):
    """End a run's kept failed instance now (debug.keep_failed_instance), stop its billing.

    Example: /train release r-7f3a2c
    """


class Resubmit(
    RunCommand,
    usage=(
        "/train resubmit <run> [from=<step>] [budget.usd=<dollars>] [key.path=value …] "
        "[--max-price <dollars>]"
    ),
):
    """Start a new attempt of a run from its last committed checkpoint, or with from=N
    from the newest checkpoint at or before step N (after a divergence), optionally with
    changes.

    The spend so far carries over, so a run stopped at its budget's hard cap continues
    only with a raised budget.usd, recorded with who raised it; without budget.usd the
    budget stays as it was. Changes (key.path=value, as for launch) take the command,
    env (hyperparameters), resources (region, zones, instance type) and a few others;
    the checks for what changed run again, and the thread records old → new and who
    (an env value, which may be a credential, is never shown: only that it changed).
    --max-price waits for capacity at or below that price per instance-hour.
    Example: /train resubmit r-7f3a2c env.LR=3e-4 --max-price 1.20
    """

    #: The new budget in USD (``budget.usd=N``), or None to keep the run's.
    budget_usd: float | None = None
    #: Resume from the newest checkpoint at or before this step (``from=N``); None: the newest.
    from_step: int | None = None
    #: Spec changes, ``key.path=value``, in the order given.
    overrides: tuple[str, ...] = ()
    #: Wait for a price per instance-hour at or below this (``--max-price``); None: any.
    max_price: float | None = None


class Logs(RunCommand, usage="/train logs <run> [attempt] [node]"):
    """Show the last lines a run's training command printed, from the run's store, so
    they are there after its instance is gone: its newest attempt and first node unless
    you name others.

    Example: /train logs r-7f3a2c 2 0
    """

    #: The attempt's number (1, 2 …); None: the newest that started.
    attempt: int | None = None
    #: The node of a multi-node attempt (0: the first).
    node: int = 0


class Ack(AlertCommand, usage="/train ack <alert>"):
    """Acknowledge an alert: it stops notifying and will not escalate.

    Example: /train ack al-91b2
    """


class Snooze(AlertCommand, usage="/train snooze <alert> <duration>"):
    """Silence an alert for a while (s, m, h or d; at most 7 days).

    Example: /train snooze al-91b2 2h
    """

    #: How long to stay silent, in seconds (1 … MAX_SNOOZE_S).
    seconds: int


class Spend(Command, usage="/train spend [day|week|month]"):
    """Show spend per run and per user for the last day (default), week or month.

    Example: /train spend week
    """

    periods: ClassVar[tuple[str, ...]] = ("day", "week", "month")

    #: One of ``periods``.
    period: str = "day"


class BudgetCommand(Command, usage="/train budget"):
    """Show run and team budgets, what is spent, and the alert thresholds.

    Example: /train budget
    """


@dataclass(frozen=True)
class UserRef:
    """A chat user as typed: a Slack mention carries an id, a plain ``@name`` only a name."""

    #: Slack user id (``U123…``), or None for a plain ``@name``.
    user_id: str | None
    #: Display name, or None for a bare ``<@U123>`` mention.
    name: str | None


class Oncall(Command, usage="/train oncall [@user]"):
    """Show who is on call, or hand on-call over to someone.

    Example: /train oncall @dana
    """

    #: The new on-call engineer, or None to show the current one.
    user: UserRef | None = None


class Cleanup(RunCommand, usage="/train cleanup <run> [--dry-run]"):
    """Delete a run's old checkpoints by its retention policy; the newest is always kept.

    With --dry-run, lists what would be deleted and deletes nothing.
    Example: /train cleanup r-7f3a2c --dry-run
    """

    #: Report only; delete nothing.
    dry_run: bool = False


class Stage(
    Command,
    usage="/train stage <s3://…|gs://…> <region> | /train stage <run> | /train stage status",
):
    """Copy a dataset into the staging bucket of a region, so runs there read it locally.

    Shows the size, the transfer cost and the time, then copies server-side (S3 multipart
    copy, Cloud Storage rewrite), resuming after a restart; the progress is posted here.
    Runs in that region whose data_uri is the dataset then read the copy. With a run whose
    preflight found its data in another region: its dataset, into its region, with the
    progress in its thread. `status` lists the copies.
    Example: /train stage s3://team-data/tokens us-west-2
    """

    #: The dataset (``s3://bucket/prefix``); None: the run's, or list the copies.
    source: str | None = None
    region: str | None = None
    #: The run whose dataset to copy.
    run: str | None = None


class Token(Command, usage="/train token [new [<name>]|list|revoke <id>|revoke all]"):
    """Get a token for the command-line client and CI, shown once, to you alone.

    The client (trainbot launch, list, status, logs, stop …) sends it. It acts as you,
    in this channel, with what you may do here; it expires in 90 days. `list` shows
    your tokens, `revoke <id>` (or `revoke all`) ends them at once.
    Example: /train token new laptop
    """

    actions: ClassVar[tuple[str, ...]] = ("new", "list", "revoke")

    #: One of ``actions``.
    action: str = "new"
    #: ``new``: the token's name (None: "cli"); ``revoke``: its id, or ``all``.
    name: str | None = None


class Help(Command, usage="/train help [<command>]"):
    """Show the commands, or the details of one.

    Example: /train help snooze
    """

    #: A verb, or None for the list of commands.
    command: str | None = None
