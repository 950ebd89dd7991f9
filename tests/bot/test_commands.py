"""The /train grammar: every command, every way to get it wrong, and a fuzz test."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bot.commands import (
    MAX_SNOOZE_S,
    USAGE,
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
    Preflight,
    Resubmit,
    Snooze,
    Spend,
    StatusCommand,
    Stop,
    UserRef,
    help_text,
    parse,
    parse_duration,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", Help()),
        ("   ", Help()),
        ("/train", Help()),
        ("launch", Launch(spec=None)),
        ("launch gpt-small", Launch(spec="gpt-small")),
        (
            "launch gpt-small budget.usd=800 resources.zone=us-east-1b",
            Launch(spec="gpt-small", overrides=("budget.usd=800", "resources.zone=us-east-1b")),
        ),
        ("/train launch gpt-small", Launch(spec="gpt-small")),
        ("LAUNCH gpt_small.v2", Launch(spec="gpt_small.v2")),
        ('launch gpt-small "name=my run"', Launch(spec="gpt-small", overrides=("name=my run",))),
        ("launch gpt-small tags=a=b", Launch(spec="gpt-small", overrides=("tags=a=b",))),
        (
            "preflight gpt-small accelerator.count=8",
            Preflight(spec="gpt-small", overrides=("accelerator.count=8",)),
        ),
        ("status", StatusCommand(run=None)),
        ("status r-7f3a2c", StatusCommand(run="r-7f3a2c")),
        ("status R-7F3A2C", StatusCommand(run="r-7f3a2c")),
        ("list", ListRuns(scope="active")),
        ("list mine", ListRuns(scope="mine")),
        ("list ALL", ListRuns(scope="all")),
        ("stop r-1", Stop(run="r-1")),
        ("resubmit r-abc", Resubmit(run="r-abc")),
        ("resubmit r-abc budget.usd=1200", Resubmit(run="r-abc", budget_usd=1200.0)),
        ("resubmit r-abc BUDGET.USD=$1,200.50", Resubmit(run="r-abc", budget_usd=1200.5)),
        ("resubmit r-abc from=20", Resubmit(run="r-abc", from_step=20)),
        ("resubmit r-abc FROM=2,000", Resubmit(run="r-abc", from_step=2000)),
        ("resubmit r-abc from=0", Resubmit(run="r-abc", from_step=0)),
        (
            "resubmit r-abc budget.usd=50 from=20",
            Resubmit(run="r-abc", budget_usd=50.0, from_step=20),
        ),
        (
            "resubmit r-abc from=20 budget.usd=50",
            Resubmit(run="r-abc", budget_usd=50.0, from_step=20),
        ),
        (
            "resubmit r-abc env.LR=3e-4 resources.zones=[us-east-1b]",
            Resubmit(run="r-abc", overrides=("env.LR=3e-4", "resources.zones=[us-east-1b]")),
        ),
        ("resubmit r-abc --max-price 1.20", Resubmit(run="r-abc", max_price=1.2)),
        (
            "resubmit r-abc --max-price=$1.5/h budget.usd=90 command='python t.py --lr 1'",
            Resubmit(
                run="r-abc",
                max_price=1.5,
                budget_usd=90.0,
                overrides=("command=python t.py --lr 1",),
            ),
        ),
        ("logs r-abc", Logs(run="r-abc")),
        ("ack al-91b2", Ack(alert="al-91b2")),
        ("ack AL-91B2", Ack(alert="al-91b2")),
        ("snooze al-91b2 30m", Snooze(alert="al-91b2", seconds=1800)),
        ("snooze al-91b2 2h", Snooze(alert="al-91b2", seconds=7200)),
        ("snooze al-91b2 1d", Snooze(alert="al-91b2", seconds=86400)),
        ("snooze al-91b2 90s", Snooze(alert="al-91b2", seconds=90)),
        ("snooze al-91b2 1H30M", Snooze(alert="al-91b2", seconds=5400)),
        ("snooze al-1 7d", Snooze(alert="al-1", seconds=MAX_SNOOZE_S)),
        ("spend", Spend(period="day")),
        ("spend week", Spend(period="week")),
        ("spend month", Spend(period="month")),
        ("budget", BudgetCommand()),
        ("oncall", Oncall(user=None)),
        ("oncall <@U123>", Oncall(user=UserRef(user_id="U123", name=None))),
        ("oncall <@U123|dana>", Oncall(user=UserRef(user_id="U123", name="dana"))),
        ("oncall <@U123|Dana Scully>", Oncall(user=UserRef(user_id="U123", name="Dana Scully"))),
        ("oncall @dana.s", Oncall(user=UserRef(user_id=None, name="dana.s"))),
        ("cleanup r-1", Cleanup(run="r-1", dry_run=False)),
        ("cleanup r-1 --dry-run", Cleanup(run="r-1", dry_run=True)),
        ("cleanup --dry-run r-1", Cleanup(run="r-1", dry_run=True)),
        ("help", Help()),
        ("help Snooze", Help(command="snooze")),
        ("“launch” gpt-small", Launch(spec="gpt-small")),
    ],
)
def test_parses(text: str, expected: Command) -> None:
    assert parse(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment", "usage"),
    [
        ("launch =5", "override", USAGE["launch"]),
        ("launch gpt-small =5", "no valid key", USAGE["launch"]),
        ("launch gpt-small key=", "no value", USAGE["launch"]),
        ("launch gpt-small bare", "not an override", USAGE["launch"]),
        ("launch gpt-small .a=1", "no valid key", USAGE["launch"]),
        ("launch gpt-small a..b=1", "no valid key", USAGE["launch"]),
        ("launch gpt-small a=1 a=2", "set twice", USAGE["launch"]),
        ("launch budget.usd=800", "Name the spec", USAGE["launch"]),
        ("launch gpt;rm", "not a spec name", USAGE["launch"]),
        ("launch ../etc/passwd", "not a spec name", USAGE["launch"]),
        ("preflight", "needs a spec", USAGE["preflight"]),
        ("status r-1 r-2", "'r-2' is extra", USAGE["status"]),
        ("status 7f3a2c", "run ids look like r-", USAGE["status"]),
        ("stop", "needs a run id", USAGE["stop"]),
        ("stop r-", "not a run id", USAGE["stop"]),
        ("stop r-ab!c", "not a run id", USAGE["stop"]),
        ("stop 'r-1 2'", "not a run id", USAGE["stop"]),
        ("stop al-1", "not a run id", USAGE["stop"]),
        ("resubmit", "needs a run id", USAGE["resubmit"]),
        ("resubmit budget.usd=5 r-1", "Name the run before the settings", USAGE["resubmit"]),
        ("resubmit from=5 r-1", "Name the run before the settings", USAGE["resubmit"]),
        ("resubmit r-1 budget=5", "budget.usd=<dollars>", USAGE["resubmit"]),
        ("resubmit r-1 spot=false", "not a resubmit setting", USAGE["resubmit"]),
        ("resubmit r-1 step=5", "from=<step>", USAGE["resubmit"]),
        ("resubmit r-1 from=", "not a step number", USAGE["resubmit"]),
        ("resubmit r-1 from=-5", "not a step number", USAGE["resubmit"]),
        ("resubmit r-1 from=2.5", "not a step number", USAGE["resubmit"]),
        ("resubmit r-1 from=ten", "not a step number", USAGE["resubmit"]),
        ("resubmit r-1 from=²", "not a step number", USAGE["resubmit"]),
        ("resubmit r-1 from=5 from=6", "given twice", USAGE["resubmit"]),
        ("resubmit r-1 budget.usd=5 budget.usd=6", "given twice", USAGE["resubmit"]),
        ("resubmit r-1 from=5 budget.usd=1 x", "'x' is extra", USAGE["resubmit"]),
        ("resubmit r-1 budget.usd=lots", "not an amount of dollars", USAGE["resubmit"]),
        ("resubmit r-1 budget.usd=0", "not an amount of dollars", USAGE["resubmit"]),
        ("resubmit r-1 budget.usd=-5", "not an amount of dollars", USAGE["resubmit"]),
        ("resubmit r-1 budget.usd=nan", "not an amount of dollars", USAGE["resubmit"]),
        ("resubmit r-1 budget.usd=1 x", "'x' is extra", USAGE["resubmit"]),
        ("resubmit r-1 --max-price", "needs a price", USAGE["resubmit"]),
        ("resubmit r-1 --max-price cheap", "not a price", USAGE["resubmit"]),
        ("resubmit r-1 --max-price 0", "not a price", USAGE["resubmit"]),
        ("resubmit r-1 --max-price 1 --max-price 2", "given twice", USAGE["resubmit"]),
        (
            "resubmit r-1 --max-price 1 resubmit.max_price=2",
            "Give the price once",
            USAGE["resubmit"],
        ),
        ("resubmit r-1 --spot", "only one is --max-price", USAGE["resubmit"]),
        ("resubmit r-1 env.LR=1 env.LR=2", "set twice", USAGE["resubmit"]),
        ("resubmit r-1 env.LR=", "no value", USAGE["resubmit"]),
        ("resubmit --max-price 1 r-1", "Name the run before the settings", USAGE["resubmit"]),
        ("logs r-1 extra", "extra", USAGE["logs"]),
        ("ack", "needs an alert id", USAGE["ack"]),
        ("ack r-1", "alert ids look like al-", USAGE["ack"]),
        ("snooze al-1", "needs an alert id and a duration", USAGE["snooze"]),
        ("snooze al-1 soon", "not a duration", USAGE["snooze"]),
        ("snooze al-1 30", "not a duration", USAGE["snooze"]),
        ("snooze al-1 -5m", "not a duration", USAGE["snooze"]),
        ("snooze al-1 0m", "zero", USAGE["snooze"]),
        ("snooze al-1 8d", "7 days", USAGE["snooze"]),
        ("snooze al-1 7d1s", "7 days", USAGE["snooze"]),
        ("snooze al-1 99999999999999999999d", "7 days", USAGE["snooze"]),
        ("list everything", "mine, active, all", USAGE["list"]),
        ("spend year", "day, week, month", USAGE["spend"]),
        ("budget team", "takes no arguments", USAGE["budget"]),
        ("oncall dana", "not a user", USAGE["oncall"]),
        ("oncall <@U1> extra", "not a user", USAGE["oncall"]),
        ("cleanup --force r-1", "--dry-run", USAGE["cleanup"]),
        ("cleanup --dry-run", "needs a run id", USAGE["cleanup"]),
        ("help a b", "extra", USAGE["help"]),
    ],
)
def test_errors_say_what_and_show_usage(text: str, fragment: str, usage: str) -> None:
    with pytest.raises(CommandError) as info:
        parse(text)
    message = info.value.plain
    assert fragment in message
    assert f"Usage: {usage}" in message
    # As Slack shows it: the usage line's <run> is text, not markup.
    assert f"Usage: {usage}".replace("<", "&lt;").replace(">", "&gt;") in str(info.value)


def test_command_error_is_a_bot_error() -> None:
    assert issubclass(CommandError, BotError)


def test_unknown_verb_suggests_the_closest() -> None:
    with pytest.raises(CommandError, match="Did you mean `launch`") as info:
        parse("lanch gpt-small")
    assert USAGE["launch"] in info.value.plain
    with pytest.raises(CommandError, match="Did you mean `snooze`"):
        parse("help snoze")


def test_unknown_verb_without_a_close_match_points_to_help() -> None:
    with pytest.raises(CommandError) as info:
        parse("xyzzy")
    assert "Did you mean" not in str(info.value)
    assert "/train help" in str(info.value)


@pytest.mark.parametrize("text", ['launch "gpt', "launch 'gpt", "stop r-1\\", "ack “a-1"])
def test_unbalanced_quotes_are_a_command_error(text: str) -> None:
    with pytest.raises(CommandError, match="quote"):
        parse(text)


def test_long_garbage_is_cut_short_in_the_message() -> None:
    with pytest.raises(CommandError) as info:
        parse("stop " + "x" * 5000)
    assert len(str(info.value)) < 300


def test_parse_duration_bounds() -> None:
    assert parse_duration("1s") == 1
    assert parse_duration("7d") == MAX_SNOOZE_S
    with pytest.raises(CommandError):
        parse_duration("604801s")
    with pytest.raises(CommandError):
        parse_duration("٣m")  # a non-ASCII digit is not a duration


def test_help_text_lists_every_command_with_usage_and_summary() -> None:
    text = help_text()
    for verb, usage in USAGE.items():
        assert usage in text, verb
    assert "Acknowledge an alert" in text
    assert len(text.splitlines()) == len(USAGE) + 2


def test_help_text_for_one_command_is_its_docstring() -> None:
    text = help_text("cleanup")
    assert text.startswith(f"`{USAGE['cleanup']}`")
    assert "--dry-run" in text
    assert "Example: /train cleanup r-7f3a2c --dry-run" in text


def test_help_text_for_an_unknown_command_suggests() -> None:
    with pytest.raises(CommandError, match="Did you mean `status`"):
        help_text("stauts")


@pytest.mark.parametrize("verb", list(USAGE))
def test_every_docstring_has_a_working_example(verb: str) -> None:
    text = help_text(verb)
    examples = [line for line in text.splitlines() if line.startswith("Example: /train ")]
    assert len(examples) == 1, text
    command = parse(examples[0].removeprefix("Example: "))
    assert command.verb == verb


def test_commands_are_frozen() -> None:
    command = parse("stop r-1")
    with pytest.raises(AttributeError):
        command.run = "r-2"  # type: ignore[attr-defined]


_WORDS = st.sampled_from(
    [
        *USAGE,
        "r-1",
        "R-AbC",
        "al-2",
        "a.b=1",
        "=",
        "x=",
        "30m",
        "8d",
        "--dry-run",
        "<@U1|n>",
        "@x",
        '"',
        "'",
        "\\",
        "“",
        "\x00",
        "é",
        "",
    ]
)


@settings(max_examples=400, deadline=None, database=None)
@given(st.text())
def test_fuzz_arbitrary_text(text: str) -> None:
    try:
        command = parse(text)
    except CommandError as exc:
        assert str(exc)
    else:
        assert isinstance(command, Command)


@settings(max_examples=600, deadline=None, database=None)
@given(st.lists(st.one_of(_WORDS, st.text(max_size=8)), max_size=6))
def test_fuzz_near_valid_commands(words: list[str]) -> None:
    try:
        command = parse(" ".join(words))
    except CommandError as exc:
        assert str(exc)
    else:
        assert isinstance(command, Command)
        assert command.verb in USAGE
