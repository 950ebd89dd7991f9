"""deploy/kubernetes/ as a platform engineer installs it (issue 28, point 1): the README's
first install, run command by command against a validator (tests/deploy/kube.py) that
checks each object's ServiceAccount, ConfigMap, Secrets and keys exist before it and that
no placeholder image is left; the migration Job needs no Slack secret; the pods'
environment and secret files are settings that load; Google credentials come from
Workload Identity unless a key is mounted; and the manifests validate offline against
the Kubernetes API schemas (strict: no unknown fields)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs.process.google_env import google_credentials_environ
from jobs.process.settings import load_settings
from tests.deploy.kube import (
    KUBERNETES,
    PLACEHOLDER_REGISTRY,
    ROOT,
    Cluster,
    Command,
    container_environment,
    containers,
    kubectl,
    pod_spec,
    readme_commands,
    render,
    render_here,
    render_with_kubectl,
)

KUBERNETES_VERSION = "1.30.0"
IMAGE = "ghcr.io/acme/trainbot:1.2.3"
KUSTOMIZATIONS = ("", "migrate", "monitoring", "backup")
Obj = dict[str, Any]


def readme_install() -> list[Command]:
    """The commands of the README's Kubernetes first install, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("**3. Kubernetes.**") :]
    block = section[section.index("```sh\n") + 6 :]
    return readme_commands(block[: block.index("```")])


def set_image(tree: Path, image: str) -> None:
    """Step 0 of the README: the team's image in image/kustomization.yaml."""
    path = tree / "deploy" / "kubernetes" / "image" / "kustomization.yaml"
    component = yaml.safe_load(path.read_text())
    (entry,) = component["images"]
    entry["newName"], entry["newTag"] = image.rsplit(":", 1)
    path.write_text(yaml.safe_dump(component))


def copy_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "checkout"
    shutil.copytree(KUBERNETES, tree / "deploy" / "kubernetes")
    return tree


def _secret_value(name: str, key: str, literal: str) -> str:
    if "$(" in literal or "…" in literal or not literal:
        return f"{name}-{key}-".ljust(64, "0")  # openssl rand -hex 32 is 64 characters
    return literal


def run_commands(
    commands: list[Command], tree: Path, *, with_optional: bool, image: str = IMAGE
) -> Cluster:
    """Each command against the validator, as `kubectl` would run it."""
    cluster = Cluster(image=image)
    for command in commands:
        if command.optional and not with_optional:
            continue
        words = list(command.words) + (list(command.optional_words) if with_optional else [])
        match words:
            case ["kubectl", "create", "secret", "generic", name, *flags]:
                data = {}
                for flag in flags:
                    option, _, rest = flag.partition("=")
                    key, _, value = rest.partition("=")
                    assert option in ("--from-literal", "--from-file"), flag
                    data[key] = (
                        '{"type": "service_account"}'
                        if option == "--from-file"
                        else _secret_value(name, key, value)
                    )
                cluster.create_secret(name, data)
            case ["kubectl", "apply", "-k", directory]:
                for obj in render(tree / directory):
                    cluster.apply(obj)
            case ["kubectl", "apply", "-f", path]:
                for obj in yaml.safe_load_all((tree / path).read_text()):
                    if obj:
                        cluster.apply(obj)
            case ["kubectl", "wait", *options]:
                (target,) = [o for o in options if "/" in o and not o.startswith("--")]
                kind, name = target.split("/")
                assert kind == "job", target
                if not cluster.has("Job", name):
                    cluster.problems.append(f"kubectl wait: job {name} was never applied")
            case ["kubectl", "delete", "job", name, *_]:
                cluster.delete("Job", name)
            case _:
                raise AssertionError(f"the test does not know this README command: {words}")
    return cluster


def of(cluster: Cluster, kind: str, name: str = "trainbot") -> Obj:
    return cluster.objects[(kind, name)]


