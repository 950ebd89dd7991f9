"""The boot scripts with hostile values: nothing from a spec runs as root, or at all.

The AWS user data is rendered by the provider's own ``render_user_data`` (what ``launch``
sends) and the GCP instance is launched on the fake Compute API (what the startup script
reads back from the metadata server); then the whole script runs under bash, with
stand-ins for the root-only commands, the runner's installer and the runner. Every payload below would touch
a file in ``owned/`` if any step read a value as shell or as template; the stand-in runner
must receive the command and the environment byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from jobs.providers.aws import AwsProvider
from jobs.providers.base import ProviderError, ResourceRequest
from jobs.providers.gcp import GcpProvider
from jobs.providers.runner_install import RunnerInstall, installer_source
from jobs.spec import JobSpec
from jobs.spec.env import image_env
from tests.fakes.gce_api import FakeComputeApi
from tests.jobs.boot import aws_boot_env, gcp_boot_env, root_commands, runner_venv, stand_in
from tests.jobs.on_gcp import gcp_on
from tests.jobs.providers.contract import launch_request

AWS_T4 = ResourceRequest(
    cloud="aws", region="us-east-1", accelerator_type="T4", accelerator_count=1
)
GCP_A100 = ResourceRequest(
    cloud="gcp", region="us-central1", accelerator_type="A100", accelerator_count=1, spot=True
)
GCP_ZONE = "us-central1-a"

# Names a spec may not give a variable: each would be shell, not a name, somewhere.
BAD_NAMES = [
    "",
    "1X",
    "A-B",
    "A B",
    "X=Y",
    "X;touch owned",
    "$(touch owned)",
    "X\n",
    "TRAINBOT_ENV_END\n",
    "X\0",
    "ÉTÉ",
]


def payloads(owned: Path) -> list[str]:
    """Text that touches a file in ``owned`` if a shell, or a second template pass, reads it."""
    x = owned / "x"
    return [
        "@@ENV@@",
        "@@ENV@@ z",
        "@@COMMAND@@",
        "@@RUNNER_PACKAGE@@ @@SCRATCH_DIR@@",
        f"a;touch {x}-semicolon;b",
        f"$(touch {x}-dollar)",
        f"`touch {x}-backtick`",
        f"'; touch {x}-quote; '",
        f'it\'s "{x}" \\ $HOME ${{HOME}} *',
        f"a\ntouch {x}-newline\nb",
        f"a\rtouch {x}-return",
        "TRAINBOT_ENV_END",
        "-x",
        "",
    ]


def hostile_env(owned: Path) -> dict[str, str]:
    """One variable per payload that can live in a one-line file (AWS refuses line breaks)."""
    x = owned / "x"
    values = [p for p in payloads(owned) if "\n" not in p and "\r" not in p]
    env = {f"HOSTILE_{i}": value for i, value in enumerate(values)}
    env["SPLICE"] = f"a';touch {x}-splice;'b"
    env["TRAINBOT_TOKEN"] = "tok-@@COMMAND@@-$(touch " + str(x) + "-token)"
    return env


RECORDER = (
    "#!{python}\nimport json, os, sys\n"
    "json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({out!r}, 'w'))\n"
)


# -- AWS ---------------------------------------------------------------------------------------


@pytest.fixture
def aws() -> AwsProvider:
    """Rendering the user data reads only the template: no AWS endpoint is asked."""
    return AwsProvider(
        region="us-east-1",
        image_id="ami-00000000",
        session=boto3.session.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        ),
    )


def run_user_data(script: str, tmp_path: Path, *, installed: bool) -> str:
    """Run the rendered user data as cloud-init would, in ``tmp_path``; its stderr.

    The stand-in runner writes its argv and environment to ``tmp_path/ran.json``.

    ``installed=False`` leaves the runner out, so the script runs the runner's installer
    with the image's python (a stand-in ``python3`` that records what it was given in
    ``tmp_path/installs.jsonl`` and leaves a runner; tests/jobs/providers/
    test_runner_pinned.py runs the real one).
    """
    bin_dir, home, ran = root_commands(tmp_path), tmp_path / "opt", tmp_path / "ran.json"
    runner = RECORDER.format(python=sys.executable, out=str(ran))
    installer = (
        f"#!{sys.executable}\nimport json, os, sys\n"
        "if sys.argv[1] == '-c': sys.exit(0)\n"
        "script, config, venv = sys.argv[1:]\n"
        "got = {'installer': open(script).read(), 'config': json.load(open(config)), 'venv': venv}\n"
        f"with open({str(tmp_path / 'installs.jsonl')!r}, 'a') as f: f.write(json.dumps(got) + '\\n')\n"
        "os.makedirs(os.path.join(venv, 'bin'), exist_ok=True)\n"
        "path = os.path.join(venv, 'bin', 'trainbot-runner')\n"
        f"open(path, 'w').write({runner!r}); os.chmod(path, 0o755)\n"
    )
    stand_in(bin_dir / "python3", installer)
    if installed:
        stand_in(home / "bin" / "trainbot-runner", runner)
    env = aws_boot_env(tmp_path, home, path=f"{bin_dir}:/usr/bin:/bin")
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, timeout=60)
    return done.stderr.decode(errors="replace")


@pytest.mark.parametrize("installed", [True, False], ids=["runner-installed", "fresh-image"])
def test_aws_user_data_carries_hostile_values_as_data(
    aws: AwsProvider, tmp_path: Path, installed: bool
) -> None:
    owned = tmp_path / "owned"
    owned.mkdir()
    command = ["trainbot-runner", "exec", "--", *payloads(owned)]
    env = hostile_env(owned)
    hostile_index = f"https://pypi.example/simple @@ENV@@ $(touch {owned / 'x'}-index)'"
    aws.runner = RunnerInstall(mode="index", index_url=hostile_index)
    req = launch_request(AWS_T4, command, zone="us-east-1a", run_id="r-1", env=env)

    stderr = run_user_data(aws.render_user_data(req), tmp_path, installed=installed)

    assert sorted(os.listdir(owned)) == [], "a value ran as shell"
    assert (tmp_path / "ran.json").exists(), stderr
    ran = json.loads((tmp_path / "ran.json").read_text())
    assert (tmp_path / "shutdown").read_text() == "shutdown -h now\n"
    assert ran["argv"] == command[1:]
    for key, value in env.items():
        assert ran["env"][key] == value, key
    assert ran["env"]["TRAINBOT_RUN_ID"] == "r-1"
    if not installed:
        lines = (tmp_path / "installs.jsonl").read_text().splitlines()
        [install] = [json.loads(line) for line in lines]
        assert install["config"]["index_url"] == hostile_index
        assert install["config"]["mode"] == "index"
        assert install["installer"] == installer_source(compact=True), "the installer, intact"
        assert install["venv"] == str(tmp_path / "opt")


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_aws_refuses_a_variable_name_that_is_not_an_identifier(aws: AwsProvider, name: str) -> None:
    req = launch_request(AWS_T4, ["trainbot-runner"], zone="us-east-1a", env={name: "v"})
    with pytest.raises(ProviderError, match="not a valid variable name") as refused:
        aws.render_user_data(req)
    assert repr(name) in str(refused.value)
    assert "letters, digits and underscores" in str(refused.value)


@pytest.mark.parametrize("value", ["a\nb", "a\rb", "a\0b", "x\nTRAINBOT_ENV_END\nid"], ids=repr)
def test_aws_refuses_a_value_the_environment_file_cannot_carry(
    aws: AwsProvider, value: str
) -> None:
    req = launch_request(AWS_T4, ["trainbot-runner"], zone="us-east-1a", env={"X": value})
    with pytest.raises(ProviderError, match="the value of X holds"):
        aws.render_user_data(req)


def test_aws_refuses_a_nul_in_the_command(aws: AwsProvider) -> None:
    req = launch_request(AWS_T4, ["trainbot-runner", "a\0b"], zone="us-east-1a", env={})
    with pytest.raises(ProviderError, match="NUL"):
        aws.render_user_data(req)


# -- GCP ---------------------------------------------------------------------------------------


@pytest.fixture
def gcp(gce: FakeComputeApi) -> GcpProvider:
    return gcp_on(gce)


def run_startup_script(
    gcp: GcpProvider, gce: FakeComputeApi, instance_id: str, tmp_path: Path, *, path: str = ""
) -> subprocess.CompletedProcess[bytes]:
    """Run the startup script as the instance would, its metadata from the fake server,
    with an installed runner in ``tmp_path/venv`` and ``path`` first on PATH."""
    runner_venv(tmp_path)
    with gce.metadata_server(GCP_ZONE, instance_id.split("/", 1)[1]) as md_url:
        return subprocess.run(
            ["bash", str(gcp.startup_script)],
            env=gcp_boot_env(
                tmp_path, md_url, path=os.pathsep.join(p for p in (path, os.environ["PATH"]) if p)
            ),
            capture_output=True,
            timeout=60,
        )


def test_gcp_startup_script_carries_hostile_values_as_data(
    gcp: GcpProvider, gce: FakeComputeApi, tmp_path: Path
) -> None:
    owned = tmp_path / "owned"
    owned.mkdir()
    ran = tmp_path / "ran.json"
    stand_in(tmp_path / "runner", RECORDER.format(python=sys.executable, out=str(ran)))
    command = [str(tmp_path / "runner"), *payloads(owned)]
    env = {**hostile_env(owned), "MULTILINE": f"a\ntouch {owned / 'x'}-env-newline\nb'"}
    gcp.runner = RunnerInstall(
        mode="index", index_url=f"https://pypi.example/ $(touch {owned / 'x'}-index)"
    )
    info = gcp.launch(launch_request(GCP_A100, command, zone=GCP_ZONE, run_id="r-1", env=env))
    done = run_startup_script(gcp, gce, info.instance_id, tmp_path)
    assert sorted(os.listdir(owned)) == [], "a value ran as shell"
    assert ran.exists(), done.stderr.decode(errors="replace")
    got = json.loads(ran.read_text())
    assert got["argv"] == command[1:]
    for key, value in env.items():
        assert got["env"][key] == value, key


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_gcp_refuses_a_variable_name_that_is_not_an_identifier(
    gcp: GcpProvider, gce: FakeComputeApi, name: str
) -> None:
    req = launch_request(GCP_A100, ["trainbot-runner"], zone=GCP_ZONE, env={name: "v"})
    with pytest.raises(ProviderError, match="not a valid variable name") as refused:
        gcp.launch(req)
    assert repr(name) in str(refused.value)
    assert "letters, digits and underscores" in str(refused.value)
    assert gce.instances() == [], "refused before anything was started"


@pytest.mark.parametrize(
    "req_env, command",
    [({"X": "a\0b"}, ["trainbot-runner"]), ({}, ["trainbot-runner", "a\0b"])],
    ids=["env", "command"],
)
def test_gcp_refuses_a_nul(
    gcp: GcpProvider, gce: FakeComputeApi, req_env: dict[str, str], command: list[str]
) -> None:
    req = launch_request(GCP_A100, command, zone=GCP_ZONE, env=req_env)
    with pytest.raises(ProviderError, match="NUL"):
        gcp.launch(req)
    assert gce.instances() == [], "refused before anything was started"


# -- a spec's container image (runner/container.py) -------------------------------------

IMAGE = "nvcr.io/nvidia/pytorch:24.05-py3"


def _docker_stand_ins(bin_dir: Path, calls: Path) -> None:
    for name in ("docker", "usermod", "systemctl"):
        stand_in(bin_dir / name, f'#!/bin/sh\necho "{name} $*" >> {calls}\n')


def test_aws_user_data_readies_docker_for_the_runners_user(
    aws: AwsProvider, tmp_path: Path
) -> None:
    spec = JobSpec(
        name="t", command=["python", "t.py"], image=IMAGE, resources={"accelerator": "T4:1"}
    )
    calls = tmp_path / "calls"
    _docker_stand_ins(tmp_path / "bin", calls)
    command = ["trainbot-runner", "exec", "--", "python", "t.py"]
    req = launch_request(AWS_T4, command, zone="us-east-1a", env=image_env(spec, local=False))

    stderr = run_user_data(aws.render_user_data(req), tmp_path, installed=True)

    ran = json.loads((tmp_path / "ran.json").read_text())
    assert ran["argv"] == command[1:], stderr
    assert ran["env"]["TRAINBOT_IMAGE"] == IMAGE
    assert ran["env"]["TRAINBOT_CONTAINER_RUNTIME"] == "docker"
    assert ran["env"]["TRAINBOT_CONTAINER_GPUS"] == "1"
    assert calls.read_text().splitlines() == [
        "systemctl start docker",
        "usermod -aG docker trainbot",
    ]
    assert "the command runs in a container (docker)" in (tmp_path / "console").read_text()


def test_aws_user_data_without_docker_says_so_and_lets_the_runner_report_it(
    aws: AwsProvider, tmp_path: Path
) -> None:
    spec = JobSpec(name="t", command=["python", "t.py"], image=IMAGE)
    req = launch_request(
        AWS_T4,
        ["trainbot-runner", "exec", "--", "x"],
        zone="us-east-1a",
        env=image_env(spec, local=False),
    )
    run_user_data(aws.render_user_data(req), tmp_path, installed=True)
    console = (tmp_path / "console").read_text()
    assert "the spec's image needs docker, which this machine image lacks" in console
    assert (tmp_path / "ran.json").exists(), "the runner starts and reports image_unavailable"


def test_gcp_startup_script_readies_docker(
    gcp: GcpProvider, gce: FakeComputeApi, tmp_path: Path
) -> None:
    spec = JobSpec(name="t", command=["python", "t.py"], image=IMAGE)
    ran, calls = tmp_path / "ran.json", tmp_path / "calls"
    stand_in(tmp_path / "runner", RECORDER.format(python=sys.executable, out=str(ran)))
    _docker_stand_ins(tmp_path / "bin", calls)
    command = [str(tmp_path / "runner"), "exec", "--", "python", "t.py"]
    req = launch_request(GCP_A100, command, zone=GCP_ZONE, env=image_env(spec, local=False))
    info = gcp.launch(req)
    done = run_startup_script(gcp, gce, info.instance_id, tmp_path, path=str(tmp_path / "bin"))
    out = done.stdout.decode(errors="replace")
    assert "the command runs in a container (docker)" in out, done.stderr
    assert calls.read_text().splitlines() == ["systemctl start docker"]
    got = json.loads(ran.read_text())
    assert got["env"]["TRAINBOT_IMAGE"] == IMAGE
    assert got["env"]["TRAINBOT_CONTAINER_RUNTIME"] == "docker"
