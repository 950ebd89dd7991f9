"""Render deploy/kubernetes as ``kubectl apply -k`` does, and a validator that plays the
part of a cluster: each object applied is checked against what exists at that moment.

Rendering uses ``kubectl kustomize`` where kubectl is installed, else a small renderer of
the kustomize features the manifests use (resources, components, ``images``, ``labels``,
``configMapGenerator`` without name hashes, kustomize's legacy output order); a test checks the two agree where both can run.

The validator refuses an object whose pods could not start yet: a ServiceAccount,
ConfigMap, Secret or Secret key it names (and has not marked optional) that is not
there, a volume mount of no volume, or an image that is still the placeholder. That is
what goes wrong on a first install applied out of order: the pods of a Job applied
before its ServiceAccount are refused by the API server, and a container whose
ConfigMap or Secret is missing stays in CreateContainerConfigError.
"""

from __future__ import annotations

import copy
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.paths import ROOT

KUBERNETES = ROOT / "deploy" / "kubernetes"
#: The image ``image/kustomization.yaml`` ships with, until a team sets its own.
PLACEHOLDER_REGISTRY = "registry.example.com/"

#: kustomize's legacy output order (api/resid/gvk.go): these kinds first, in this order;
#: every other kind after them, by group/version/kind; these two last.
_ORDER_FIRST = [
    "Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition",
    "ServiceAccount", "PodSecurityPolicy", "Role", "ClusterRole", "RoleBinding",
    "ClusterRoleBinding", "ConfigMap", "Secret", "Endpoints", "Service", "LimitRange",
    "PriorityClass", "PersistentVolume", "PersistentVolumeClaim", "Deployment",
    "StatefulSet", "CronJob", "PodDisruptionBudget",
]  # fmt: skip
_ORDER_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]

#: Images the manifests run as they are, not the team's trainbot image: the backup
#: CronJob's pg_dump (deploy/kubernetes/backup).
THIRD_PARTY_IMAGES = frozenset({"postgres:16"})

Obj = dict[str, Any]


# --- rendering -------------------------------------------------------------------------


def kubectl() -> str | None:
    return shutil.which("kubectl")


def render(directory: Path) -> list[Obj]:
    """The objects ``kubectl apply -k directory`` sends, in its order."""
    command = kubectl()
    if command is not None:
        return render_with_kubectl(directory, command)
    return render_here(directory)


def render_with_kubectl(directory: Path, command: str) -> list[Obj]:
    done = subprocess.run(
        [command, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def render_here(directory: Path) -> list[Obj]:
    objects = _build(directory)
    return sorted(objects, key=_legacy_order)


def _kustomization(directory: Path) -> Obj:
    loaded: Obj = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return loaded


def _build(directory: Path) -> list[Obj]:
    k = _kustomization(directory)
    objects: list[Obj] = []
    for entry in k.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objects.extend(_build(path))
        else:
            objects.extend(copy.deepcopy(d) for d in yaml.safe_load_all(path.read_text()) if d)
    for generator in k.get("configMapGenerator", []):
        # As kustomize writes it with generatorOptions.disableNameSuffixHash (no hash).
        assert k.get("generatorOptions", {}).get("disableNameSuffixHash"), directory
        data = {Path(f).name: (directory / f).read_text() for f in generator["files"]}
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": generator["name"]},
                "data": dict(sorted(data.items())),
            }
        )
    for component in k.get("components", []):
        _transform(objects, _kustomization((directory / component).resolve()))
    _transform(objects, k)
    return objects


def _transform(objects: list[Obj], k: Obj) -> None:
    for image in k.get("images", []):
        for obj in objects:
            for container in _containers(obj):
                if _image_name(container["image"]) == image["name"]:
                    name = image.get("newName", image["name"])
                    tag = image.get("newTag")
                    container["image"] = f"{name}:{tag}" if tag else name
    for entry in k.get("labels", []):
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(entry["pairs"])


def _image_name(image: str) -> str:
    """An image reference without its tag or digest."""
    image = image.split("@")[0]
    return image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image


def _legacy_order(obj: Obj) -> tuple[int, str, str, str]:
    kind = obj["kind"]
    if kind in _ORDER_FIRST:
        rank = _ORDER_FIRST.index(kind) - len(_ORDER_FIRST)
    elif kind in _ORDER_LAST:
        rank = 1 + _ORDER_LAST.index(kind)
    else:
        rank = 0
    group_version = obj["apiVersion"]
    group, _, version = group_version.rpartition("/")
    gvk = f"{group or '~G'}_{version}_{kind}"
    return rank, gvk, obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def pod_spec(obj: Obj) -> Obj | None:
    """The pod template's spec of a workload, or None."""
    spec = obj.get("spec", {})
    if obj["kind"] == "CronJob":
        spec = spec.get("jobTemplate", {}).get("spec", {})
    template = spec.get("template")
    if obj["kind"] in ("Deployment", "Job", "StatefulSet", "DaemonSet", "CronJob") and template:
        pod: Obj = template["spec"]
        return pod
    return None


