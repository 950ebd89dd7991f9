"""What Google's clients need from the environment: a key file, or nothing.

Used where Google is (the GCP provider, a ``gs://`` store); without a key file the
clients find the pod's Workload Identity or the instance's account through the metadata
server. A ``GOOGLE_APPLICATION_CREDENTIALS`` naming no file is refused at load
(:func:`jobs.process.settings.load_settings`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jobs.process.settings import Settings

__all__ = ["google_credentials_environ"]


def google_credentials_environ(
    settings: Settings, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """What to add to the environment for Google's clients: ``GOOGLE_APPLICATION_CREDENTIALS``
    pointing at ``gcp_credentials_file`` when that file is there and nothing else names a
    key; else nothing, and the clients find the pod's Workload Identity or the instance's
    account through the metadata server."""
    source = os.environ if environ is None else environ
    wanted = settings.gcp_credentials_file
    if source.get("GOOGLE_APPLICATION_CREDENTIALS") or wanted is None or not wanted.is_file():
        return {}
    return {"GOOGLE_APPLICATION_CREDENTIALS": str(wanted)}
