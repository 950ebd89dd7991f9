"""The shipped Prometheus rules select what the shipped scrape configurations give
(issue 28, point 1): every ``job`` matcher in deploy/prometheus/alerts.yaml names the job
that scrape-kubernetes.yaml, scrape-compose.yaml and the Operator's ServiceMonitor each
give every replica, and each of them scrapes the admin port, where /metrics is."""

from __future__ import annotations

import re
from typing import Any

import yaml

from jobs.web.admin import ADMIN_PATHS
from tests.deploy.kube import KUBERNETES, ROOT, render_here

PROMETHEUS = ROOT / "deploy" / "prometheus"
MATCHER = re.compile(r'(\w+)\s*(=~|!=|!~|=)\s*"([^"]*)"')


def rules() -> list[dict[str, Any]]:
    loaded = yaml.safe_load((PROMETHEUS / "alerts.yaml").read_text())
    return [rule for group in loaded["groups"] for rule in group["rules"]]


def matchers(expr: str) -> list[tuple[str, str, str]]:
    """The label matchers inside the expression's selectors ({…})."""
    found = []
    for selector in re.findall(r"\{([^{}]*)\}", expr):
        found += MATCHER.findall(selector)
    return found


def scrape_job(name: str) -> dict[str, Any]:
    config = yaml.safe_load((PROMETHEUS / name).read_text())
    (job,) = config["scrape_configs"]
    return dict(job)


def admin_container_port() -> tuple[str, int]:
    app = render_here(KUBERNETES)
    (deployment,) = [o for o in app if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (port,) = [p for p in container["ports"] if p["name"] == "admin"]
    return port["name"], port["containerPort"]


def shipped_jobs() -> dict[str, str]:
    """Each shipped way of scraping -> the job label its series get."""
    app = {(o["kind"], o["metadata"]["name"]): o for o in render_here(KUBERNETES)}
    (monitor,) = render_here(KUBERNETES / "monitoring")
    wanted = monitor["spec"]["selector"]["matchLabels"]
    (service,) = [
        o for (kind, _), o in app.items()
        if kind == "Service" and wanted.items() <= o["metadata"]["labels"].items()
    ]  # fmt: skip
    return {
        "scrape-kubernetes.yaml": scrape_job("scrape-kubernetes.yaml")["job_name"],
        "scrape-compose.yaml": scrape_job("scrape-compose.yaml")["job_name"],
        "ServiceMonitor": service["metadata"]["labels"][monitor["spec"]["jobLabel"]],
    }


def test_every_job_matcher_names_the_job_every_shipped_scrape_gives() -> None:
    jobs = set(shipped_jobs().values())
    assert len(jobs) == 1, shipped_jobs()
    used: dict[str, set[str]] = {}
    for rule in rules():
        for label, op, value in matchers(str(rule["expr"])):
            assert label not in ("instance", "port"), (rule["alert"], "selects by address")
            if label == "job":
                assert op == "=", rule["alert"]
                used.setdefault(value, set()).add(rule["alert"])
    assert set(used) == jobs, used
    # The two the issue found silent.
    assert {"TrainbotDown", "TrainbotNoLeader"} <= used[jobs.pop()]
    text = (PROMETHEUS / "alerts.yaml").read_text()
    assert "8787" not in text and "8788" not in text


def test_each_shipped_scrape_reaches_the_admin_port_and_its_metrics_path() -> None:
    name, port = admin_container_port()
    # Plain Prometheus on Kubernetes: the pods of the Deployment, their port named admin.
    kubernetes = scrape_job("scrape-kubernetes.yaml")
    assert kubernetes["metrics_path"] in ADMIN_PATHS
    keeps = {
        tuple(r["source_labels"]): r["regex"]
        for r in kubernetes["relabel_configs"]
        if r.get("action") == "keep"
    }
    assert keeps[("__meta_kubernetes_pod_container_port_name",)] == name
    pod_keep = keeps[
        (
            "__meta_kubernetes_pod_label_app_kubernetes_io_name",
            "__meta_kubernetes_pod_label_app_kubernetes_io_component",
        )
    ]
    app = render_here(KUBERNETES)
    (deployment,) = [o for o in app if o["kind"] == "Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pod_keep == (
        f"{labels['app.kubernetes.io/name']};{labels['app.kubernetes.io/component']}"
    )
    # The Operator: the ServiceMonitor's endpoint is the admin Service's port to it.
    (monitor,) = render_here(KUBERNETES / "monitoring")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] in ADMIN_PATHS
    (admin_service,) = [
        o for o in app if o["kind"] == "Service" and o["metadata"]["name"] == "trainbot-admin"
    ]
    (service_port,) = admin_service["spec"]["ports"]
    assert (service_port["name"], service_port["targetPort"]) == (endpoint["port"], name)
    # Compose: each replica's admin port in the image, on the compose network.
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    job = scrape_job("scrape-compose.yaml")
    assert job["metrics_path"] in ADMIN_PATHS
    (targets,) = job["static_configs"]
    replicas = sorted(s for s in compose["services"] if s.startswith("trainbot"))
    assert sorted(targets["targets"]) == [f"{r}:{port}" for r in replicas]
    for replica in replicas:
        published = [str(p).rsplit(":", 1)[-1] for p in compose["services"][replica]["ports"]]
        assert str(port) in published, replica
    assert compose["x-trainbot"]["environment"]["TRAINBOT_ADMIN_HOST"] == "0.0.0.0"
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert f"TRAINBOT_ADMIN_PORT={port}" in dockerfile
