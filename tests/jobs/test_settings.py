from __future__ import annotations

from datetime import time
from pathlib import Path

import pytest

from jobs.domain.errors import SettingsError, TrainbotError
from jobs.process.settings import SHIPPED_SPECS_DIR, Settings, env_name, load_settings


def test_defaults_are_the_embedded_setup() -> None:
    settings = load_settings({})
    state = Path.home() / ".trainbot"
    assert settings.state_dir == state
    assert settings.database_url == f"sqlite:///{state / 'trainbot.db'}"
    assert settings.checkpoint_uri == (state / "checkpoints").as_uri()
    assert settings.provider == "local"
    assert settings.notifier == "console"
    assert (settings.ingest_host, settings.ingest_port) == ("127.0.0.1", 8787)
    assert settings.public_url == "http://127.0.0.1:8787"
    assert settings.specs_dir == SHIPPED_SPECS_DIR
    assert (settings.specs_dir / "tiny.yaml").is_file()
    assert settings.slack_bot_token is None
    assert settings.slack_signing_secret is None
    assert settings.slack_app_token is None
    assert settings.allowed_channels == []
    assert settings.admins == []
    assert settings.local_termination_window_s == 30.0
    assert settings.local_mean_time_between_preemptions_s is None
    assert settings.local_cores >= 1
    assert settings.timezone == "UTC"
    assert settings.digest_time == time(9, 0)
    assert settings.heartbeat_deadline_s > 0
    assert settings.escalation_delay_s > 0
    assert settings.scheduler_lease_s == 30.0
    assert settings.slack_api_url == "https://slack.com/api/"


def test_state_dir_moves_every_derived_default(tmp_path: Path) -> None:
    settings = load_settings({"TRAINBOT_STATE_DIR": str(tmp_path)})
    assert settings.state_dir == tmp_path
    assert settings.database_url == f"sqlite:///{tmp_path / 'trainbot.db'}"
    assert settings.checkpoint_uri == (tmp_path / "checkpoints").as_uri()


def test_explicit_values_override_the_derived_ones(tmp_path: Path) -> None:
    settings = load_settings(
        {
            "TRAINBOT_STATE_DIR": str(tmp_path),
            "TRAINBOT_DATABASE_URL": "postgresql://u@db:5432/trainbot",
            "TRAINBOT_CHECKPOINT_URI": "s3://bucket/ckpt",
            "TRAINBOT_PUBLIC_URL": "https://trainbot.example.com/",
            "TRAINBOT_INGEST_PORT": "9000",
            "TRAINBOT_DIGEST_TIME": "7:30",
            "TRAINBOT_TIMEZONE": "Europe/Berlin",
            "TRAINBOT_LOCAL_MEAN_TIME_BETWEEN_PREEMPTIONS_S": "120",
        }
    )
    assert settings.database_url == "postgresql://u@db:5432/trainbot"
    assert settings.checkpoint_uri == "s3://bucket/ckpt"
    assert settings.public_url == "https://trainbot.example.com"
    assert settings.ingest_port == 9000
    assert settings.digest_time == time(7, 30)
    assert settings.tz.key == "Europe/Berlin"
    assert settings.local_mean_time_between_preemptions_s == 120.0


def test_public_url_follows_the_ingest_address() -> None:
    assert load_settings({"TRAINBOT_INGEST_PORT": "9100"}).public_url == "http://127.0.0.1:9100"
    # Listening on every interface: runners on this machine still use loopback.
    any_host = load_settings({"TRAINBOT_INGEST_HOST": "0.0.0.0"})
    assert any_host.public_url == "http://127.0.0.1:8787"
    assert load_settings({"TRAINBOT_INGEST_HOST": "::1"}).public_url == "http://[::1]:8787"


def test_lists_are_comma_separated_and_names_case_insensitive() -> None:
    settings = load_settings(
        {"trainbot_allowed_channels": "C01, C02,,", "TRAINBOT_ADMINS": '["U1", "U2"]'}
    )
    assert settings.allowed_channels == ["C01", "C02"]
    assert settings.admins == ["U1", "U2"]


def test_aws_failover_regions_are_a_comma_list_the_provider_watches() -> None:
    from jobs.providers.aws import from_settings

    env = {"TRAINBOT_AWS_REGION": "us-east-1", "TRAINBOT_AWS_REGIONS": "us-west-2, eu-west-1,,"}
    settings = load_settings(env)
    assert settings.aws_regions == ["us-west-2", "eu-west-1"]
    assert load_settings({"TRAINBOT_AWS_REGIONS": '["us-west-2"]'}).aws_regions == ["us-west-2"]
    assert load_settings({}).aws_regions == []
    provider = from_settings(settings)  # builds no client until asked
    try:
        assert provider.regions == ("us-west-2", "eu-west-1")
    finally:
        provider.close()


def test_empty_variables_count_as_unset() -> None:
    settings = load_settings({"TRAINBOT_PROVIDER": "", "TRAINBOT_INGEST_PORT": ""})
    assert settings.provider == "local"
    assert settings.ingest_port == 8787


