"""What `trainbot` prints as it starts, as a platform's log shipper reads it: the banner a
JSON record in JSON mode, ``TRAINBOT_LOG_LEVEL`` in any case, a bad level one line and no
traceback, and `trainbot migrate` with no Slack secret (issue 28, points 1 and 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import requests

from tests.bot.test_cli import serving, trainbot_env


def _trainbot(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bot.cli", *args],
        env=trainbot_env(tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_migrate_with_a_lower_case_level_and_no_slack_secret_says_json(tmp_path: Path) -> None:
    done = _trainbot(
        tmp_path,
        "migrate",
        TRAINBOT_LOG_LEVEL="info",
        TRAINBOT_LOG_FORMAT="json",
        TRAINBOT_NOTIFIER="slack",  # the ConfigMap's; the migration posts nothing
    )
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    record = json.loads(line)
    assert record["level"] == "info" and record["revision"]
    assert record["message"] == f"trainbot: database at revision {record['revision']}"
    for logged in done.stderr.splitlines():  # INFO lines, each a JSON object
        json.loads(logged)


def test_a_bad_log_level_is_one_line_and_no_traceback(tmp_path: Path) -> None:
    done = _trainbot(tmp_path, "migrate", TRAINBOT_LOG_LEVEL="chatty")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "trainbot: bad setting: TRAINBOT_LOG_LEVEL='chatty': expected one of debug, info, "
        "warning, error, critical (any case)"
    ]


def test_serve_banner_is_a_json_record_in_json_mode(tmp_path: Path) -> None:
    with serving(tmp_path, TRAINBOT_LOG_FORMAT="json", TRAINBOT_LOG_LEVEL="WARNING") as (
        proc,
        line,
    ):
        try:
            banner = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(line + proc.communicate(timeout=30)[1]) from None
        assert banner["event"] == "started" and banner["level"] == "info"
        assert banner["url"].startswith("http://127.0.0.1:")
        assert banner["python"] == ".".join(map(str, sys.version_info[:3]))
        assert banner["version"]
        assert banner["url"] in banner["message"]
        assert requests.get(f"{banner['admin_url']}/healthz", timeout=10).status_code == 200
