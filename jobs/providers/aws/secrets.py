"""Preflight's question about an ``aws-sm://`` secret, answered without reading it.

``DescribeSecret`` says whether it exists (and gives its ARN); ``SimulatePrincipalPolicy``
says whether the runner's instance role may call ``GetSecretValue`` on that ARN. The
instance role may read only secrets under the admin's prefix (``TRAINBOT_AWS_SECRETS_PREFIX``,
default ``trainbot/``; deploy/aws/runner-instance-policy.json grants exactly that), so a
name outside it is refused before any call.
"""

from __future__ import annotations

import shlex
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from runner.secrets import SecretRef

__all__ = ["DEFAULT_SECRETS_PREFIX", "secret_problem"]

#: The prefix the shipped instance policy lets the runner read.
DEFAULT_SECRETS_PREFIX = "trainbot/"
_READ = "secretsmanager:GetSecretValue"


def _name_of(ref: SecretRef) -> str:
    """The secret's name: an ARN's last part without the six random characters AWS adds."""
    if not ref.path.startswith("arn:"):
        return ref.path
    name = ref.path.split(":secret:", 1)[1]
    return name[:-7] if len(name) > 7 and name[-7] == "-" else name


def secret_problem(
    *,
    clients: Any,
    region: str,
    ref: SecretRef,
    prefix: str,
    instance_profile: str | None,
) -> tuple[str, str] | None:
    """None when ``ref`` exists in ``region`` and the instance role may read it; else what
    is wrong and what to do."""
    name = _name_of(ref)
    if prefix and not name.startswith(prefix):
        return (
            f"its name is not under {prefix}, the only secrets the instance role may read",
            f"store it as {prefix}{name.rsplit('/', 1)[-1]} (or an admin changes "
            "TRAINBOT_AWS_SECRETS_PREFIX and the instance policy together)",
        )
    create = (
        f"aws secretsmanager create-secret --region {region} --name {shlex.quote(name)} "
        "--secret-string file://value.txt"
    )
    try:
        found = clients.client("secretsmanager").describe_secret(SecretId=ref.path)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code == "ResourceNotFoundException":
            return f"no such secret in {region}", f"create it: {create}"
        return (
            f"Secrets Manager refused DescribeSecret ({code})",
            "let the control plane's role call secretsmanager:DescribeSecret on it "
            "(deploy/aws/iam-policy.json)",
        )
    except BotoCoreError as exc:
        return f"Secrets Manager not reachable ({exc})", "check the network, then preflight again"
    if found.get("DeletedDate"):
        return (
            f"it is scheduled for deletion in {region}",
            f"restore it: aws secretsmanager restore-secret --secret-id {shlex.quote(name)}",
        )
    if not instance_profile:
        return (
            "no instance profile is set, so the instances have no role to read it with",
            "set TRAINBOT_AWS_INSTANCE_PROFILE (deploy/aws/README.md)",
        )
    return _role_problem(clients, arn=str(found["ARN"]), profile=instance_profile, prefix=prefix)


def _role_problem(clients: Any, *, arn: str, profile: str, prefix: str) -> tuple[str, str] | None:
    iam = clients.client("iam")
    name = profile.rsplit("/", 1)[-1] if profile.startswith("arn:") else profile
    fix = (
        f"grant the instance role {_READ} on arn:…:secret:{prefix}* "
        "(deploy/aws/runner-instance-policy.json)"
    )
    try:
        roles = iam.get_instance_profile(InstanceProfileName=name)["InstanceProfile"]["Roles"]
        if not roles:
            return f"instance profile {name} has no role", f"add the runner role to it; {fix}"
        role = str(roles[0]["Arn"])
        answer = iam.simulate_principal_policy(
            PolicySourceArn=role, ActionNames=[_READ], ResourceArns=[arn]
        )
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        return (
            f"could not check the instance role's access ({code})",
            "let the control plane's role call iam:GetInstanceProfile and "
            "iam:SimulatePrincipalPolicy on the runner role (deploy/aws/iam-policy.json)",
        )
    except BotoCoreError as exc:
        return f"IAM not reachable ({exc})", "check the network, then preflight again"
    decisions = [r.get("EvalDecision") for r in answer.get("EvaluationResults", [])]
    if decisions and all(d == "allowed" for d in decisions):
        return None
    said = ", ".join(str(d) for d in decisions) or "no answer"
    return f"the instance role {role} may not read it ({_READ}: {said})", fix
