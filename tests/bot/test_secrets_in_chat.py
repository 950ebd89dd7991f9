"""What a ``/train`` command carries in ``env`` stays in the run's spec: signed HTTP into
the real Slack app, the real control plane behind it, a fake Slack Web API at the network
edge, and every Slack call, journal record and log line searched for the values. Also the
smaller ones of the same issue: a megabyte of text is refused before it is split, a parse
error echoes what was typed as text (never as Slack markup), and a run's name may not
hold characters a reader cannot see or that reverse the text around them.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from sqlalchemy import insert
from sqlalchemy.exc import IntegrityError

from bot.commands import MAX_COMMAND_CHARS, CommandError, parse, summary
from bot.dispatch import handle_text
from bot.replies import unexpected
from jobs.database.db import session_scope
from jobs.database.models import Run
from jobs.domain.lifecycle import RunState
from jobs.process.logs import make_handler
from jobs.usecases.service import Actor
from tests.bot import test_security
from tests.bot.test_security import ADA, EVE, RANDOM, answer, run_ids, waiting_run
from tests.bot.test_slack_app import FAST, Slack, wait_until
from tests.jobs.test_logs import on_the_root_logger

#: Two channels trainbot serves (one of them Ada's), launchers named, a fake Slack.
slack = test_security.slack

#: Values no Slack call, journal record or log line may hold.
OLD = "old-creds-7Hq2x9"
NEW = "new-creds-Zp4k1m"


class Logs(logging.Handler):
    """Every record at INFO and above, as it was made (what any handler is given) and as
    the JSON handler writes it (redaction included)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.raw: list[str] = []
        self.stream = io.StringIO()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        self.raw.append(text)

    def text(self) -> str:
        return "\n".join([*self.raw, self.stream.getvalue()])


@pytest.fixture
def logs() -> Iterator[Logs]:
    found = Logs()
    json_lines = make_handler("json", stream=found.stream)
    json_lines.setLevel(logging.INFO)
    # ``found`` first: it sees each record before a filter rewrites it.
    with on_the_root_logger(found, json_lines):
        yield found


def everything(slack: Slack, logs: Logs) -> str:
    """What left trainbot: every Slack Web API call, every response_url post, every
    journal record, every log line."""
    slack.notifier.flush(10)
    with slack.fake.cond:
        calls = [(c.method, c.args) for c in slack.fake.calls]
    with slack.hooks.cond:
        posts = list(slack.hooks.posts)
    parts = [json.dumps(calls), json.dumps(posts), json.dumps(list(slack.records), default=str)]
    return "\n".join([*parts, logs.text()])


def assert_kept_secret(slack: Slack, logs: Logs, *values: str) -> None:
    seen = everything(slack, logs)
    for value in values:
        assert value not in seen, f"{value} left trainbot"


def stopped_run(slack: Slack, extra: str) -> str:
    run_id = waiting_run(slack, extra)
    answer(slack, f"stop {run_id}")
    wait_until(lambda: slack.state(run_id) == RunState.STOPPED, 30, "the stop")
    return run_id


def test_denied_and_refused_commands_never_echo_an_env_value(slack: Slack, logs: Logs) -> None:
    replies = [
        # Not a launcher; a channel trainbot does not serve.
        answer(slack, f"launch tiny env.MY_CREDS={OLD}", user=EVE),
        answer(slack, f"launch tiny env.AWS_SECRET_ACCESS_KEY={OLD}", channel=RANDOM),
        # The grammar refuses it; the spec refuses it (not text, not YAML, reserved).
        answer(slack, f'resubmit r-1 "env={{MY_CREDS: {OLD}}}"'),
        answer(slack, f"launch tiny env.MY_CREDS={OLD} oops"),
        answer(slack, f"launch tiny {FAST} env.MY_CREDS=[{OLD}]"),
        answer(slack, f'launch tiny {FAST} "env.MY_CREDS={{{OLD}"'),
        answer(slack, f"launch tiny {FAST} env.TRAINBOT_TOKEN={OLD}"),
    ]
    assert run_ids(slack) == []
    assert "'env=…' is not a resubmit setting" in replies[2]
    assert "env.MY_CREDS: expected text (from override 'env.MY_CREDS=…')" in replies[4]
    assert "is reserved" in replies[6]
    wait_until(lambda: len(slack.journal("denied")) >= 2, 10, "two denials")
    assert_kept_secret(slack, logs, OLD)


