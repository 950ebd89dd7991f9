"""Every ``/train`` verb, declared once: its command, what it does, who sees the reply,
and who may run it.

A :class:`Verb` binds a command class (whose parser is in :mod:`bot.commands`) to its
handler (one service call and the reply it makes) and to its :class:`Permission`, as
bolt binds a listener to a command and errbot a ``@botcmd`` to a method. The
dispatcher looks a command up here, asks the authoriser what the permission asks, and
calls the handler; the Slack listener reads from here whether the reply is private,
whether every delivery runs it, and whether it opens the launch form. A command class
that is not declared is refused before anything runs, and a declaration cannot be made
without a permission, so a new verb is never dispatched with an unstated policy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Literal, TypeVar

from bot import commands, messages, replies
from bot.command_types import RunCommand
from bot.commands import (
    Ack,
    BudgetCommand,
    Cleanup,
    Command,
    Help,
    Launch,
    ListRuns,
    Logs,
    Oncall,
    Preflight,
    Release,
    Resubmit,
    Snooze,
    Specs,
    Spend,
    Stage,
    StatusCommand,
    Stop,
    Token,
)
from jobs.process.deps import Deps
from jobs.runs import kept
from jobs.staging import service as staging
from jobs.usecases import service
from jobs.usecases.service import Actor
from jobs.web import api_tokens

__all__ = [
    "ANYONE",
    "ONCALL_KEY",
    "VERBS",
    "Permission",
    "Reply",
    "Verb",
    "declared",
    "index",
]

C = TypeVar("C", bound=Command)


@dataclass(frozen=True)
class Reply:
    """What a command answers: text for the person who asked, and the data behind it."""

    text: str
    #: True when Slack shows it only to the person who asked: errors, help, and the
    #: replies of a private verb (:attr:`Verb.private`).
    ephemeral: bool = False
    #: The run or alert the reply is about, for front ends that add buttons.
    run_id: str | None = None
    alert_id: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    #: How the command went, for a front end that answers with a status (the HTTP API):
    #: done; the text did not parse; refused (who may do what); or it failed.
    outcome: Literal["ok", "invalid", "refused", "failed"] = "ok"


#: Reply.data key: the on-call name the text holds, to be shown as a mention in Slack.
ONCALL_KEY = "oncall"


@dataclass(frozen=True)
class Permission:
    """Who may run a verb, beyond being one of the team in an allowed channel (which
    :class:`bot.auth.Authorizer` checks for every verb). Each field adds one rule; a
    permission with none (:data:`ANYONE`) asks nothing more, and the service shows and
    changes only what the caller's channel sees."""

    #: It starts compute (needs a launcher): only people on ``TRAINBOT_LAUNCHERS`` as it
    #: stands when the command acts.
    starts_compute: bool = False
    #: It changes the run it names (``command.run``): only that run's requester or an admin.
    changes_run: bool = False
    #: It sets who is on call: admins only (launchers, when no admins are configured).
    sets_oncall: bool = False
    #: It creates a run from a spec, which reports to the spec's ``notify.channel``: a
    #: private channel only for its members.
    new_run: bool = False
    #: True of a command that only reads, for which none of the above applies
    #: (``cleanup --dry-run``, ``oncall`` without a name); None: the rules always apply.
    reads_only: Callable[[Any], bool] | None = None


#: A verb anyone of the team in an allowed channel may run: it reads, or acts on their
#: channel's alerts (acknowledging one is for all of the channel), and starts nothing.
ANYONE = Permission()

#: A handler: the service call and its reply, for an actor the dispatcher has authorised.
#: ``key`` is the delivery's idempotency key (None outside Slack).
Handler = Callable[[Deps, C, Actor, str | None], Reply]


