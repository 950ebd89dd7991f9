"""From a typed command to the service call and a reply: shared by every front end.

Listeners stay thin: parse, call :func:`dispatch`, render. No traceback ever reaches a
user: our own errors become their message, anything else a short apology (and a log
line with the traceback for the operator).

Every reply is clipped to :data:`bot.messages.MAX_REPLY_TEXT` with an honest "N more".
For Slack (``markup="slack"``, what the Slack listeners get) it is also escaped, so a
spec named ``<!channel>`` pings nobody; the only markup a reply keeps is the mention of
an on-call person by id. The console gets the plain text.

Authorisation runs here too, for every front end: a front end passes the signed
:class:`~bot.auth.Caller` and its :class:`~bot.auth.Authorizer`, and the command is
described as an :class:`~bot.auth.Ask` (:func:`ask_for`) and decided before anything
runs. Only in-process callers that already decided (the service's own tests) pass an
:class:`~jobs.service.Actor` instead.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from sqlmodel import select

from bot import commands, messages
from bot.auth import Ask, Authorizer, Caller
from bot.mentions import escape, mention
from jobs import service
from jobs.db import session_scope
from jobs.deps import Deps
from jobs.errors import TrainbotError
from jobs.logs import bare_traceback
from jobs.models import Run
from jobs.service import Actor
from jobs.spec import load_spec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reply:
    """What a command answers: text for the person who asked, and the data behind it."""

    text: str
    #: True for errors and help: Slack shows these only to the person who asked.
    ephemeral: bool = False
    #: The run or alert the reply is about, for front ends that add buttons.
    run_id: str | None = None
    alert_id: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


Markup = Literal["slack", "plain"]


def dispatch(
    deps: Deps,
    command: commands.Command | str,
    actor: Actor | Caller,
    *,
    auth: Authorizer | None = None,
    key: str | None = None,
    markup: Markup = "slack",
    audit: bool = True,
) -> Reply:
    """Run one command, parsed or as its `/train …` text, for ``actor``: a front end's
    :class:`Caller`, whom ``auth`` authorises first (a refusal is audited unless
    ``audit`` is False, for a repeated delivery), or an already trusted :class:`Actor`."""
    if isinstance(command, str):
        text = command
        try:
            command = commands.parse(text)
        except commands.CommandError as exc:
            log.debug("a command did not parse: %s", commands.summary(text))
            return _finish(Reply(text=exc.plain, ephemeral=True), markup)
    if isinstance(actor, Caller):
        if auth is None:
            raise TypeError("a Caller is authorised: pass the front end's Authorizer")
        denial = auth.authorize(actor, ask_for(deps, command), audit=audit)
        if denial is not None:  # our own sentence, whose only markup is the owner's mention
            refused = Reply(text=denial.text, ephemeral=True, run_id=denial.run_id)
            return _finish(refused, "plain")
        actor = auth.actor(actor)
    what = "runs" if isinstance(command, commands.ListRuns | commands.StatusCommand) else "lines"
    try:
        reply = _dispatch(deps, command, actor, key=key)
    except TrainbotError as exc:
        reply = Reply(text=messages.error(str(exc)), ephemeral=True)
    except Exception as exc:
        # The command as parsed, its env values masked (its repr), and where it failed,
        # without any exception's message: a database error quotes the values it was given.
        log.error("command %r failed: %s", command, bare_traceback(exc))
        reply = Reply(text=messages.unexpected(), ephemeral=True)
    return _finish(reply, markup, what=what)


#: Parse and run one `/train …` command, for the console: its reply is plain text.
handle_text = functools.partial(dispatch, markup="plain")


def ask_for(deps: Deps, command: commands.Command) -> Ask:
    """What a command would do, for the authoriser: whether it starts compute (launch,
    preflight with its dry run, resubmit in every form), the run it changes and whose
    that is, whether it sets the on-call, and where a new run would report."""
    verb = command.verb
    if isinstance(command, commands.Oncall):
        return Ask(action=verb, sets_oncall=command.user is not None)
    if isinstance(command, commands.Launch | commands.Preflight):
        return Ask(action=verb, starts_compute=True, reports_to=_notify_channel(deps, command))
    run_id = _changed_run(command)
    if run_id is None:
        return Ask(action=verb)
    owner = _owner(deps, run_id)  # None: no such run, and the service says so
    return Ask(
        action=verb,
        starts_compute=isinstance(command, commands.Resubmit),
        run=run_id,
        owner=owner,
    )


def _changed_run(command: commands.Command) -> str | None:
    """The run a command changes, when only its owner or an admin may do that."""
    if isinstance(command, commands.Stop | commands.Resubmit):
        return command.run
    if isinstance(command, commands.Cleanup) and not command.dry_run:
        return command.run
    return None


def _owner(deps: Deps, run_id: str) -> str | None:
    with session_scope(deps.engine) as session:
        return session.exec(select(Run.requester).where(Run.id == run_id)).first()


def _notify_channel(deps: Deps, command: commands.Launch | commands.Preflight) -> str | None:
    """The channel the spec (with its overrides) names in ``notify.channel``; None when
    it names none or cannot be read (then the service refuses it in its own words)."""
    if command.spec is None:
        return None
    try:
        spec = load_spec(
            command.spec, specs_dir=deps.settings.specs_dir, overrides=command.overrides
        )
    except TrainbotError:
        return None
    return spec.notify.channel or None


#: Reply.data key: the on-call name the text holds, to be shown as a mention in Slack.
_ONCALL = "oncall"


def _finish(reply: Reply, markup: Markup, *, what: str = "lines") -> Reply:
    """Escape the reply for Slack (keeping a validated on-call mention), then clip it."""
    text = reply.text
    if markup == "slack":
        text = escape(text)
        who = reply.data.get(_ONCALL)
        if isinstance(who, str) and who:
            text = text.replace(escape(who), mention(who), 1)
    return replace(reply, text=messages.fit_lines(text, what=what))


def _dispatch(deps: Deps, command: commands.Command, actor: Actor, *, key: str | None) -> Reply:
    if isinstance(command, commands.Help):
        return Reply(text=commands.help_text(command.command), ephemeral=True)
    if isinstance(command, commands.Launch | commands.Preflight):
        if command.spec is None:
            names = ", ".join(service.specs(deps)) or "none"
            return Reply(
                text=f"Which spec? /train launch <spec> [key=value …]. Specs: {names}",
                ephemeral=True,
            )
        launch = isinstance(command, commands.Launch)
        run = service.submit(
            deps,
            spec_name=command.spec,
            overrides=command.overrides,
            actor=actor,
            idempotency_key=key,
            launch=launch,
        )
        say = messages.submitted if launch else messages.preflight_only
        return Reply(text=say(run.id, run.spec_name), run_id=run.id)
    if isinstance(command, commands.StatusCommand):
        cards = service.status(deps, command.run, actor)
        return Reply(text=messages.run_list(cards, "active"), run_id=command.run)
    if isinstance(command, commands.ListRuns):
        cards = service.list_runs(deps, command.scope, actor)
        return Reply(text=messages.run_list(cards, command.scope))
    if isinstance(command, commands.Stop):
        run = service.stop(deps, command.run, actor)
        return Reply(text=messages.stopped(run.id), run_id=run.id)
    if isinstance(command, commands.Resubmit):
        run = service.resubmit(
            deps,
            command.run,
            actor,
            budget_usd=command.budget_usd,
            from_step=command.from_step,
            overrides=command.overrides,
            max_price=command.max_price,
        )
        if command.from_step is not None:
            text = messages.resubmitted_from(command.run, run.id, run.last_committed_step)
        elif command.overrides or command.max_price is not None:
            text = messages.resubmitted_changed(command.run, run.id, command.max_price)
        else:
            text = messages.resubmitted(command.run, run.id)
        return Reply(text=text, run_id=run.id)
    if isinstance(command, commands.Logs):
        return Reply(text=service.logs(deps, command.run, actor), ephemeral=True)
    if isinstance(command, commands.Ack):
        alert = service.acknowledge(deps, command.alert, actor)
        return Reply(text=messages.acked(alert.id, alert.acked_by or actor.user), alert_id=alert.id)
    if isinstance(command, commands.Snooze):
        alert = service.snooze(deps, command.alert, command.seconds, actor)
        return Reply(text=messages.snoozed(alert.id, alert.snoozed_until), alert_id=alert.id)
    if isinstance(command, commands.Spend):
        report = service.spend_report(deps, command.period, actor)
        return Reply(text=messages.spend_report(report), data=report)
    if isinstance(command, commands.BudgetCommand):
        return Reply(text=messages.budget_table(service.budgets(deps, actor)))
    if isinstance(command, commands.Oncall):
        user = None
        if command.user is not None:
            ref = command.user
            user = f"<@{ref.user_id}>" if ref.user_id else f"@{ref.name}"
        current = service.oncall(deps, user, actor)
        return Reply(
            text=messages.oncall(current, changed=user is not None),
            data={_ONCALL: current} if current else {},
        )
    if isinstance(command, commands.Cleanup):
        summary = service.cleanup(deps, command.run, actor, dry_run=command.dry_run)
        return Reply(text=messages.cleanup(summary), run_id=command.run, data=summary)
    raise commands.CommandError(f"{type(command).__name__} is not handled yet")
