"""Providers: where instances run. The registry maps a provider name to what it is.

Each factory imports its module when called, so choosing ``local`` never imports a cloud
SDK. A provider is added here by name (see the README, "Adding a provider"), or by
:func:`register` (a provider shipped elsewhere, a test's); nothing is looked up
dynamically, and no caller asks a provider's type. What the rest of the control plane
needs to know about a provider without building it (the URI schemes of its object
store, how to make a bucket, whether its instances are this machine's processes) is
declared in its :class:`Registration`, here and nowhere else.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jobs.providers.base import Provider, ProviderError

if TYPE_CHECKING:
    from jobs.process.settings import Settings

__all__ = [
    "PROVIDERS",
    "ProviderNotConfigured",
    "Registration",
    "cloud_of_scheme",
    "credential_broker_from_settings",
    "known_names",
    "make_provider",
    "provider_from_settings",
    "providers_from_settings",
    "register",
    "registration",
]


@dataclass(frozen=True)
class Registration:
    """One provider, as the registry knows it before it is built."""

    # The module that implements it: ``make(**options)`` (its constructor's options),
    # ``from_settings(settings)`` (the process settings it reads) and
    # ``credential_broker(settings)`` (the runners' checkpoint-credential broker, or None).
    module: str
    # Object-store URI schemes its instances hold credentials for ("s3"); a checkpoint
    # store of another provider's scheme cannot be written from its instances.
    store_schemes: tuple[str, ...] = ()
    # The shell command that creates a checkpoint bucket in ``{region}``, for remedies;
    # "" when it has none.
    new_bucket: str = ""
    # Its instances are processes on the control plane's own machine (its built
    # provider's ``Capabilities.runs_on_this_machine`` says the same): settings checks
    # (a loopback URL, a local checkpoint directory) are read from this.
    on_this_machine: bool = False
    # The prefix of the process settings it reads (``TRAINBOT_AWS_``), named in the
    # remedy when a spec picks it and it is not configured.
    settings_prefix: str = ""
    # The types a preflight dry run may use when ``TRAINBOT_DRY_RUN_INSTANCE_TYPES`` is
    # unset: small CPU types and the one-GPU type of each accelerator (a dry run is one
    # process, a few steps).
    dry_run_types: tuple[str, ...] = ()


#: Provider name (as in ``TRAINBOT_PROVIDER``, ``TRAINBOT_PROVIDERS`` and a spec's
#: ``resources.cloud``) → its registration. Cloud Storage keeps deleted objects for a
#: week by default (soft delete): every pruned checkpoint, billed; hence the flag.
PROVIDERS: dict[str, Registration] = {
    "local": Registration(
        "jobs.providers.local", on_this_machine=True, settings_prefix="TRAINBOT_LOCAL_"
    ),
    "aws": Registration(
        "jobs.providers.aws",
        store_schemes=("s3",),
        new_bucket="aws s3 mb s3://BUCKET --region {region}",
        settings_prefix="TRAINBOT_AWS_",
        dry_run_types=(
            "t3.medium",
            "t3.large",
            "m6i.large",
            "m6i.xlarge",
            "g4dn.xlarge",
            "g5.xlarge",
            "g6.xlarge",
            "g6e.xlarge",
            "p3.2xlarge",
        ),
    ),
    "gcp": Registration(
        "jobs.providers.gcp",
        store_schemes=("gs",),
        new_bucket=(
            "gcloud storage buckets create gs://BUCKET --location={region} --soft-delete-duration=0"
        ),
        settings_prefix="TRAINBOT_GCP_",
        dry_run_types=(
            "e2-standard-2",
            "e2-standard-4",
            "n1-standard-4",
            "n2-standard-4",
            "g2-standard-4",
            "a2-highgpu-1g",
            "a2-ultragpu-1g",
        ),
    ),
}


class ProviderNotConfigured(ProviderError):
    """A spec (or a stored attempt) names a provider this control plane has not built;
    the message says which variables configure it."""

    def __init__(self, message: str, *, name: str) -> None:
        super().__init__(message)
        self.name = name


def register(name: str, registration: Registration) -> None:
    """Add a provider to the registry (a provider shipped outside this package, or one a
    test defines). A name already registered is refused, so nothing is replaced
    silently; tests remove theirs with ``PROVIDERS.pop(name)``."""
    if name in PROVIDERS:
        raise ProviderError(f"a provider named {name!r} is registered already")
    PROVIDERS[name] = registration


def known_names() -> str:
    """The registered names for a message: ``'local', 'aws' or 'gcp'``."""
    names = [repr(name) for name in PROVIDERS]
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def registration(name: str) -> Registration:
    """The named provider's registration; :class:`ProviderError` for an unknown name."""
    try:
        return PROVIDERS[name]
    except KeyError:
        known = ", ".join(sorted(PROVIDERS))
        raise ProviderError(f"unknown provider {name!r}: use one of {known}") from None


def cloud_of_scheme(scheme: str) -> str | None:
    """The provider whose instances hold credentials for URIs of ``scheme``; None for a
    scheme no provider claims (a local path, ``file:``)."""
    return next((n for n, r in PROVIDERS.items() if scheme in r.store_schemes), None)


def _module(name: str) -> Any:
    return importlib.import_module(registration(name).module)


def make_provider(name: str, /, **options: Any) -> Provider:
    """Build the named provider; ``options`` are its constructor's keyword arguments."""
    provider: Provider = _module(name).make(**options)
    return provider


def provider_from_settings(settings: Settings, name: str | None = None) -> Provider:
    """The provider ``name`` (default: ``TRAINBOT_PROVIDER``), configured from the
    process settings."""
    provider: Provider = _module(name or settings.provider).from_settings(settings)
    return provider


def providers_from_settings(
    settings: Settings, *, default: Provider | None = None, built: Iterable[Provider] = ()
) -> dict[str, Provider]:
    """Every provider the settings configure (``TRAINBOT_PROVIDERS`` and the default
    ``TRAINBOT_PROVIDER``), the default first. ``default`` (built already, a test's)
    stands for the settings' default provider; ``built`` ones are used as they are."""
    names = list(settings.configured_providers)
    if default is not None:
        names = [default.name, *(n for n in names[1:] if n != default.name)]
    found: dict[str, Provider] = {p.name: p for p in (*built, *([default] if default else []))}
    made: list[Provider] = []
    try:
        for name in names:
            if name not in found:
                found[name] = provider_from_settings(settings, name)
                made.append(found[name])
    except BaseException:
        for provider in made:
            provider.close()
        raise
    ranked = sorted(found, key=lambda n: names.index(n) if n in names else len(names))
    return {name: found[name] for name in ranked}


def credential_broker_from_settings(settings: Settings) -> Any:
    """The broker that hands runners credentials for their own run's checkpoints
    (``POST /v1/credentials``), when the provider has one and the settings enable it."""
    return _module(settings.provider).credential_broker(settings)
