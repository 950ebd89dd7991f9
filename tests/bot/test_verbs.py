"""Every ``/train`` verb is declared once (:mod:`bot.verbs`), with its handler, the
privacy of its reply and its permission; the dispatcher runs nothing that is not."""

from __future__ import annotations

import io
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bot import replies
from bot.auth import Ask, Caller, LocalAuthorizer, Policy
from bot.command_types import RunCommand
from bot.commands import Command, Stop, grammar, help_text, parse
from bot.console import ConsoleNotifier
from bot.dispatch import ask_for, dispatch, handle_text
from bot.listeners.runs import _modal_command_text
from bot.verbs import ANYONE, VERBS, Permission, Reply, Verb, declared, index
from jobs.database.db import session_scope
from jobs.database.models import Run
from jobs.domain.lifecycle import RunState
from jobs.outbound.notify import CallbackJournal
from jobs.process.bootstrap import ControlPlane
from jobs.process.deps import Deps
from jobs.process.settings import load_settings
from jobs.spec import load_spec
from jobs.usecases.service import Actor


def _listed_verbs() -> list[str]:
    """The verbs ``/train help`` lists, read from its text as a person sees it."""
    found = [re.match(r"`/train ([^\s`]+)", line) for line in help_text().splitlines()]
    return [m.group(1) for m in found if m is not None]


def _example(verb: str) -> str:
    """The example of ``/train help <verb>``, without its ``/train``."""
    (line,) = [x for x in help_text(verb).splitlines() if x.startswith("Example: /train ")]
    return line.removeprefix("Example: /train ")


def test_every_verb_of_help_has_exactly_one_declaration() -> None:
    listed = _listed_verbs()
    assert len(listed) == 18 and len(set(listed)) == len(listed)
    assert Counter(v.name for v in declared()) == Counter(listed)
    assert [v.name for v in declared()] == listed  # in the order help lists them
    for verb in declared():
        assert VERBS[verb.command] == verb
        assert isinstance(verb.policy, Permission)
        # Its parser is the grammar's, and its help's example parses into its command.
        cls, parser = grammar()[verb.name]
        assert cls is verb.command and verb.parse is parser
        command = parse(_example(verb.name))
        assert type(command) is verb.command
        assert verb.parse(_example(verb.name).split()[1:]) == command


class Frobnicate(RunCommand, usage="/train frobnicate <run>"):
    """A verb someone added to the grammar's classes and forgot to declare."""


class Oncallish(Command, usage="/train oncallish"):
    """A command about no run."""


def _reply(deps: Deps, command: Any, actor: Actor, key: str | None) -> Reply:
    raise AssertionError("an undeclared verb's handler must never run")


def test_a_verb_cannot_be_declared_without_a_policy() -> None:
    with pytest.raises(TypeError):
        Verb(Frobnicate, private=False, handle=_reply)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="Permission"):
        Verb(Frobnicate, policy=None, private=False, handle=_reply)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="names none"):  # changes a run it cannot name
        Verb(Oncallish, policy=Permission(changes_run=True), private=False, handle=_reply)
    with pytest.raises(TypeError, match="one of the two"):
        Verb(Frobnicate, policy=ANYONE, private=False)
    declared_once = Verb(Frobnicate, policy=ANYONE, private=False, handle=_reply)
    with pytest.raises(ValueError, match="declared twice"):
        index([declared_once, declared_once])


@pytest.fixture
def console(tmp_path: Path) -> Iterator[tuple[ControlPlane, list[dict[str, Any]]]]:
    records: list[dict[str, Any]] = []
    settings = load_settings(
        {
            "TRAINBOT_STATE_DIR": str(tmp_path / "state"),
            "TRAINBOT_INGEST_PORT": "0",
            "TRAINBOT_LAUNCHERS": "ada",
        }
    )
    journal = CallbackJournal(lambda t, run, data: records.append({"type": t, **data}))
    notifier = ConsoleNotifier(io.StringIO())
    with ControlPlane(settings, notifier=notifier, journal=journal, scheduler=False) as cp:
        yield cp, records


def _run_of(deps: Deps, requester: str) -> str:
    with session_scope(deps.engine) as session:
        spec = load_spec("tiny", specs_dir=deps.settings.specs_dir)
        run = Run(
            spec_name="tiny",
            spec=spec.model_dump(mode="json"),
            requester=requester,
            channel="console",
        )
        session.add(run)
        session.commit()
        return run.id


