"""Issue 25, points 1 to 3, 5 and 6: the run's code and environment, the machine image, and
the runner pinned on the instance.

The boot script the provider really sent (the EC2 user data read back from moto; the GCP
startup script with its instance's metadata server) runs under bash as a played
instance: stand-ins only for the root-only commands (shutdown, runuser, useradd …). The
image's python is this checkout's interpreter, which has torch and the runner's
dependencies but, on a fresh instance, no runner. The runner's installer is the real one
and pip is real; the public index is a closed port and pip's own configuration is off,
so trainbot can only come from the control plane's own wheel, served by a real control
plane (its WSGI app on waitress, over loopback HTTP) to the attempt's token, or, in
``index`` mode, from an index served on loopback. The instance has no bucket access,
except where the run's code is under test: there it checks the pinned commit out of a git
repository served over loopback HTTP, runs setup against the team's own loopback index,
and archives the environment to the run's store (moto's S3, the GCS emulator), which the
next attempt's instance restores.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from http.server import SimpleHTTPRequestHandler
from pathlib import Path
from types import ModuleType
from typing import Any

import boto3
import pytest
from sqlalchemy import Engine
from sqlmodel import Session

from jobs.database.db import make_engine, migrate
from jobs.database.models import Attempt, DryRunInstance, Run, hash_token
from jobs.ingest import IngestService
from jobs.preflight import (
    CapacityCheck,
    PreflightContext,
    Status,
    resource_request,
    run_preflight,
)
from jobs.providers.aws import DEFAULT_IMAGE as AWS_DEFAULT_IMAGE
from jobs.providers.aws import AwsProvider
from jobs.providers.aws.settings import AwsSettings
from jobs.providers.base import ProviderError, ResourceRequest
from jobs.providers.gcp import GcpProvider
from jobs.providers.gcp.images import DEFAULT_IMAGE as GCP_DEFAULT_IMAGE
from jobs.providers.gcp.settings import GcpSettings
from jobs.providers.runner_install import (
    INSTALLER_PATH,
    SERVED_WHEELS,
    RunnerInstall,
    ServedWheels,
    Wheel,
    built_wheel,
    control_plane_version,
)
from jobs.spec import JobSpec, parse_spec
from jobs.spec.env import code_env
from jobs.usecases.code_pin import pin_code
from jobs.web.server import RUNNER_WHEEL_PATH, ControlPlaneApp, ServerHandle, serve
from runner.store import run_store
from tests.fakes import aws as fake
from tests.fakes.code_servers import GitRepo, build_wheel, serve_directory, write_simple_index
from tests.fakes.gce_api import FakeComputeApi
from tests.fakes.gcs_emulator import create_bucket, gcs_emulator
from tests.fakes.loopback import QuietHandler, serving
from tests.fakes.moto_server import closed_port
from tests.jobs.boot import root_commands, stand_in
from tests.jobs.on_gcp import gcp_on
from tests.jobs.providers.contract import launch_request
from tests.jobs.rows import running_attempt, tiny_run

__all__ = ["gcs_emulator"]  # the session's emulator, a fixture

REGION = "us-east-1"
T4 = ResourceRequest(cloud="aws", region=REGION, accelerator_type="T4", accelerator_count=1)
A100 = ResourceRequest(
    cloud="gcp", region="us-central1", accelerator_type="A100", accelerator_count=1
)
GCP_ZONE = "us-central1-a"
#: What the played instance's command reports: where the runner it runs came from.
PROBE = (
    "import importlib.metadata as md, importlib.util, json, sys, runner;"
    "json.dump({'runner': runner.__file__, 'version': md.version('trainbot'),"
    " 'torch': importlib.util.find_spec('torch') is not None}, open(sys.argv[1], 'w'))"
)


def image_python(bin_dir: Path) -> Path:
    """The image's python: this interpreter (torch and the runner's dependencies, no
    runner of its own once on an instance: the venv takes its site-packages only)."""
    return stand_in(bin_dir / "python3", f'#!/bin/sh\nexec {sys.executable} "$@"\n')


def no_index() -> dict[str, str]:
    """pip with no reachable index and none of this machine's pip configuration."""
    return {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": f"http://127.0.0.1:{closed_port()}/simple",
        "PIP_RETRIES": "0",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }


def ran(out: Path, boot_log: str) -> dict[str, Any]:
    assert out.exists(), boot_log[-4000:]
    return dict(json.loads(out.read_text()))


@pytest.fixture(scope="module")
def wheel() -> Wheel:
    return built_wheel()


# -- the control plane that serves the wheel ----------------------------------------------------

TOKEN = "tok-attempt-live"


