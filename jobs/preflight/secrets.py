"""The secrets check: each secret of the spec exists, and the run's instances may read it.

The control plane never reads a value. A cloud provider answers from the secret's
metadata and its policy (AWS: ``DescribeSecret`` and a policy simulation for the instance
role; GCP: the secret's metadata and ``testIamPermissions``), through
:class:`SecretChecker`; the local provider's instances are this machine, so its answer is
whether the file is in the admin's directory (``TRAINBOT_LOCAL_SECRETS_DIR``), its size
and never its contents.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from jobs.preflight.report import CheckResult, PreflightContext, PreflightPlan, Status
from runner import env as contract
from runner.secrets import SCHEMES, SecretRef, parse_ref

__all__ = ["SecretChecker", "SecretsCheck"]


@runtime_checkable
class SecretChecker(Protocol):
    """A provider whose instances can read secrets from its cloud's store."""

    def secret_problem(self, ref: SecretRef) -> tuple[str, str] | None:
        """None when the secret exists and the run's instances may read it; else what is
        wrong (naming the secret) and what to do. Never reads the value."""
        ...


class SecretsCheck:
    """Every secret of the spec can be read on the run's instances."""

    name: str = "secrets"

    def run(self, ctx: PreflightContext, *, prior: PreflightPlan) -> CheckResult:
        secrets = ctx.spec.secrets
        if not secrets:
            return CheckResult(self.name, Status.PASS, "no secrets", data={"secrets": []})
        provider = ctx.provider.name
        problems: list[tuple[str, str]] = []
        for var, text in secrets.items():
            ref = parse_ref(text)
            found = _problem(ctx, ref)
            if found is not None:
                what, todo = found
                problems.append((f"{var} ({ref}): {what}", todo))
        data = {"secrets": sorted(secrets), "provider": provider}
        if problems:
            return CheckResult(
                self.name,
                Status.FAIL,
                "; ".join(what for what, _ in problems),
                "; ".join(dict.fromkeys(todo for _, todo in problems)),
                data={**data, "unreadable": len(problems)},
            )
        names = ", ".join(sorted(secrets))
        return CheckResult(
            self.name,
            Status.PASS,
            f"{len(secrets)} secret(s) readable by the run's instances: {names}",
            data=data,
        )


def _problem(ctx: PreflightContext, ref: SecretRef) -> tuple[str, str] | None:
    provider = ctx.provider
    if ref.provider != provider.name:
        others = ", ".join(f"{s}://" for s, p in SCHEMES.items() if p == provider.name)
        return (
            f"a {ref.scheme}:// secret cannot be read on {provider.name} instances",
            f"store it where {provider.name} instances read secrets ({others or 'none'})",
        )
    if ref.scheme == "local":
        return _local_problem(ref)
    if isinstance(provider, SecretChecker):
        return provider.secret_problem(ref)
    return (
        f"the {provider.name} provider cannot check secrets",
        "remove the secret from the spec, or use a provider that reads them",
    )


def _local_problem(ref: SecretRef) -> tuple[str, str] | None:
    folder = contract.LOCAL_SECRETS_DIR.get()
    var = contract.LOCAL_SECRETS_DIR.name
    if folder is None:
        return (
            f"{var} is not set on the control plane",
            f"an admin sets {var} to a directory of secret files (one file per secret)",
        )
    path = folder / ref.path
    if not path.is_file():
        return (
            f"there is no file {ref.path} in {folder}",
            f"an admin writes the secret to {path} (chmod 600)",
        )
    return None
