"""A staging copy of 80 MiB across two regions on moto, its control plane killed with
SIGKILL in the middle of the large object's multipart copy, and the copy finishing
after a restart without starting over.

The control plane is :mod:`tests.jobs.replica_process` (what ``trainbot serve`` builds
with Slack), on SQLite, talking to moto's server in this process and to the fake Slack
Web API. moto's request log (werkzeug's, one line per request answered) shows what was
copied: each part of the large object is requested once, none of those done before the
kill is requested after it, its multipart upload is created once, and the progress
message posted by the first process is the one the second edits to its end.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import boto3
import pytest
import requests
from sqlalchemy import Engine
from sqlmodel import select

from jobs.database.db import make_engine, migrate
from jobs.process.deps import load_secret
from jobs.staging import Staging, StagingState
from tests.bot.test_slack_app import ResponseUrls, sign
from tests.fakes.slack_api import FakeSlack
from tests.jobs.rows import all_detached, detached
from tests.jobs.test_staging import s3_bucket
from tests.paths import ROOT
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow]

TOKEN = "xoxb-staging"
CHANNEL = "C0TRAIN"
ADA = "U0ADA"
SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
MiB = 2**20
#: S3's smallest part but 5 MiB: moto reads the whole source object for each part it
#: copies, so the large object's eight parts read it eight times (at 32 MiB parts and a
#: 256 MiB object that was 2 GiB of reading, most of the test's 90 s on a busy machine).
PART = 8 * MiB
#: The dataset: a large object copied in 8 parts first (keys sort so), a multipart
#: one of 12 MiB (two parts), and two under the part size (CopyObject).
SIZES = {"a-big.bin": 64 * MiB, "b-mid.bin": 12 * MiB, "c-small.bin": 4 * MiB, "d-tiny.txt": 700}


class RequestLog(logging.Handler):
    """moto's requests for one bucket, in the order answered."""

    def __init__(self, bucket: str) -> None:
        super().__init__(logging.INFO)
        self.bucket = bucket
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if f"/{self.bucket}/" in line:
            with self._lock:
                self.lines.append(line)

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self.lines)


@pytest.fixture
def request_log() -> Iterator[Any]:
    logger = logging.getLogger("werkzeug")
    made: list[RequestLog] = []
    level = logger.level

    def watch(bucket: str) -> RequestLog:
        handler = RequestLog(bucket)
        logger.addHandler(handler)
        made.append(handler)
        return handler

    logger.setLevel(logging.INFO)
    yield watch
    logger.setLevel(level)
    for handler in made:
        logger.removeHandler(handler)


def part_numbers(lines: list[str], key: str) -> list[int]:
    return [
        int(m.group(1))
        for line in lines
        if f"/{key}?" in line and line.split('"')[1].startswith("PUT")
        for m in [re.search(r"partNumber=(\d+)", line)]
        if m
    ]


