"""Issue 25, points 5 and 6: the machine image, and the runner pinned on the instance.

The boot script the provider really sent (the EC2 user data read back from moto; the GCP
startup script with its instance's metadata server) runs under bash as a played
instance: stand-ins only for the root-only commands (shutdown, runuser, useradd …). The
image's python is this checkout's interpreter, which has torch and the runner's
dependencies but, on a fresh instance, no runner. The runner's installer is the real one
and pip is real; the public index is a closed port and pip's own configuration is off,
so trainbot can only come from the control plane's wheel in the run's bucket (moto's S3
read with the instance profile's credentials from a fake IMDSv2; the GCS emulator read
with the metadata server's token), or, in ``index`` mode, from an index served on
loopback.
"""

from __future__ import annotations

import base64
import datetime
import functools
import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import boto3
import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from google.auth.credentials import AnonymousCredentials

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
    RunnerInstall,
    Wheel,
    built_wheel,
    control_plane_version,
)
from jobs.spec import parse_spec
from runner.store.gcs import GCSStore
from tests.fakes import aws as fake
from tests.fakes.gce_api import FakeComputeApi
from tests.fakes.gcs_emulator import create_bucket, gcs_emulator
from tests.fakes.metadata import FakeImds
from tests.fakes.moto_server import closed_port
from tests.jobs.providers.contract import launch_request

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


