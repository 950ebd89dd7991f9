"""IAM's ``SimulatePrincipalPolicy`` for moto's server, which lacks it (moto 5.2).

What it evaluates is a role's own identity policies, inline and attached (their default
versions), as IAM does for a principal with no boundary, no SCP and no session policy:
an explicit ``Deny`` wins, then any ``Allow``, else an implicit deny. ``Action`` and
``Resource`` (and ``NotAction``/``NotResource``) match with IAM's wildcards, case-
insensitively for actions; conditions are not evaluated (a statement with one is
skipped, so a conditional grant reads as not granted, the safe side for a preflight).
The answer has the real shape (``EvaluationResults`` of ``EvalActionName``,
``EvalResourceName``, ``EvalDecision``), so the provider's call is the one it makes on AWS.
"""

from __future__ import annotations

import json
from fnmatch import fnmatchcase
from typing import Any
from urllib.parse import unquote

from moto.core.responses import ActionResult
from moto.iam.responses import IamResponse

__all__ = ["serve_policy_simulation"]


def _listed(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _document(text: Any) -> dict[str, Any]:
    if isinstance(text, dict):
        return text
    return json.loads(unquote(text) if str(text).lstrip().startswith("%") else text)


def _matches(statement: dict[str, Any], action: str, resource: str) -> bool:
    if "Condition" in statement:
        return False
    if "Action" in statement:
        acted = any(fnmatchcase(action.lower(), a.lower()) for a in _listed(statement["Action"]))
    else:
        acted = not any(
            fnmatchcase(action.lower(), a.lower()) for a in _listed(statement.get("NotAction"))
        )
    if "Resource" in statement:
        placed = any(fnmatchcase(resource, r) for r in _listed(statement["Resource"]))
    else:
        placed = not any(fnmatchcase(resource, r) for r in _listed(statement.get("NotResource")))
    return acted and placed


def _decision(statements: list[dict[str, Any]], action: str, resource: str) -> str:
    found = [s for s in statements if _matches(s, action, resource)]
    if any(s.get("Effect") == "Deny" for s in found):
        return "explicitDeny"
    if any(s.get("Effect") == "Allow" for s in found):
        return "allowed"
    return "implicitDeny"


def _simulate_principal_policy(self: Any) -> ActionResult:
    role = self.backend.get_role_by_arn(self._get_param("PolicySourceArn"))
    documents = [_document(doc) for doc in role.policies.values()]
    for policy in role.managed_policies.values():
        documents += [_document(v.document) for v in policy.versions if v.is_default]
    statements = [s for d in documents for s in _listed_statements(d)]
    actions = self._get_param("ActionNames", []) or []
    resources = self._get_param("ResourceArns", []) or ["*"]
    results = [
        {
            "EvalActionName": action,
            "EvalResourceName": resource,
            "EvalDecision": _decision(statements, action, resource),
        }
        for action in actions
        for resource in resources
    ]
    return ActionResult({"EvaluationResults": results, "IsTruncated": False})


def _listed_statements(document: dict[str, Any]) -> list[dict[str, Any]]:
    found = document.get("Statement", [])
    return [found] if isinstance(found, dict) else list(found)


def serve_policy_simulation() -> None:
    """Teach moto's IAM ``SimulatePrincipalPolicy`` (idempotent)."""
    IamResponse.simulate_principal_policy = _simulate_principal_policy  # type: ignore[attr-defined]