@pytest.fixture(params=["required only", "with every optional secret"])
def installed(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Cluster, bool]:
    tree = copy_tree(tmp_path)
    set_image(tree, IMAGE)
    full = request.param != "required only"
    return run_commands(readme_install(), tree, with_optional=full), full


# --- the first install ----------------------------------------------------------------------


def test_the_readme_first_install_applies_each_object_after_what_it_needs(
    installed: tuple[Cluster, bool],
) -> None:
    cluster, full = installed
    assert cluster.problems == []
    applied = cluster.applied
    assert applied.index(("Job", "trainbot-migrate")) < applied.index(("Deployment", "trainbot"))
    for kind in ("ServiceAccount", "ConfigMap"):
        assert applied.index((kind, "trainbot")) < applied.index(("Job", "trainbot-migrate"))
    assert ("ServiceMonitor", "trainbot") in applied if full else True


def test_the_validator_refuses_the_old_order_and_the_placeholder_image(tmp_path: Path) -> None:
    """The issue's first install: the Job applied alone before anything else, with the
    image as shipped. The validator must see both faults, or the tests above prove nothing."""
    tree = copy_tree(tmp_path)
    old = [
        Command(("kubectl", "create", "secret", "generic", "trainbot-database",
                 "--from-literal=password=x"), optional=False),
        Command(("kubectl", "apply", "-f", "deploy/kubernetes/migrate/job.yaml"), optional=False),
    ]  # fmt: skip
    problems = run_commands(old, tree, with_optional=False).problems
    assert any("ServiceAccount trainbot does not exist" in p for p in problems), problems
    assert any("ConfigMap trainbot does not exist" in p for p in problems), problems
    assert any("placeholder image trainbot" in p for p in problems), problems

    unset = run_commands(readme_install(), copy_tree(tmp_path / "unset"), with_optional=False)
    assert any(f"placeholder image {PLACEHOLDER_REGISTRY}" in p for p in unset.problems)


def test_one_image_setting_reaches_the_job_and_the_deployment(tmp_path: Path) -> None:
    tree = copy_tree(tmp_path)
    set_image(tree, IMAGE)
    for name in ("", "migrate"):
        for obj in render(tree / "deploy" / "kubernetes" / name):
            for container in containers(obj):
                assert container["image"] == IMAGE, (name, obj["kind"])


def test_the_migration_job_needs_the_database_secret_alone(tmp_path: Path) -> None:
    tree = copy_tree(tmp_path)
    set_image(tree, IMAGE)
    cluster = Cluster(image=IMAGE)
    cluster.create_secret("trainbot-database", {"password": "s3cret-pw"})
    for obj in render(tree / "deploy" / "kubernetes" / "migrate"):
        cluster.apply(obj)
    assert cluster.problems == []
    job = of(cluster, "Job", "trainbot-migrate")
    assert cluster.secrets_named_by(job) == {"trainbot-database"}
    (container,) = pod_spec(job)["containers"]  # type: ignore[index]
    assert container["args"] == ["migrate"]
    env, _ = container_environment(cluster, job, mounts={"secrets": tmp_path / "job-secrets"})
    assert env["TRAINBOT_NOTIFIER"] == "slack"  # the ConfigMap's, shared with the Deployment
    settings = load_settings(env, purpose="migrate")  # what `trainbot migrate` reads
    assert ":s3cret-pw@" in settings.database_url


