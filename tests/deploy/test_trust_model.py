"""The README's trust model and the deploy files name the same settings: every setting
the trust model section names is passed by ``deploy/compose.yaml`` and by the Kubernetes
manifests (from the ConfigMap or the Secret the README says), so neither recipe runs with
a part of the trust model silently off. And the NetworkPolicy lets the public port in
from anywhere and the admin port only from the monitoring namespace."""

from __future__ import annotations

import re
from typing import Any

import yaml

from jobs.process.settings import Settings, env_name
from tests.deploy.kube import render_here
from tests.paths import ROOT

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
    """The control plane's objects as `kubectl apply -k deploy/kubernetes` renders them."""
    return render_here(KUBERNETES)


def of_kind(kind: str, name: str = "trainbot") -> dict[str, Any]:
    (doc,) = [d for d in kubernetes_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def control_plane_container() -> dict[str, Any]:
    pod = of_kind("Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return container


def secret_files() -> dict[str, dict[str, Any]]:
    """Each setting the pods read from a file in TRAINBOT_SECRETS_DIR -> its Secret source."""
    pod = of_kind("Deployment")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "secrets"]
    files: dict[str, dict[str, Any]] = {}
    for source in volume["projected"]["sources"]:
        for item in source["secret"].get("items", []):
            files[f"TRAINBOT_{item['path'].upper()}"] = source["secret"]
    return files


def kubernetes_sources() -> dict[str, str]:
    """Each setting the control plane's pods get -> ``ConfigMap`` or ``Secret <name>`` (a
    variable from a Secret, or a file of one in TRAINBOT_SECRETS_DIR)."""
    container = control_plane_container()
    sources: dict[str, str] = {
        name: f"Secret {secret['name']}" for name, secret in secret_files().items()
    }
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
    # A secret may come as a file: its _FILE variable, or the secrets directory.
    from_directory = {
        env_name(field)
        for field, info in Settings.model_fields.items()
        if "TRAINBOT_SECRETS_DIR" in env and "SecretStr" in str(info.annotation)
    }
    missing = {
        name
        for name in settings_table()
        if name not in env and f"{name}_FILE" not in env and name not in from_directory
    }
    assert not missing, f"deploy/compose.yaml does not pass {sorted(missing)}"
    # Both replicas need the one secret: a file every replica reads, required (a
    # replica whose file is missing refuses to start, naming it).
    assert env["TRAINBOT_RUNNER_TOKEN_SECRET_FILE"].startswith(env["TRAINBOT_SECRETS_DIR"])
    assert env["TRAINBOT_ALLOW_EXTERNAL_USERS"].endswith(":-false}")


def test_kubernetes_passes_every_trust_model_setting_from_where_the_readme_says() -> None:
    sources = kubernetes_sources()
    for name, where in settings_table().items():
        assert name in sources, f"deploy/kubernetes does not pass {name}"
        expected = re.sub(r"`|\(optional\)", "", where).split()
        assert sources[name].split() == expected, (name, sources[name], where)
    # The shared runner-token secret is required: a pod without it would sign with its own.
    assert not secret_files()["TRAINBOT_RUNNER_TOKEN_SECRET"].get("optional", False)


def test_the_readme_compose_recipe_turns_checkpoint_isolation_on() -> None:
    deploy = section((ROOT / "README.md").read_text(), "Deploy")
    recipe = deploy[deploy.index("**2. Compose") : deploy.index("**3. Kubernetes")]
    assert "> runner_token_secret" in recipe  # the file every replica reads
    for name in (
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