def _containers(obj: Obj) -> Iterator[Obj]:
    pod = pod_spec(obj)
    if pod is not None:
        yield from pod.get("initContainers", [])
        yield from pod.get("containers", [])


def containers(obj: Obj) -> list[Obj]:
    return list(_containers(obj))


# --- the README's commands ---------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """One command of the README's recipe: its words, and whether the README says it
    is optional ("# Only with …" above it). Bracketed words (``[--from-literal=…]``) are
    optional parts, kept in ``optional_words``."""

    words: tuple[str, ...]
    optional: bool
    optional_words: tuple[str, ...] = ()


def readme_commands(block: str) -> list[Command]:
    """The commands of a ``sh`` block: continuations joined, ``&&`` split, comments
    dropped; a comment starting "Only" marks the command after it optional."""
    commands: list[Command] = []
    optional_next = False
    joined = block.replace("\\\n", " ")
    for line in joined.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            optional_next = stripped.lstrip("# ").lower().startswith("only")
            continue
        code = stripped.split(" #", 1)[0]
        for part in code.split("&&"):
            words, optional_words = _words(part)
            if words:
                commands.append(Command(tuple(words), optional_next, tuple(optional_words)))
        optional_next = False
    return commands


def _words(part: str) -> tuple[list[str], list[str]]:
    words: list[str] = []
    optional: list[str] = []
    for word in shlex.split(part):
        if word.startswith("[") and word.endswith("]"):
            optional.append(word[1:-1])
        else:
            words.append(word)
    return words, optional


# --- the validator -------------------------------------------------------------------------


@dataclass
class Cluster:
    """What a namespace holds, and every problem an apply would have met."""

    image: str
    objects: dict[tuple[str, str], Obj] = field(default_factory=dict)
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    applied: list[tuple[str, str]] = field(default_factory=list)

    def has(self, kind: str, name: str) -> bool:
        if kind == "Secret":
            return name in self.secrets
        return (kind, name) in self.objects

    def create_secret(self, name: str, data: dict[str, str]) -> None:
        if name in self.secrets:
            self.problems.append(f"secret {name} created twice (kubectl create fails)")
        self.secrets[name] = dict(data)

    def delete(self, kind: str, name: str) -> None:
        self.objects.pop((kind, name), None)

    def apply(self, obj: Obj) -> None:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        for problem in self.missing_for(obj):
            self.problems.append(f"{where}: {problem}")
        self.objects[(obj["kind"], obj["metadata"]["name"])] = obj
        self.applied.append((obj["kind"], obj["metadata"]["name"]))

    def missing_for(self, obj: Obj) -> list[str]:
        """What ``obj`` needs that is not there now."""
        missing: list[str] = []
        if obj["kind"] == "ServiceMonitor":
            missing += self._service_monitor(obj)
        pod = pod_spec(obj)
        if pod is None:
            return missing
        account = pod.get("serviceAccountName", "default")
        if account != "default" and not self.has("ServiceAccount", account):
            missing.append(f"ServiceAccount {account} does not exist")
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for volume in volumes.values():
            missing += self._volume(volume)
        for container in containers(obj):
            image = container.get("image", "")
            if image in THIRD_PARTY_IMAGES:
                pass
            elif image.startswith(PLACEHOLDER_REGISTRY) or "/" not in image:
                missing.append(f"container {container['name']} has the placeholder image {image}")
            elif image != self.image:
                missing.append(f"container {container['name']} runs {image}, not {self.image}")
            for source in container.get("envFrom", []):
                missing += self._whole("ConfigMap", source.get("configMapRef"))
                missing += self._whole("Secret", source.get("secretRef"))
            for var in container.get("env", []):
                ref = var.get("valueFrom", {})
                missing += self._key("ConfigMap", ref.get("configMapKeyRef"))
                missing += self._key("Secret", ref.get("secretKeyRef"))
            for mount in container.get("volumeMounts", []):
                if mount["name"] not in volumes:
                    missing.append(f"volume mount {mount['name']} names no volume")
        return missing

    def _whole(self, kind: str, ref: Obj | None) -> list[str]:
        if ref is None or ref.get("optional") or self.has(kind, ref["name"]):
            return []
        return [f"{kind} {ref['name']} does not exist"]

    def _key(self, kind: str, ref: Obj | None) -> list[str]:
        if ref is None or ref.get("optional"):
            return []
        if not self.has(kind, ref["name"]):
            return [f"{kind} {ref['name']} does not exist"]
        keys = self._keys(kind, ref["name"])
        return [] if ref["key"] in keys else [f"{kind} {ref['name']} has no key {ref['key']}"]

    def _keys(self, kind: str, name: str) -> set[str]:
        if kind == "Secret":
            return set(self.secrets[name])
        return set(self.objects[(kind, name)].get("data", {}))

    def _items(self, kind: str, name: str, items: list[Obj], optional: bool) -> list[str]:
        if optional:
            return []
        if not self.has(kind, name):
            return [f"{kind} {name} does not exist"]
        keys = self._keys(kind, name)
        return [f"{kind} {name} has no key {i['key']}" for i in items if i["key"] not in keys]

    def _volume(self, volume: Obj) -> list[str]:
        missing: list[str] = []
        if "secret" in volume:
            s = volume["secret"]
            missing += self._items(
                "Secret", s["secretName"], s.get("items", []), s.get("optional", False)
            )
        if "configMap" in volume:
            c = volume["configMap"]
            missing += self._items(
                "ConfigMap", c["name"], c.get("items", []), c.get("optional", False)
            )
        for source in volume.get("projected", {}).get("sources", []):
            for kind, key in (("Secret", "secret"), ("ConfigMap", "configMap")):
                if key in source:
                    s = source[key]
                    missing += self._items(
                        kind, s["name"], s.get("items", []), s.get("optional", False)
                    )
        return missing

    def _service_monitor(self, obj: Obj) -> list[str]:
        wanted = obj["spec"]["selector"]["matchLabels"]
        services = [
            o for (kind, _), o in self.objects.items()
            if kind == "Service" and wanted.items() <= o["metadata"].get("labels", {}).items()
        ]  # fmt: skip
        if not services:
            return [f"no Service carries the labels {wanted}"]
        ports = {p.get("name") for s in services for p in s["spec"]["ports"]}
        return [
            f"no selected Service has a port named {e['port']}"
            for e in obj["spec"]["endpoints"]
            if e["port"] not in ports
        ]

    def secrets_named_by(self, obj: Obj) -> set[str]:
        """Every Secret a workload's pods name, optional or not."""
        names: set[str] = set()
        pod = pod_spec(obj)
        if pod is None:
            return names
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                names.add(volume["secret"]["secretName"])
            for source in volume.get("projected", {}).get("sources", []):
                if "secret" in source:
                    names.add(source["secret"]["name"])
        for container in containers(obj):
            for source in container.get("envFrom", []):
                if "secretRef" in source:
                    names.add(source["secretRef"]["name"])
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    names.add(ref["name"])
        return names