def test_the_pods_environment_and_secret_files_are_settings_that_load(
    installed: tuple[Cluster, bool], tmp_path: Path
) -> None:
    cluster, full = installed
    deployment = of(cluster, "Deployment")
    env, _ = container_environment(
        cluster, deployment, mounts={"secrets": tmp_path / "pod-secrets"}
    )
    secret_values = {
        v for data in cluster.secrets.values() for k, v in data.items() if "aws" not in k
    }
    assert not secret_values & set(env.values())  # files, not variables (AWS keys aside)
    settings = load_settings(env)
    slack = cluster.secrets["trainbot-slack"]
    assert settings.slack_bot_token is not None
    assert settings.slack_bot_token.get_secret_value() == slack["bot-token"]
    assert settings.runner_token_secret is not None
    assert (
        settings.runner_token_secret.get_secret_value()
        == cluster.secrets["trainbot-runner-tokens"]["secret"]
    )
    password = cluster.secrets["trainbot-database"]["password"]
    assert f":{password}@" in settings.database_url
    assert (settings.pagerduty_routing_key is not None) == full
    assert (settings.slack_app_token is not None) == full


def test_google_credentials_come_from_workload_identity_unless_a_key_is_mounted(
    installed: tuple[Cluster, bool], tmp_path: Path
) -> None:
    cluster, full = installed
    deployment = of(cluster, "Deployment")
    (container,) = pod_spec(deployment)["containers"]  # type: ignore[index]
    assert "GOOGLE_APPLICATION_CREDENTIALS" not in {v["name"] for v in container["env"]}
    env, _ = container_environment(
        cluster, deployment, mounts={"secrets": tmp_path / "pod-secrets"}
    )
    settings = load_settings(env)
    google = google_credentials_environ(settings, env)
    if not full:  # no trainbot-cloud Secret: Workload Identity
        assert google == {}
    else:
        assert Path(google["GOOGLE_APPLICATION_CREDENTIALS"]).read_text().startswith("{")


# --- the manifests themselves --------------------------------------------------------------


@pytest.mark.skipif(kubectl() is None, reason="kubectl is not installed")
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_test_renderer_agrees_with_kubectl(name: str) -> None:
    command = kubectl()
    assert command is not None
    assert render_here(KUBERNETES / name) == render_with_kubectl(KUBERNETES / name, command)