def _state(deps: Deps, run_id: str) -> RunState:
    with session_scope(deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None
        return run.state


def test_a_new_verb_cannot_be_dispatched_without_a_declaration(
    console: tuple[ControlPlane, list[dict[str, Any]]],
) -> None:
    cp, records = console
    deps = cp.deps
    run_id = _run_of(deps, "ada")
    auth = LocalAuthorizer(Policy.from_settings(deps.settings), journal=deps.journal)
    ada = Caller(team=None, user="ada", channel="console")

    reply = dispatch(deps, Frobnicate(run=run_id), ada, auth=auth, markup="plain")
    assert reply.ephemeral and reply.text == replies.unexpected()
    with pytest.raises(TypeError, match="declared nowhere"):
        ask_for(deps, Frobnicate(run=run_id))

    # A subclass of a declared command does not inherit its declaration (or its policy).
    class ForceStop(Stop, usage="/train forcestop <run>"):
        """Stop without a checkpoint."""

    reply = dispatch(deps, ForceStop(run=run_id), ada, auth=auth, markup="plain")
    assert reply.text == replies.unexpected()
    reply = dispatch(deps, ForceStop(run=run_id), Actor(user="ada", channel="console"))
    assert reply.text == replies.unexpected()
    assert _state(deps, run_id) == RunState.PENDING
    assert not [r for r in records if r["type"] == "denied"]


def test_each_verb_asks_what_its_declaration_says(
    console: tuple[ControlPlane, list[dict[str, Any]]],
) -> None:
    cp, _ = console
    deps = cp.deps
    run_id = _run_of(deps, "bob")
    ask = {text: ask_for(deps, parse(text)) for text in _commands(run_id)}
    new_run = Ask(action="launch", starts_compute=True)
    assert ask["launch tiny"] == new_run
    assert ask["launch"] == new_run  # the form: what its submission will be
    assert ask["launch tiny notify.channel=C0SECRET"] == Ask(
        action="launch", starts_compute=True, reports_to="C0SECRET"
    )
    assert ask["preflight tiny"] == Ask(action="preflight", starts_compute=True)
    assert ask[f"stop {run_id}"] == Ask(action="stop", run=run_id, owner="bob")
    assert ask[f"release {run_id}"] == Ask(action="release", run=run_id, owner="bob")
    assert ask[f"resubmit {run_id} from=10"] == Ask(
        action="resubmit", starts_compute=True, run=run_id, owner="bob"
    )
    assert ask["resubmit r-nosuchrun"] == Ask(
        action="resubmit", starts_compute=True, run="r-nosuchrun", owner=None
    )
    assert ask[f"cleanup {run_id}"] == Ask(action="cleanup", run=run_id, owner="bob")
    assert ask[f"cleanup {run_id} --dry-run"] == Ask(action="cleanup")
    assert ask["oncall @dana"] == Ask(action="oncall", sets_oncall=True)
    assert ask["oncall"] == Ask(action="oncall")
    for text in ("status", f"status {run_id}", "list all", f"logs {run_id}", "ack al-1",
                 "snooze al-1 2h", "spend week", "budget", "help stop"):  # fmt: skip
        assert ask[text] == Ask(action=text.split()[0]), text


def _commands(run_id: str) -> list[str]:
    return [
        "launch tiny", "launch", "launch tiny notify.channel=C0SECRET", "preflight tiny",
        f"stop {run_id}", f"release {run_id}", f"resubmit {run_id} from=10", "resubmit r-nosuchrun",
        f"cleanup {run_id}", f"cleanup {run_id} --dry-run", "oncall @dana", "oncall",
        "status", f"status {run_id}", "list all", f"logs {run_id}", "ack al-1",
        "snooze al-1 2h", "spend week", "budget", "help stop",
    ]  # fmt: skip


def test_a_private_verbs_reply_is_for_the_caller_alone(
    console: tuple[ControlPlane, list[dict[str, Any]]],
) -> None:
    # A verb whose public record is a run's card or an alert's message, or that answers
    # the caller alone; the Slack listener sends what is ephemeral to the caller only.
    private = {v.name for v in declared() if v.private}
    assert private == {
        "launch",
        "preflight",
        "specs",
        "stop",
        "release",
        "resubmit",
        "logs",
        "ack",
        "snooze",
        "token",
        "help",
    }
    cp, _ = console
    deps = cp.deps
    run_id = _run_of(deps, "ada")
    ada = Actor(user="ada", channel="console")
    assert handle_text(deps, "help", ada).ephemeral
    assert handle_text(deps, f"logs {run_id}", ada).ephemeral
    assert not handle_text(deps, "list all", ada).ephemeral
    assert not handle_text(deps, "oncall @grace", ada).ephemeral
    assert not handle_text(deps, f"status {run_id}", ada).ephemeral
    stopped = handle_text(deps, f"stop {run_id}", ada)
    assert stopped.ephemeral and stopped.run_id == run_id, stopped
    assert _state(deps, run_id) == RunState.STOPPED


def test_the_launch_forms_field_error_shows_the_text_as_typed() -> None:
    # A form field shows plain text: a parse error's Slack escaping would show as "&lt;".
    values = {
        "spec": {"spec": {"type": "static_select", "selected_option": {"value": "tiny"}}},
        "overrides": {"overrides": {"type": "plain_text_input", "value": "a<b>&c"}},
    }
    text, errors = _modal_command_text({"view": {"state": {"values": values}}})
    assert text == "" and list(errors) == ["overrides"]
    assert "'a<b>&c' is not an override" in errors["overrides"], errors
    assert "&lt;" not in errors["overrides"] and "&amp;" not in errors["overrides"]