def test_secrets_never_show_in_repr() -> None:
    settings = load_settings(
        {
            "TRAINBOT_NOTIFIER": "slack",
            "TRAINBOT_SLACK_BOT_TOKEN": "xoxb-very-secret",
            "TRAINBOT_SLACK_SIGNING_SECRET": "signing-very-secret",
        }
    )
    assert settings.slack_bot_token is not None
    assert settings.slack_bot_token.get_secret_value() == "xoxb-very-secret"
    assert "very-secret" not in repr(settings)
    assert "very-secret" not in str(settings)


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINBOT_INGEST_PORT", "8999")
    assert load_settings().ingest_port == 8999
    assert Settings().ingest_port == 8999


def test_an_explicit_mapping_ignores_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINBOT_PROVIDER", "gcp")
    monkeypatch.setenv("TRAINBOT_INGEST_PORT", "8999")
    settings = load_settings({})
    assert settings.provider == "local"
    assert settings.ingest_port == 8787


def test_unknown_trainbot_variables_are_ignored() -> None:
    settings = load_settings({"TRAINBOT_TEST_POSTGRES_URL": "postgresql://x", "HOME": "/x"})
    assert settings.provider == "local"


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("DIGEST_TIME", "25:00", "TRAINBOT_DIGEST_TIME='25:00': expected HH:MM in 24-hour time"),
        ("DIGEST_TIME", "9am", "TRAINBOT_DIGEST_TIME='9am': expected HH:MM"),
        ("INGEST_PORT", "abc", "TRAINBOT_INGEST_PORT='abc': expected a whole number"),
        ("INGEST_PORT", "70000", "TRAINBOT_INGEST_PORT='70000': must be at most 65535"),
        ("PROVIDER", "azure", "TRAINBOT_PROVIDER='azure': expected one of 'local', 'aws' or"),
        ("NOTIFIER", "email", "TRAINBOT_NOTIFIER='email': expected one of 'console' or 'slack'"),
        ("TIMEZONE", "Mars/Base", "TRAINBOT_TIMEZONE='Mars/Base': unknown time zone"),
        ("LOCAL_TERMINATION_WINDOW_S", "0", "must be greater than 0"),
        ("LOCAL_PRICE_PER_HOUR_USD", "-1", "TRAINBOT_LOCAL_PRICE_PER_HOUR_USD='-1': must be at"),
        ("LOCAL_CORES", "zero", "TRAINBOT_LOCAL_CORES='zero': expected a whole number"),
        ("HEARTBEAT_DEADLINE_S", "soon", "TRAINBOT_HEARTBEAT_DEADLINE_S='soon': expected a number"),
        ("ADMINS", "[U1", "TRAINBOT_ADMINS='[U1': expected a comma-separated list"),
        ("PUBLIC_URL", "ftp://host", "TRAINBOT_PUBLIC_URL='ftp://host': expected an http://"),
        ("SCHEDULER_LEASE_S", "0.5", "TRAINBOT_SCHEDULER_LEASE_S='0.5': must be at least 1"),
        ("SLACK_API_URL", "slack.com/api", "expected an http:// or https:// URL"),
    ],
)
def test_bad_values_are_named_by_their_variable(variable: str, value: str, expected: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings({f"TRAINBOT_{variable}": value})
    assert expected in str(caught.value)
    assert caught.value.problems[0].startswith(f"TRAINBOT_{variable}=")
    assert "Traceback" not in str(caught.value)


def test_every_bad_variable_is_reported_at_once() -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(
            {
                "TRAINBOT_DIGEST_TIME": "25:00",
                "TRAINBOT_INGEST_PORT": "abc",
                "TRAINBOT_PROVIDER": "azure",
            }
        )
    names = sorted(problem.split("=", 1)[0] for problem in caught.value.problems)
    assert names == ["TRAINBOT_DIGEST_TIME", "TRAINBOT_INGEST_PORT", "TRAINBOT_PROVIDER"]
    assert str(caught.value).startswith("3 bad settings:")


def test_slack_notifier_needs_its_secrets() -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings({"TRAINBOT_NOTIFIER": "slack", "TRAINBOT_SLACK_BOT_TOKEN": "xoxb-1"})
    assert len(caught.value.problems) == 1
    assert "TRAINBOT_SLACK_SIGNING_SECRET is not set" in str(caught.value)
    assert "TRAINBOT_NOTIFIER=console" in str(caught.value)


def test_cloud_provider_needs_reachable_store_and_url() -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings({"TRAINBOT_PROVIDER": "aws"})
    text = str(caught.value)
    assert "TRAINBOT_CHECKPOINT_URI=" in text and "s3://bucket/prefix" in text
    assert "TRAINBOT_PUBLIC_URL=" in text and "loopback" in text
    settings = load_settings(
        {
            "TRAINBOT_PROVIDER": "aws",
            "TRAINBOT_CHECKPOINT_URI": "s3://team-ckpt/runs",
            "TRAINBOT_PUBLIC_URL": "https://trainbot.example.com",
        }
    )
    assert settings.provider == "aws"


def test_settings_error_is_a_trainbot_error() -> None:
    assert issubclass(SettingsError, TrainbotError)
    assert env_name("digest_time") == "TRAINBOT_DIGEST_TIME"
