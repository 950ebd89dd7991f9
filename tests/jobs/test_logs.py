"""Structured logs: JSON lines that parse, ids from the context, and never a secret.

Tokens are fed in two ways: through real code paths that log what they are given (the
Slack notifier logging a message it cannot post, a failing background call's traceback,
the CLI's own logging setup in a subprocess), and directly.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bot.slack_notifier import SlackNotifier
from jobs.outbound.notify import TextMessage
from jobs.process.logs import (
    REDACTED,
    JsonFormatter,
    RedactSecrets,
    configure_logging,
    log_context,
    make_handler,
    secret_values,
)
from jobs.process.settings import load_settings
from tests.fakes.slack_api import FakeSlack
from tests.paths import ROOT

BOT_TOKEN = "xoxb-1234567890-0987654321-AbCdEfGhIjKlMnOpQrStUvWx"
USER_TOKEN = "xoxp-1111111111-2222222222-abcdefabcdef"
APP_TOKEN = "xapp-1-A0123456789-1234567890-0123456789abcdef"
SIGNING_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
RUNNER_TOKEN = "3c5b9f0e7d2a41868e1b6f4d9c0a7e2b5d8f1a3c6e9b2d4f7a0c3e5b8d1f4a6c"


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """The root logger writing JSON lines into a buffer, with the settings' secrets."""
    settings = load_settings(
        {
            "TRAINBOT_SLACK_BOT_TOKEN": BOT_TOKEN,
            "TRAINBOT_SLACK_SIGNING_SECRET": SIGNING_SECRET,
            "TRAINBOT_SLACK_APP_TOKEN": APP_TOKEN,
        }
    )
    out = io.StringIO()
    with on_the_root_logger(make_handler("json", stream=out, secrets=secret_values(settings))):
        yield out


@contextmanager
def on_the_root_logger(*handlers: logging.Handler) -> Iterator[None]:
    """``handlers`` on the root logger, at INFO, for the block (added in order: the first
    sees each record first); then the logger as it was."""
    root = logging.getLogger()
    level = root.level
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        for handler in handlers:
            root.removeHandler(handler)
        root.setLevel(level)


def lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def no_secret(text: str) -> bool:
    return not any(
        s in text
        for s in (BOT_TOKEN, USER_TOKEN, APP_TOKEN, SIGNING_SECRET, RUNNER_TOKEN, "xoxb-", "xapp-")
    )


def test_json_lines_carry_time_level_logger_message_and_the_context_ids(
    captured: io.StringIO,
) -> None:
    log = logging.getLogger("jobs.test")
    log.warning("outside any run")
    with log_context(run_id="r-1"):
        log.info("run work %d", 1)
        with log_context(attempt_id="a-2"):
            log.error("attempt work")
        log.info("after the attempt")

    records = lines(captured)

    assert [r["message"] for r in records] == [
        "outside any run",
        "run work 1",
        "attempt work",
        "after the attempt",
    ]
    assert all(set(r) >= {"time", "level", "logger", "message"} for r in records)
    assert records[0]["logger"] == "jobs.test" and records[0]["level"] == "warning"
    assert str(records[0]["time"]).endswith("+00:00")
    assert "run_id" not in records[0]
    assert (records[1]["run_id"], records[1].get("attempt_id")) == ("r-1", None)
    assert (records[2]["run_id"], records[2]["attempt_id"]) == ("r-1", "a-2")
    assert "attempt_id" not in records[3]


def test_a_token_in_a_message_the_notifier_logs_is_redacted(captured: io.StringIO) -> None:
    """A real path: the Slack notifier logs the text of a message it cannot post."""
    fake = FakeSlack(tokens=[BOT_TOKEN]).start()
    notifier = SlackNotifier(fake.client(BOT_TOKEN))
    try:
        notifier.close(timeout=1)
        notifier.post(
            TextMessage(
                channel="C1",
                kind="error",
                text=f"oops, pasted {BOT_TOKEN} and Authorization: Bearer {RUNNER_TOKEN}",
            )
        )
    finally:
        fake.close()

    text = captured.getvalue()
    records = lines(captured)
    assert any("not posting to C1" in str(r["message"]) for r in records)
    assert no_secret(text), text
    assert REDACTED in text


