"""Providers: where instances run. The registry maps a provider name to its factories.

Each factory imports its module when called, so choosing ``local`` never imports a cloud
SDK. A provider is added here by name (see the README, "Adding a provider"); nothing is
looked up dynamically, and no caller asks a provider's type.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jobs.providers.base import Provider, ProviderError

if TYPE_CHECKING:
    from jobs.settings import Settings

__all__ = [
    "PROVIDERS",
    "credential_broker_from_settings",
    "make_provider",
    "provider_from_settings",
]

#: Provider name (as in ``TRAINBOT_PROVIDER`` and a spec's ``resources.cloud``) → the
#: module that implements it. Each module has ``make(**options)`` (its constructor's
#: options), ``from_settings(settings)`` (the process settings it reads) and
#: ``credential_broker(settings)`` (the runners' checkpoint-credential broker, or None).
PROVIDERS: Mapping[str, str] = {
    "local": "jobs.providers.local",
    "aws": "jobs.providers.aws",
    "gcp": "jobs.providers.gcp",
}


def _module(name: str) -> Any:
    try:
        path = PROVIDERS[name]
    except KeyError:
        known = ", ".join(sorted(PROVIDERS))
        raise ProviderError(f"unknown provider {name!r}: use one of {known}") from None
    return importlib.import_module(path)


def make_provider(name: str, /, **options: Any) -> Provider:
    """Build the named provider; ``options`` are its constructor's keyword arguments."""
    provider: Provider = _module(name).make(**options)
    return provider


def provider_from_settings(settings: Settings) -> Provider:
    """The provider ``TRAINBOT_PROVIDER`` names, configured from the process settings."""
    provider: Provider = _module(settings.provider).from_settings(settings)
    return provider


def credential_broker_from_settings(settings: Settings) -> Any:
    """The broker that hands runners credentials for their own run's checkpoints
    (``POST /v1/credentials``), when the provider has one and the settings enable it."""
    return _module(settings.provider).credential_broker(settings)
