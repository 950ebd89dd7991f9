"""The README's trust model and the deploy files name the same settings: every setting
the trust model section names is passed by ``deploy/compose.yaml`` and by the Kubernetes
manifests (from the ConfigMap or the Secret the README says), so neither recipe runs with
a part of the trust model silently off. And the NetworkPolicy lets the public port in
from anywhere and the admin port only from the monitoring namespace."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from jobs.settings import Settings, env_name

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
TABLE_TITLE = "**The settings of the trust model**"


def section(markdown: str, title: str) -> str:
    """The text of the ``## title`` section, up to the next ``## `` heading."""
    start = markdown.index(f"\n## {title}\n")
    end = markdown.find("\n## ", start + 1)
    return markdown[start : end if end != -1 else None]


def trust_model() -> str:
    return section((ROOT / "README.md").read_text(), "Trust model")


def settings_table() -> dict[str, str]:
    """The trust model's table of settings: name -> where Kubernetes takes it from."""
    text = trust_model()
    table = text[text.index(TABLE_TITLE) :]
    rows: dict[str, str] = {}
    for line in table.splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        match = re.fullmatch(r"\| `(TRAINBOT_[A-Z0-9_]+)` \| [^|]+ \| ([^|]+) \|", line)
        if match:
            rows[match.group(1)] = match.group(2).strip()
    assert rows, f"no table of settings after {TABLE_TITLE} in README's trust model"
    return rows


def compose_environment() -> dict[str, str]:
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    env: dict[str, str] = compose["x-trainbot"]["environment"]
    return env


def kubernetes_docs() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def of_kind(kind: str, name: str = "trainbot") -> dict[str, Any]:
    (doc,) = [d for d in kubernetes_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def control_plane_container() -> dict[str, Any]:
    pod = of_kind("Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return container


def kubernetes_sources() -> dict[str, str]:
    """Each variable the control plane's pods get -> ``ConfigMap`` or ``Secret <name>``."""
    container = control_plane_container()
    sources: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        config_map = of_kind("ConfigMap", ref["configMapRef"]["name"])
        sources.update(dict.fromkeys(config_map["data"], "ConfigMap"))
    for var in container.get("env", []):
        secret = var.get("valueFrom", {}).get("secretKeyRef")
        sources[var["name"]] = f"Secret {secret['name']}" if secret else "value"
    return sources


def test_the_trust_model_names_only_settings_its_table_lists() -> None:
    table = settings_table()
    named = set(re.findall(r"TRAINBOT_[A-Z0-9_]*[A-Z0-9]", trust_model()))
    assert named <= set(table), (
        f"named in the trust model, missing from its table: {named - set(table)}"
    )
    known = {env_name(field) for field in Settings.model_fields}
    assert set(table) <= known, f"not settings: {set(table) - known}"


def test_compose_passes_every_trust_model_setting() -> None:
    env = compose_environment()
    missing = set(settings_table()) - set(env)
    assert not missing, f"deploy/compose.yaml does not pass {sorted(missing)}"
    # Both replicas need the one secret: compose refuses to start without it.
    assert ":?" in env["TRAINBOT_RUNNER_TOKEN_SECRET"]
    assert env["TRAINBOT_ALLOW_EXTERNAL_USERS"].endswith(":-false}")


def test_kubernetes_passes_every_trust_model_setting_from_where_the_readme_says() -> None:
    sources = kubernetes_sources()
    for name, where in settings_table().items():
        assert name in sources, f"deploy/kubernetes does not pass {name}"
        expected = re.sub(r"`|\(optional\)", "", where).split()
        assert sources[name].split() == expected, (name, sources[name], where)
    # The shared runner-token secret is required: a pod without it would sign with its own.
    (var,) = [
        v for v in control_plane_container()["env"] if v["name"] == "TRAINBOT_RUNNER_TOKEN_SECRET"
    ]
    assert not var["valueFrom"]["secretKeyRef"].get("optional", False)


def test_the_readme_compose_recipe_turns_checkpoint_isolation_on() -> None:
    deploy = section((ROOT / "README.md").read_text(), "Deploy")
    recipe = deploy[deploy.index("**2. Compose") : deploy.index("**3. Kubernetes")]
    for name in (
        "TRAINBOT_RUNNER_TOKEN_SECRET",
        "TRAINBOT_CHECKPOINT_LOCATIONS",
        "TRAINBOT_AWS_RUNNER_STORAGE_ROLE_ARN",
        "TRAINBOT_AWS_INSTANCE_PROFILE",
    ):
        assert f"{name}=" in recipe, name


def test_the_network_policy_opens_the_public_port_and_keeps_admin_to_monitoring() -> None:
    policy = of_kind("NetworkPolicy")
    ports = {p["name"]: p["containerPort"] for p in control_plane_container()["ports"]}
    pod_labels = of_kind("Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    by_port: dict[int, list[dict[str, Any]]] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            by_port.setdefault(port["port"], []).append(rule)
    assert set(by_port) == {ports["http"], ports["admin"]}
    (public,) = by_port[ports["http"]]
    assert "from" not in public  # Slack and the runners come through the load balancer
    (admin,) = by_port[ports["admin"]]
    (source,) = admin["from"]
    assert source == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }
    egress = {p["port"] for rule in policy["spec"]["egress"] for p in rule["ports"]}
    assert egress == {53, 5432, 443}
