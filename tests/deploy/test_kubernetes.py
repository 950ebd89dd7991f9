"""deploy/kubernetes/ validates offline against the Kubernetes API schemas (strict: no
unknown fields), and holds what a two-replica team install needs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30.0"


def _resources() -> list[Path]:
    return sorted(p for p in MANIFESTS.glob("*.yaml") if p.name != "kustomization.yaml")


def _docs() -> dict[str, dict[str, Any]]:
    docs: dict[str, dict[str, Any]] = {}
    for path in _resources():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[doc["kind"]] = doc
    return docs


def test_manifests_validate_strictly() -> None:
    validate = Path(sys.executable).with_name("kubernetes-validate")
    command = str(validate) if validate.exists() else shutil.which("kubernetes-validate")
    if command is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    proc = subprocess.run(
        [command, "--strict", "-k", KUBERNETES_VERSION, *map(str, _resources())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("passed") == len(_resources()), proc.stdout


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in _resources())


def test_two_replicas_probed_on_healthz_and_kept_by_a_budget() -> None:
    docs = _docs()
    deployment = docs["Deployment"]
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    paths = {"readinessProbe": "/readyz", "livenessProbe": "/healthz", "startupProbe": "/healthz"}
    for probe, path in paths.items():
        assert container[probe]["httpGet"] == {"path": path, "port": "admin"}, probe
    assert pod["securityContext"]["runAsNonRoot"] is True
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        spec = docs[kind]["spec"]
        selector = spec["selector"].get("matchLabels", spec["selector"])
        assert selector.items() <= labels.items(), kind
    assert docs["PodDisruptionBudget"]["spec"]["minAvailable"] == 1


def test_credentials_come_from_secrets_only() -> None:
    docs = _docs()
    for kind in ("Deployment", "Job"):
        (container,) = docs[kind]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        for name in ("TRAINBOT_DATABASE_URL", "TRAINBOT_SLACK_BOT_TOKEN"):
            assert env[name]["valueFrom"]["secretKeyRef"]["name"].startswith("trainbot-")
    config = docs["ConfigMap"]["data"]
    assert not [k for k in config if "TOKEN" in k or "SECRET" in k or "DATABASE" in k]
    deployment_env = {
        e["name"]: e for e in docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert deployment_env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["optional"]


def test_migration_job_runs_trainbot_migrate() -> None:
    job = _docs()["Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["migrate"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("OnFailure", "Never")


def test_probes_and_scrapes_use_the_admin_port_which_the_service_does_not_expose() -> None:
    """A flood of the public port cannot fail a probe (issue 23): probes and scrapes go
    to the admin listener, which binds the pod's network; the Service, which the ingress
    or load balancer reaches, exposes the public port only (it has no /metrics)."""
    docs = _docs()
    template = docs["Deployment"]["spec"]["template"]
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = container["args"]
    assert args[args.index("--port") + 1] == str(ports["http"])
    assert args[args.index("--admin-port") + 1] == str(ports["admin"]) != str(ports["http"])
    assert args[args.index("--admin-host") + 1] == "0.0.0.0"  # kubelet and Prometheus
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["admin"])
    assert annotations["prometheus.io/path"] == "/metrics"
    exposed = [p["targetPort"] for p in docs["Service"]["spec"]["ports"]]
    assert exposed == ["http"]