def test_manifests_validate_strictly(tmp_path: Path) -> None:
    validate = Path(sys.executable).with_name("kubernetes-validate")
    command = str(validate) if validate.exists() else shutil.which("kubernetes-validate")
    if command is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    tree = copy_tree(tmp_path)
    set_image(tree, IMAGE)
    files = []
    for name in ("", "migrate", "backup"):  # monitoring/ is a CRD's object: no schema here
        for i, obj in enumerate(render(tree / "deploy" / "kubernetes" / name)):
            path = tmp_path / f"{name or 'app'}-{i}-{obj['kind']}.yaml"
            path.write_text(yaml.safe_dump(obj))
            files.append(str(path))
    proc = subprocess.run(
        [command, "--strict", "-k", KUBERNETES_VERSION, *files],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("passed") == len(files), proc.stdout


def test_every_manifest_is_in_a_kustomization() -> None:
    listed: set[Path] = set()
    for name in (*KUSTOMIZATIONS, "config"):
        directory = KUBERNETES / name
        k = yaml.safe_load((directory / "kustomization.yaml").read_text())
        listed |= {(directory / r).resolve() for r in k.get("resources", [])}
    manifests = {p.resolve() for p in KUBERNETES.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert manifests <= listed


def _app() -> dict[tuple[str, str], Obj]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render_here(KUBERNETES)}


def test_two_replicas_live_on_the_process_and_ready_on_the_database() -> None:
    docs = _app()
    deployment = docs[("Deployment", "trainbot")]
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    paths = {"readinessProbe": "/readyz", "livenessProbe": "/healthz", "startupProbe": "/healthz"}
    for probe, path in paths.items():
        assert container[probe]["httpGet"] == {"path": path, "port": "admin"}, probe
    assert pod["securityContext"]["runAsNonRoot"] is True
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for kind, name in (("Service", "trainbot"), ("Service", "trainbot-admin"),
                       ("PodDisruptionBudget", "trainbot")):  # fmt: skip
        spec = docs[(kind, name)]["spec"]
        selector = spec["selector"].get("matchLabels", spec["selector"])
        assert selector.items() <= labels.items(), kind
    assert docs[("PodDisruptionBudget", "trainbot")]["spec"]["minAvailable"] == 1


def test_secrets_are_files_and_the_configmap_holds_none() -> None:
    docs = _app()
    config = docs[("ConfigMap", "trainbot")]["data"]
    assert not [k for k in config if "TOKEN" in k or "SECRET" in k or "PASSWORD" in k]
    from sqlalchemy.engine import make_url

    assert make_url(config["TRAINBOT_DATABASE_URL"]).password is None
    (container,) = docs[("Deployment", "trainbot")]["spec"]["template"]["spec"]["containers"]
    by_name = {e["name"]: e for e in container["env"]}
    trainbot_refs = [
        n for n, e in by_name.items() if n.startswith("TRAINBOT_") and "valueFrom" in e
    ]
    assert trainbot_refs == []  # every TRAINBOT_ secret is a file
    assert by_name["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["optional"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["secrets"]["mountPath"] == by_name["TRAINBOT_SECRETS_DIR"]["value"]
    assert mounts["secrets"]["readOnly"] is True


def test_probes_and_scrapes_use_the_admin_port_which_the_public_service_does_not_expose() -> None:
    """A flood of the public port cannot fail a probe (issue 23): probes and scrapes go
    to the admin listener, which binds the pod's network; the public Service, which the
    ingress or load balancer reaches, exposes the public port only."""
    docs = _app()
    template = docs[("Deployment", "trainbot")]["spec"]["template"]
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = container["args"]
    assert args[args.index("--port") + 1] == str(ports["http"])
    assert args[args.index("--admin-port") + 1] == str(ports["admin"]) != str(ports["http"])
    assert args[args.index("--admin-host") + 1] == "0.0.0.0"  # kubelet and Prometheus
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["admin"])
    assert annotations["prometheus.io/path"] == "/metrics"
    assert [p["targetPort"] for p in docs[("Service", "trainbot")]["spec"]["ports"]] == ["http"]
    admin = docs[("Service", "trainbot-admin")]["spec"]
    assert admin["clusterIP"] == "None"
    assert [p["targetPort"] for p in admin["ports"]] == ["admin"]


# --- backups ----------------------------------------------------------------------------


def test_the_backup_cronjob_applies_after_the_install_and_runs_the_shipped_script(
    tmp_path: Path,
) -> None:
    tree = copy_tree(tmp_path)
    set_image(tree, IMAGE)
    cluster = run_commands(readme_install(), tree, with_optional=False)
    assert cluster.problems == []
    for obj in render(tree / "deploy" / "kubernetes" / "backup"):
        cluster.apply(obj)
    assert cluster.problems == []
    cron = of(cluster, "CronJob", "trainbot-backup")
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    assert cluster.secrets_named_by(cron) == {"trainbot-database"}  # no Slack secret
    pod = pod_spec(cron)
    assert pod is not None
    (container,) = containers(cron)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["backups"]["persistentVolumeClaim"]["claimName"] == "trainbot-backups"
    assert cluster.has("PersistentVolumeClaim", "trainbot-backups")
    # The script it runs is the one tests/deploy/test_backup.py runs against PostgreSQL.
    script = container["command"][-1]
    assert script.startswith(mounts["scripts"] + "/")
    scripts = of(cluster, "ConfigMap", volumes["scripts"]["configMap"]["name"])
    shipped = KUBERNETES / "backup" / Path(script).name
    assert scripts["data"][Path(script).name] == shipped.read_text()
    env = {e["name"]: e for e in container["env"]}
    assert env["DATABASE_URL"]["valueFrom"]["configMapKeyRef"]["key"] == "TRAINBOT_DATABASE_URL"
    password = env["PGPASSWORD_FILE"]["value"]
    assert password.startswith(mounts["secrets"] + "/")
    assert env["BACKUP_DIR"]["value"] == mounts["backups"]