def test_an_accepted_launch_shows_its_env_nowhere(slack: Slack, logs: Logs) -> None:
    run_id = waiting_run(slack, f"env.MY_CREDS={OLD} env.AWS_SECRET_ACCESS_KEY={NEW}")
    for text in (f"status {run_id}", "status", "list all", f"logs {run_id}"):
        answer(slack, text)
    slack.event({"type": "app_home_opened", "user": ADA, "channel": "D0ADA", "tab": "home"})
    wait_until(lambda: ADA in slack.fake.home_views, 10, "Ada's home")
    assert_kept_secret(slack, logs, OLD, NEW)
    # The spec keeps them: the run needs them.
    with session_scope(slack.cp.deps.engine) as session:
        run = session.get(Run, run_id)
        assert run is not None and run.spec["env"]["MY_CREDS"] == OLD


def test_a_command_that_fails_unexpectedly_logs_no_env_value(slack: Slack, logs: Logs) -> None:
    """A step count no database integer holds: the write fails in the middle of the
    launch, and the log line names the command, with its env masked, and where it failed."""
    steps = "9" * 30
    reply = answer(
        slack,
        f'launch tiny {FAST} env.MY_CREDS={OLD} "command=python train.py --steps {steps}" '
        f'"env.AWS_SECRET_ACCESS_KEY={NEW}"',
    )
    assert reply == unexpected()
    failed = [line for line in logs.raw if "failed" in line]
    assert failed, logs.text()
    line = failed[0]
    assert "Launch(spec='tiny'" in line and "env.MY_CREDS=…" in line
    assert "Traceback" in line and "messages not logged" in line
    assert_kept_secret(slack, logs, OLD, NEW)


def test_a_database_error_does_not_quote_the_row(slack: Slack) -> None:
    """What a background task logs when a write fails: the statement, not its values."""
    run_id = waiting_run(slack)
    with pytest.raises(IntegrityError) as caught:
        with slack.cp.deps.engine.begin() as conn:
            conn.execute(insert(Run), {"id": run_id, "spec": {"env": {"MY_CREDS": OLD}}})
    assert "INSERT INTO" in str(caught.value) and OLD not in str(caught.value)


def test_a_resubmit_that_changes_env_says_what_changed_not_to_what(
    slack: Slack, logs: Logs
) -> None:
    old = stopped_run(slack, f"env.MY_CREDS={OLD}")
    before = set(run_ids(slack))
    reply = answer(slack, f"resubmit {old} env.MY_CREDS={NEW} env.EXTRA_SECRET={NEW}x")
    wait_until(lambda: len(run_ids(slack)) > len(before), 15, f"the new run ({reply})")
    (new,) = set(run_ids(slack)) - before
    record = slack.wait_journal("resubmit_changed", timeout=15)
    assert record["changes"] == [
        {"key": "env.EXTRA_SECRET", "change": "added"},
        {"key": "env.MY_CREDS", "change": "changed"},
    ]
    said = "with changes env.EXTRA_SECRET added; env.MY_CREDS changed"
    slack.notifier.flush(10)
    for run_id in (old, new):
        thread = " ".join(m.text for m in slack.thread(run_id))
        assert said in thread, (run_id, thread)
    answer(slack, f"status {new}")
    assert_kept_secret(slack, logs, OLD, NEW)


