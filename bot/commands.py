"""Parse ``/train …`` text into typed command objects.

This module is pure (no I/O, no clock), so the Slack listeners and the console share one
grammar and it can be fuzzed. Each command's help text is its class docstring: the first
line is the summary shown by ``/train help``, the rest (with an example) is shown by
``/train help <command>``. ``parse`` either returns a :class:`Command` or raises
:class:`CommandError` whose message says what was wrong and shows the usage line.
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from bot.command_types import (
    Ack,
    BotError,
    BudgetCommand,
    Cleanup,
    Command,
    CommandError,
    Help,
    Launch,
    ListRuns,
    Logs,
    Oncall,
    ParseError,
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
    UserRef,
    masked_override,
)
from runner.duration import parse_duration as runner_duration

__all__ = [
    "MAX_SNOOZE_S",
    "USAGE",
    "Ack",
    "BotError",
    "BudgetCommand",
    "Cleanup",
    "Command",
    "CommandError",
    "Help",
    "Launch",
    "ListRuns",
    "Logs",
    "Oncall",
    "ParseError",
    "Preflight",
    "Release",
    "Resubmit",
    "Snooze",
    "Specs",
    "Spend",
    "Stage",
    "StatusCommand",
    "Stop",
    "Token",
    "UserRef",
    "grammar",
    "help_text",
    "parse",
    "parse_duration",
    "summary",
]

#: A snooze longer than this is almost always a typo, and it would hide a real problem.
MAX_SNOOZE_S = 7 * 24 * 3600
#: The longest ``/train`` text read. Longer text is refused before it is split: splitting
#: a megabyte like a shell takes tens of seconds. Big values belong in the spec file.
MAX_COMMAND_CHARS = 8_000
#: How much of a token an error message echoes.
_SHOW_CHARS = 40


_RUN_ID = re.compile(r"r-[a-z0-9]{1,64}", re.ASCII)
_ALERT_ID = re.compile(r"al-[a-z0-9]{1,64}", re.ASCII)
# The same names jobs/spec.py accepts, so a bad one fails here, with the usage line.
# A name may follow its source's label (team/gpt-small: jobs/spec/sources.py).
_SPEC = re.compile(
    r"(?:[A-Za-z0-9][A-Za-z0-9._\-]{0,63}/)?[A-Za-z0-9][A-Za-z0-9._\-]{0,127}", re.ASCII
)
_OVERRIDE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z0-9_\-]+)*", re.ASCII)
_MENTION = re.compile(r"<@([A-Za-z0-9]+)(?:\|([^<>|]+))?>", re.ASCII)
_AT_NAME = re.compile(r"@([A-Za-z0-9][A-Za-z0-9._\-]{0,79})", re.ASCII)
# Slack and phones turn straight quotes into curly ones; shlex only knows the straight kind.
_QUOTES = str.maketrans({"“": '"', "”": '"', "‘": "'", "’": "'"})


def _fail(cls: type[Command], problem: str) -> CommandError:
    return CommandError(f"{problem}\nUsage: {cls.usage}")


def _no_args(cls: type[Command], args: Sequence[str]) -> None:
    if args:
        raise _fail(cls, f"`{cls.verb}` takes no arguments, got {_show(args[0])}.")


def _at_most(cls: type[Command], args: Sequence[str], n: int) -> None:
    if len(args) > n:
        raise _fail(cls, f"Too many arguments to `{cls.verb}`: {_show(args[n])} is extra.")


def _show(token: str) -> str:
    """Quote a user token for an error message, cut short so a paste cannot flood the chat;
    an ``env`` value is never echoed (see :func:`bot.command_types.masked_override`)."""
    token = masked_override(token)
    return repr(token if len(token) <= _SHOW_CHARS else token[: _SHOW_CHARS - 3] + "...")


def _run_id(cls: type[Command], token: str) -> str:
    run = token.strip("`").lower()
    if not _RUN_ID.fullmatch(run):
        raise _fail(cls, f"{_show(token)} is not a run id; run ids look like r-7f3a2c.")
    return run


def _alert_id(cls: type[Command], token: str) -> str:
    alert = token.strip("`").lower()
    if not _ALERT_ID.fullmatch(alert):
        raise _fail(cls, f"{_show(token)} is not an alert id; alert ids look like al-91b2.")
    return alert


def _one_run(cls: type[Command], args: Sequence[str]) -> str:
    if not args:
        raise _fail(cls, f"`{cls.verb}` needs a run id.")
    _at_most(cls, args, 1)
    return _run_id(cls, args[0])


def _spec_and_overrides(
    cls: type[Command], args: Sequence[str]
) -> tuple[str | None, tuple[str, ...]]:
    if not args:
        return None, ()
    spec, rest = args[0], args[1:]
    if "=" in spec:
        raise _fail(cls, f"Name the spec before the overrides: {_show(spec)} is an override.")
    if not _SPEC.fullmatch(spec):
        raise _fail(
            cls,
            f"{_show(spec)} is not a spec name; use letters, digits, '-', '_' and '.' "
            "(source/name picks one source's spec).",
        )
    return spec, _overrides(cls, rest)


def _overrides(cls: type[Command], tokens: Sequence[str]) -> tuple[str, ...]:
    """``key.path=value`` tokens, each with a valid key and a value, no key twice."""
    overrides: list[str] = []
    seen: set[str] = set()
    for token in tokens:
        key, eq, value = token.partition("=")
        if not eq:
            raise _fail(cls, f"{_show(token)} is not an override; write key.path=value.")
        if not key or not _OVERRIDE_KEY.fullmatch(key):
            raise _fail(cls, f"{_show(token)} has no valid key; write key.path=value.")
        if not value:
            raise _fail(cls, f"{_show(token)} has no value; write {key}=<value>.")
        if key in seen:
            raise _fail(cls, f"{key} is set twice; keep one.")
        seen.add(key)
        overrides.append(f"{key}={value}")
    return tuple(overrides)


def parse_duration(text: str) -> int:
    """Whole seconds in ``90s``, ``30m``, ``2h``, ``1d`` or ``1h30m``, up to MAX_SNOOZE_S.

    The unit is required: in chat, a bare ``30`` could mean minutes.
    """
    try:
        value = runner_duration(text, unit_required=True)
    except ValueError:
        raise CommandError(
            f"{_show(text)} is not a duration; write a number and a unit (s, m, h or d): 30m, 2h."
        ) from None
    if value > MAX_SNOOZE_S:
        raise CommandError(f"{_show(text)} is longer than 7 days; snooze for 7d at most.")
    seconds = round(value)
    if seconds <= 0:
        raise CommandError(f"{_show(text)} is zero; snooze for at least 1s.")
    return seconds


def _user(cls: type[Command], text: str) -> UserRef:
    mention = _MENTION.fullmatch(text)
    if mention:
        name = mention.group(2)
        return UserRef(user_id=mention.group(1).upper(), name=(name or "").strip() or None)
    at = _AT_NAME.fullmatch(text)
    if at:
        return UserRef(user_id=None, name=at.group(1))
    raise _fail(cls, f"{_show(text)} is not a user; mention them, like @dana.")


def _parse_launch(args: Sequence[str]) -> Command:
    spec, overrides = _spec_and_overrides(Launch, args)
    return Launch(spec=spec, overrides=overrides)


def _parse_preflight(args: Sequence[str]) -> Command:
    spec, overrides = _spec_and_overrides(Preflight, args)
    if spec is None:
        raise _fail(Preflight, "`preflight` needs a spec name.")
    return Preflight(spec=spec, overrides=overrides)


def _parse_specs(args: Sequence[str]) -> Command:
    _no_args(Specs, args)
    return Specs()


def _parse_status(args: Sequence[str]) -> Command:
    _at_most(StatusCommand, args, 1)
    return StatusCommand(run=_run_id(StatusCommand, args[0]) if args else None)


def _choice(cls: type[Command], args: Sequence[str], choices: tuple[str, ...]) -> str | None:
    """The optional one word of a command that takes one of ``choices``; None when absent."""
    _at_most(cls, args, 1)
    if not args:
        return None
    word = args[0].lower()
    if word not in choices:
        raise _fail(cls, f"{_show(args[0])} is not one of {', '.join(choices)}.")
    return word


def _parse_list(args: Sequence[str]) -> Command:
    scope = _choice(ListRuns, args, ListRuns.scopes)
    return ListRuns() if scope is None else ListRuns(scope=scope)


def _parse_snooze(args: Sequence[str]) -> Command:
    if len(args) < 2:
        raise _fail(Snooze, "`snooze` needs an alert id and a duration.")
    _at_most(Snooze, args, 2)
    alert = _alert_id(Snooze, args[0])
    try:
        seconds = parse_duration(args[1])
    except CommandError as exc:
        raise _fail(Snooze, exc.plain) from None
    return Snooze(alert=alert, seconds=seconds)


def _parse_ack(args: Sequence[str]) -> Command:
    if not args:
        raise _fail(Ack, "`ack` needs an alert id.")
    _at_most(Ack, args, 1)
    return Ack(alert=_alert_id(Ack, args[0]))


def _parse_spend(args: Sequence[str]) -> Command:
    period = _choice(Spend, args, Spend.periods)
    return Spend() if period is None else Spend(period=period)


def _parse_budget(args: Sequence[str]) -> Command:
    _no_args(BudgetCommand, args)
    return BudgetCommand()


def _parse_oncall(args: Sequence[str]) -> Command:
    if not args:
        return Oncall()
    # A legacy mention may carry a display name with spaces: <@U123|Dana Scully>.
    return Oncall(user=_user(Oncall, " ".join(args)))


def _parse_cleanup(args: Sequence[str]) -> Command:
    flags = [a for a in args if a.startswith("--")]
    rest = [a for a in args if not a.startswith("--")]
    for flag in flags:
        if flag.lower() not in ("--dry-run", "--dryrun"):
            raise _fail(Cleanup, f"Unknown option {_show(flag)}; the only one is --dry-run.")
    return Cleanup(run=_one_run(Cleanup, rest), dry_run=bool(flags))


def _parse_resubmit(args: Sequence[str]) -> Command:
    if not args:
        raise _fail(Resubmit, "`resubmit` needs a run id.")
    if "=" in args[0] or args[0].startswith("--"):
        raise _fail(Resubmit, f"Name the run before the settings: {_show(args[0])} is one.")
    run = _run_id(Resubmit, args[0])
    rest = list(args[1:])
    max_price: float | None = None
    got: dict[str, float | int] = {}
    changes: list[str] = []
    while rest:
        arg = rest.pop(0)
        flag, eq, value = arg.partition("=")
        if arg.startswith("--"):
            if flag.lower() != "--max-price":
                raise _fail(Resubmit, f"Unknown option {_show(arg)}; the only one is --max-price.")
            if max_price is not None:
                raise _fail(Resubmit, "--max-price is given twice; give it once.")
            if not eq:
                if not rest:
                    raise _fail(Resubmit, "--max-price needs a price, like --max-price 1.20.")
                value = rest.pop(0)
            max_price = _price(value)
            continue
        if not eq:
            raise _fail(Resubmit, f"Too many arguments to `resubmit`: {_show(arg)} is extra.")
        setting = _RESUBMIT_SETTINGS.get(flag.strip().lower())
        if setting is None:
            # Here, not at the top: the spec model is the server's (pydantic), and
            # ``trainbot`` without the server extra must still say what to install.
            from jobs.spec.changes import TOP_LEVEL_CHANGES

            if "." not in flag and flag.strip() not in TOP_LEVEL_CHANGES:
                raise _fail(
                    Resubmit,
                    f"{_show(arg)} is not a resubmit setting; a resubmit takes from=<step>, "
                    "like from=2000, budget.usd=<dollars>, like budget.usd=1200, and spec "
                    "changes, like env.LR=3e-4 or resources.zones=[us-east-1b].",
                )
            changes.append(arg)
            continue
        field, read = setting
        if field in got:
            raise _fail(Resubmit, f"{flag.strip()}= is given twice; give it once.")
        got[field] = read(value)
    overrides = _overrides(Resubmit, changes)
    if any(o.partition("=")[0] == "resubmit.max_price" for o in overrides) and max_price:
        raise _fail(Resubmit, "Give the price once: --max-price or resubmit.max_price=, not both.")
    return Resubmit(
        run=run,
        budget_usd=float(got["budget_usd"]) if "budget_usd" in got else None,
        from_step=int(got["from_step"]) if "from_step" in got else None,
        overrides=overrides,
        max_price=max_price,
    )


def _amount(value: str) -> float:
    """A positive amount of dollars from ``1200``, ``$1,200.50`` or ``1.20/h``; NaN when
    the text is not one."""
    try:
        amount = float(value.strip().lstrip("$").removesuffix("/h").replace(",", ""))
    except ValueError:
        return math.nan
    return amount if math.isfinite(amount) and amount > 0 else math.nan


def _price(value: str) -> float:
    amount = _amount(value)
    if not amount <= 10_000:  # NaN too
        raise _fail(
            Resubmit,
            f"{_show(value)} is not a price per instance-hour; write --max-price 1.20.",
        )
    return amount


def _dollars(value: str) -> float:
    amount = _amount(value)
    if math.isnan(amount):
        raise _fail(Resubmit, f"{_show(value)} is not an amount of dollars; write budget.usd=1200.")
    return amount


def _step(value: str) -> int:
    text = value.strip().replace(",", "").replace("_", "")
    if not re.fullmatch(r"[0-9]{1,18}", text):
        raise _fail(
            Resubmit,
            f"{_show(value)} is not a step number; write from=2000 to resume from the newest "
            "checkpoint at or before step 2000.",
        )
    return int(text)


#: A resubmit's settings: the key people write → (Resubmit's field, how to read it).
_RESUBMIT_SETTINGS: dict[str, tuple[str, Callable[[str], float | int]]] = {
    "budget.usd": ("budget_usd", _dollars),
    "from": ("from_step", _step),
}


#: The most nodes a multi-node attempt has (the wire's node numbers go to 1023).
_MAX_NODE = 1023


def _parse_logs(args: Sequence[str]) -> Command:
    if not args:
        raise _fail(Logs, "`logs` needs a run id.")
    _at_most(Logs, args, 3)
    run = _run_id(Logs, args[0])
    numbers: list[int] = []
    for what, token, low, high in zip(
        ("an attempt number", "a node number"),
        args[1:],
        (1, 0),
        (1_000_000, _MAX_NODE),
        strict=False,  # the numbers given: none, one or both
    ):
        text = token.strip().removeprefix("attempt=").removeprefix("node=")
        if not (text.isascii() and text.isdigit() and low <= int(text) <= high):
            raise _fail(
                Logs,
                f"{_show(token)} is not {what}; write /train logs {run} 2 for attempt 2, "
                f"or /train logs {run} 2 1 for its node 1.",
            )
        numbers.append(int(text))
    attempt = numbers[0] if numbers else None
    return Logs(run=run, attempt=attempt, node=numbers[1] if len(numbers) > 1 else 0)


_TOKEN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,39}", re.ASCII)
_TOKEN_ID = re.compile(r"tk-[a-z0-9]{1,64}", re.ASCII)


_REGION = re.compile(r"[a-z]{2,}(-[a-z0-9]+)+", re.ASCII)


def _parse_stage(args: Sequence[str]) -> Command:
    if len(args) == 1 and args[0].lower() == "status":
        return Stage()
    if len(args) == 1 and _RUN_ID.fullmatch(args[0]):
        return Stage(run=args[0])
    if len(args) != 2:
        raise _fail(Stage, "Name the dataset and the region to copy it to.")
    # Slack may wrap a link in <…> or <…|label>.
    source, region = args[0].strip("<>").split("|")[0], args[1].lower()
    if not re.fullmatch(r"(s3|gs)://[a-z0-9][a-z0-9._\-]{1,221}(/\S*)?", source, re.ASCII):
        raise _fail(Stage, f"{_show(source)} is not a bucket URI: write s3://BUCKET/PREFIX.")
    if not _REGION.fullmatch(region):
        raise _fail(Stage, f"{_show(args[1])} is not a region such as us-west-2.")
    return Stage(source=source, region=region)


def _parse_token(args: Sequence[str]) -> Command:
    if not args:
        return Token()
    action = args[0].lower()
    if action not in Token.actions:
        raise _fail(Token, f"{_show(args[0])} is not one of {', '.join(Token.actions)}.")
    _at_most(Token, args, 2)
    rest = args[1] if len(args) > 1 else None
    if action == "list":
        _at_most(Token, args, 1)
        return Token(action=action)
    if action == "revoke":
        if rest is None:
            raise _fail(Token, "`token revoke` needs a token id (see /train token list) or all.")
        name = rest.strip("`").lower()
        if name != "all" and not _TOKEN_ID.fullmatch(name):
            raise _fail(Token, f"{_show(rest)} is not a token id; token ids look like tk-1a2b3c4d.")
        return Token(action=action, name=name)
    if rest is not None and not _TOKEN_NAME.fullmatch(rest):
        raise _fail(
            Token, f"{_show(rest)} is not a token name; use letters, digits, '-', '_', '.'."
        )
    return Token(action=action, name=rest)


def _parse_help(args: Sequence[str]) -> Command:
    _at_most(Help, args, 1)
    if not args:
        return Help()
    return Help(command=_known_verb(args[0]))


_PARSERS: dict[str, tuple[type[Command], Callable[[Sequence[str]], Command]]] = {
    "launch": (Launch, _parse_launch),
    "preflight": (Preflight, _parse_preflight),
    "specs": (Specs, _parse_specs),
    "status": (StatusCommand, _parse_status),
    "list": (ListRuns, _parse_list),
    "stop": (Stop, lambda args: Stop(run=_one_run(Stop, args))),
    "release": (Release, lambda args: Release(run=_one_run(Release, args))),
    "resubmit": (Resubmit, _parse_resubmit),
    "logs": (Logs, _parse_logs),
    "ack": (Ack, _parse_ack),
    "snooze": (Snooze, _parse_snooze),
    "spend": (Spend, _parse_spend),
    "budget": (BudgetCommand, _parse_budget),
    "oncall": (Oncall, _parse_oncall),
    "cleanup": (Cleanup, _parse_cleanup),
    "stage": (Stage, _parse_stage),
    "token": (Token, _parse_token),
    "help": (Help, _parse_help),
}

#: The usage line of every command, by verb, in the order ``/train help`` lists them.
USAGE: Mapping[str, str] = {verb: cls.usage for verb, (cls, _) in _PARSERS.items()}


def grammar() -> Mapping[str, tuple[type[Command], Callable[[Sequence[str]], Command]]]:
    """Every verb's command class and parser, in the order ``/train help`` lists them.

    The rest of a verb (its handler, reply and permission) is declared in
    :mod:`bot.verbs`, which takes the parser from here: this module stays pure."""
    return MappingProxyType(_PARSERS)


def _known_verb(word: str) -> str:
    verb = word.lower()
    if verb in _PARSERS:
        return verb
    close = difflib.get_close_matches(verb, list(_PARSERS), n=1, cutoff=0.6)
    if close:
        cls, _ = _PARSERS[close[0]]
        raise CommandError(
            f"Unknown command {_show(word)}. Did you mean `{close[0]}`?\nUsage: {cls.usage}"
        )
    raise CommandError(
        f"Unknown command {_show(word)}. Type `/train help` for the list of commands."
    )


def parse(text: str) -> Command:
    """Turn the text after ``/train`` into a command; an empty text asks for help.

    Raises :class:`ParseError`, whose ``str()`` is escaped for Slack (``plain`` is not)."""
    try:
        return _parse(text)
    except ParseError:
        raise
    except CommandError as exc:
        raise ParseError(exc.plain) from None


def _parse(text: str) -> Command:
    if len(text) > MAX_COMMAND_CHARS:
        raise ParseError(
            f"That command is {len(text):,} characters long; a /train command is at most "
            f"{MAX_COMMAND_CHARS:,}. Put long values in the spec file and launch it by name. "
            "Type `/train help` for the list of commands."
        )
    try:
        tokens = shlex.split(text.translate(_QUOTES))
    except ValueError:
        raise CommandError(
            "A quote is not closed; close it or leave quotes out. "
            "Type `/train help` for the list of commands."
        ) from None
    if tokens and tokens[0].lower() == "/train":
        tokens = tokens[1:]
    if not tokens:
        return Help()
    _, parser = _PARSERS[_known_verb(tokens[0])]
    return parser(tokens[1:])


def summary(text: str) -> str:
    """What a log line may say about ``/train`` text that did not parse: its first word
    when that is a command, and its length; never the text, which can hold a secret."""
    words = text[:200].split(maxsplit=2)
    if words and words[0].lower() == "/train":
        words = words[1:]
    verb = words[0].lower() if words else ""
    shown = verb if verb in _PARSERS else "(no command)"
    return f"{shown}, {len(text):,} characters"


def _doc(cls: type[Command]) -> tuple[str, str]:
    doc = inspect.cleandoc(cls.__doc__ or "")
    summary, _, rest = doc.partition("\n")
    return summary.strip(), rest.strip()


def help_text(command_name: str | None = None) -> str:
    """The list of commands (one line each), or the details of one, from the docstrings."""
    if command_name is None:
        lines = ["Commands:"]
        for verb, (cls, _) in _PARSERS.items():
            summary, _ = _doc(cls)
            lines.append(f"`{USAGE[verb]}` — {summary}")
        lines.append("Type `/train help <command>` for details.")
        return "\n".join(lines)
    cls, _ = _PARSERS[_known_verb(command_name)]
    summary, details = _doc(cls)
    parts = [f"`{cls.usage}`", summary]
    if details:
        parts.append(details)
    return "\n".join(parts)