def test_a_traceback_with_a_secret_is_redacted(captured: io.StringIO) -> None:
    log = logging.getLogger("jobs.test")
    try:
        raise RuntimeError(f"signing secret {SIGNING_SECRET} refused for token={RUNNER_TOKEN}")
    except RuntimeError:
        log.exception("the call failed")

    record = lines(captured)[0]

    assert record["message"] == "the call failed"
    assert "RuntimeError" in str(record["exception"])
    assert no_secret(captured.getvalue()), captured.getvalue()


@pytest.mark.parametrize(
    ("fed", "kept"),
    [
        (f"bot token {BOT_TOKEN} in a sentence", "bot token [redacted] in a sentence"),
        (f"user {USER_TOKEN}", "user [redacted]"),
        (f"app {APP_TOKEN}", "app [redacted]"),
        (f"Authorization: Bearer {RUNNER_TOKEN}", "Authorization: Bearer [redacted]"),
        (
            f"TRAINBOT_TOKEN={RUNNER_TOKEN} trainbot-runner",
            "TRAINBOT_TOKEN=[redacted] trainbot-runner",
        ),
        ('{"token": "abc123def456"}', '{"token": "[redacted]"}'),
        (f"X-Slack-Signature: v0={'a1' * 32}", "X-Slack-Signature: [redacted]"),
        (
            "postgresql://trainbot:hunter2hunter2@db:5432/x",
            "postgresql://trainbot:[redacted]@db:5432/x",
        ),
        (f"secret is {SIGNING_SECRET}!", "secret is [redacted]!"),
        ("step 10 loss 0.25 sha256 ok", "step 10 loss 0.25 sha256 ok"),
    ],
)
def test_secrets_are_redacted_by_pattern_and_by_value(fed: str, kept: str) -> None:
    out = io.StringIO()
    handler = make_handler("text", stream=out, secrets=[SIGNING_SECRET])
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("tests.redact")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("%s", fed)
    finally:
        log.removeHandler(handler)
        log.propagate = True

    assert out.getvalue().rstrip("\n") == kept
    assert RedactSecrets([SIGNING_SECRET]).redact(fed) == kept


def test_the_text_format_shows_the_ids_and_configure_respects_existing_handlers() -> None:
    out = io.StringIO()
    handler = make_handler("text", stream=out)
    record = logging.LogRecord("jobs.x", logging.INFO, __file__, 1, "hello %s", ("there",), None)
    with log_context(run_id="r-9", attempt_id="a-9"):
        for f in handler.filters:
            f.filter(record)  # type: ignore[union-attr]
    assert handler.format(record).endswith("INFO jobs.x [r-9 a-9]: hello there")
    assert JsonFormatter().format(record).startswith('{"time": ')
    # pytest's own handlers are on the root logger: like basicConfig, leave them be.
    assert configure_logging("json") is None


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_the_cli_logs_in_the_format_asked_and_never_the_token(tmp_path: Path, fmt: str) -> None:
    """``trainbot serve`` refusing to start logs nothing secret, in either format."""
    code = (
        "import logging, sys\n"
        "from bot.cli import _configure_logging\n"
        "_configure_logging(verbose=True)\n"
        "log = logging.getLogger('jobs.process.bootstrap')\n"
        f"log.warning('started with %s and %s', {BOT_TOKEN!r}, 'Bearer {RUNNER_TOKEN}')\n"
        "with __import__('jobs.process.logs').process.logs.log_context(run_id='r-7'):\n"
        "    log.error('failed for %s', 'r-7')\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TRAINBOT_STATE_DIR": str(tmp_path),
        "TRAINBOT_SLACK_BOT_TOKEN": BOT_TOKEN,
        "TRAINBOT_LOG_FORMAT": fmt,
    }
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )

    err = done.stderr.strip().splitlines()
    assert len(err) == 2, done.stderr
    assert no_secret(done.stderr), done.stderr
    if fmt == "json":
        first, second = (json.loads(line) for line in err)
        assert first["logger"] == "jobs.process.bootstrap" and first["level"] == "warning"
        assert second["run_id"] == "r-7"
    else:
        assert (
            "WARNING jobs.process.bootstrap: started with [redacted] and Bearer [redacted]"
            in err[0]
        )
        assert "[r-7]" in err[1]