def test_a_megabyte_of_text_is_refused_before_it_is_read(slack: Slack) -> None:
    text = "launch tiny env.BLOB=" + "x" * 1_000_000
    reply = answer(slack, text)
    assert f"{len(text):,} characters long" in reply and f"{MAX_COMMAND_CHARS:,}" in reply
    assert len(reply) < 500 and run_ids(slack) == []
    # The same rule for the console, where nothing else checks the size first.
    said = handle_text(slack.cp.deps, "/train " + text, Actor(user=ADA, channel="C0TRAIN"))
    assert "at most" in said.text and len(said.text) < 500


def test_a_parse_error_echoes_markup_as_text(slack: Slack) -> None:
    reply = answer(slack, "stop <!channel> ")
    assert "<!channel>" not in reply and "&lt;!channel&gt;" in reply
    reply = answer(slack, "launch <https://evil.example|click&me>")
    assert "<https" not in reply and "&lt;https://evil.example|click&amp;me&gt;" in reply
    # The usage line's placeholders are text too, and a paste is cut short.
    reply = answer(slack, "snooze al-1 " + "<!here>" * 500)
    assert "<" not in reply and "&lt;alert&gt;" in reply and len(reply) < 400
    # The console shows the same error as typed.
    with pytest.raises(CommandError) as caught:
        parse("stop <!channel>")
    assert "'<!channel>' is not a run id" in caught.value.plain
    said = handle_text(slack.cp.deps, "stop <!channel>", Actor(user=ADA, channel="C0TRAIN"))
    assert said.text.startswith("'<!channel>' is not a run id")


@pytest.mark.parametrize(
    "name",
    [
        "gpt\u202egnp.exe",  # right-to-left override
        "safe\u2066run\u2069",  # an isolate
        "\u200fmarked",  # right-to-left mark
        "ze\u200bro",  # zero-width space
        "jo\u200dined",  # zero-width joiner
        "soft\u00adhyphen",  # a format character, category Cf
        "hangul\u3164filler",  # draws nothing, though a letter
        "line\u2028break",
    ],
)
def test_a_run_name_that_hides_or_reverses_text_is_refused(slack: Slack, name: str) -> None:
    reply = answer(slack, f'launch tiny {FAST} "name={name}"')
    assert "invisible or reverses the text" in reply, reply
    assert f"U+{ord(next(c for c in name if not c.isascii())):04X}" in reply
    assert run_ids(slack) == []


def test_a_run_name_in_any_script_is_fine(slack: Slack) -> None:
    run_id = waiting_run(slack, '"name=تجربة 7" "description=נסיון ראשון"')
    assert run_id in run_ids(slack)
    reply = answer(slack, f'launch tiny {FAST} "description=a\u202eb"')
    assert "reverses the text" in reply


def test_redaction_knows_secret_names_and_the_env_of_a_spec() -> None:
    """The last defence, for code that logs text it did not parse: names that say
    secret, key or creds, and every env value, whatever its name."""
    stream = io.StringIO()
    log = logging.getLogger("tests.secrets")
    handler = make_handler("json", stream=stream)
    log.addHandler(handler)
    try:
        log.warning(
            "AWS_SECRET_ACCESS_KEY=%s MY_CREDS: %s env.LR=%s spec=%s",
            OLD,
            NEW,
            "3e-4-hyper",
            json.dumps({"env": {"WANDB": "w-" + OLD}, "max_hours": 2}),
        )
    finally:
        log.removeHandler(handler)
    line = json.loads(stream.getvalue())["message"]
    for value in (OLD, NEW, "3e-4-hyper"):
        assert value not in line
    assert "AWS_SECRET_ACCESS_KEY=[redacted]" in line and '"max_hours": 2' in line
    # What may be said about text that did not parse: its verb and its size.
    text = f"/train launch tiny env.X={OLD} '"
    assert summary(text) == f"launch, {len(text)} characters"
    assert summary(f"{OLD} launch") == f"(no command), {len(OLD) + 7} characters"