@dataclass(frozen=True)
class Verb(Generic[C]):
    """One ``/train`` verb: everything about it but its grammar (in :mod:`bot.commands`)."""

    #: The command class its text parses into; its ``verb`` is the word after ``/train``.
    command: type[C]
    #: Who may run it. Required: a verb without a stated policy cannot be declared.
    policy: Permission
    #: Whether the reply is for the person who asked alone (Slack: ephemeral): its public
    #: record is a run's card or an alert's message, or it answers only them.
    private: bool
    #: The service call and its reply; None when :attr:`answer` answers it.
    handle: Handler[C] | None = None
    #: The reply when the command alone answers it (help), with no I/O: the Slack
    #: listener gives it in the acknowledgement, before any check that needs the Web API.
    answer: Callable[[C], str] | None = None
    #: Whether every delivery runs it: the service takes the delivery's key and returns
    #: what the first delivery did, so a delivery that died half-way is finished by a
    #: retry. Other verbs run once per key and ignore a repeat.
    keyed: bool = False
    #: True of a command that asks for the launch form (``launch`` with no spec): Slack
    #: opens the form; a front end without forms gets the handler's reply.
    wants_form: Callable[[C], bool] | None = None
    #: What the reply's lines are, for the "N more" when it is clipped.
    lines: Literal["lines", "runs"] = "lines"

    def __post_init__(self) -> None:
        name = self.command.__name__
        if not isinstance(self.policy, Permission):
            raise TypeError(f"{name}: a verb needs a Permission, got {self.policy!r}")
        if (self.handle is None) == (self.answer is None):
            raise TypeError(f"{name}: give a handler or an answer (one of the two)")
        if self.policy.changes_run and not issubclass(self.command, RunCommand):
            raise TypeError(f"{name} changes a run but names none")

    @property
    def name(self) -> str:
        return self.command.verb

    @property
    def parse(self) -> Callable[[Sequence[str]], Command]:
        """The verb's parser: the arguments after the verb, as words, to its command."""
        return commands.grammar()[self.name][1]

    def run(self, deps: Deps, command: C, actor: Actor, *, key: str | None = None) -> Reply:
        """Call the service for an authorised ``actor`` and make the reply."""
        if self.answer is not None:
            return Reply(text=self.answer(command), ephemeral=self.private)
        assert self.handle is not None  # __post_init__: one of the two
        reply = self.handle(deps, command, actor, key)
        if self.private and not reply.ephemeral:
            return replace(reply, ephemeral=True)
        return reply


# ----------------------------------------------------------------------------- handlers


def _submit(deps: Deps, command: Launch | Preflight, actor: Actor, key: str | None) -> Reply:
    if command.spec is None:
        names = ", ".join(service.specs(deps)) or "none"
        text = f"Which spec? /train launch <spec> [key=value …]. Specs: {names}"
        return Reply(text=text, ephemeral=True)
    launch = isinstance(command, Launch)
    run = service.submit(
        deps,
        spec_name=command.spec,
        overrides=command.overrides,
        spec_text=command.spec_text if isinstance(command, Launch) else None,
        actor=actor,
        idempotency_key=key,
        launch=launch,
    )
    say = replies.submitted if launch else replies.preflight_only
    return Reply(text=say(run.id, run.spec_name), run_id=run.id)


def _specs(deps: Deps, command: Specs, actor: Actor, key: str | None) -> Reply:
    return Reply(text=replies.spec_list(service.spec_catalog(deps)))


def _status(deps: Deps, command: StatusCommand, actor: Actor, key: str | None) -> Reply:
    cards = service.status(deps, command.run, actor)
    return Reply(text=replies.run_list(cards, "active"), run_id=command.run)


def _list(deps: Deps, command: ListRuns, actor: Actor, key: str | None) -> Reply:
    cards = service.list_runs(deps, command.scope, actor)
    return Reply(text=replies.run_list(cards, command.scope))


def _stop(deps: Deps, command: Stop, actor: Actor, key: str | None) -> Reply:
    run = service.stop(deps, command.run, actor)
    return Reply(text=replies.stopped(run.id), run_id=run.id)


def _release(deps: Deps, command: Release, actor: Actor, key: str | None) -> Reply:
    ended = kept.release(deps, command.run, actor)
    return Reply(text=replies.released(command.run, [row.instance_id for row in ended]))


def _resubmit(deps: Deps, command: Resubmit, actor: Actor, key: str | None) -> Reply:
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
        text = replies.resubmitted_from(command.run, run.id, run.last_committed_step)
    elif command.overrides or command.max_price is not None:
        text = replies.resubmitted_changed(command.run, run.id, command.max_price)
    else:
        text = replies.resubmitted(command.run, run.id)
    return Reply(text=text, run_id=run.id)


def _logs(deps: Deps, command: Logs, actor: Actor, key: str | None) -> Reply:
    found = service.logs(deps, command.run, actor, attempt=command.attempt, node=command.node)
    return Reply(text=messages.run_log(found), run_id=found.run_id)


def _ack(deps: Deps, command: Ack, actor: Actor, key: str | None) -> Reply:
    alert = service.acknowledge(deps, command.alert, actor)
    return Reply(text=replies.acked(alert.id, alert.acked_by or actor.user), alert_id=alert.id)


def _snooze(deps: Deps, command: Snooze, actor: Actor, key: str | None) -> Reply:
    alert = service.snooze(deps, command.alert, command.seconds, actor)
    return Reply(text=replies.snoozed(alert.id, alert.snoozed_until), alert_id=alert.id)


def _spend(deps: Deps, command: Spend, actor: Actor, key: str | None) -> Reply:
    report = service.spend_report(deps, command.period, actor)
    return Reply(text=replies.spend_report(report), data=report)


def _budget(deps: Deps, command: BudgetCommand, actor: Actor, key: str | None) -> Reply:
    return Reply(text=replies.budget_table(service.budgets(deps, actor)))


