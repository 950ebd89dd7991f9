"""Issue 26, point 1, on GCP against a fake that speaks Secret Manager's REST protocol
(``tests.fakes.secret_manager``): preflight reads the secret's metadata and IAM policy,
never its payload; the runner (``trainbot-runner exec``, this checkout's) reads it with
the metadata server's token into the command's environment only."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.auth.credentials import AnonymousCredentials

from jobs.preflight import Status
from jobs.providers.base import ResourceRequest
from jobs.providers.gcp import GcpProvider
from jobs.spec import parse_spec
from jobs.spec.env import secrets_env
from tests.fakes.secret_manager import FakeSecretManager
from tests.jobs.boot import gcp_boot_env, secret_checker
from tests.jobs.test_preflight import secrets_check
from tests.paths import ROOT

PROJECT = "team-1"
RUNNER = "trainbot-runner@team-1.iam.gserviceaccount.com"
A100 = ResourceRequest(
    cloud="gcp", region="us-central1", accelerator_type="A100", accelerator_count=1
)
VALUE = "hf_" + hashlib.sha256(b"gcp-secret").hexdigest()[:24]
TRAIN = secret_checker("HF_TOKEN")


@pytest.fixture
def sm() -> Iterator[FakeSecretManager]:
    with FakeSecretManager(instance_account=RUNNER) as fake:
        fake.add(f"projects/{PROJECT}/secrets/trainbot-hf", VALUE, readers=(RUNNER,))
        fake.add(f"projects/{PROJECT}/secrets/trainbot-db", "other")  # nobody may read it
        yield fake


def _check(sm: FakeSecretManager, secrets: dict[str, str], tmp_path: Path) -> Any:
    gcp = GcpProvider(
        project=PROJECT,
        region="us-central1",
        api_endpoint=sm.url,
        credentials=AnonymousCredentials(),
        service_account=RUNNER,
        secrets_endpoint=sm.url,
    )
    return secrets_check(
        tmp_path, gcp, secrets, request=A100, store="gs://bucket/x", run_id="r-gcp-secrets"
    )


def test_preflight_reads_metadata_and_policy_never_the_payload(
    sm: FakeSecretManager, tmp_path: Path
) -> None:
    ref = f"gcp-sm://projects/{PROJECT}/secrets/trainbot-hf"
    ok = _check(sm, {"HF_TOKEN": ref}, tmp_path)
    assert ok.status is Status.PASS, ok.detail
    denied = _check(sm, {"DB": f"gcp-sm://projects/{PROJECT}/secrets/trainbot-db"}, tmp_path)
    assert denied.status is Status.FAIL
    assert f"the service account {RUNNER} may not read it" in denied.detail
    assert "gcloud secrets add-iam-policy-binding trainbot-db" in denied.remedy
    missing = _check(sm, {"X": f"gcp-sm://projects/{PROJECT}/secrets/trainbot-gone"}, tmp_path)
    assert missing.status is Status.FAIL and "no such secret in project team-1" in missing.detail
    assert "gcloud secrets create trainbot-gone --project team-1" in missing.remedy
    outside = _check(sm, {"X": f"gcp-sm://projects/{PROJECT}/secrets/hf"}, tmp_path)
    assert outside.status is Status.FAIL and "does not start with trainbot-" in outside.detail
    assert not [path for _, path, _ in sm.seen if ":access" in path], "no payload was read"


def _exec(sm: FakeSecretManager, tmp_path: Path, secrets: dict[str, str]) -> Any:
    spec = parse_spec({"command": "python train.py", "secrets": secrets}, name="s")
    (tmp_path / "train.py").write_text(TRAIN)
    digest = hashlib.sha256(VALUE.encode()).hexdigest()
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(ROOT),
        "TRAINBOT_RUN_ID": "r-gcp",
        "TRAINBOT_ATTEMPT_ID": "a-gcp",
        "TRAINBOT_TOKEN": "tok",
        "TRAINBOT_CHECKPOINT_URI": str(tmp_path / "ckpt"),
        "TRAINBOT_GCP_METADATA_URL": sm.url,
        "TRAINBOT_GCP_SECRETS_URL": sm.url,
        "TRAINBOT_EVENTS_FILE": str(tmp_path / "events.jsonl"),
        **secrets_env(spec, local=False),
    }
    command = [sys.executable, "-m", "runner.cli", "exec", "--"]
    command += [sys.executable, str(tmp_path / "train.py"), digest]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)


def test_the_runner_reads_it_with_the_metadata_token(sm: FakeSecretManager, tmp_path: Path) -> None:
    ref = f"gcp-sm://projects/{PROJECT}/secrets/trainbot-hf"
    done = _exec(sm, tmp_path, {"HF_TOKEN": ref})
    said = done.stdout + done.stderr
    assert done.returncode == 0 and "secret ok" in said, said
    assert VALUE not in said
    # A secret its account may not read fails the attempt (1), naming it and the answer.
    denied = _exec(sm, tmp_path, {"HF_TOKEN": f"gcp-sm://projects/{PROJECT}/secrets/trainbot-db"})
    said = denied.stdout + denied.stderr
    assert denied.returncode == 1, said
    assert "secret HF_TOKEN (gcp-sm://projects/team-1/secrets/trainbot-db/versions/latest)" in said
    assert "HTTP 403" in said and "secret ok" not in said


def test_the_startup_script_s_runner_reads_it_and_the_metadata_holds_only_the_reference(
    sm: FakeSecretManager, tmp_path: Path
) -> None:
    """The instance's whole boot on the fake Compute API: the startup script reads the
    attempt's environment from the instance metadata and starts this checkout's runner,
    which reads the secret with the (fake) metadata server's token."""
    from tests.fakes.gce_api import FakeComputeApi
    from tests.jobs.providers.contract import launch_request

    (tmp_path / "train.py").write_text(TRAIN)
    digest = hashlib.sha256(VALUE.encode()).hexdigest()
    spec = parse_spec(
        {
            "command": "x",
            "secrets": {"HF_TOKEN": f"gcp-sm://projects/{PROJECT}/secrets/trainbot-hf"},
        },
        name="s",
    )
    env = {
        "TRAINBOT_TOKEN": "tok",
        "TRAINBOT_CHECKPOINT_URI": str(tmp_path / "ckpt"),
        # The instance's metadata server for the token, and Secret Manager: the fake's.
        "TRAINBOT_GCP_METADATA_URL": sm.url,
        "TRAINBOT_GCP_SECRETS_URL": sm.url,
        **secrets_env(spec, local=False),
    }
    command = ["trainbot-runner", "exec", "--", sys.executable, str(tmp_path / "train.py"), digest]
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    for name, body in {
        "python": f'exec env PYTHONPATH={ROOT} {sys.executable} "$@"',
        "trainbot-runner": f'exec env PYTHONPATH={ROOT} {sys.executable} -m runner.cli "$@"',
    }.items():
        (venv / name).write_text(f"#!/bin/sh\n{body}\n")
        (venv / name).chmod(0o755)
    with FakeComputeApi() as gce:
        gcp = GcpProvider(
            project=gce.project,
            region="us-central1",
            api_endpoint=gce.url,
            credentials=AnonymousCredentials(),
            service_account=RUNNER,
        )
        zone = "us-central1-a"
        info = gcp.launch(launch_request(A100, command, zone=zone, env=env))
        assert VALUE not in repr(gce.instances())  # the metadata holds the reference only
        with gce.metadata_server(zone, info.instance_id.split("/", 1)[1]) as md_url:
            done = subprocess.run(
                ["bash", str(gcp.startup_script)],
                env=gcp_boot_env(tmp_path, md_url),
                capture_output=True,
                text=True,
                timeout=60,
            )
        said = done.stdout + done.stderr
        assert "secret ok" in said and "trainbot: runner exited 0" in said, said
        assert VALUE not in said
