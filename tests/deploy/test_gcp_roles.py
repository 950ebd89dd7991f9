"""The control plane's GCP binding is conditioned on trainbot's own instances: its IAM
condition, evaluated on the resource names Compute Engine checks, holds for every
instance and boot disk trainbot names and for the project-level checks, and fails for
anyone else's VM. The README's binding command passes it."""

from __future__ import annotations

import re
from typing import Any

import yaml

from jobs.providers.gcp.names import instance_name
from tests.paths import ROOT

PROJECT = "projects/p-1"


def condition() -> dict[str, str]:
    roles = yaml.safe_load((ROOT / "deploy" / "gcp" / "roles.yaml").read_text())["roles"]
    found: dict[str, str] = roles["trainbotControlPlane"]["condition"]
    return found


def extract(name: str, template: str) -> str:
    """CEL's ``extract`` on a resource name: the part ``{name}`` stands for, up to the
    next ``/``; empty when the name does not hold the template's prefix."""
    prefix = template.split("{", 1)[0]
    at = name.find(prefix)
    return "" if at == -1 else name[at + len(prefix) :].split("/", 1)[0]


def evaluate(expression: str, *, type_: str, name: str) -> bool:
    """The condition's CEL on one resource: the operators it uses (==, !=, &&, ||, a
    string's startsWith and a name's extract), written as Python. Anything else in it
    fails the test rather than being guessed."""
    python = expression.replace("&&", " and ").replace("||", " or ")
    python = re.sub(r"resource\.name\.extract\(('[^']*')\)", r"extract(NAME, \1)", python)
    python = python.replace(".startsWith(", ".startswith(")
    python = python.replace("resource.type", "TYPE")
    leftover = re.sub(r"'[^']*'|\b(and|or|extract|NAME|TYPE|startswith)\b|[()=!., \n]", "", python)
    assert leftover == "", f"the condition uses what this test cannot evaluate: {leftover}"
    scope: dict[str, Any] = {"extract": extract, "NAME": name, "TYPE": type_}
    # Only the names above are left (checked): no builtins, nothing else to call.
    return bool(eval(python, {"__builtins__": {}}, scope))


INSTANCE = "compute.googleapis.com/Instance"
DISK = "compute.googleapis.com/Disk"


def test_the_condition_admits_trainbots_instances_and_disks_only() -> None:
    expression = condition()["expression"]
    ours = instance_name("r-3f9c2a1b", "a-00c0ffee")
    node = instance_name("r-3f9c2a1b", "a-00c0ffee", node=3)
    zone = f"{PROJECT}/zones/us-central1-a"
    for name in (ours, node):
        assert evaluate(expression, type_=INSTANCE, name=f"{zone}/instances/{name}")
        assert evaluate(expression, type_=DISK, name=f"{zone}/disks/{name}")
    for theirs in ("prod-db-1", "web-trainbot-1", "trainbotx"):
        assert not evaluate(expression, type_=INSTANCE, name=f"{zone}/instances/{theirs}")
        assert not evaluate(expression, type_=DISK, name=f"{zone}/disks/{theirs}")
    # Quota, listing, operations and placement policies are checked on other resources.
    for type_, name in (
        ("compute.googleapis.com/Project", PROJECT),
        ("compute.googleapis.com/Region", f"{PROJECT}/regions/us-central1"),
        ("compute.googleapis.com/Subnetwork", f"{PROJECT}/regions/us-central1/subnetworks/d"),
        ("compute.googleapis.com/ResourcePolicy", f"{PROJECT}/regions/r/resourcePolicies/x"),
    ):
        assert evaluate(expression, type_=type_, name=name), type_


def test_the_readme_binds_the_control_plane_role_with_the_condition() -> None:
    readme = (ROOT / "deploy" / "gcp" / "README.md").read_text().replace("\\\n", " ")
    (binding,) = re.findall(
        r"gcloud projects add-iam-policy-binding [^\n]*trainbotControlPlane[^\n]*", readme
    )
    assert '--condition="$CONDITION"' in binding
    assert 'role.pop("condition", None)' in readme  # not a field of the role itself
    assert condition()["title"] and condition()["description"]