def _oncall(deps: Deps, command: Oncall, actor: Actor, key: str | None) -> Reply:
    user = None
    if command.user is not None:
        ref = command.user
        user = f"<@{ref.user_id}>" if ref.user_id else f"@{ref.name}"
    current = service.oncall(deps, user, actor)
    return Reply(
        text=replies.oncall(current, changed=user is not None),
        data={ONCALL_KEY: current} if current else {},
    )


def _cleanup(deps: Deps, command: Cleanup, actor: Actor, key: str | None) -> Reply:
    summary = service.cleanup(deps, command.run, actor, dry_run=command.dry_run)
    return Reply(text=replies.cleanup(summary), run_id=command.run, data=summary)


def _stage(deps: Deps, command: Stage, actor: Actor, key: str | None) -> Reply:
    if command.run is not None:
        return Reply(text=staging.stage_run(deps, command.run, actor), run_id=command.run)
    if command.source is None or command.region is None:
        return Reply(text=staging.stage_status(deps))
    return Reply(text=staging.stage(deps, command.source, command.region, actor))


def _token(deps: Deps, command: Token, actor: Actor, key: str | None) -> Reply:
    if command.action == "list":
        rows = api_tokens.tokens(deps, actor)
        listed = [(row.id, row.name, row.expires_at, row.last_used_at) for row in rows]
        return Reply(text=replies.token_list(listed))
    if command.action == "revoke":
        return Reply(
            text=replies.tokens_revoked(api_tokens.revoke(deps, actor, command.name or ""))
        )
    issued = api_tokens.issue(deps, actor, name=command.name or "cli")
    text = replies.token_issued(
        issued.id,
        issued.token,
        name=issued.name,
        expires=issued.expires_at,
        url=deps.settings.public_url,
    )
    return Reply(text=text)


# ----------------------------------------------------------------------------- the verbs

#: Launch and preflight: they start compute (the dry run, then the launch) for a new run.
_NEW_RUN = Permission(starts_compute=True, new_run=True)


#: Every verb, in the order ``/train help`` lists them.
_DECLARED: tuple[Verb[Any], ...] = (
    Verb(
        Launch,
        policy=_NEW_RUN,
        private=True,
        handle=_submit,
        keyed=True,
        wants_form=lambda command: command.spec is None,
    ),
    Verb(Preflight, policy=_NEW_RUN, private=True, handle=_submit, keyed=True),
    Verb(Specs, policy=ANYONE, private=True, handle=_specs),
    Verb(StatusCommand, policy=ANYONE, private=False, handle=_status, lines="runs"),
    Verb(ListRuns, policy=ANYONE, private=False, handle=_list, lines="runs"),
    Verb(Stop, policy=Permission(changes_run=True), private=True, handle=_stop),
    Verb(Release, policy=Permission(changes_run=True), private=True, handle=_release),
    Verb(
        Resubmit,
        policy=Permission(starts_compute=True, changes_run=True),
        private=True,
        handle=_resubmit,
    ),
    Verb(Logs, policy=ANYONE, private=True, handle=_logs),
    Verb(Ack, policy=ANYONE, private=True, handle=_ack),
    Verb(Snooze, policy=ANYONE, private=True, handle=_snooze),
    Verb(Spend, policy=ANYONE, private=False, handle=_spend),
    Verb(BudgetCommand, policy=ANYONE, private=False, handle=_budget),
    Verb(
        Oncall,
        policy=Permission(sets_oncall=True, reads_only=lambda command: command.user is None),
        private=False,
        handle=_oncall,
    ),
    Verb(
        Cleanup,
        policy=Permission(changes_run=True, reads_only=lambda command: command.dry_run),
        private=False,
        handle=_cleanup,
    ),
    # A token acts as the person who asked, in their channel, with what they may do there:
    # it gives nothing chat does not, so anyone of the team may have one. Private: the
    # reply holds the token.
    # It moves data at the team's cost: launchers only; the list is anyone's.
    Verb(
        Stage,
        policy=Permission(
            starts_compute=True, reads_only=lambda c: c.source is None and c.run is None
        ),
        private=False,
        handle=_stage,
    ),
    Verb(Token, policy=ANYONE, private=True, handle=_token),
    Verb(
        Help,
        policy=ANYONE,
        private=True,
        answer=lambda command: commands.help_text(command.command),
    ),
)


def declared() -> tuple[Verb[Any], ...]:
    """Every verb, in the order ``/train help`` lists them."""
    return _DECLARED


def index(verbs: Iterable[Verb[Any]]) -> Mapping[type[Command], Verb[Any]]:
    """The verbs by command class; a class declared twice is a mistake, refused here."""
    found: dict[type[Command], Verb[Any]] = {}
    for verb in verbs:
        if verb.command in found:
            raise ValueError(f"{verb.command.__name__} is declared twice")
        found[verb.command] = verb
    return found


#: The declaration of every command class the dispatcher runs.
VERBS: Mapping[type[Command], Verb[Any]] = index(_DECLARED)