def command(url: str, hooks: str, text: str) -> None:
    """``/train <text>`` from Ada in the channel, signed as Slack signs it."""
    form = {
        "team_id": "T0TEST",
        "channel_id": CHANNEL,
        "channel_name": "ml-training",
        "user_id": ADA,
        "user_name": "ada",
        "command": "/train",
        "text": text,
        "api_app_id": "A0TRAIN",
        "response_url": f"{hooks}/commands/stage",
        "trigger_id": f"trg-{uuid.uuid4().hex[:12]}",
    }
    body = urlencode(form).encode()
    ts = str(int(time.time()))
    headers = {
        "Content-Type": "application/x-www-form-urlencoded",
        "X-Slack-Request-Timestamp": ts,
        "X-Slack-Signature": sign(body, ts, SECRET),
    }
    answer = requests.post(f"{url}/slack/events", data=body, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text


def _only_row(engine: Engine) -> Staging | None:
    rows = all_detached(engine, select(Staging))
    assert len(rows) <= 1
    return rows[0] if rows else None


def staging_row(engine: Engine, staging_id: str) -> Staging:
    return detached(engine, Staging, staging_id)


def test_a_copy_killed_mid_part_resumes_after_restart(
    moto_server: str, request_log: Any, tmp_path: Path
) -> None:
    s3 = boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1")
    source = s3_bucket(moto_server, "us-east-1")
    stage = s3_bucket(moto_server, "us-west-2")
    bodies: dict[str, bytes] = {}
    for name, size in SIZES.items():
        bodies[name] = os.urandom(size)
        s3.put_object(Bucket=source, Key=f"data/{name}", Body=bodies[name])
    moto_log = request_log(stage)

    url = f"sqlite:///{tmp_path / 'trainbot.db'}"
    engine = make_engine(url)
    migrate(engine)
    state = tmp_path / "state"
    load_secret(state)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TRAINBOT_STATE_DIR": str(state),
        "TRAINBOT_DATABASE_URL": url,
        "TRAINBOT_INGEST_PORT": "0",
        "TRAINBOT_NOTIFIER": "slack",
        "TRAINBOT_SLACK_SIGNING_SECRET": SECRET,
        "TRAINBOT_SLACK_BOT_TOKEN": TOKEN,
        "TRAINBOT_ALLOWED_CHANNELS": CHANNEL,
        "TRAINBOT_LAUNCHERS": ADA,
        "TRAINBOT_TIMEZONE": "UTC",
        "TRAINBOT_LOG_FORMAT": "text",
        "TRAINBOT_AWS_ENDPOINT_URL": moto_server,
        "TRAINBOT_STAGING_BUCKETS": f"us-west-2=s3://{stage}/staged",
        "TRAINBOT_STAGING_PART_BYTES": str(PART),
        "REPLICA_LEASE_S": "2",
        "REPLICA_POST_INTERVAL_S": "0.2",
    }
    fake = FakeSlack(tokens=[TOKEN]).start()
    hooks = ResponseUrls()
    fake.add_channel(CHANNEL, "ml-training", members=[ADA])
    env["REPLICA_SLACK_API"] = fake.api_url
    procs: list[subprocess.Popen[str]] = []

    def control_plane(name: str) -> tuple[subprocess.Popen[str], str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.jobs.replica_process"],
            cwd=ROOT,
            env={**env, "REPLICA_NAME": name},
            stdout=subprocess.PIPE,
            stderr=(tmp_path / f"{name}.log").open("w"),
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, (tmp_path / f"{name}.log").read_text()[-3000:]
        return proc, json.loads(line)["url"]

    try:
        first, url = control_plane("first")
        # Ada asks in the channel, as Slack sends it: a signed slash command.
        command(url, hooks.url, f"stage s3://{source}/data us-west-2")
        answer = hooks.wait("/commands/stage", timeout=60)["text"]
        row: Staging = wait_until(lambda: _only_row(engine), 10, "the staging row")
        assert f"Staging {row.id}: copy s3://{source}/data/ (us-east-1) to " in answer
        assert "4 objects, 83.9 MB, about $0.0016 of transfer at $0.02/GB" in answer
        big = f"staged/{source}/data/a-big.bin"

        def mid_copy() -> Staging | None:
            now = staging_row(engine, row.id)
            return now if now.current_key == "data/a-big.bin" and len(now.parts) >= 2 else None

        wait_until(mid_copy, 60, "the large object's copy under way", every=0.01)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        killed_at = len(moto_log.snapshot())
        before = staging_row(engine, row.id)
        assert before.state is StagingState.COPYING and before.upload_id
        done_before = {int(p["n"]) for p in before.parts}
        assert 2 <= len(done_before) < 8, "killed after the large object, not during it"
        message_ts = before.message_ts
        assert message_ts and not message_ts.startswith("pending-")

        control_plane("second")
        finished: Staging = wait_until(
            lambda: (r := staging_row(engine, row.id)).state is StagingState.DONE and r,
            120,
            "the copy finished after the restart",
        )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
        fake.close()
        hooks.close()
        engine.dispose()

    lines = moto_log.snapshot()
    # Each part of the large object copied once, over both processes; the upload
    # created once and completed once: the copy went on, it did not start over.
    parts = part_numbers(lines, big)
    assert Counter(parts) == Counter(range(1, 9)), sorted(parts)
    assert not done_before & set(part_numbers(lines[killed_at:], big))
    creates = [ln for ln in lines if f"/{big}?uploads" in ln]
    assert len(creates) == 1, creates
    assert finished.part_copies <= 8 + 2 + 2  # each part once (one may be copied, unsaved)
    assert (finished.objects_done, finished.bytes_done) == (4, sum(SIZES.values()))
    # The small objects were single CopyObject requests (no upload for them).
    assert not [ln for ln in lines if "c-small.bin?uploads" in ln or "d-tiny.txt?uploads" in ln]
    for name, body in bodies.items():
        copied = s3.get_object(Bucket=stage, Key=f"staged/{source}/data/{name}")["Body"].read()
        assert hashlib.sha256(copied).digest() == hashlib.sha256(body).digest(), name

    # One progress message, posted by the first process, edited by both to the end.
    posts = [c for c in fake.calls_to("chat.postMessage") if row.id in json.dumps(c.args)]
    assert len(posts) == 1
    shown = fake.message(CHANNEL, message_ts)
    assert shown is not None and "is copied to" in shown.text
    assert any("%" in text for text, _ in shown.edits), shown.edits
