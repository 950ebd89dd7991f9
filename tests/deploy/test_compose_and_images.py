"""deploy/compose.yaml and the Dockerfiles as a platform expects them (issue 28, point 2):
secrets as files and a database URL without its password, a stop grace longer than the
drain, dependencies installed under constraints.txt, Python 3.11 declared and checked,
and psycopg2 built rather than the -binary wheel. (tests/deploy/test_container.py builds
and runs the images where podman is installed.)"""

from __future__ import annotations

import re
from typing import Any

import yaml
from sqlalchemy.engine import make_url

from bot.cli import DRAIN_S
from jobs.process.settings import Settings, env_name
from tests.paths import ROOT

DEPLOY = ROOT / "deploy"


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return loaded


def _seconds(text: str) -> float:
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", text)
    assert match and text, text
    return int(match.group(1) or 0) * 60 + float(match.group(2) or 0)


def test_compose_stops_each_replica_after_its_drain_not_during_it() -> None:
    services = compose()["services"]
    replicas = [name for name in services if name.startswith("trainbot")]
    assert len(replicas) == 2
    for name in replicas:
        grace = _seconds(services[name]["stop_grace_period"])
        assert grace >= DRAIN_S + 5, (name, grace)


def test_compose_passes_secrets_as_files_and_the_url_without_its_password() -> None:
    loaded = compose()
    env = loaded["x-trainbot"]["environment"]
    assert make_url(env["TRAINBOT_DATABASE_URL"]).password is None
    secrets = {
        env_name(f)
        for f, info in Settings.model_fields.items()
        if "SecretStr" in str(info.annotation)
    }
    assert not secrets & set(env), "a secret passed as a variable"
    directory = env["TRAINBOT_SECRETS_DIR"]
    assert env["TRAINBOT_RUNNER_TOKEN_SECRET_FILE"].startswith(directory + "/")
    for name in ("trainbot-1", "trainbot-2", "postgres"):
        mounts = [str(v) for v in loaded["services"][name]["volumes"]]
        assert any(m.endswith(f":{directory}:ro") for m in mounts), (name, mounts)
    postgres = loaded["services"]["postgres"]["environment"]
    assert "POSTGRES_PASSWORD" not in postgres
    assert postgres["POSTGRES_PASSWORD_FILE"] == f"{directory}/database_password"
    ignored = (DEPLOY / "secrets" / ".gitignore").read_text().splitlines()
    assert "*" in ignored  # nobody commits a secret by accident


def _pip_installs(dockerfile: str) -> list[str]:
    text = dockerfile.replace("\\\n", " ")
    return [
        m.group(0)
        for m in re.finditer(r"pip install [^&\n]*", text)
        if "--upgrade pip" not in m.group(0)
    ]


def test_images_install_under_constraints_and_declare_python_3_11() -> None:
    for name in ("Dockerfile", "Dockerfile.runner"):
        dockerfile = (DEPLOY / name).read_text()
        installs = _pip_installs(dockerfile)
        assert installs, name
        for install in installs:
            assert "-c constraints.txt" in install, (name, install)
        assert "sys.version_info >= (3, 11)" in dockerfile, name
        assert 'requires-python=">=3.11"' in dockerfile, name
        assert "3.10" not in dockerfile, name


def test_the_control_plane_image_builds_psycopg2_against_debians_libpq() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "libpq-dev" in dockerfile and "libpq5" in dockerfile
    assert "--no-binary psycopg2" in dockerfile
    assert "re.sub(r'^psycopg2-binary', 'psycopg2', d)" in dockerfile
    # The wheel with the server extra only: [postgres] would bring psycopg2-binary back.
    assert '[server]"' in dockerfile and "[server,postgres]" not in dockerfile
    assert "! /opt/trainbot/bin/pip show -q psycopg2-binary" in dockerfile
