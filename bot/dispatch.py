"""From a typed command to the service call and a reply: shared by every front end.

Listeners stay thin: parse, call :func:`dispatch`, render. What each verb does, who
sees its reply and who may run it is declared once, in :mod:`bot.verbs`; a command no
verb declares is refused here before anything runs. No traceback ever reaches a user:
our own errors become their message, anything else a short apology (and a log line
with the traceback for the operator).

Every reply is clipped to :data:`bot.messages.MAX_REPLY_TEXT` by
:func:`bot.replies.fit_lines`, with an honest "N more".
For Slack (``markup="slack"``, what the Slack listeners get) it is also escaped, so a
spec named ``<!channel>`` pings nobody; the only markup a reply keeps is the mention of
an on-call person by id. The console gets the plain text.

Authorisation runs here too, for every front end: a front end passes the signed
:class:`~bot.auth.Caller` and its :class:`~bot.auth.Authorizer`, and the command is
described as an :class:`~bot.auth.Ask` (:func:`ask_for`, from its verb's declared
permission) and decided before anything runs. Only in-process callers that already
decided (the service's own tests) pass an :class:`~jobs.usecases.service.Actor` instead.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import Any, Literal

from sqlmodel import select

from bot import commands, replies
from bot.auth import Ask, Authorizer, Caller
from bot.command_types import RunCommand
from bot.mentions import escape, mention
from bot.verbs import ONCALL_KEY, VERBS, Reply, Verb
from jobs.database.db import session_scope
from jobs.database.models import Run
from jobs.domain.errors import PermissionDenied, TrainbotError
from jobs.process.deps import Deps
from jobs.process.logs import bare_traceback
from jobs.spec import spec_from_text
from jobs.spec.sources import load_spec_for, one_fetch_per_repository
from jobs.usecases.service import Actor

__all__ = ["Markup", "Reply", "ask_for", "dispatch", "handle_text"]

log = logging.getLogger(__name__)


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
    # A spec repository is read once per command: the spec authorised (where its run
    # reports) is the spec launched, even if its branch moves in between.
    with one_fetch_per_repository():
        return _dispatch(deps, command, actor, auth=auth, key=key, markup=markup, audit=audit)


def _dispatch(
    deps: Deps,
    command: commands.Command | str,
    actor: Actor | Caller,
    *,
    auth: Authorizer | None,
    key: str | None,
    markup: Markup,
    audit: bool,
) -> Reply:
    if isinstance(command, str):
        text = command
        try:
            command = commands.parse(text)
        except commands.CommandError as exc:
            log.debug("a command did not parse: %s", commands.summary(text))
            return _finish(Reply(text=exc.plain, ephemeral=True, outcome="invalid"), markup)
    verb = VERBS.get(type(command))
    if verb is None:  # declared nowhere, so no policy says who may run it: nobody may
        log.error("command %r has no declaration in bot.verbs; refused", command)
        return _finish(Reply(text=replies.unexpected(), ephemeral=True, outcome="failed"), markup)
    if isinstance(actor, Caller):
        if auth is None:
            raise TypeError("a Caller is authorised: pass the front end's Authorizer")
        denial = auth.authorize(actor, ask_for(deps, command), audit=audit)
        if denial is not None:  # our own sentence, whose only markup is the owner's mention
            refused = Reply(
                text=denial.text, ephemeral=True, run_id=denial.run_id, outcome="refused"
            )
            return _finish(refused, "plain")
        actor = auth.actor(actor)
    try:
        reply = verb.run(deps, command, actor, key=key)
    except TrainbotError as exc:
        outcome: Literal["refused", "failed"] = (
            "refused" if isinstance(exc, PermissionDenied) else "failed"
        )
        reply = Reply(text=replies.error(str(exc)), ephemeral=True, outcome=outcome)
    except Exception as exc:
        # The command as parsed, its env values masked (its repr), and where it failed,
        # without any exception's message: a database error quotes the values it was given.
        log.error("command %r failed: %s", command, bare_traceback(exc))
        reply = Reply(text=replies.unexpected(), ephemeral=True, outcome="failed")
    return _finish(reply, markup, what=verb.lines)


#: Parse and run one `/train …` command, for the console: its reply is plain text.
handle_text = functools.partial(dispatch, markup="plain")


def ask_for(deps: Deps, command: commands.Command) -> Ask:
    """What a command would do, for the authoriser, from its verb's declared
    :class:`~bot.verbs.Permission`: whether it starts compute (launch, preflight with its
    dry run, resubmit in every form), the run it changes and whose that is, whether it
    sets the on-call, and where a new run would report. A command declared nowhere has
    no answer (TypeError): :func:`dispatch` refuses it before it gets here."""
    verb = _declared(command)
    policy = verb.policy
    if policy.reads_only is not None and policy.reads_only(command):
        return Ask(action=verb.name)
    run_id = command.run if policy.changes_run and isinstance(command, RunCommand) else None
    reports_to = None
    if policy.new_run and isinstance(command, commands.Launch | commands.Preflight):
        reports_to = _notify_channel(deps, command)
    return Ask(
        action=verb.name,
        starts_compute=policy.starts_compute,
        run=run_id,
        owner=None if run_id is None else _owner(deps, run_id),  # None: no such run
        sets_oncall=policy.sets_oncall,
        reports_to=reports_to,
    )


def _declared(command: commands.Command) -> Verb[Any]:
    verb = VERBS.get(type(command))
    if verb is None:
        raise TypeError(f"{type(command).__name__} is declared nowhere in bot.verbs")
    return verb


def _owner(deps: Deps, run_id: str) -> str | None:
    with session_scope(deps.engine) as session:
        return session.exec(select(Run.requester).where(Run.id == run_id)).first()


def _notify_channel(deps: Deps, command: commands.Launch | commands.Preflight) -> str | None:
    """The channel the spec (with its overrides) names in ``notify.channel``; None when
    it names none or cannot be read (then the service refuses it in its own words)."""
    if command.spec is None:
        return None
    text = command.spec_text if isinstance(command, commands.Launch) else None
    try:
        if text is not None:
            spec = spec_from_text(text, name=command.spec, overrides=command.overrides)
        else:
            spec = load_spec_for(deps.settings, command.spec, overrides=command.overrides)
    except TrainbotError:
        return None
    return spec.notify.channel or None


def _finish(reply: Reply, markup: Markup, *, what: str = "lines") -> Reply:
    """Escape the reply for Slack (keeping a validated on-call mention), then clip it."""
    text = reply.text
    if markup == "slack":
        text = escape(text)
        who = reply.data.get(ONCALL_KEY)
        if isinstance(who, str) and who:
            text = text.replace(escape(who), mention(who), 1)
    return replace(reply, text=replies.fit_lines(text, what=what))
