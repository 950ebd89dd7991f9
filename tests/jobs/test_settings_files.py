"""Secrets from files (``TRAINBOT_X_FILE``, ``TRAINBOT_SECRETS_DIR``), the database password
apart from its URL, and the log level in any case (issue 28, point 2)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from jobs.domain.errors import SettingsError
from jobs.process.google_env import google_credentials_environ
from jobs.process.logs import parse_log_level
from jobs.process.settings import load_settings

SLACK = {"TRAINBOT_NOTIFIER": "slack"}


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_each_secret_setting_reads_its_file_without_the_trailing_newline(tmp_path: Path) -> None:
    files = {
        "SLACK_BOT_TOKEN": "xoxb-from-a-file",
        "SLACK_SIGNING_SECRET": "signing-from-a-file",
        "SLACK_APP_TOKEN": "xapp-from-a-file",
        "RUNNER_TOKEN_SECRET": "r" * 64,
        "PAGERDUTY_ROUTING_KEY": "pagerduty-from-a-file",
    }
    env = dict(SLACK)
    for name, value in files.items():
        env[f"TRAINBOT_{name}_FILE"] = str(_write(tmp_path / name.lower(), value + "\n"))

    settings = load_settings(env)

    for name, value in files.items():
        secret = getattr(settings, name.lower())
        assert secret is not None and secret.get_secret_value() == value, name
    assert "from-a-file" not in repr(settings)


def test_a_secrets_directory_gives_what_the_environment_does_not(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets"
    _write(secrets / "slack_bot_token", "xoxb-dir")  # the field's name
    _write(secrets / "slack-signing-secret", "signing-dir\n")  # a Secret key's usual spelling
    _write(secrets / "TRAINBOT_PAGERDUTY_ROUTING_KEY", "pd-dir")  # the variable's name
    _write(secrets / "runner_token_secret", "d" * 40)
    explicit = _write(tmp_path / "runner-secret", "f" * 40)
    _write(secrets / "..data" / "ignored", "kubelet's own files are ignored")

    settings = load_settings(
        {
            **SLACK,
            "TRAINBOT_SECRETS_DIR": str(secrets),
            "TRAINBOT_RUNNER_TOKEN_SECRET_FILE": str(explicit),  # explicit beats the directory
        }
    )

    assert settings.slack_bot_token is not None
    assert settings.slack_bot_token.get_secret_value() == "xoxb-dir"
    assert settings.slack_signing_secret is not None
    assert settings.slack_signing_secret.get_secret_value() == "signing-dir"
    assert settings.pagerduty_routing_key is not None
    assert settings.pagerduty_routing_key.get_secret_value() == "pd-dir"
    assert settings.runner_token_secret is not None
    assert settings.runner_token_secret.get_secret_value() == "f" * 40


def test_the_database_password_comes_apart_from_the_url(tmp_path: Path) -> None:
    password = _write(tmp_path / "password", "p@ss/w:rd\n")
    settings = load_settings(
        {
            "TRAINBOT_DATABASE_URL": "postgresql://trainbot@db:5432/trainbot",
            "TRAINBOT_DATABASE_PASSWORD_FILE": str(password),
        }
    )
    from sqlalchemy.engine import make_url

    url = make_url(settings.database_url)
    assert (url.username, url.password, url.host, url.database) == (
        "trainbot",
        "p@ss/w:rd",
        "db",
        "trainbot",
    )
    assert "p@ss" not in repr(settings.database_password)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {
                "TRAINBOT_DATABASE_URL": "postgresql://u:inline@db/x",
                "TRAINBOT_DATABASE_PASSWORD": "p",
            },
            "TRAINBOT_DATABASE_URL holds a password too",
        ),
        (
            {"TRAINBOT_DATABASE_URL": "sqlite:////tmp/x.db", "TRAINBOT_DATABASE_PASSWORD": "p"},
            "the database is not PostgreSQL",
        ),
    ],
)
def test_a_password_in_two_places_is_refused(env: dict[str, str], expected: str) -> None:
    with pytest.raises(SettingsError, match=expected):
        load_settings(env)


def test_missing_unreadable_empty_and_doubly_set_files_are_one_clear_line_each(
    tmp_path: Path,
) -> None:
    unreadable = _write(tmp_path / "unreadable", "xoxb-x")
    unreadable.chmod(0)
    empty = _write(tmp_path / "empty", "\n")
    both = _write(tmp_path / "both", "x" * 40)
    env = {
        **SLACK,
        "TRAINBOT_SLACK_BOT_TOKEN_FILE": str(tmp_path / "absent"),
        "TRAINBOT_SLACK_SIGNING_SECRET_FILE": str(unreadable),
        "TRAINBOT_PAGERDUTY_ROUTING_KEY_FILE": str(empty),
        "TRAINBOT_RUNNER_TOKEN_SECRET": "y" * 40,
        "TRAINBOT_RUNNER_TOKEN_SECRET_FILE": str(both),
        "TRAINBOT_SECRETS_DIR": str(tmp_path / "no-such-dir"),
    }
    try:
        with pytest.raises(SettingsError) as caught:
            load_settings(env)
    finally:
        unreadable.chmod(0o600)
    problems = caught.value.problems
    text = "\n".join(problems)
    assert f"TRAINBOT_SLACK_BOT_TOKEN_FILE={tmp_path / 'absent'}: no such file" in text
    if os.geteuid() != 0:  # root reads any file
        assert "TRAINBOT_SLACK_SIGNING_SECRET_FILE=" in text and "permission denied" in text
    assert "TRAINBOT_PAGERDUTY_ROUTING_KEY_FILE=" in text and "the file is empty" in text
    assert "TRAINBOT_RUNNER_TOKEN_SECRET and TRAINBOT_RUNNER_TOKEN_SECRET_FILE are both set" in text
    assert "TRAINBOT_SECRETS_DIR=" in text and "no such directory" in text
    assert all("\n" not in problem for problem in problems)
    assert "Traceback" not in str(caught.value) and "y" * 40 not in str(caught.value)


@pytest.mark.parametrize(
    ("raw", "level"),
    [
        ("info", logging.INFO),
        ("INFO", logging.INFO),
        ("Debug", logging.DEBUG),
        ("warn", logging.WARNING),
        (" error ", logging.ERROR),
        ("", logging.WARNING),
        (None, logging.WARNING),
    ],
)
def test_the_log_level_is_read_in_any_case(raw: str | None, level: int) -> None:
    assert parse_log_level(raw) == level
    if raw:
        assert (
            load_settings({"TRAINBOT_LOG_LEVEL": raw}).log_level
            == logging.getLevelName(level).lower()
        )


def test_a_bad_log_level_is_one_line_naming_the_choices() -> None:
    with pytest.raises(SettingsError) as caught:
        parse_log_level("loud")
    assert str(caught.value) == (
        "bad setting: TRAINBOT_LOG_LEVEL='loud': expected one of debug, info, warning, "
        "error, critical (any case)"
    )
    with pytest.raises(SettingsError, match="TRAINBOT_LOG_LEVEL='loud'"):
        load_settings({"TRAINBOT_LOG_LEVEL": "loud"})


def test_the_migration_needs_no_notifier_secret() -> None:
    env = {"TRAINBOT_NOTIFIER": "slack", "TRAINBOT_DATABASE_URL": "postgresql://u@db/x"}
    with pytest.raises(SettingsError, match="TRAINBOT_SLACK_BOT_TOKEN is not set"):
        load_settings(env)
    assert load_settings(env, purpose="migrate").database_url == "postgresql://u@db/x"


def test_google_key_only_where_one_is_mounted(tmp_path: Path) -> None:
    key = tmp_path / "gcp" / "key.json"
    settings = load_settings({"TRAINBOT_GCP_CREDENTIALS_FILE": str(key)})
    assert google_credentials_environ(settings, {}) == {}  # Workload Identity
    _write(key, "{}")
    assert google_credentials_environ(settings, {}) == {"GOOGLE_APPLICATION_CREDENTIALS": str(key)}
    mine = {"GOOGLE_APPLICATION_CREDENTIALS": str(key)}
    assert google_credentials_environ(settings, mine) == {}  # the operator's own wins


def test_a_google_key_variable_naming_no_file_is_refused_where_google_is_used(
    tmp_path: Path,
) -> None:
    env = {
        "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "absent.json"),
        "TRAINBOT_PROVIDER": "gcp",
        "TRAINBOT_CHECKPOINT_URI": "gs://b/p",
        "TRAINBOT_PUBLIC_URL": "https://trainbot.example.com",
    }
    with pytest.raises(SettingsError, match=r"GOOGLE_APPLICATION_CREDENTIALS=.*no such file"):
        load_settings(env)