class Plane:
    """A real control plane (its WSGI app on waitress, on loopback) and its database,
    serving the wheels this process's providers offer (as ``trainbot serve`` does)."""

    def __init__(self, engine: Engine, wheels: ServedWheels = SERVED_WHEELS) -> None:
        self.engine = engine
        self.server: ServerHandle = serve(
            ControlPlaneApp(engine, IngestService(engine), wheels=wheels),
            "127.0.0.1",
            0,
            admin_port=None,
        )
        self.url = self.server.url
        self.ingest_url = self.url + "/v1/events"

    def add_attempt(
        self, run_id: str, attempt_id: str = "attempt-1", token: str = TOKEN, *, number: int = 1
    ) -> None:
        with Session(self.engine) as session:
            if session.get(Run, run_id) is None:
                session.add(tiny_run(run_id))
                session.flush()
            session.add(
                running_attempt(
                    attempt_id, run_id, number=number, provider="aws", token_hash=hash_token(token)
                )
            )
            session.commit()

    def get(self, path: str, token: str | None, **headers: str) -> tuple[int, bytes, Any]:
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(self.url + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, reply.read(), reply.headers
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read(), exc.headers


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    engine = make_engine(f"sqlite:///{tmp_path / 'plane.db'}")
    migrate(engine)
    made = Plane(engine)
    try:
        yield made
    finally:
        made.server.shutdown()
        engine.dispose()


def attempt_env(plane: Plane, token: str = TOKEN, **more: str) -> dict[str, str]:
    """What the service gives an attempt: its token and the control plane's URL."""
    return {"TRAINBOT_TOKEN": token, "TRAINBOT_INGEST_URL": plane.ingest_url, **more}


@contextmanager
def tampering_proxy(upstream: str) -> Iterator[str]:
    """A man in the middle on loopback: forwards GETs to ``upstream`` (headers and all)
    and flips one byte of every body it passes on; its URL."""

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            headers = {"Authorization": self.headers.get("Authorization", "")}
            request = urllib.request.Request(upstream + self.path, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    status, body, sent = reply.status, bytearray(reply.read()), reply.headers
            except urllib.error.HTTPError as exc:
                status, body, sent = exc.code, bytearray(exc.read()), exc.headers
            if status == 200 and body:
                body[len(body) // 2] ^= 0xFF
            self.send_response(status)
            for name, value in sent.items():
                if name.lower() not in ("date", "server", "connection"):
                    self.send_header(name, value)
            self.end_headers()
            self.wfile.write(bytes(body))

    with serving(Handler) as url:
        yield url


def runner_config(script: str) -> dict[str, Any]:
    """The installer's CONFIG in an AWS user data."""
    lines = script.splitlines()
    return dict(json.loads(lines[lines.index("TRAINBOT_RUNNER_END") - 1]))


def test_the_control_plane_serves_its_wheel_to_live_tokens_only(plane: Plane, wheel: Wheel) -> None:
    """GET /v1/runner-wheel: an attempt's or a dry run's token; its bytes, length and
    digest; 401 otherwise; 404 for a digest it does not have; no body, no other method."""
    SERVED_WHEELS.offer(wheel)
    plane.add_attempt("r-wheel")
    with Session(plane.engine) as session:
        session.add(
            DryRunInstance(
                id="d-1", run_id="r-wheel", provider="aws", token_hash=hash_token("tok-dry-run")
            )
        )
        session.commit()
    path = f"{RUNNER_WHEEL_PATH}?sha256={wheel.sha256}"
    for token in (TOKEN, "tok-dry-run"):
        status, body, headers = plane.get(path, token)
        assert status == 200, body[:200]
        assert body == wheel.path.read_bytes()
        assert headers["Content-Length"] == str(len(body))
        assert headers["X-Trainbot-Wheel-Sha256"] == wheel.sha256
        assert headers["ETag"] == f'"{wheel.sha256}"'
        assert headers["Content-Type"] == "application/octet-stream"
    for token in (None, "tok-wrong", ""):
        status, body, headers = plane.get(path, token)
        assert status == 401 and b"unknown or revoked runner token" in body, body
        assert "X-Trainbot-Wheel-Sha256" not in headers
    status, body, _ = plane.get(f"{RUNNER_WHEEL_PATH}?sha256={'0' * 64}", TOKEN)
    assert status == 404 and b"has no runner wheel of sha256 " + b"0" * 64 in body, body
    assert plane.get(f"{RUNNER_WHEEL_PATH}?sha256=../../etc", TOKEN)[0] == 400
    # A GET with a body is refused; POST is not a method of the route.
    request = urllib.request.Request(
        plane.url + path,
        data=b"x" * 10,
        method="GET",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 413
    request = urllib.request.Request(plane.url + path, data=b"", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 405


def test_a_wheel_still_being_built_is_retried_not_missing(tmp_path: Path, wheel: Wheel) -> None:
    """A replica whose wheel is still being built answers 503 with Retry-After."""
    engine = make_engine(f"sqlite:///{tmp_path / 'plane.db'}")
    migrate(engine)
    shelf = ServedWheels()
    plane = Plane(engine, wheels=shelf)
    try:
        plane.add_attempt("r-soon")
        path = f"{RUNNER_WHEEL_PATH}?sha256={wheel.sha256}"
        assert plane.get(path, TOKEN)[0] == 404
        shelf.expect()
        status, _, headers = plane.get(path, TOKEN)
        assert (status, headers["Retry-After"]) == (503, "5")
        shelf.offer(wheel)
        shelf.arrived()
        assert plane.get(path, TOKEN)[1] == wheel.path.read_bytes()
    finally:
        plane.server.shutdown()
        engine.dispose()


# -- AWS ----------------------------------------------------------------------------------------


@pytest.fixture
def moto(moto_server: str) -> dict[str, Any]:
    """A checkpoint bucket, and AWS's public Deep Learning AMI parameter in this region."""
    image = fake.image_id(moto_server)
    fake.public_parameter(AWS_DEFAULT_IMAGE.removeprefix("resolve:ssm:"), image, region=REGION)
    bucket = fake.unique_bucket(moto_server, region=REGION, prefix="ckpt")
    return {"url": moto_server, "image": image, "bucket": bucket}


def aws_provider(moto: dict[str, Any], runner: RunnerInstall, **options: Any) -> AwsProvider:
    """No image_id: the default, resolved through the public SSM parameter."""
    return AwsProvider(
        region=REGION,
        endpoint_url=moto["url"],
        session=boto3.session.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION
        ),
        runner=runner,
        **options,
    )


def user_data(url: str, instance_id: str) -> str:
    answer = fake.client("ec2", url).describe_instance_attribute(
        InstanceId=instance_id, Attribute="userData"
    )
    return base64.b64decode(answer["UserData"]["Value"]).decode()


def play_aws(script: str, root: Path, env: dict[str, str]) -> str:
    """Run the user data as cloud-init would, as root on a fresh instance; its output."""
    bin_dir = root_commands(root)
    image_python(bin_dir)
    done = subprocess.run(
        ["bash", "-c", script],
        env={
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "TRAINBOT_BOOT_HOME": str(root / "opt"),
            "TRAINBOT_BOOT_ENV_FILE": str(root / "etc" / "runner.env"),
            "TRAINBOT_BOOT_SCRATCH_DIR": str(root / "scratch"),
            "TRAINBOT_BOOT_CONSOLE": str(root / "console"),
            "TRAINBOT_BOOT_PYTHON": str(bin_dir / "python3"),
            **env,
        },
        capture_output=True,
        timeout=240,
    )
    return (done.stdout + done.stderr).decode(errors="replace")


def test_aws_instance_with_a_token_the_control_plane_refuses_fails_clearly(
    moto: dict[str, Any], plane: Plane, wheel: Wheel, tmp_path: Path
) -> None:
    """401, at once (no retry), said on the console; the instance still shuts down."""
    aws = aws_provider(moto, RunnerInstall(mode="wheel"))
    out = tmp_path / "ran.json"
    req = launch_request(
        T4,
        ["python", "-c", PROBE, str(out)],
        zone="us-east-1a",
        env=attempt_env(plane, token="tok-not-this-attempts"),
    )
    plane.add_attempt(req.run_id, req.attempt_id)  # its real token is TOKEN
    root = tmp_path / "instance"
    log = play_aws(aws.render_user_data(req), root, no_index())
    assert not out.exists()
    assert "refused this instance's token (HTTP 401: unknown or revoked runner token" in log
    assert "trying again" not in log, "a refused token is not retried"
    assert "tok-not-this-attempts" not in log
    assert "cannot install the runner" in (root / "console").read_text()
    assert (root / "shutdown").read_text() == "shutdown -h now\n"


def test_aws_instance_refuses_a_wheel_tampered_with_on_the_way(
    moto: dict[str, Any], plane: Plane, wheel: Wheel, tmp_path: Path
) -> None:
    """A byte changed between the control plane and the instance: the sha256 the control
    plane wrote into the boot script does not match, and nothing is installed."""
    aws = aws_provider(moto, RunnerInstall(mode="wheel"))
    out = tmp_path / "ran.json"
    with tampering_proxy(plane.url) as proxy:
        req = launch_request(
            T4,
            ["python", "-c", PROBE, str(out)],
            zone="us-east-1a",
            env={**attempt_env(plane), "TRAINBOT_INGEST_URL": f"{proxy}/v1/events"},
        )
        plane.add_attempt(req.run_id, req.attempt_id)
        root = tmp_path / "instance"
        log = play_aws(aws.render_user_data(req), root, no_index())
    assert not out.exists()
    assert f"not {wheel.sha256} that the control plane wrote into this boot script" in log
    assert "refusing it" in log and "trying again" not in log
    assert not list((root / "opt").glob("lib/python*/site-packages/runner")), "not installed"
    assert "cannot install the runner" in (root / "console").read_text()


@pytest.mark.slow
def test_aws_index_mode_installs_exactly_this_version_from_the_configured_index(
    moto: dict[str, Any], wheel: Wheel, tmp_path: Path
) -> None:
    with loopback_index(tmp_path / "index", wheel) as (index_url, requested):
        aws = aws_provider(moto, RunnerInstall(mode="index", index_url=index_url))
        out = tmp_path / "ran.json"
        req = launch_request(T4, ["python", "-c", PROBE, str(out)], zone="us-east-1a")
        script = aws.render_user_data(req)
        lines = script.splitlines()
        config = json.loads(lines[lines.index("TRAINBOT_RUNNER_END") - 1])
        assert config == {
            "mode": "index",
            "package": "trainbot",
            "version": control_plane_version(),
            "index_url": index_url,
        }
        log = play_aws(script, tmp_path / "instance", no_index())
        got = ran(out, log)
    assert got["version"] == control_plane_version()
    assert got["runner"].startswith(str(tmp_path / "instance" / "opt"))
    assert "/simple/trainbot/" in requested, "trainbot==<version> came from the configured index"
    assert not [p for p in requested if "torch" in p], "the image has torch: none asked for"


def test_aws_image_mode_installs_nothing(moto: dict[str, Any], tmp_path: Path) -> None:
    aws = aws_provider(moto, RunnerInstall(mode="image"))
    out = tmp_path / "ran.json"
    # The image's own runner, wherever the image put it.
    runner = stand_in(
        tmp_path / "image" / "trainbot-runner",
        f"#!{sys.executable}\nimport json, sys\njson.dump({{'runner': 'image'}}, open({str(out)!r}, 'w'))\n",
    )
    script = aws.render_user_data(launch_request(T4, [str(runner)], zone="us-east-1a"))
    assert "RUNNER_MODE=image" in script
    root = tmp_path / "instance"
    # Any call of the image's python would be an install: record it.
    log = play_aws(
        script,
        root,
        {"TRAINBOT_BOOT_PYTHON": str(stand_in(root / "py", f"#!/bin/sh\ntouch {root}/python\n"))},
    )
    assert ran(out, log) == {"runner": "image"}
    assert not (root / "python").exists() and not (root / "opt").exists(), "nothing installed"
    assert "installing nothing" in log


def test_wheel_mode_needs_the_control_planes_url_for_its_instances(
    moto: dict[str, Any], gce: FakeComputeApi
) -> None:
    """An instance that could not reach the control plane would fail after its boot:
    the launch is refused first, saying what to set."""
    aws = aws_provider(moto, RunnerInstall(mode="wheel"))
    gcp = gcp_provider(gce, RunnerInstall(mode="wheel"))
    for provider, request, zone, setting in (
        (aws, T4, "us-east-1a", "TRAINBOT_AWS_RUNNER_INSTALL=index"),
        (gcp, A100, GCP_ZONE, "TRAINBOT_GCP_RUNNER_INSTALL=index"),
    ):
        for env in (
            {"TRAINBOT_TOKEN": TOKEN},
            {"TRAINBOT_TOKEN": TOKEN, "TRAINBOT_INGEST_URL": "ftp://cp/v1/events"},
            {"TRAINBOT_INGEST_URL": "https://cp.example/v1/events"},
        ):
            req = launch_request(request, ["true"], zone=zone, env=env)
            with pytest.raises(ProviderError, match=setting) as refused:
                provider.launch(req)
            assert "TRAINBOT_PUBLIC_URL" in str(refused.value)


def test_aws_image_missing_in_the_region_fails_with_what_to_set(
    moto: dict[str, Any],
) -> None:
    aws = aws_provider(moto, RunnerInstall(mode="index"))
    assert aws.capacity(T4), "the default image resolves through SSM in us-east-1"
    missing = replace(T4, image_id="ami-0123456789abcdef0")
    with pytest.raises(ProviderError, match=r"resources\.image_id") as refused:
        aws.capacity(missing)
    assert "ami-0123456789abcdef0 does not exist in us-east-1" in str(refused.value)
    # The public parameter is published per region; here, in none other.
    with pytest.raises(ProviderError, match="TRAINBOT_AWS_IMAGE_ID") as refused:
        aws.capacity(replace(T4, region="eu-north-1"))
    assert "does not exist in eu-north-1" in str(refused.value)
    # A spec's image wins over the provider's, at launch too.
    named = replace(T4, image_id=moto["image"])
    assert aws.capacity(named)


# -- GCP ----------------------------------------------------------------------------------------


def gcp_provider(gce: FakeComputeApi, runner: RunnerInstall, **options: Any) -> GcpProvider:
    return gcp_on(gce, runner=runner, **options)


def play_gcp(
    gce: FakeComputeApi, gcp: GcpProvider, instance_id: str, root: Path, env: dict[str, str]
) -> str:
    """Run the startup script against the instance's metadata server, to its end."""
    zone, name = instance_id.split("/", 1)
    with gce.metadata_server(zone, name) as md_url:
        done = subprocess.run(
            ["bash", str(gcp.startup_script)],
            env={
                "PATH": f"{root / 'bin'}:/usr/bin:/bin",
                "TRAINBOT_GCE_METADATA_URL": md_url,
                "TRAINBOT_STATE_DIR": str(root / "state"),
                "TRAINBOT_VENV": str(root / "venv"),
                "TRAINBOT_RUN_AS": "",
                "TRAINBOT_HALT": "true",
                "TRAINBOT_IMAGE_PYTHON": str(image_python(root / "bin")),
                **env,
            },
            capture_output=True,
            timeout=240,
        )
    return (done.stdout + done.stderr).decode(errors="replace")


def test_gcp_instance_with_a_revoked_token_fails_clearly(
    gce: FakeComputeApi, plane: Plane, wheel: Wheel, tmp_path: Path
) -> None:
    gcp = gcp_provider(gce, RunnerInstall(mode="wheel"))
    out = tmp_path / "ran.json"
    req = launch_request(
        A100, ["python", "-c", PROBE, str(out)], zone=GCP_ZONE, env=attempt_env(plane)
    )
    plane.add_attempt(req.run_id, req.attempt_id)
    info = gcp.launch(req)
    with Session(plane.engine) as session:  # the attempt ended: its token is revoked
        attempt = session.get(Attempt, req.attempt_id)
        assert attempt is not None
        attempt.token_hash = None
        session.add(attempt)
        session.commit()
    log = play_gcp(gce, gcp, info.instance_id, tmp_path / "instance", no_index())
    assert not out.exists()
    assert "refused this instance's token (HTTP 401" in log
    assert "runner exited 126" in log


def test_gcp_image_mode_installs_nothing(gce: FakeComputeApi, tmp_path: Path) -> None:
    gcp = gcp_provider(gce, RunnerInstall(mode="image"))
    out = tmp_path / "ran.json"
    runner = stand_in(
        tmp_path / "image" / "trainbot-runner",
        f"#!{sys.executable}\nimport json, sys\njson.dump({{'runner': 'image'}}, open({str(out)!r}, 'w'))\n",
    )
    info = gcp.launch(launch_request(A100, [str(runner)], zone=GCP_ZONE))
    root = tmp_path / "instance"
    log = play_gcp(gce, gcp, info.instance_id, root, {})
    assert ran(out, log) == {"runner": "image"}
    assert not (root / "venv").exists(), "nothing installed"
    assert "installing nothing" in log


def test_gcp_image_the_spec_names_must_exist(gce: FakeComputeApi) -> None:
    gcp = gcp_provider(gce, RunnerInstall(mode="index"))
    assert gcp.capacity(A100), "the default Deep Learning VM family exists"
    missing = replace(A100, image_id="projects/my-team/global/images/family/trainer")
    with pytest.raises(ProviderError, match=r"resources\.image_id") as refused:
        gcp.capacity(missing)
    assert "projects/my-team/global/images/family/trainer does not exist" in str(refused.value)
    assert "TRAINBOT_GCP_IMAGE" in str(refused.value)
    with pytest.raises(ProviderError, match="not an image URL"):
        gcp.capacity(replace(A100, image_id="ubuntu"))
    gce.add_image("my-team", "trainer-v2", family="trainer")
    assert gcp.capacity(missing), "there once the team has published it"
    info = gcp.launch(launch_request(missing, ["true"], zone=GCP_ZONE))
    assert gce.boot_image(*info.instance_id.split("/", 1)) == missing.image_id


# -- the run's code and its environment on the instance ------------------------------------------

#: The team's script: which commit it runs in, and the package its setup installed.
CODE_PROBE = """\
import importlib.metadata, importlib.util, json, os, pathlib, sys
import runner, tinydep

json.dump(
    {
        "commit": pathlib.Path(".git/HEAD").read_text().strip(),
        "cwd": os.getcwd(),
        "tinydep": tinydep.VERSION,
        "python": sys.prefix,
        "torch": importlib.util.find_spec("torch") is not None,
        "runner": runner.__file__,
        "version": importlib.metadata.version("trainbot"),
    },
    open(sys.argv[1], "w"),
)
"""


class TeamCode:
    """The team's repository (git over loopback HTTP) and its own package index (loopback,
    holding tinydep only), a spec naming them, pinned as ``submit`` pins it, and then a
    push to ``main`` that the run must not follow."""

    def __init__(self, root: Path, base: str, repo: GitRepo) -> None:
        self.setup_runs = root / "setup-runs.txt"
        self.pinned = repo.commit(
            {"train.py": CODE_PROBE, "requirements.txt": "tinydep==1.0\n"}, message="first"
        )
        spec = parse_spec(
            {
                "command": "python train.py",
                "code": {"repo": repo.url(base), "ref": "main"},
                "setup": [
                    "pip install -q -r requirements.txt",
                    f"echo $TRAINBOT_ATTEMPT_ID >> {self.setup_runs}",
                ],
                # The team's index: pip on the instance asks it, and no other.
                "env": {"PIP_INDEX_URL": f"{base}/simple/", "PIP_CONFIG_FILE": os.devnull},
            },
            name="team",
        )
        self.spec: JobSpec = pin_code(spec)
        self.head = repo.commit({"train.py": "raise SystemExit('not this commit')\n"})

    def env(self, plane: Plane, attempt: str, token: str, **store: str) -> dict[str, str]:
        """The attempt's environment as the service renders it for a cloud instance: the
        code and setup variables (``code_env``), the run's store, the attempt's token."""
        return attempt_env(
            plane,
            token,
            TRAINBOT_RUN_ID="r-code",
            TRAINBOT_ATTEMPT_ID=attempt,
            **self.spec.env,
            **code_env(self.spec, local=False),
            **store,
        )

    def launch(
        self,
        provider: AwsProvider | GcpProvider,
        plane: Plane,
        request: ResourceRequest,
        *,
        zone: str,
        number: int,
        out: Path,
        store: dict[str, str],
    ) -> str:
        """Launch attempt ``number`` of the run, its command writing what it saw to
        ``out``; its instance id."""
        attempt, token = f"attempt-{number}", f"tok-code-{number}"
        req = launch_request(
            request,
            ["trainbot-runner", "exec", "--", "python", "train.py", str(out)],
            zone=zone,
            run_id="r-code",
            attempt_id=attempt,
            env=self.env(plane, attempt, token, **store),
        )
        plane.add_attempt(req.run_id, attempt, token, number=number)
        return provider.launch(req).instance_id

    def built_then_restored(self, first: str, second: str) -> None:
        """Attempt 1 ran setup and archived what it built; attempt 2 restored it."""
        assert "trainbot-runner: setup: pip install -q -r requirements.txt" in first
        assert "setup ran in" in first and "archived the environment" in first
        assert f"code {self.pinned[:12]}" in second
        assert "environment restored from the store" in second
        assert "trainbot-runner: setup:" not in second
        assert self.attempts_that_ran_setup() == ["attempt-1"]

    def attempts_that_ran_setup(self) -> list[str]:
        return self.setup_runs.read_text().split() if self.setup_runs.exists() else []


@pytest.fixture
def team_code(tmp_path: Path) -> Iterator[TeamCode]:
    repo = GitRepo(tmp_path / "team")
    tinydep = build_wheel(tmp_path / "team" / "wheels", "tinydep", "1.0", "VERSION = '1.0'\n")
    write_simple_index(repo.served, [tinydep])
    with serve_directory(repo.served) as base:
        yield TeamCode(tmp_path / "team", base, repo)


def code_ran(team: TeamCode, out: Path, log: str, scratch: Path) -> dict[str, Any]:
    """The probe ran in the pinned commit's checkout, with setup's package, in the
    code's own virtual environment; what it saw."""
    got = ran(out, log)
    assert got["commit"] == team.pinned != team.head, "the commit pinned at submit"
    assert got["tinydep"] == "1.0"
    assert Path(got["cwd"]) == scratch / "code"
    assert Path(got["python"]) == scratch / "code" / ".venv"
    assert got["torch"], "the image's torch, seen from the code's virtual environment too"
    assert got["version"] == control_plane_version()
    return got


def launched_from_the_default_image_with_the_wheel(
    moto: dict[str, Any], plane: Plane, wheel: Wheel, instance_id: str
) -> None:
    """The default image (the Deep Learning AMI, through AWS's public SSM parameter); the
    user data names the control plane's wheel, its token read from the root-only
    environment file; nothing is put in the run's bucket for it."""
    [reservation] = fake.client("ec2", moto["url"]).describe_instances(InstanceIds=[instance_id])[
        "Reservations"
    ]
    assert reservation["Instances"][0]["ImageId"] == moto["image"]
    assert runner_config(user_data(moto["url"], instance_id))["wheel"] == {
        "url": f"{plane.url}{RUNNER_WHEEL_PATH}?sha256={wheel.sha256}",
        "sha256": wheel.sha256,
        "size": wheel.path.stat().st_size,
        "file": wheel.file_name,
        "token_from": "env-file",
    }
    listed = fake.client("s3", moto["url"]).list_objects_v2(Bucket=moto["bucket"])
    assert listed["KeyCount"] == 0, "nothing is put in the run's bucket"


@pytest.mark.slow
def test_aws_boot_checks_out_the_pinned_commit_and_builds_then_restores_its_environment(
    moto: dict[str, Any], plane: Plane, wheel: Wheel, team_code: TeamCode, tmp_path: Path
) -> None:
    """Attempt 1's instance installs the runner from the control plane's wheel, checks
    out the pinned commit, runs setup against the team's index and archives what it built
    to the run's bucket; attempt 2's (fresh scratch disk: no code, no environment; the
    runner already on its image, to keep the test short) restores the archive instead.
    The instance reaches S3 with static credentials standing in for its role."""
    url, bucket = moto["url"], moto["bucket"]
    aws = aws_provider(moto, RunnerInstall(mode="wheel"))
    s3 = {
        "TRAINBOT_CHECKPOINT_URI": f"s3://{bucket}/ckpt",
        "AWS_ENDPOINT_URL_S3": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }
    imds = {"TRAINBOT_BOOT_IMDS_URL": f"http://127.0.0.1:{closed_port()}", **no_index()}
    logs: list[str] = []
    for number in (1, 2):
        out = tmp_path / f"ran-{number}.json"
        instance_id = team_code.launch(
            aws, plane, T4, zone="us-east-1a", number=number, out=out, store=s3
        )
        root = tmp_path / f"instance-{number}"
        script = user_data(url, instance_id)
        if number == 1:
            launched_from_the_default_image_with_the_wheel(moto, plane, wheel, instance_id)
        image = {"TRAINBOT_BOOT_HOME": str(tmp_path / "instance-1" / "opt")} if number > 1 else {}
        log = play_aws(script, root, {**imds, **image})
        got = code_ran(team_code, out, log, root / "scratch")
        logs.append(log)
        venv = tmp_path / "instance-1" / "opt"
        assert got["runner"].startswith(str(venv)), "the runner the instance runs is the wheel's"
        assert f"tok-code-{number}" not in log, "the token is never printed"
        assert (root / "shutdown").read_text() == "shutdown -h now\n"
        assert "trainbot-runner exited with code 0" in (root / "console").read_text()
    assert f"fetching the runner wheel from {plane.url}{RUNNER_WHEEL_PATH}" in logs[0]
    assert not list(venv.glob("lib/python*/site-packages/torch")), "torch was not installed"
    team_code.built_then_restored(*logs)
    listed = fake.client("s3", url).list_objects_v2(Bucket=bucket, Prefix="ckpt/r-code/env/")
    names = sorted(o["Key"].rsplit("/", 1)[1] for o in listed.get("Contents", []))
    assert len(names) == 2 and names[0].endswith(".json") and names[1].endswith(".tar.gz")


@pytest.mark.slow
def test_gcp_boot_checks_out_the_pinned_commit_and_builds_then_restores_its_environment(
    gce: FakeComputeApi,
    plane: Plane,
    wheel: Wheel,
    team_code: TeamCode,
    gcs_emulator: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As on AWS, with the startup script reading the attempt from the instance's
    metadata server and the environment archived to the GCS emulator."""
    bucket = create_bucket(gcs_emulator, prefix="ckpt")
    gcp = gcp_provider(gce, RunnerInstall(mode="wheel"))
    gcs = {"TRAINBOT_CHECKPOINT_URI": f"gs://{bucket}/ckpt", "STORAGE_EMULATOR_HOST": gcs_emulator}
    logs: list[str] = []
    for number in (1, 2):
        out = tmp_path / f"ran-{number}.json"
        instance_id = team_code.launch(
            gcp, plane, A100, zone=GCP_ZONE, number=number, out=out, store=gcs
        )
        root = tmp_path / f"instance-{number}"
        if number == 1:
            assert gce.boot_image(*instance_id.split("/", 1)) == GCP_DEFAULT_IMAGE, "a DLVM"
            instance = gce.instance(*instance_id.split("/", 1))
            assert instance is not None
            metadata = {i["key"]: i["value"] for i in instance["metadata"]["items"]}
            config = json.loads(metadata["trainbot-runner"])
            assert config["wheel"]["url"] == f"{plane.url}{RUNNER_WHEEL_PATH}?sha256={wheel.sha256}"
            assert config["wheel"]["token_from"] == "gce-metadata"
            assert "tok-code-1" not in json.dumps(config), "the token stays in trainbot-env"
        image = {"TRAINBOT_VENV": str(tmp_path / "instance-1" / "venv")} if number > 1 else {}
        log = play_gcp(gce, gcp, instance_id, root, {**no_index(), **image})
        got = code_ran(team_code, out, log, root / "state" / "scratch")
        logs.append(log)
        assert got["runner"].startswith(str(tmp_path / "instance-1" / "venv"))
        assert f"tok-code-{number}" not in log
        assert "runner exited 0" in log
    assert "installing the runner" in logs[0]
    team_code.built_then_restored(*logs)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
    names = sorted(o.key for o in run_store(f"gs://{bucket}/ckpt", "r-code").list("env/"))
    assert len(names) == 2 and names[0].endswith(".json") and names[1].endswith(".tar.gz")


# -- settings, the spec, and the installer's signature --------------------------------------------


def test_each_provider_reads_its_own_runner_and_image_settings() -> None:
    assert AwsSettings.from_env({}).runner() == RunnerInstall(mode="wheel")
    aws = AwsSettings.from_env(
        {
            "TRAINBOT_AWS_RUNNER_INSTALL": "index",
            "TRAINBOT_AWS_RUNNER_INDEX_URL": "https://i/simple",
        }
    )
    assert aws.runner() == RunnerInstall(mode="index", index_url="https://i/simple")
    gcp = GcpSettings.from_env({"TRAINBOT_GCP_IMAGE": "projects/p/global/images/x"})
    assert gcp.image == "projects/p/global/images/x" and gcp.runner().mode == "wheel"
    assert GcpSettings.from_env({}).image == GCP_DEFAULT_IMAGE
    with pytest.raises(ProviderError, match="TRAINBOT_GCP_RUNNER_INSTALL='pip'"):
        GcpSettings.from_env({"TRAINBOT_GCP_RUNNER_INSTALL": "pip"})


def test_a_spec_names_its_machine_image() -> None:
    spec = parse_spec(
        {"command": "python train.py", "resources": {"image_id": "ami-0abc"}}, name="gpu"
    )
    assert spec.resources.image_id == "ami-0abc"
    assert parse_spec({"command": "python train.py"}, name="gpu").resources.image_id is None
    over = parse_spec({"command": "x"}, name="gpu", overrides=["resources.image_id=ami-0def"])
    assert over.resources.image_id == "ami-0def"


@functools.lru_cache(maxsize=1)
def installer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("runner_install_script", INSTALLER_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_without_torch_in_the_image_the_installer_asks_for_it(wheel: Wheel, tmp_path: Path) -> None:
    """The image's python here is the bare interpreter (no torch, no dependencies)."""
    bare = Path(sys.base_prefix) / "bin" / "python3"
    probe = [
        str(bare),
        "-c",
        "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)",
    ]
    if subprocess.run(probe, check=False).returncode == 0:
        pytest.skip("the base interpreter has torch")
    with loopback_index(tmp_path / "index", wheel) as (index_url, requested):
        config = tmp_path / "runner.json"
        config.write_text(
            json.dumps(
                {
                    "mode": "index",
                    "package": "trainbot",
                    "version": wheel.version,
                    "index_url": index_url,
                }
            )
        )
        done = subprocess.run(
            [str(bare), str(INSTALLER_PATH), str(config), str(tmp_path / "venv")],
            env={"PATH": "/usr/bin:/bin", **no_index()},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert "the image has no torch: installing it too" in done.stdout
    assert "installing trainbot[torch]==" in done.stdout
    assert "/simple/trainbot/" in requested


# -- a package index on loopback ------------------------------------------------------------------


@contextmanager
def loopback_index(root: Path, wheel: Wheel) -> Iterator[tuple[str, list[str]]]:
    """A PEP 503 simple index on 127.0.0.1 holding only trainbot's wheel; the paths asked."""
    project = root / "simple" / "trainbot"
    project.mkdir(parents=True)
    (project / wheel.file_name).write_bytes(wheel.path.read_bytes())
    (project / "index.html").write_text(
        f'<a href="{wheel.file_name}#sha256={wheel.sha256}">{wheel.file_name}</a>\n'
    )
    requested: list[str] = []

    class Handler(QuietHandler, SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(root), **kwargs)

        def do_GET(self) -> None:
            requested.append(self.path)
            super().do_GET()

    with serving(Handler) as url:
        yield f"{url}/simple", requested


def test_preflight_fails_a_spec_whose_image_is_not_in_the_region(
    moto: dict[str, Any], gce: FakeComputeApi, tmp_path: Path
) -> None:
    """The capacity check asks the provider, which looks the image up first."""
    for provider, image, expected in (
        (
            aws_provider(moto, RunnerInstall(mode="index")),
            "ami-0fedcba9876543210",
            "the AMI ami-0fedcba9876543210 does not exist in us-east-1",
        ),
        (
            gcp_provider(gce, RunnerInstall(mode="index")),
            "projects/my-team/global/images/trainer-v9",
            "the boot image projects/my-team/global/images/trainer-v9 does not exist",
        ),
    ):
        accelerator = "T4:1" if provider.name == "aws" else "A100:1"
        job = parse_spec(
            {
                "command": "python train.py",
                "resources": {"cloud": provider.name, "accelerator": accelerator},
                "checkpoint": {"uri": "s3://ckpt/runs"},
            },
            name="gpu",
            overrides=[f"resources.image_id={image}"],
        )
        request = resource_request(job, provider)  # the spec's image, carried to the provider
        assert request.image_id == image
        ctx = PreflightContext(
            spec=job,
            run_id="r-image",
            provider=provider,
            request=request,
            checkpoint_uri="s3://ckpt/runs",
            mtbp_s=6 * 3600.0,
            env={},
            workdir=tmp_path / "work",
        )
        [result] = run_preflight(ctx, [CapacityCheck()]).results
        assert result.status == Status.FAIL, result
        assert expected in result.detail and "resources.image_id" in result.detail


def test_a_wheel_an_admin_names_must_be_this_control_planes_version(
    wheel: Wheel, tmp_path: Path
) -> None:
    mine = tmp_path / wheel.file_name
    mine.write_bytes(wheel.path.read_bytes())
    assert RunnerInstall(wheel=mine).the_wheel().sha256 == wheel.sha256
    other = tmp_path / "trainbot-9.9.9-py3-none-any.whl"
    other.write_bytes(b"PK")
    with pytest.raises(ProviderError, match=r"is version 9\.9\.9, but this control plane is"):
        RunnerInstall(wheel=other).the_wheel()
    with pytest.raises(ProviderError, match="not a trainbot wheel"):
        RunnerInstall(wheel=tmp_path / "runner.zip").the_wheel()
    with pytest.raises(ProviderError, match="is not one of wheel, index, image"):
        RunnerInstall(mode="pip")  # type: ignore[arg-type]
    assert built_wheel() == wheel, "built once per process, the same bytes"