def container_environment(
    cluster: Cluster, obj: Obj, *, mounts: dict[str, Path]
) -> tuple[dict[str, str], dict[str, Path]]:
    """What the kubelet would give the first container: its variables (from its
    ConfigMaps, Secrets and values) and its secret volumes written as files under
    ``mounts[volume]``; paths in variables that point inside a mount are rewritten to
    the files here. Returns (variables, {mount path in the pod: directory here})."""
    pod = pod_spec(obj)
    assert pod is not None
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    where: dict[str, Path] = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if mount["name"] in mounts and ("projected" in volume or "secret" in volume):
            here = mounts[mount["name"]]
            here.mkdir(parents=True, exist_ok=True)
            _write_volume(cluster, volume, here)
            where[mount["mountPath"]] = here
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef")
        if ref and cluster.has("ConfigMap", ref["name"]):
            env.update(cluster.objects[("ConfigMap", ref["name"])].get("data", {}))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref and ref["key"] in cluster.secrets.get(ref["name"], {}):
            env[var["name"]] = cluster.secrets[ref["name"]][ref["key"]]
    for name, value in env.items():
        for inside, here in where.items():
            if value == inside or value.startswith(inside + "/"):
                env[name] = str(here) + value[len(inside) :]
    return env, where


def _write_volume(cluster: Cluster, volume: Obj, here: Path) -> None:
    sources = volume.get("projected", {}).get("sources", [])
    if "secret" in volume:
        s = volume["secret"]
        sources = [{"secret": {"name": s["secretName"], **s}}]
    for source in sources:
        secret = source.get("secret")
        if not secret or secret["name"] not in cluster.secrets:
            continue
        data = cluster.secrets[secret["name"]]
        items = secret.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            if item["key"] in data:
                (here / item["path"]).write_text(data[item["key"]])
