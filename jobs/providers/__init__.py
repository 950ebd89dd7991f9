"""Providers: where instances run. The registry maps a provider name to its factory.

Each factory imports its module when called, so choosing ``local`` never imports a cloud
SDK. A provider is added here by name; nothing is looked up dynamically.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from jobs.providers.base import Provider, ProviderError

__all__ = ["PROVIDERS", "make_provider"]


def _local(**options: Any) -> Provider:
    from jobs.providers.local import LocalProvider

    return LocalProvider(**options)


def _aws(**options: Any) -> Provider:
    from jobs.providers import aws

    return aws.make(**options)


def _gcp(**options: Any) -> Provider:
    from jobs.providers import gcp

    return gcp.make(**options)


#: Provider name (as in ``ResourceRequest.cloud`` and the spec) → factory.
PROVIDERS: Mapping[str, Callable[..., Provider]] = {
    "local": _local,
    "aws": _aws,
    "gcp": _gcp,
}


def make_provider(name: str, /, **options: Any) -> Provider:
    """Build the named provider; ``options`` are its constructor's keyword arguments."""
    try:
        factory = PROVIDERS[name]
    except KeyError:
        known = ", ".join(sorted(PROVIDERS))
        raise ProviderError(f"unknown provider {name!r}: use one of {known}") from None
    return factory(**options)
