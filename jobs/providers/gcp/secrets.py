"""Preflight's question about a ``gcp-sm://`` secret, answered without reading it.

The secret's metadata (``secrets.get``) says whether it exists; its IAM policy
(``secrets.getIamPolicy``) whether the runner's service account holds
``roles/secretmanager.secretAccessor`` on it. Only a grant on the secret itself counts:
that is the least privilege the deploy notes ask for (a project-wide grant would let the
instances read every secret). The secret's id must start with the admin's prefix
(``TRAINBOT_GCP_SECRETS_PREFIX``, default ``trainbot-``). Plain REST through google-auth's
authorized session, as the bucket lookups do: no Secret Manager SDK.
"""

from __future__ import annotations

import shlex
from typing import Any

from runner.secrets import SecretRef

__all__ = ["DEFAULT_SECRETS_ENDPOINT", "DEFAULT_SECRETS_PREFIX", "secret_problem"]

DEFAULT_SECRETS_PREFIX = "trainbot-"
DEFAULT_SECRETS_ENDPOINT = "https://secretmanager.googleapis.com"
_ACCESSOR = "roles/secretmanager.secretAccessor"
#: Roles that hold ``secretmanager.versions.access`` on a secret.
_READERS = frozenset({_ACCESSOR, "roles/secretmanager.admin", "roles/owner", "roles/editor"})


def secret_problem(
    *,
    session: Any,
    endpoint: str,
    ref: SecretRef,
    prefix: str,
    service_account: str | None,
    timeout_s: float,
) -> tuple[str, str] | None:
    """None when ``ref`` exists and the runner's service account may read it; else what
    is wrong and what to do."""
    _, project, _, secret = ref.path.split("/")[:4]
    secret_name = f"projects/{project}/secrets/{secret}"
    if prefix and not secret.startswith(prefix):
        return (
            f"its id does not start with {prefix}, the only secrets the runner may read",
            f"store it as {prefix}{secret} (or an admin changes TRAINBOT_GCP_SECRETS_PREFIX)",
        )
    base = f"{endpoint.rstrip('/')}/v1/{secret_name}"
    try:
        found = session.get(base, timeout=timeout_s)
    except Exception as exc:  # requests' and google-auth's errors alike
        return f"Secret Manager not reachable ({exc})", "check the network, then preflight again"
    if found.status_code == 404:
        return (
            f"no such secret in project {project}",
            f"create it: gcloud secrets create {shlex.quote(secret)} --project {project} "
            "--data-file=value.txt",
        )
    if found.status_code != 200:
        return (
            f"Secret Manager refused secrets.get (HTTP {found.status_code})",
            "give the control plane's service account roles/secretmanager.viewer on it",
        )
    if not service_account:
        return (
            "no runner service account is set, so who reads it on the instance is unknown",
            "set TRAINBOT_GCP_SERVICE_ACCOUNT (deploy/gcp/README.md)",
        )
    grant = (
        f"gcloud secrets add-iam-policy-binding {shlex.quote(secret)} --project {project} "
        f"--member serviceAccount:{service_account} --role {_ACCESSOR}"
    )
    try:
        policy = session.post(f"{base}:getIamPolicy", json={}, timeout=timeout_s)
    except Exception as exc:
        return f"Secret Manager not reachable ({exc})", "check the network, then preflight again"
    if policy.status_code != 200:
        return (
            f"Secret Manager refused getIamPolicy (HTTP {policy.status_code})",
            "give the control plane's service account roles/secretmanager.viewer on it",
        )
    member = f"serviceAccount:{service_account}"
    for binding in policy.json().get("bindings", []):
        if binding.get("role") in _READERS and member in binding.get("members", []):
            return None
    return f"the service account {service_account} may not read it", f"grant it: {grant}"
