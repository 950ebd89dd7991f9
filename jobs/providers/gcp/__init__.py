"""Spot GPUs on Google Compute Engine, through the real ``google-cloud-compute`` client.

``google.cloud`` is imported only inside this package. The design and its reasons are in
docs/architecture.md, "Providers: GCP"; the registry calls :func:`make` and
:func:`from_settings`. ``credentials`` holds the runners' checkpoint-token broker (downscoped
by a Credential Access Boundary to one run's prefix).
"""

from jobs.providers.gcp.catalog import PRICES_PATH
from jobs.providers.gcp.credentials import StorageTokenBroker, credential_broker
from jobs.providers.gcp.launch import DEFAULT_IMAGE, STARTUP_SCRIPT_PATH
from jobs.providers.gcp.names import instance_name, label_value
from jobs.providers.gcp.permissions import PERMISSIONS, REQUIRED_PERMISSIONS
from jobs.providers.gcp.provider import GcpProvider, from_settings, make
from jobs.providers.gcp.refresh import prices_from_catalog

__all__ = [
    "DEFAULT_IMAGE",
    "PERMISSIONS",
    "PRICES_PATH",
    "REQUIRED_PERMISSIONS",
    "STARTUP_SCRIPT_PATH",
    "GcpProvider",
    "StorageTokenBroker",
    "credential_broker",
    "from_settings",
    "instance_name",
    "label_value",
    "make",
    "prices_from_catalog",
]