def stand_in(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    path.chmod(0o755)
    return path


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
    bin_dir = root / "bin"
    for name, body in {
        "shutdown": f'echo "shutdown $*" >> {root / "shutdown"}',
        "runuser": 'while [ "$1" != "--" ]; do shift; done; shift; exec "$@"',
        "id": "exit 0",
        "useradd": "exit 0",
        "chgrp": "exit 0",
        "chown": "exit 0",
        "apt-get": "exit 1",
    }.items():
        stand_in(bin_dir / name, f"#!/bin/sh\n{body}\n")
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


@pytest.mark.slow
def test_aws_instance_installs_the_control_planes_wheel_from_the_bucket_with_no_index(
    moto: dict[str, Any], wheel: Wheel, tmp_path: Path
) -> None:
    url, bucket = moto["url"], moto["bucket"]
    aws = aws_provider(moto, RunnerInstall(mode="wheel"))
    out = tmp_path / "ran.json"
    req = launch_request(
        T4,
        ["python", "-c", PROBE, str(out)],
        zone="us-east-1a",
        env={"TRAINBOT_CHECKPOINT_URI": f"s3://{bucket}/ckpt"},
    )
    info = aws.launch(req)

    # The default image: the Deep Learning AMI, through AWS's public SSM parameter.
    [reservation] = fake.client("ec2", url).describe_instances(InstanceIds=[info.instance_id])[
        "Reservations"
    ]
    assert reservation["Instances"][0]["ImageId"] == moto["image"]
    # The control plane's own wheel, content-addressed in the run's bucket.
    key = f"ckpt/_trainbot/wheels/trainbot-{wheel.version}-{wheel.sha256[:12]}-py3-none-any.whl"
    stored = fake.client("s3", url).get_object(Bucket=bucket, Key=key)["Body"].read()
    assert stored == wheel.path.read_bytes()

    with FakeImds() as imds:
        imds.give_role("trainbot-runner", access_key="AKIAINSTANCE", secret_key="s3cr3t")
        log = play_aws(
            user_data(url, info.instance_id),
            tmp_path / "instance",
            {
                "TRAINBOT_BOOT_IMDS_URL": imds.url,
                "TRAINBOT_BOOT_S3_ENDPOINT": url,
                **no_index(),
            },
        )
        asked = [s.path for s in imds.seen]
    got = ran(out, log)
    venv = tmp_path / "instance" / "opt"
    assert got["runner"].startswith(str(venv)), "the runner the instance runs is the wheel's"
    assert got["version"] == control_plane_version() == wheel.version
    assert got["torch"], "the image's torch, seen through the venv"
    assert not list(venv.glob("lib/python*/site-packages/torch")), "torch was not installed"
    assert "/latest/meta-data/iam/security-credentials/trainbot-runner" in asked
    assert (tmp_path / "instance" / "shutdown").read_text() == "shutdown -h now\n"
    assert "trainbot-runner exited with code 0" in (tmp_path / "instance" / "console").read_text()


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


def test_aws_wheel_mode_needs_the_run_in_an_s3_bucket(moto: dict[str, Any]) -> None:
    aws = aws_provider(moto, RunnerInstall(mode="wheel"))
    req = launch_request(
        T4, ["true"], zone="us-east-1a", env={"TRAINBOT_CHECKPOINT_URI": "/var/ckpt"}
    )
    with pytest.raises(ProviderError, match="TRAINBOT_AWS_RUNNER_INSTALL=index") as refused:
        aws.render_user_data(req)
    assert "checkpoint.uri" in str(refused.value) and "s3://" in str(refused.value)


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


@pytest.fixture
def gce() -> Iterator[FakeComputeApi]:
    with FakeComputeApi() as api:
        yield api


def gcp_provider(gce: FakeComputeApi, runner: RunnerInstall, **options: Any) -> GcpProvider:
    return GcpProvider(
        project=gce.project,
        region="us-central1",
        api_endpoint=gce.url,
        credentials=AnonymousCredentials(),
        service_account="trainbot-runner@trainbot-test.iam.gserviceaccount.com",
        runner=runner,
        **options,
    )


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


@pytest.mark.slow
def test_gcp_instance_installs_the_control_planes_wheel_from_the_bucket_with_no_index(
    gce: FakeComputeApi,
    gcs_emulator: str,
    wheel: Wheel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
    bucket = create_bucket(gcs_emulator, prefix="ckpt")
    gcp = gcp_provider(gce, RunnerInstall(mode="wheel"))
    out = tmp_path / "ran.json"
    req = launch_request(
        A100,
        [str(tmp_path / "instance" / "venv" / "bin" / "python"), "-c", PROBE, str(out)],
        zone=GCP_ZONE,
        env={"TRAINBOT_CHECKPOINT_URI": f"gs://{bucket}/ckpt"},
    )
    info = gcp.launch(req)

    assert gce.boot_image(*info.instance_id.split("/", 1)) == GCP_DEFAULT_IMAGE, "a DLVM"
    key = f"ckpt/_trainbot/wheels/trainbot-{wheel.version}-{wheel.sha256[:12]}-py3-none-any.whl"
    stored = GCSStore(bucket, "", emulator_host=gcs_emulator).get_bytes(key)
    assert stored == wheel.path.read_bytes()

    log = play_gcp(
        gce,
        gcp,
        info.instance_id,
        tmp_path / "instance",
        {"TRAINBOT_BOOT_GCS_ENDPOINT": gcs_emulator, **no_index()},
    )
    got = ran(out, log)
    assert got["runner"].startswith(str(tmp_path / "instance" / "venv"))
    assert got["version"] == control_plane_version() == wheel.version
    assert got["torch"]
    assert "runner exited 0" in log


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


@pytest.mark.parametrize("token", ["", "FwoGZXIvYXdzEXAMPLE//token="], ids=["user", "role"])
def test_the_installers_s3_signature_is_botocores(token: str) -> None:
    """moto does not check signatures; botocore's signer does what S3 checks."""
    url = "http://127.0.0.1:5000/ckpt-bucket/team%20a/_trainbot/wheels/trainbot-0.1.0-abc.whl"
    request = AWSRequest(method="GET", url=url)
    S3SigV4Auth(Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI", token or None), "s3", REGION).add_auth(
        request
    )
    when = datetime.datetime.strptime(request.context["timestamp"], "%Y%m%dT%H%M%SZ")
    mine = installer().sigv4_headers(
        host="127.0.0.1:5000",
        path="/ckpt-bucket/team%20a/_trainbot/wheels/trainbot-0.1.0-abc.whl",
        region=REGION,
        creds={"key": "AKIDEXAMPLE", "secret": "wJalrXUtnFEMI", "token": token},
        now=when,
    )
    assert mine["Authorization"] == request.headers["Authorization"]


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

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(root), **kwargs)

        def do_GET(self) -> None:
            requested.append(self.path)
            super().do_GET()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple", requested
    finally:
        server.shutdown()
        server.server_close()


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
